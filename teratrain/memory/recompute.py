"""Activation recomputation (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").

Policies (`memory.recompute`):
- full:      every block is a segment: store only block inputs, recompute each block in backward.
- every-k:   segments of k consecutive blocks (`memory.recompute_every`); one stored input per segment.
- sqrt:      k = round(sqrt(L)): L/k stored inputs + k blocks recomputed at a time, O(sqrt(L)) memory.
- selective: only the attention core (QK^T, softmax, dropout, .V) is recomputed (Korthikanti et
             al. 2022): the T x T part that is cheap to redo and costly to keep. Fused attention
             (flash/cuDNN SDPA) keeps no T x T part, so this saves only the logsumexp.
- selective-ops: each block is checkpointed with a per-op policy (torch.utils.checkpoint's
             `create_selective_checkpoint_contexts`, torchtitan's "op" selective recomputation keeping
             every product; Megatron-LM's recompute of norms and activations): the outputs of the matrix products and
             of fused attention (with its logsumexp) are kept, everything else (norms, casts, RoPE,
             SiLU/GELU and the gating product, residual adds) is recomputed in backward, so no GEMM
             and no attention runs twice. A block's forward collectives (tensor parallelism) run again
             in its recompute, as under full.
- selective-ops-alternate: as selective-ops, but of a block's linear layers' products only the 1st, 3rd,
             5th, ... output is kept (counted in the order the block runs them, apart in forward and
             in the replay): torchtitan's "op" policy (which counts only aten.mm and also keeps
             reduce-scatter outputs: the same without tensor parallelism and float8). LoRA's adapter
             products count among them. A Llama block keeps wq's, wv's, w1's and w2's outputs and
             runs wk, wo and w3 again in backward (at llama-8b's shape 37% of the block's forward GEMM
             FLOPs). Dense blocks only: an MoE layer's GEMMs vary in number with its kernel.
Dropout RNG is replayed (`preserve_rng_state`), so gradients equal those without recomputation.
A model of your own (models/protocol.py) gets `full`: each of its blocks' forward is checkpointed.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from teratrain.compat import attention_ops, gemm_ops, linear_gemm_ops
from teratrain.config_schema import SELECTIVE_OPS
from teratrain.models.protocol import blocks, is_builtin
from teratrain.models.transformer import Blocks


def segment_size(policy: str, n_layers: int, every: int) -> int:
    if policy == "full" or policy in SELECTIVE_OPS:
        return 1
    if policy == "every-k":
        return every
    if policy == "sqrt":
        return max(1, round(math.sqrt(n_layers)))
    raise ValueError(f"policy {policy!r} has no segments")


class RecomputedBlocks(Blocks):
    """The same blocks (same parameter names), run in checkpointed segments of `k` blocks."""

    def __init__(self, blocks: Blocks, k: int, ops: str | None = None):
        super().__init__(blocks)
        self.k, self.ops = k, ops  # ops: the per-op policy (SELECTIVE_OPS) each block is checkpointed with

    def forward(self, h, pos=None, caches=None, start: int = 0):
        if caches is not None or not torch.is_grad_enabled():
            return super().forward(h, pos, caches, start)
        kw = {"context_fn": per_op_contexts(self.ops)} if self.ops else {}
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
            block.forward = _checkpointed(block.forward, policy if policy in SELECTIVE_OPS else None)
        return model
    if policy == "selective":
        for block in model.layers:
            block.attention.core = Recomputed(block.attention.core)
        return model
    model.layers = RecomputedBlocks(model.layers, segment_size(policy, len(model.layers), every),
                                    ops=policy if policy in SELECTIVE_OPS else None)
    return model


def _gemm_output_contexts(every_other: bool):
    """The (forward, recompute) contexts of a per-op policy, made for each checkpointed block: keep what a matrix
    product or attention (fused or not) made and recompute the rest; `every_other`: of the linear layers'
    products only the 1st, 3rd, ..., counted apart in the forward and in the replay (which meets the same products
    in the same order)."""
    linear, kept = linear_gemm_ops(), gemm_ops() | attention_ops()
    # linear products met so far: in the forward, in the replay (torch versions that ask the policy again while
    # replaying; others match the replay's ops to the forward's by their order and ask only in the forward)
    seen = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if every_other and func in linear:
            seen[ctx.is_recompute] += 1
            keep = seen[ctx.is_recompute] % 2 == 1
        else:
            keep = func in kept
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def keep_gemm_outputs():
    """memory.recompute=selective-ops's contexts: every product's output kept."""
    return _gemm_output_contexts(every_other=False)


def keep_alternate_gemm_outputs():
    """memory.recompute=selective-ops-alternate's contexts: every other linear product's output kept."""
    return _gemm_output_contexts(every_other=True)


def per_op_contexts(policy: str):
    """The checkpoint's `context_fn` of a per-op policy (SELECTIVE_OPS)."""
    return keep_alternate_gemm_outputs if policy == "selective-ops-alternate" else keep_gemm_outputs


def _checkpointed(forward, ops: str | None = None):
    """`forward` run under checkpoint: its activations are recomputed in backward (module hooks, such
    as ZeRO-3's gathers, stay outside it and run once); `ops`: a per-op policy (SELECTIVE_OPS)."""
    extra = {"context_fn": per_op_contexts(ops)} if ops else {}

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    return run
