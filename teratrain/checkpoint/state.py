"""RNG streams as (tensors, JSON) and back, and how they are seeded.

Nothing here pickles: tensors go to safetensors, everything else must be JSON. (Optimizer state is
saved as logical tensors: checkpoint/holdings.py.)
"""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed every RNG a run may draw from (torch CPU and CUDA, Python, NumPy); all are checkpointed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def deterministic_algorithms(on: bool) -> None:
    """`train.deterministic`: the same bits from the same inputs on a GPU, run after run. Off by
    default, as in torch: cuDNN's attention backward (what scaled_dot_product_attention runs on
    Hopper in bf16) accumulates with atomic adds in whatever order its blocks finish, so two runs
    part in the last bit from the first step, and top-k routing turns that into other experts
    (bench/determinism.py measured it; bench/README.md, "The layout matrix"). On, torch picks deterministic
    kernels everywhere and refuses an op that has none; cuBLAS needs a fixed workspace for it, set
    here before its first matmul."""
    if on:
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """Every RNG stream a training step may draw from: Python, NumPy, torch CPU and CUDA."""
    tensors = {"rng.torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    meta = {"python": [version, list(internal), gauss], "numpy": _jsonable(np_state)}
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["rng.torch_cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(meta["numpy"])


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.integer):
        return int(x)
    return x
