"""Whole model weights from a checkpoint, whatever the layout that wrote it.

The checkpoint's index (index.py) lists each parameter's pieces in global coordinates, so every
weight is assembled by reading its pieces alone, one tensor at a time: host memory holds the model
(or one tensor), never the optimizer state (`teratrain generate`, export, quantization, evaluation).
Values are the fp32 masters where training kept them (what training continues from).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from teratrain.checkpoint.format import CheckpointError
from teratrain.checkpoint.holdings import PARAM, Entry
from teratrain.checkpoint.index import Index, Reader
from teratrain.checkpoint.pieces import Piece


def full_model(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Every parameter, whole, by global name (the single-device model's state dict)."""
    with Reader(Index(ckpt_dir)) as reader:
        names = reader.index.names(PARAM)
        if not names:
            raise CheckpointError(f"{ckpt_dir} holds no model weights; point --ckpt at a teratrain run's checkpoint.")
        return {name: reader.read(PARAM, name) for name in names}


@torch.no_grad()
def load_weights(model: nn.Module, ckpt_dir: Path) -> None:
    """Fill a single-device model's parameters from the checkpoint, each read straight into its
    parameter (cast to its dtype, on its device): no second copy of the model."""
    with Reader(Index(ckpt_dir)) as reader:
        for name, p in model.named_parameters():
            if reader.index.info(PARAM, name) is None:
                raise CheckpointError(f"{ckpt_dir} lacks parameter {name}; {reader.index.why_missing(name)}")
            reader.fill(Entry(PARAM, Piece.whole_of(name, tuple(p.shape)), p.data))


def read_tensors(ckpt_dir: Path, *suffixes: str):
    """(stem, (tensors...)) for every parameter group whose names are stem + each suffix, read whole
    one group at a time (e.g. a LoRA layer's A and B: memory/lora.py)."""
    with Reader(Index(ckpt_dir)) as reader:
        for name in reader.index.names(PARAM):
            if name.endswith(suffixes[0]):
                stem = name[: -len(suffixes[0])]
                yield stem, tuple(reader.read(PARAM, stem + s) for s in suffixes)

