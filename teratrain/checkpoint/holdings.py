"""What an engine holds of the logical tensors, for checkpoints in both directions.

Every engine answers `holdings()` with `Slot`s: local tensors that are pieces of logical tensors
(parallel/placement.py says which; a ZeRO shard is a flat range of one). The same slots are read
when saving and filled when restoring, so one writer and one reader serve every strategy:

    values       each parameter's value as training continues from it: the fp32 master where the
                 engine keeps one (the low-precision parameter is its cast), else the parameter
    optimizers   each optimizer with the slot of each of its parameters, in its order; its state
                 is saved per parameter as logical tensors `optim.<key>`:
                   elementwise (shaped like the parameter piece: Adam moments, momentum) -> a piece
                     of a tensor of the parameter's global shape, so it reshards like the parameter;
                   0-d (a step count) -> one value per parameter, the same for every piece of it;
                   anything else (Adafactor's or SM3's per-row/column factors) -> factored: kept per
                     local piece (`optim.<key>@<piece>`), readable only by a layout with that piece.
    replica      None, or this rank's replica index when replicas differ (local SGD between syncs)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from teratrain.checkpoint.pieces import Piece
from teratrain.parallel.placement import Placement

PARAM = "param"  # the logical tensor of each parameter's values
OPTIM = "optim."  # prefix of optimizer-state logical tensors


@dataclass
class Slot:
    pl: Placement  # the parameter this is a piece of
    tensor: torch.Tensor  # local data: the whole local piece, or the flat range [lo, hi) of it
    lo: int = 0
    hi: int | None = None

    def piece(self) -> Piece:
        return Piece.of(self.pl, self.lo, self.hi)


@dataclass
class Holdings:
    values: list[Slot]
    optimizers: list[tuple[torch.optim.Optimizer, list[Slot]]] = field(default_factory=list)
    replica: int | None = None


@dataclass
class Entry:
    """One piece of one logical tensor: what a writer stores and a reader fills."""

    kind: str  # PARAM or `optim.<key>` (factored: `optim.<key>@<piece key>`)
    piece: Piece
    tensor: torch.Tensor  # data to save, or the tensor to fill
    replica: int | None = None

    @property
    def logical(self) -> str:
        return f"{self.kind}/{self.piece.name}"


def ordered_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """An optimizer's parameters in state_dict order (their ids 0, 1, ...)."""
    return [p for group in opt.param_groups for p in group["params"]]


def slot_index(slots: list[Slot]) -> dict[int, Slot]:
    return {id(s.tensor): s for s in slots}


def save_entries(h: Holdings) -> tuple[list[Entry], dict]:
    """Every piece this rank holds, and the optimizer state that is not a tensor (JSON) by logical name."""
    out = [Entry(PARAM, s.piece(), s.tensor, h.replica) for s in h.values]
    scalars: dict[str, object] = {}
    for opt, slots in h.optimizers:
        by_id = slot_index(slots)
        for p in ordered_params(opt):
            slot = by_id[id(p)]
            for key, v in opt.state.get(p, {}).items():
                if torch.is_tensor(v):
                    out.append(Entry(*state_piece(key, v, slot), v, h.replica))
                else:
                    scalars[f"{OPTIM}{key}/{slot.pl.name}"] = v
    return out, scalars


def state_piece(key: str, v: torch.Tensor, slot: Slot) -> tuple[str, Piece]:
    """The logical tensor and piece of one optimizer state tensor of `slot`'s parameter."""
    piece = slot.piece()
    if v.shape == slot.tensor.shape:  # elementwise: a piece of a tensor shaped like the parameter
        return f"{OPTIM}{key}", piece
    if v.dim() == 0:  # per tensor (a step count): one value, equal on every piece
        return f"{OPTIM}{key}", Piece.whole_of(piece.name, ())
    return f"{OPTIM}{key}@{piece.key()}", Piece.whole_of(piece.name, tuple(v.shape))  # factored


def is_factored(kind: str) -> bool:
    return "@" in kind
