"""A model chunk: what one pipeline stage computes, runnable forward and backward on its own.

A rank of an interleaved schedule holds v chunks (stages r, r + pp, ...). Each chunk is a view, not a
module: its blocks are a `Blocks.part` of `model.layers` (the same block modules, run with the same
recomputation policy), so the engines, checkpoints and placements see one model and one set of
parameters per rank, by global name.

    stage 0:      tokens (B, T) -> embed -> [detach: x] -> blocks -> h (B, T', d)
    middle:       x (B, T', d) received               -> blocks -> h
    last stage:   x                                    -> blocks -> norm -> head -> loss ()
T' = T, or T / tp under sequence parallelism. Stage 0 cuts the graph after the embedding, so every
stage has an input leaf `x`: the input-gradient pass (ZB-H1's I) ends there and the weight pass (W)
then finishes the embedding's gradient from x.grad. A stage 0 with no blocks (`parallel.stage_layers`
0, ...) runs the embedding alone, uncut: its backward is the embedding's (stage 0 never splits it).

Mixture of experts: one process's loss is the cross-entropy plus every MoE layer's weighted aux loss
(models/transformer.py), so each stage's aux losses must enter its own backward, whether or not it
holds the head. `with_aux` ties them to the chunk's output as Megatron's MoEAuxLossAutoScaler does:
identity forward, and a backward that also seeds the aux losses with the weight the loss has in the
update (1 / micro-batches, times the fp16 loss scale), so B, and ZB-H1's I and W, need no second root.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from teratrain.memory.compression import watch_blocks
from teratrain.memory.recompute import RecomputedBlocks
from teratrain.models.layers import Positions
from teratrain.models.moe import blocks_aux_loss


class Chunk:
    def __init__(self, model: nn.Module, stage: int, num_stages: int, blocks: range):
        self.model, self.stage = model, stage
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        model.pad_head = False  # the split backward reads the head's own GEMM (Transformer.head)
        self.blocks = model.layers.part([str(i) for i in blocks])
        # the model's first stage with no blocks runs the embedding alone and sends its output, which it
        # need not keep (the lookup's backward reads only the token ids)
        self.embeds_only = self.is_first and not self.is_last and len(blocks) == 0
        self._weights: list[nn.Parameter] | None = None
        watch_blocks(model, self.blocks)  # activation compression: these blocks are the stack's inside

    def embed(self, tokens: torch.Tensor, pos: Positions | None = None) -> torch.Tensor:
        """Stage 0's embedding: (B, T) -> (B, T', d)."""
        return self.model.embed(tokens, 0, pos.index if pos is not None else None)

    def forward(self, x: torch.Tensor, targets: torch.Tensor, pos: Positions, segment=None) -> torch.Tensor:
        """This chunk's blocks on x (B, T', d); the last stage goes on to the mean loss over targets (B, T).
        `pos`: the micro-batch's positions (the model's SequenceLayout made them from its tokens, on every
        stage alike). `segment(fn, *args)`, when given, runs each recomputed segment of blocks in place of
        torch's checkpoint (saved.py: the split backward replays each segment once)."""
        m = self.model
        if segment is not None and isinstance(self.blocks, RecomputedBlocks):
            blocks = list(self.blocks)
            h = x
            for i in range(0, len(blocks), self.blocks.k):
                h = segment(_run_blocks, blocks[i:i + self.blocks.k], h, pos)
        else:
            h = self.blocks(x, pos)
        return m.loss(h, targets) if self.is_last else h

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of this chunk's MoE aux losses from its latest forward (None: no MoE layer here)."""
        return blocks_aux_loss(self.blocks.values())

    def weights(self) -> list[nn.Parameter]:
        """Trainable parameters used after the input leaf x (blocks, and the head on the last stage):
        those whose gradient the weight pass computes. Listed once (every split backward asks; walking
        the modules each time cost the host 0.4 ms a micro-batch at 16 blocks): which parameters train
        is fixed before the first step."""
        if self._weights is None:
            mods = [self.blocks] + ([self.model.norm, self.model.output] if self.is_last else [])
            if self.is_last and self.model.output is None:
                mods.append(self.model.tok_embeddings)  # tied: the head is the embedding matrix
            self._weights = [p for mod in mods if mod is not None for p in mod.parameters() if p.requires_grad]
        return self._weights

    def early_weights(self, tokens: int) -> list[nn.Parameter]:
        """Matrices whose gradient ZB-H1's I makes at once (backward.py `early`; vectors always are):
        on the last stage the output projection's (tied: the embedding matrix), when its (vocab, d)
        gradient is smaller than what its W would wait with, the (tokens, vocab) gradient of the
        logits and the (tokens, d) input, i.e. above about d tokens per micro-batch. ZB-H1 keeps every
        stage at 1F1B's peak only if a micro-batch waiting for W holds alike on every stage (Qi et al.
        2023 sec. 2.1); the logit gradient made the last stage's larger (`python bench/pipeline_live.py
        --account` counts what each stage holds after every action, by kind). The head's GEMM moves from W into I on the stage that already runs the head,
        the slowest of an even split, whose work sets the pace: the simulator shows no longer step
        there, and (p-1) x the GEMM where the split makes the last stage no slower than the others."""
        if not self.is_last:
            return []
        head = self.model.output if self.model.output is not None else self.model.tok_embeddings
        return [p for p in head.parameters() if p.requires_grad and p.dim() == 2 and grad_in_i(tokens, *p.shape)]


def grad_in_i(tokens: int, rows: int, cols: int) -> bool:
    """Is a (rows, cols) matrix's gradient smaller than what its W would wait with, the (tokens, rows)
    gradient of its output and its (tokens, cols) input? (`Chunk.early_weights`; the planner's
    activations.pending_head counts by the same rule.)"""
    return tokens * (rows + cols) > rows * cols


def _run_blocks(blocks: list[nn.Module], h: torch.Tensor, pos: Positions) -> torch.Tensor:
    for block in blocks:
        h = block(h, pos)
    return h
def with_aux(out: torch.Tensor, aux: torch.Tensor, weight: Callable[[], float]) -> torch.Tensor:
    """`out` (its value), whose backward also gives `aux` the gradient `weight()` (read then: the
    loss scale may change between a micro-batch's forward and its backward)."""
    return _AuxLoss.apply(out, aux, weight)


class _AuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, aux, weight):
        ctx.weight = weight
        ctx.aux_meta = (aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.aux_meta
        return grad, torch.full((), ctx.weight(), dtype=dtype, device=device), None
