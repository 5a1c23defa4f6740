"""The checkpoint format's shared names: its error, the safetensors dtype names, and the index file
(`index.json`: every logical tensor's global shape, dtype and pieces on disk) as rank 0 builds it
from the ranks' JSON. io.py writes and checks checkpoint folders, index.py reads the index: both
import this module, neither the other.
"""

from __future__ import annotations

import torch

INDEX = "index.json"
FORMAT = "teratrain-logical/1"

# torch dtype -> safetensors dtype name (the safetensors header's "dtype")
DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
               torch.uint8: "U8", torch.bool: "BOOL"}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


class CheckpointError(RuntimeError):
    """No usable checkpoint: one sentence naming the problem and the fix."""


def merge_rank(index: dict, rank_meta: dict, file: str) -> None:
    """Add one rank's pieces and non-tensor optimizer state (its JSON) to the index being built."""
    tensors = index.setdefault("tensors", {})
    for p in rank_meta.get("pieces", ()):
        t = tensors.setdefault(f"{p['kind']}/{p['name']}", {"kind": p["kind"], "name": p["name"],
                                                             "shape": p["shape"], "dtype": p["dtype"], "pieces": []})
        t["pieces"].append({"file": file, **{k: p[k] for k in ("key", "offsets", "box", "flat", "replica")}})
    index.setdefault("scalars", {}).update(rank_meta.get("scalars", {}))
