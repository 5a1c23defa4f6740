"""Parameters laid end to end in flat buffers, padded so every rank owns an equal contiguous shard.

A `FlatGroup` of parameters p_0..p_k (numels n_0..n_k, N = sum n_i) has a flat index space of
`padded = ceil(N / world) * world` elements; rank r owns [r*S, (r+1)*S) with S = padded / world.
Flat, equal shards mean each collective is one call on one contiguous buffer (no fragmentation,
no per-tensor launches) and every rank's share differs from N/world by under one element per rank.

With `whole=True` (optimizers whose state is not elementwise: Adafactor's and SM3's row/column
statistics need whole matrices) every parameter stays in one rank's shard: parameters are dealt
into `world` bins, largest first onto the lightest bin, bin r laid out at [r*S, r*S + its size)
with S the largest bin. The collectives are unchanged; the price is the padding up to S on the
lighter ranks (traffic and gradient-shard memory), shown by `padded`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn


# Reduce inputs alive at once, per engine, which bounds the transient memory (fp32 reduce copies of
# bf16 grads). DataParallelEngine: reductions of copies still running after a launch (launching another
# first waits for the oldest; a bucket reduced in place is waited for at the step). ZeroEngine: inputs
# alive at once, the one being made included (it waits for the oldest before making it): a few buckets
# at stages 1/2, one block at stage 3, as FSDP2 keeps by default (a block's fp32 reduce input is twice
# its bf16 parameters: 0.87 GB for a Llama-8B block).
MAX_INFLIGHT_REDUCES = 2
BLOCK_REDUCES_IN_FLIGHT = 1

# Optimizers whose state is not elementwise (row/column statistics of whole matrices): ZeRO deals
# their parameters whole (FlatGroup's `whole=True`).
WHOLE_PARAM_OPTIMIZERS = ("adafactor", "sm3")


@dataclass
class Piece:
    """The part of parameter `index` that falls in this rank's shard."""

    index: int
    shard_lo: int  # offset inside this rank's shard
    numel: int


class FlatGroup:
    def __init__(self, names: list[str], params: list[nn.Parameter], world: int, rank: int, whole: bool = False):
        numels = [p.numel() for p in params]
        if whole:  # bin by bin, so each rank's parameters are contiguous from its shard's start
            bins = deal(numels, world)
            order = [i for b in bins for i in b]
            names, params, numels = [names[i] for i in order], [params[i] for i in order], [numels[i] for i in order]
            spans = _spans(bins)
            self.shard_numel = max(1, max(sum(numels[lo:hi]) for lo, hi in spans))
            self.offsets = [r * self.shard_numel + sum(numels[lo:i]) for r, (lo, hi) in enumerate(spans)
                            for i in range(lo, hi)]
        else:
            self.offsets = [0, *itertools.accumulate(numels)][:-1]
            self.shard_numel = math.ceil(sum(numels) / world)
        self.names, self.params, self.world, self.rank = names, params, world, rank
        self.shapes = [p.shape for p in params]
        self.numels = numels
        self.numel = sum(numels)
        self.padded = self.shard_numel * world
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        self.pieces = self._pieces()
        self.gaps = _gaps(self.offsets, self.numels, self.padded)

    def _pieces(self) -> list[Piece]:
        out = []
        for i, (start, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(start, self.lo), min(start + n, self.hi)
            if lo < hi:
                out.append(Piece(i, lo - self.lo, hi - lo))
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a (padded,) buffer shaped like each parameter."""
        return [flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def shard_views(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Views of a (shard_numel,) buffer, one per piece of this rank's shard."""
        return [shard[pc.shard_lo:pc.shard_lo + pc.numel] for pc in self.pieces]

    def flatten(self, tensors: list[torch.Tensor | None], dtype: torch.dtype, device) -> torch.Tensor:
        """Tensors shaped like the params (None = zeros) copied into a new (padded,) buffer; only
        the padding and the missing tensors' ranges are zeroed (one pass over the bytes, not two).
        The copies are one `_foreach_copy_`: between dtypes (bf16 gradients into an fp32 reduce
        input) it moved 3.1 TB/s on an H200, where a `copy_` per tensor moved 1.9-2.0 (its kernel casts
        each element through a runtime dtype switch)."""
        flat = torch.empty(self.padded, dtype=dtype, device=device)
        for lo, hi in self.gaps:
            flat[lo:hi].zero_()
        views = self.views(flat)
        pairs = [(view, t) for view, t in zip(views, tensors) if t is not None]
        if pairs:
            torch._foreach_copy_([view for view, _ in pairs], [t for _, t in pairs])
        for view, t in zip(views, tensors):
            if t is None:
                view.zero_()
        return flat


def deal(numels: list[int], world: int) -> list[list[int]]:
    """Indices of `numels` dealt into `world` bins: largest first onto the lightest bin (ties to the
    lower bin), each bin in the original order. Deterministic, so every rank and the planner agree."""
    bins: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        bins[r].append(i)
        load[r] += numels[i]
    return [sorted(b) for b in bins]


def _gaps(offsets: list[int], numels: list[int], padded: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of a (padded,) buffer that no parameter covers (padding)."""
    out, pos = [], 0
    for lo, n in sorted(zip(offsets, numels)):
        if lo > pos:
            out.append((pos, lo))
        pos = max(pos, lo + n)
    return out + ([(pos, padded)] if pos < padded else [])


def _spans(bins: list[list[int]]) -> list[tuple[int, int]]:
    """[lo, hi) positions of each bin's parameters once laid out bin after bin."""
    out, lo = [], 0
    for b in bins:
        out.append((lo, lo + len(b)))
        lo += len(b)
    return out

