"""Pieces of logical tensors: which part of a global tensor some local data is.

A logical tensor has a global name and shape: a parameter (`layers.3.attention.wq.weight`) or one of
its optimizer moments. A rank holds a *piece* of it, described in global coordinates only:

    box      offsets + shape of a hyper-rectangle of the global tensor: the local tensor a placement
             describes (tensor parallelism splits one dim, expert parallelism keeps rows of a stack of
             experts; a pipeline stage holds whole tensors). It may run past the global shape: padding
             (a vocabulary padded to tp pieces).
    lo, hi   the flat range of the box, in row-major order, that the piece holds: all of it, or one
             rank's ZeRO shard of the flat buffer the local tensor lies in (parallel/flat.py).

So any layout's pieces meet any other layout's in global coordinates: a reader intersects the piece
it needs with the pieces on disk, box by box, and never needs to know which strategy wrote them.
A flat range of a box is a union of at most 2*ndim - 1 sub-boxes that are each contiguous in the
range (`sub_boxes`): a part row, whole rows, a part row, recursively.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import torch

from teratrain.parallel.placement import Placement

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (global start, shape, flat offset in the piece's data)


@dataclass(frozen=True)
class Piece:
    name: str  # global name of the logical tensor's parameter
    shape: tuple[int, ...]  # global shape
    offsets: tuple[int, ...]  # where the box starts in the global tensor
    box: tuple[int, ...]  # the box's shape (may run past `shape`: padding)
    lo: int  # flat range [lo, hi) of the box held
    hi: int

    @classmethod
    def of(cls, pl: Placement, lo: int = 0, hi: int | None = None) -> "Piece":
        """The piece of a local tensor shaped as `pl` describes, or the flat range [lo, hi) of it."""
        box = pl.local_shape()
        offsets = [pl.bounds()[0] if d == pl.dim else 0 for d in range(len(box))]
        if pl.experts is not None:  # a stack of experts: this rank's rows of dim 0
            offsets[0] = pl.experts[0]
        offsets = tuple(offsets)
        return cls(pl.name, tuple(pl.global_shape), offsets, tuple(box), lo, math.prod(box) if hi is None else hi)

    @classmethod
    def whole_of(cls, name: str, shape: tuple[int, ...]) -> "Piece":
        shape = tuple(shape)
        return cls(name, shape, (0,) * len(shape), shape, 0, math.prod(shape))

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def is_box(self) -> bool:
        """Does the piece hold its whole box (then it is stored shaped like the box)?"""
        return self.lo == 0 and self.hi == math.prod(self.box)

    def clipped(self) -> "Piece":
        """A whole-box piece without its padding (the box cut to the global shape)."""
        assert self.is_box()
        box = tuple(max(0, min(n, s - o)) for n, s, o in zip(self.box, self.shape, self.offsets))
        return Piece(self.name, self.shape, self.offsets, box, 0, math.prod(box))

    def sub_boxes(self) -> list[Box]:
        return [(tuple(o + s for o, s in zip(self.offsets, start)), shape, flat - self.lo)
                for start, shape, flat in _flat_range_boxes(self.box, self.lo, self.hi)]

    def in_bounds(self) -> int:
        """Elements of the piece inside the global tensor (the rest is padding)."""
        return sum(math.prod(b - a for a, b in zip(*region)) for _, region in regions(self))

    def key(self) -> str:
        """A compact identity of the region (names a factored optimizer state's piece)."""
        return f"{','.join(map(str, self.offsets))}+{','.join(map(str, self.box))}[{self.lo}:{self.hi}]"

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "box": list(self.box), "flat": [self.lo, self.hi]}

    @classmethod
    def from_json(cls, name: str, shape, d: dict) -> "Piece":
        return cls(name, tuple(shape), tuple(d["offsets"]), tuple(d["box"]), *d["flat"])


def _flat_range_boxes(box: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """[lo, hi) of a row-major box as (start within the box, shape, flat position) sub-boxes, each one
    contiguous in flat order."""
    if lo >= hi:
        return []
    if not box:
        return [((), (), lo)]
    inner = math.prod(box[1:])
    if inner == 0:
        return []

    def row(r: int, a: int, b: int) -> list[Box]:  # elements [a, b) of row r
        return [((r,) + s, (1,) + n, r * inner + f) for s, n, f in _flat_range_boxes(box[1:], a, b)]

    first, last = -(-lo // inner), hi // inner  # the whole rows are [first, last)
    if first > last:  # the range lies inside one row
        r = lo // inner
        return row(r, lo - r * inner, hi - r * inner)
    out = row(first - 1, lo - (first - 1) * inner, inner) if lo < first * inner else []
    if first < last:
        out.append(((first,) + (0,) * (len(box) - 1), (last - first,) + box[1:], first * inner))
    if last * inner < hi:
        out += row(last, 0, hi - last * inner)
    return out


def overlap(a_start, a_shape, b_start, b_shape, bound) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The intersection of two boxes inside [0, bound), as (start, stop), or None when empty."""
    lo = tuple(max(x, y) for x, y in zip(a_start, b_start))
    hi = tuple(min(x + n, y + m, s) for x, n, y, m, s in zip(a_start, a_shape, b_start, b_shape, bound))
    return (lo, hi) if all(x < y for x, y in zip(lo, hi)) else None


def region_view(flat: torch.Tensor, box: Box, region: tuple) -> torch.Tensor:
    """The part of a piece's flat data (`flat`) that holds `region` (global (start, stop)), as a
    view shaped like the region; `box` is the piece's sub-box containing it."""
    start, shape, off = box
    view = flat[off:off + math.prod(shape)].view(shape)
    return view[tuple(slice(a - s, b - s) for a, b, s in zip(*region, start))]


def regions(piece: Piece) -> list[tuple[Box, tuple]]:
    """Each sub-box of `piece` with the part of it inside the global tensor (padding left out)."""
    out = []
    for box in piece.sub_boxes():
        region = overlap(box[0], box[1], box[0], box[1], piece.shape)
        if region:
            out.append((box, region))
    return out


class PieceSource(abc.ABC):
    """An `init_fn` of given values (parallel/placement.py `init_local_`): it fills any piece of a
    parameter (a tensor-parallel slice, the flat range of it in a ZeRO-3 shard) by reading just that
    region, `region(name, start, stop, global shape)`, of the whole parameter."""

    buffers: dict[str, torch.Tensor] | None = None  # buffer values to restore, if the source has them

    @abc.abstractmethod
    def region(self, name: str, start: tuple, stop: tuple, shape: tuple) -> torch.Tensor:
        """Elements [start, stop) of the parameter `name`, whose global shape is `shape`."""

    def __call__(self, t: torch.Tensor, name: str) -> None:
        self.read_piece(t, Placement(name=name, global_shape=tuple(t.shape)))

    @torch.no_grad()
    def read_piece(self, t: torch.Tensor, pl: Placement, lo: int = 0, hi: int | None = None) -> None:
        flat = t.view(-1)
        flat.zero_()  # padding (a vocabulary padded to tp pieces) stays zero
        for box, region in regions(Piece.of(pl, lo, hi)):
            region_view(flat, box, region).copy_(self.region(pl.name, *region, pl.global_shape))


class WholeTensors(PieceSource):
    """Values given as whole tensors by global name: the parameters (and buffers) of a model that was
    built on a real device, kept when parallelize() moves it to the meta device."""

    def __init__(self, tensors: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor] | None = None):
        self.tensors, self.buffers = tensors, buffers

    def region(self, name, start, stop, shape):
        return self.tensors[name][tuple(slice(a, b) for a, b in zip(start, stop))]
