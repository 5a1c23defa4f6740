"""The layers tensor parallelism swaps in (parallel/tensor.py decides where). Each keeps the
parameter names of the layer it replaces (`weight`, `bias`), holds only this rank's piece as a
plain local tensor, and calls explicit collectives from parallel/comm.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from teratrain.models.layers import to_compute_dtype
from teratrain.parallel.comm import MAX, SUM, all_reduce, sequence_rows
from teratrain.parallel.placement import placement
from teratrain.parallel.tp_overlap import column_group, row_exit


class SequenceShards:
    """Which tokens this tp rank holds under sequence parallelism (comm.sequence_rows: rows of the
    flattened batch). `batch`, the micro-batch's B, is recorded by the embedding of each forward:
    learned positions need it to know which positions their rows are."""

    def __init__(self, n: int, rank: int, chunks: int):
        self.n, self.rank, self.chunks = n, rank, chunks
        self.batch: int | None = None

    def positions(self, length: int, device) -> torch.Tensor:
        """Position in its sequence (of `length`) of each token row this rank holds, in order."""
        spans = sequence_rows(self.batch * length, self.n, self.rank, self.chunks)
        return torch.cat([torch.arange(a, b, device=device) for a, b in spans]) % length


class _SequenceLinear(torch.autograd.Function):
    """y = X W^T + b for X a sequence-parallel region input, keeping only this rank's shard of X
    (comm.Regather). Backward: the shard's all-gather is launched first, the input gradient dY W
    computed under it, then the weight gradient dY^T X reads the gathered X (Megatron-LM's order)."""

    @staticmethod
    def forward(ctx, X, shard, w, b, regather):
        ctx.save_for_backward(shard, w)
        ctx.regather, ctx.has_bias = regather, b is not None
        regather.users += 1
        return F.linear(X, w, b)

    @staticmethod
    def backward(ctx, gy):
        shard, w = ctx.saved_tensors
        ctx.regather.start(shard)
        dx = gy.matmul(w) if ctx.needs_input_grad[0] else None  # (B, T, d_in), under the gather
        X = ctx.regather.finish()
        g = gy.reshape(-1, gy.shape[-1])  # (N, d_out)
        dw = g.t().mm(X.reshape(-1, X.shape[-1])) if ctx.needs_input_grad[2] else None  # frozen: none
        db = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return dx, None, dw, db, None


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, keeping only the sequence shard of an input gathered by
    comm.gather_sequence_to_linears (weights cast to the input's dtype through autograd, as
    autocast casts them)."""
    kept = getattr(x, "regather", None)
    if kept is None or not torch.is_grad_enabled():
        return F.linear(x, w, b)
    regather, shard = kept
    return _SequenceLinear.apply(x, shard, w.to(x.dtype), b.to(x.dtype) if b is not None else None, regather)


class _Parallel(nn.Module):
    """A split linear layer's weight, bias and (LoRA, memory/lora.py) adapter pieces. `adapter` is
    (lora_a, lora_b, scale, dropout) split like the weight, or None."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, entry, exit, adapter=None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.entry, self.exit = entry, exit
        self.lora_a, self.lora_b, self.lora_scale, self.lora_dropout = adapter or (None, None, 0.0, None)

    gemm = None  # memory/fp8.py's Fp8Gemm where this piece's GEMMs run in float8; else F.linear
    float8_weight = None  # memory/fp8.py's Float8Weight: set by ZeRO-3's float8 gathers and the step's casts

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.gemm is None:
            return linear(x, self.weight, bias)
        return self.gemm(x, self.weight, bias, self.float8_weight)

    def _adapter_term(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.lora_a is None:
            return None
        return self.lora_scale * F.linear(linear(self.lora_dropout(x), self.lora_a), self.lora_b)

    def _adapted(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        term = self._adapter_term(x)
        return y if term is None else y + term


class ColumnParallel(_Parallel):
    """y = X W'^T + b' with W' this rank's rows of W (its output features): (.., d_in) -> (.., d_out/tp).
    `entry` brings X in (identity when a region hook already did), `exit` takes y out (identity:
    the output stays split; all-gather in the all-gather form, parallel.tp_form). An adapter adds
    s B' A X with B' this rank's rows of B and A whole. Under parallel.tp_overlap=chunked, `joint`
    (parallel/tp_overlap.py) computes it with the other projections of its region, the entry
    collective overlapped with all of their GEMMs."""

    joint = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.entry is not None:
            x = self.entry(x)
        if self.joint is not None:
            x, y = self.joint.take(self, x)  # x: the whole region input, for the adapter
            return self._adapted(x, y)
        y = self._adapted(x, self._linear(x, self.bias))
        return self.exit(y) if self.exit is not None else y


class RowParallel(_Parallel):
    """y = reduce(X' W'^T) + b with W' this rank's columns of W (its input features): the partial
    products of all ranks add up to X W^T; the whole bias is added once, after the reduction. An
    adapter's partial s B A' X' (A' this rank's columns of A, B whole) joins the reduction. With
    `overlap` (the TPContext of parallel.tp_overlap=chunked) the reduction runs unit by unit under
    the GEMM (parallel/tp_overlap.py)."""

    overlap = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.entry is not None:
            x = self.entry(x)
        if self.overlap is not None:
            c, x = self.overlap, to_compute_dtype(x)
            y = row_exit(x, self.weight, self._adapter_term(x), c.group, c.sp, c.chunks)
        else:
            y = self.exit(self._adapted(x, self._linear(x, None)))
        return y + self.bias if self.bias is not None else y


class PartialRowParallel(nn.Module):
    """y = X' W'^T (+ b on one rank): a row-parallel product left unreduced, for a caller that sums
    it later (the shared experts, whose gated outputs the MoE layer reduces at once). The bias is added on the
    rank given `add_bias` and multiplied by zero elsewhere, so every rank builds the same graph."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, add_bias: bool):
        super().__init__()
        self.weight, self.bias, self.bias_share = weight, bias, 1.0 if add_bias else 0.0

    gemm = None  # memory/fp8.py's Fp8Gemm where the product runs in float8, as the pieces above take it
    float8_weight = None  # memory/fp8.py's Float8Weight: set by ZeRO-3's float8 gathers and the step's casts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight) if self.gemm is None else self.gemm(x, self.weight, None, self.float8_weight)
        return y + self.bias * self.bias_share if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, hi) of the (padded) embedding on each rank: a token outside the range looks up
    zeros here and its row on the rank that holds it; `exit` sums the ranks' outputs (all-reduce,
    or reduce-scatter along the sequence under sequence parallelism, which also records the batch
    size in `shards`)."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, exit, shards: SequenceShards | None = None):
        super().__init__()
        self.weight, self.exit, self.shards = weight, exit, shards
        self.lo, self.hi = placement(weight).bounds()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.shards is not None:
            self.shards.batch = tokens.shape[0]
        outside = (tokens < self.lo) | (tokens >= self.hi)  # (B, T)
        h = F.embedding((tokens - self.lo).masked_fill(outside, 0), self.weight)  # (B, T, d)
        return self.exit(h.masked_fill(outside.unsqueeze(-1), 0.0))


class VocabParallelHead(nn.Module):
    """The tied head: logits of this rank's vocabulary rows, through the embedding's own piece.
    With `overlap` (parallel.tp_overlap=chunked) `entry` only casts and the entry collective runs
    under the head's GEMM (parallel/tp_overlap.py)."""

    def __init__(self, entry, overlap=None):
        super().__init__()
        self.entry, self.overlap = entry, overlap

    def forward(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.overlap is not None:
            c = self.overlap
            _, (y,) = column_group(self.entry(h), [weight], [None], c.group, c.sp, c.chunks)
            return y  # (B, T, V/tp)
        return linear(self.entry(h), weight)  # (B, T, V/tp)


class SequenceShardPositions(nn.Embedding):
    """Learned positions under sequence parallelism: the positions of this rank's tokens (the hidden
    states hold B*T/tp token rows, viewed (B, T/tp, d)). The weight stays whole (the same parameter)."""

    def __init__(self, weight: nn.Parameter, shards: SequenceShards):
        super().__init__(*weight.shape, device="meta")
        self.weight, self.shards = weight, shards

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        mine = positions[self.shards.positions(positions.shape[0], positions.device)]
        return super().forward(mine).view(self.shards.batch, -1, self.weight.shape[1])  # (B, T/tp, d)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy from logits split over the vocabulary (Megatron-LM): a max, a sum of
    exponentials and the target's logit are each all-reduced; nothing of size V is communicated.
    logits (N, V/tp) in the compute dtype, targets (N,) global ids -> per-token loss (N,) fp32, equal
    on every rank. The softmax is computed in fp32 straight from the low-precision logits (the
    subtraction of the max writes the fp32 tensor: no separate upcast copy) and the backward works in
    that saved tensor (no clone). Columns past the real vocabulary (padding) are -inf: they take no
    probability and no gradient."""

    @staticmethod
    def forward(ctx, logits, targets, group, lo: int, num_real: int):
        n = logits.shape[0]
        if num_real:
            m = logits[:, :num_real].max(dim=1).values.float()
        else:  # this rank holds only padding
            m = torch.full((n,), float("-inf"), device=logits.device)
        all_reduce(m, group, op=MAX)
        shifted = torch.sub(logits, m.unsqueeze(1))  # (N, V/tp) fp32 by type promotion
        if num_real < shifted.shape[1]:
            shifted[:, num_real:] = float("-inf")
        here = (targets >= lo) & (targets < lo + logits.shape[1])
        local = (targets - lo).masked_fill(~here, 0)
        picked = shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~here, 0.0)
        all_reduce(picked, group, op=SUM)
        probs = shifted.exp_()  # reuses `shifted`'s memory; becomes the softmax below
        total = probs.sum(dim=1)
        all_reduce(total, group, op=SUM)
        probs.div_(total.unsqueeze(1))
        ctx.save_for_backward(probs, local, here)
        ctx.dtype, ctx.spent = logits.dtype, False
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        if ctx.spent:  # the softmax was consumed in place below
            raise RuntimeError("the vocab-parallel cross-entropy's backward ran twice on one graph")
        ctx.spent = True
        probs, local, here = ctx.saved_tensors
        g = probs.scatter_add_(1, local.unsqueeze(1), -here.to(probs.dtype).unsqueeze(1))  # p_ij - [j == target_i]
        if ctx.dtype == g.dtype:
            return g.mul_(grad.unsqueeze(1)), None, None, None, None
        out = torch.empty_like(g, dtype=ctx.dtype)  # scale and cast back in one pass
        return torch.mul(g, grad.unsqueeze(1), out=out), None, None, None, None


class VocabParallelLoss(nn.Module):
    """Mean next-token cross-entropy from vocab-parallel logits (B, T, V_pad/tp), in fp32."""

    def __init__(self, ctx, rank: int, tp: int, vocab_size: int):
        super().__init__()
        self.ctx, self.vocab_size = ctx, vocab_size  # ctx.group: the tp group, looked up when first used
        piece = -(-vocab_size // tp)
        self.lo = min(rank * piece, vocab_size)
        self.num_real = min(piece, vocab_size - self.lo)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses = _VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), self.ctx.group,
                                                  self.lo, self.num_real)
        return losses.mean()


class ForkedRNG(nn.Module):
    """Runs a parameter-free module (a dropout) on a random stream of this tensor-parallel rank's
    own, so split regions (local heads, sequence shards) draw different masks on different ranks
    while replicated regions, on the default stream, agree. The stream's seed is drawn from the
    default CPU generator, which every tp rank shares and which recomputation (preserve_rng_state)
    and checkpoints already restore: replays and resumes draw the same masks, with no state here."""

    def __init__(self, inner: nn.Module, tp_rank: int):
        super().__init__()
        self.inner, self.tp_rank = inner, tp_rank

    def forward(self, *args, **kwargs):
        if not self.training:
            return self.inner(*args, **kwargs)
        seed = int(torch.randint(0, 2**62, ())) ^ (self.tp_rank * 0x9E3779B97F4A7C15 % 2**62)
        device = args[0].device
        with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else [], device_type=device.type):
            torch.manual_seed(seed)
            return self.inner(*args, **kwargs)
