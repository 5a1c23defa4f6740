"""Activation recomputation (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").

Policies (`memory.recompute`):
- full:      every block is a segment: store only block inputs, recompute each block in backward.
- every-k:   segments of k consecutive blocks (`memory.recompute_every`); one stored input per segment.
- sqrt:      k = round(sqrt(L)): L/k stored inputs + k blocks recomputed at a time, O(sqrt(L)) memory.
- selective: only the attention core (QK^T, softmax, dropout, .V) is recomputed (Korthikanti et
             al. 2022): the T x T part that is cheap to redo and costly to keep.
Dropout RNG is replayed (`preserve_rng_state`), so gradients equal those without recomputation.
A model of your own (models/protocol.py) gets `full`: each of its blocks' forward is checkpointed.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from teratrain.models.protocol import blocks, is_builtin
from teratrain.models.transformer import Blocks


def segment_size(policy: str, n_layers: int, every: int) -> int:
    if policy == "full":
        return 1
    if policy == "every-k":
        return every
    if policy == "sqrt":
        return max(1, round(math.sqrt(n_layers)))
    raise ValueError(f"policy {policy!r} has no segments")


class RecomputedBlocks(Blocks):
    """The same blocks (same parameter names), run in checkpointed segments of `k` blocks."""

    def __init__(self, blocks: Blocks, k: int):
        super().__init__(blocks)
        self.k = k

    def forward(self, h, pos=None, caches=None, start: int = 0):
        if caches is not None or not torch.is_grad_enabled():
            return super().forward(h, pos, caches, start)
        for i in range(0, len(self), self.k):
            h = checkpoint(self._segment, h, pos, i, use_reentrant=False, preserve_rng_state=True)
        return h

    def part(self, keys) -> "RecomputedBlocks":
        return RecomputedBlocks(super().part(keys), self.k)

    def _segment(self, h, pos, i: int):
        for block in list(self)[i:i + self.k]:
            h = block(h, pos)
        return h


class Recomputed(nn.Module):
    """Run a parameter-free module under checkpoint (selective recomputation)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return checkpoint(self.inner, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def apply_recompute(model: nn.Module, policy: str, every: int = 2) -> nn.Module:
    if policy == "none":
        return model
    if not is_builtin(model):  # a model of your own: each of its blocks (models/protocol.py) is a segment
        for _, block in blocks(model):
            block.forward = _checkpointed(block.forward)
        return model
    if policy == "selective":
        for block in model.layers:
            block.attention.core = Recomputed(block.attention.core)
        return model
    model.layers = RecomputedBlocks(model.layers, segment_size(policy, len(model.layers), every))
    return model


def _checkpointed(forward):
    """`forward` run under checkpoint: its activations are recomputed in backward (module hooks, such
    as ZeRO-3's gathers, stay outside it and run once)."""

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    return run
