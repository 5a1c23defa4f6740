"""Whole model weights from a checkpoint, whatever the layout that wrote it.

Every rank file that holds model state contributes pieces: whole local tensors (`model.*`, written
by one rank of each set of replicas) or ZeRO-3 flat shards, put back together per flat group from
the ranks its layout names. Each local tensor is then placed into its logical tensor by the
placement recorded beside it (tensor-parallel pieces side by side, padding dropped), so the result
is the single-device model's state dict by global name.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from teratrain.checkpoint.io import CheckpointError
from teratrain.parallel.placement import Placement


def full_model(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    world = json.loads((ckpt_dir / "meta.json").read_text())["world"]
    metas = [json.loads((ckpt_dir / f"rank{r:05d}.json").read_text()) for r in range(world)]
    out: dict[str, torch.Tensor] = {}
    for r, meta in enumerate(metas):
        if meta.get("replica_of") is not None:
            continue  # an exact replica of a rank whose file holds the state
        placements = meta.get("placements", {})
        with safe_open(str(ckpt_dir / f"rank{r:05d}.safetensors"), framework="pt") as f:
            for key in f.keys():
                if key.startswith("model."):
                    name = key.removeprefix("model.")
                    _put(out, name, f.get_tensor(key), _placement(name, placements))
        layout = meta.get("zero")
        if layout and layout["stage"] == 3:
            for names, numels, ranks in layout["groups"]:
                if ranks[0] == r:  # the group's first rank reassembles it
                    _put_group(out, ckpt_dir, metas, names, numels, ranks, placements)
    if not out:
        raise CheckpointError(f"{ckpt_dir} holds no model weights; point --ckpt at a teratrain run's checkpoint.")
    return out


def _placement(name: str, placements: dict) -> Placement | None:
    pl = placements.get(name)
    return Placement.from_json(pl) if pl else None


def _put(out: dict, name: str, local: torch.Tensor, pl: Placement | None) -> None:
    """Write a local piece into its logical tensor (creating it at its global shape). Without a
    recorded placement (checkpoints of whole replicas) the tensor is whole."""
    if pl is None or pl.dim is None:
        out[name] = local if pl is None else local.view(pl.global_shape)
        return
    full = out.setdefault(pl.name, torch.zeros(pl.global_shape, dtype=local.dtype))
    full[pl.global_slices()] = local.view(pl.local_shape())[pl.local_slices()]


def _put_group(out, ckpt_dir: Path, metas: list, names, numels, ranks, placements) -> None:
    """Rank i of a ZeRO-3 group holds elements [i*S, (i+1)*S) of its padded flat buffer
    (parallel/flat.py): the members' shards in order give the buffer back; split it by the numels."""
    shards = []
    for m in ranks:
        index = next(i for i, g in enumerate(metas[m]["zero"]["groups"]) if g[0] == names)
        with safe_open(str(ckpt_dir / f"rank{m:05d}.safetensors"), framework="pt") as f:
            key = f"zero.{index}.master" if f"zero.{index}.master" in f.keys() else f"zero.{index}.params"
            shards.append(f.get_tensor(key))
    flat, offset = torch.cat(shards), 0
    for name, n in zip(names, numels):
        _put(out, name, flat[offset:offset + n], _placement(name, placements))
        offset += n
