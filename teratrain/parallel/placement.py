"""Placement is data: where each local parameter comes from and how its gradient is combined.

The transform that splits a parameter (tensor, expert or pipeline parallelism) records a
`Placement` on it; everything downstream reads it and nothing guesses: engines bucket by
`group`, the gradient norm and the inf check count each logical element once, checkpoints write
logical tensors, the planner counts bytes by the same rules.

Gradient rule (one for every parameter): the true gradient of the global loss, the mean of the dp x cp
ranks' losses (a cp rank's loss is the mean over its chunks of the samples, all chunks alike long), is
the SUM of the local gradients over `group` (the ranks holding identical copies whose local gradients
are partial), divided by dp x cp (`dp` below is the mesh group, which varies dp and cp):
    plain parameter            group dp            sum/(dp cp) = the data-parallel average
    sequence-parallel norm     group dp_tp         each tp rank saw T/tp tokens: partial over tp too
    replicated key/value head  dp x its tp peers   each peer's query heads add to the gradient
    expert (ep)                ep_replicas         each copy already summed its ep group's tokens
Copies outside `group` (e.g. a norm weight on every tp rank without sequence parallelism, whose
gradients are already identical) are listed in `tied` and counted once by the norm.

Nothing here communicates: whole tensors are rebuilt from placed pieces by comm.py's `to_global`
and `gather_stages`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
from torch import nn

from teratrain.models.protocol import init_buffers


@dataclass(frozen=True, kw_only=True)
class Placement:
    name: str  # global name, the same on every layout (`layers.17.attention.wq.weight`)
    global_shape: tuple[int, ...]
    dim: int | None = None  # tensor dim split into `count` equal pieces (the last one padded)
    axis: str | None = None  # the mesh axis the pieces are spread over
    index: int = 0  # which piece this rank holds (pieces may repeat when count < the axis size)
    count: int = 1
    group: str = "dp"  # mesh group the gradient is summed over (then divided by dp x cp)
    tied: tuple[str, ...] = ("tp",)  # axes with identical copies outside `group`: counted once
    stage: int | None = None  # pipeline stage holding it (None: every stage's model has it)
    experts: tuple[int, int] | None = None  # a stack of experts along dim 0: global experts [start, stop) held

    @property
    def piece(self) -> int:
        """Length along `dim` of every piece (local tensors are this long; the last may be padding)."""
        return math.ceil(self.global_shape[self.dim] / self.count) if self.dim is not None else 0

    def bounds(self) -> tuple[int, int]:
        """[start, stop) along `dim` of the global tensor that this rank's piece holds."""
        size = self.global_shape[self.dim]
        start = min(self.index * self.piece, size)  # a piece past the end (tiny sizes) is all padding
        return start, min(start + self.piece, size)

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        if self.dim is not None:
            shape[self.dim] = self.piece
        if self.experts is not None:
            shape[0] = self.experts[1] - self.experts[0]
        return tuple(shape)

    def whole(self) -> bool:
        """Does this rank hold the whole tensor (no tensor-parallel piece, every expert)?"""
        return self.dim is None and self.experts is None

    def global_slices(self) -> tuple[slice, ...]:
        """Index into the global tensor giving this rank's data (padding excluded)."""
        out = [slice(None)] * len(self.global_shape)
        if self.dim is not None:
            out[self.dim] = slice(*self.bounds())
        if self.experts is not None:
            out[0] = slice(*self.experts)
        return tuple(out)

    def local_slices(self) -> tuple[slice, ...]:
        """Index into the local tensor giving its real (non-padding) data."""
        out = [slice(None)] * len(self.global_shape)
        if self.dim is not None:
            lo, hi = self.bounds()
            out[self.dim] = slice(0, hi - lo)
        return tuple(out)

    def to_json(self) -> dict:
        d = asdict(self)
        d["global_shape"], d["tied"] = list(self.global_shape), list(self.tied)
        d["experts"] = None if self.experts is None else list(self.experts)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Placement":
        experts = d.get("experts")
        d = {k: v for k, v in d.items() if k != "expert"}  # one expert a tensor: written before the stacks
        return cls(**{**d, "global_shape": tuple(d["global_shape"]), "tied": tuple(d["tied"]),
                      "experts": None if experts is None else tuple(experts)})

    def with_(self, **changes) -> "Placement":
        return replace(self, **changes)


def placement(p: torch.Tensor) -> Placement:
    """The placement recorded on a parameter (`assign_defaults` gives every parameter one)."""
    pl = getattr(p, "placement", None)
    if pl is None:
        raise RuntimeError("parameter has no placement; parallelize() assigns one to every parameter")
    return pl


def place(p: torch.Tensor, pl: Placement) -> None:
    p.placement = pl


def placements_json(model: nn.Module) -> dict[str, dict]:
    """Every parameter's placement, by local name, as JSON (checkpoints record them)."""
    return {n: placement(p).to_json() for n, p in model.named_parameters()}


def assign_defaults(model: nn.Module) -> None:
    """Give every parameter without a placement the plain one: whole, averaged over dp, identical
    on every tp rank. Runs first, so split transforms only overwrite what they split."""
    for name, p in model.named_parameters():
        if getattr(p, "placement", None) is None:
            place(p, Placement(name=name, global_shape=tuple(p.shape)))


def counted_here(pl: Placement, coords: dict[str, int], group_rank: int | None = None) -> bool:
    """Should this rank's copy count in a sum over all ranks (the gradient norm)? Copies along the
    `tied` axes count on coordinate 0 only; pass `group_rank` when the gradient is also replicated
    over `group` (all-reduced, not reduce-scattered), so only group rank 0 counts it."""
    return all(coords.get(a, 0) == 0 for a in pl.tied) and not group_rank


def init_local_(t: torch.Tensor, pl: Placement, init_fn: Callable[[torch.Tensor, str], None]) -> None:
    """Initialize a local tensor as the matching slice of the whole parameter: `init_fn(full, name)`
    fills the global tensor (its values depend only on the name and the seed), and this rank keeps
    its piece, padding zeroed. So every layout starts from the same model. An `init_fn` with a
    `read_piece(t, pl)` method holds trained weights (checkpoint/hf_weights.py): it reads just the piece."""
    read = getattr(init_fn, "read_piece", None)
    if read is not None:
        read(t, pl)
        return
    if pl.whole():
        init_fn(t, pl.name)
        return
    full = torch.empty(pl.global_shape, dtype=t.dtype, device=t.device)
    init_fn(full, pl.name)
    with torch.no_grad():
        t.zero_()
        t[pl.local_slices()].copy_(full[pl.global_slices()])


def materialize(model: nn.Module, device: torch.device | str, init_fn: Callable[[torch.Tensor, str], None]) -> None:
    """Allocate a meta-device model on `device` and initialize every parameter by its placement.
    (`to_empty` makes new Parameter objects when leaving the meta device: placements are carried over.)"""
    kept = {n: placement(p) for n, p in model.named_parameters()}
    model.to_empty(device=device)
    for n, p in model.named_parameters():
        place(p, kept[n])
    with torch.no_grad():
        for p in model.parameters():
            init_local_(p, placement(p), init_fn)
    init_buffers(model, device, getattr(init_fn, "buffers", None))
