"""Whole model weights from a checkpoint, whatever the layout that wrote it: the full `model.*`
tensors rank 0 saved (single process, data parallel, ZeRO-1/2, parameter server), or the ZeRO-3
parameter shards of every rank put back together offline from the group layout in the rank files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from teratrain.checkpoint.io import CheckpointError, load_rank


def full_model(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    tensors, meta = load_rank(ckpt_dir, 0)
    weights = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    if weights:
        return weights
    if "zero" not in meta:
        raise CheckpointError(f"{ckpt_dir} holds no model weights; point --ckpt at a teratrain run's checkpoint.")
    return _from_zero_shards(ckpt_dir, meta["zero"])


def _from_zero_shards(ckpt_dir: Path, layout: dict) -> dict[str, torch.Tensor]:
    """Rank r holds elements [r*S, (r+1)*S) of each group's padded flat buffer (parallel/flat.py):
    concatenating the ranks' shards in order gives the buffer back; split it by the numels."""
    world = json.loads((ckpt_dir / "meta.json").read_text())["world"]
    shards = [load_rank(ckpt_dir, r)[0] for r in range(world)]
    out = {}
    for i, (names, numels) in enumerate(layout["groups"]):
        key = f"zero.{i}.master" if f"zero.{i}.master" in shards[0] else f"zero.{i}.params"
        flat = torch.cat([s[key] for s in shards if key in s])
        offset = 0
        for name, n in zip(names, numels):
            out[name] = flat[offset:offset + n]
            offset += n
    return out
