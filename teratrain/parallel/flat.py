"""Parameters laid end to end in flat buffers, padded so every rank owns an equal contiguous shard.

A `FlatGroup` of parameters p_0..p_k (numels n_0..n_k, N = sum n_i) has a flat index space of
`padded = ceil(N / world) * world` elements; rank r owns [r*S, (r+1)*S) with S = padded / world.
Flat, equal shards mean each collective is one call on one contiguous buffer (no fragmentation,
no per-tensor launches) and every rank's share differs from N/world by under one element per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


# Flat buffers whose collective is still running, per engine: launching another first waits for the
# oldest. This bounds the transient memory (e.g. fp32 reduce copies of bf16 grads) to a few buckets.
MAX_INFLIGHT_REDUCES = 2


@dataclass
class Piece:
    """The part of parameter `index` that falls in this rank's shard."""

    index: int
    shard_lo: int  # offset inside this rank's shard
    numel: int


class FlatGroup:
    def __init__(self, names: list[str], params: list[nn.Parameter], world: int, rank: int):
        self.names, self.params, self.world, self.rank = names, params, world, rank
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1]
        self.shard_numel = math.ceil(self.numel / world)
        self.padded = self.shard_numel * world
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        self.pieces = self._pieces()

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
        """Tensors shaped like the params (None = zeros) copied into a new (padded,) buffer."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for view, t in zip(self.views(flat), tensors):
            if t is not None:
                view.copy_(t)
        return flat
