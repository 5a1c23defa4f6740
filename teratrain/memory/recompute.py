"""Activation recomputation (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").

Policies (`memory.recompute`):
- full:      every block is a segment: store only block inputs, recompute each block in backward.
- every-k:   segments of k consecutive blocks (`memory.recompute_every`); one stored input per segment.
- sqrt:      k = round(sqrt(L)): L/k stored inputs + k blocks recomputed at a time, O(sqrt(L)) memory.
- selective: only the attention core (QK^T, softmax, dropout, .V) is recomputed (Korthikanti et
             al. 2022): the T x T part that is cheap to redo and costly to keep. Fused attention
             (flash/cuDNN SDPA) keeps no T x T part, so this saves only the logsumexp.
- selective-ops: each block is checkpointed with a per-op policy (torch.utils.checkpoint's
             `create_selective_checkpoint_contexts`, the "op" selective recomputation of torchtitan;
             Megatron-LM's recompute of norms and activations): the outputs of the matrix products and
             of fused attention (with its logsumexp) are kept, everything else (norms, casts, RoPE,
             SiLU/GELU and the gating product, residual adds) is recomputed in backward, so no GEMM
             and no attention runs twice. A block's forward collectives (tensor parallelism) run again
             in its recompute, as under full.
Dropout RNG is replayed (`preserve_rng_state`), so gradients equal those without recomputation.
A model of your own (models/protocol.py) gets `full`: each of its blocks' forward is checkpointed.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from teratrain.compat import gemm_and_attention_ops
from teratrain.models.protocol import blocks, is_builtin
from teratrain.models.transformer import Blocks


def segment_size(policy: str, n_layers: int, every: int) -> int:
    if policy in ("full", "selective-ops"):
        return 1
    if policy == "every-k":
        return every
    if policy == "sqrt":
        return max(1, round(math.sqrt(n_layers)))
    raise ValueError(f"policy {policy!r} has no segments")


class RecomputedBlocks(Blocks):
    """The same blocks (same parameter names), run in checkpointed segments of `k` blocks."""

    def __init__(self, blocks: Blocks, k: int, ops: bool = False):
        super().__init__(blocks)
        self.k, self.ops = k, ops  # ops: memory.recompute=selective-ops's per-op policy

    def forward(self, h, pos=None, caches=None, start: int = 0):
        if caches is not None or not torch.is_grad_enabled():
            return super().forward(h, pos, caches, start)
        kw = {"context_fn": keep_gemm_outputs} if self.ops else {}
        for i in range(0, len(self), self.k):
            h = checkpoint(self._segment, h, pos, i, use_reentrant=False, preserve_rng_state=True, **kw)
        return h

    def part(self, keys) -> "RecomputedBlocks":
        return RecomputedBlocks(super().part(keys), self.k, self.ops)

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
            block.forward = _checkpointed(block.forward, policy == "selective-ops")
        return model
    if policy == "selective":
        for block in model.layers:
            block.attention.core = Recomputed(block.attention.core)
        return model
    model.layers = RecomputedBlocks(model.layers, segment_size(policy, len(model.layers), every),
                                    ops=policy == "selective-ops")
    return model


def _keep_gemms(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """selective-ops: keep what a matrix product or fused attention made, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if func in gemm_and_attention_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def keep_gemm_outputs():
    """The (forward, recompute) contexts of memory.recompute=selective-ops (`_keep_gemms`)."""
    return create_selective_checkpoint_contexts(_keep_gemms)


def _checkpointed(forward, ops: bool = False):
    """`forward` run under checkpoint: its activations are recomputed in backward (module hooks, such
    as ZeRO-3's gathers, stay outside it and run once); `ops`: selective-ops's per-op policy."""
    extra = {"context_fn": keep_gemm_outputs} if ops else {}

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    return run
