"""Output head and cross-entropy fused and chunked over the tokens: no (B*T, V) logits ever exist.

The plain path (`transformer.lm_loss`) makes the logits of the whole batch, an fp32 copy of them, and
in backward their fp32 gradient: at llama-1b's shape (16,384 tokens a micro-batch, vocab 32,000) that
is 2 + 4 + 4 GiB in flight. Here the tokens are cut into `chunks` pieces; for each piece the head GEMM
makes its logits (compute dtype), the loss takes their fp32 logsumexp, and - since the loss is a scalar
whose gradient is known up to one factor - the gradient of the piece, softmax - onehot, goes straight
through the two gradient GEMMs (dh = dlogits W, dW += dlogits^T h). Backward only scales the stored
dh and dW by the incoming gradient. The FLOPs are the plain path's (no recomputation); the memory is
one piece's logits plus dh and an fp32 dW. The idea is Liger-Kernel's fused linear cross-entropy
(Hsu et al. 2024, arXiv:2410.10989), here in plain PyTorch that torch.compile traces and fuses.

Targets equal to `IGNORE_INDEX` (-100, F.cross_entropy's default) count neither in the loss nor in
the mean, as in F.cross_entropy.

A vocabulary that is not a multiple of ALIGN (GPT-2's 50,257) leaves every row of the logits and of their
gradient misaligned for the GEMMs, which then run far slower: on one H100, gpt2-350m's eager step took 91.5 / 90.5
ms at 50,257 unpadded and 68.3 / 71.0 at 50,304 (bench/results/h100/2026-12-05_gpt2_vocab_padded.json). So the weight
is padded with zero rows to a multiple of ALIGN for the GEMMs and the padded logits are -inf: they take no
probability, their gradient is zero, and the loss and gradients are the unpadded ones (the whole-logits head,
models/transformer.py head, pads the same way and hands on a view of the first V columns).
"""

from __future__ import annotations

import math

import torch
from torch import nn

IGNORE_INDEX = -100
ALIGN = 64  # vocabulary rows the GEMMs see: a multiple of this


def auto_chunks(num_tokens: int, vocab_size: int, d_model: int) -> int:
    """Pieces of about num_tokens * d_model / vocab_size tokens each, so one piece's logits are as large
    as the hidden states (Liger-Kernel's rule): 16 at llama-1b (32,000 / 2,048), 32 at llama-8b."""
    return max(1, min(num_tokens, math.ceil(vocab_size / d_model)))


def padded_vocab(vocab: int) -> int:
    """The rows the head GEMMs multiply: `vocab` rounded up to a multiple of ALIGN."""
    return -(-vocab // ALIGN) * ALIGN


class _Padded(torch.autograd.Function):
    """w (V, d) with `pad` zero rows appended; backward, the first V rows of the gradient as a tensor of their
    own (a view of them would keep the padded gradient's storage alive as the weight's .grad)."""

    @staticmethod
    def forward(w, pad: int):
        return torch.cat([w, w.new_zeros(pad, w.shape[1])])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.rows = inputs[0].shape[0]

    @staticmethod
    def backward(ctx, grad):
        return grad[:ctx.rows].clone(), None


def aligned(w: torch.Tensor) -> torch.Tensor:
    """w (V, d) with zero rows appended up to padded_vocab(V) (w itself where V is a multiple of ALIGN)."""
    pad = padded_vocab(w.shape[0]) - w.shape[0]
    return w if pad == 0 else _Padded.apply(w, pad)


def _logits(h: torch.Tensor, w: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 logits of h (n, d) against the padded w (V_pad, d): (n, V_pad), the columns past `vocab` -inf."""
    logits = (h @ w.t()).float()
    if logits.shape[1] > vocab:
        logits[:, vocab:] = -math.inf
    return logits


def _piece_loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, vocab: int) -> torch.Tensor:
    """Summed loss of one piece, h (n, d), the padded w (V_pad, d), y (n,), with no gradient."""
    logits = _logits(h, w, vocab)  # (n, V_pad)
    valid = y != IGNORE_INDEX
    picked = logits.gather(1, torch.where(valid, y, 0)[:, None]).squeeze(1)
    return torch.where(valid, torch.logsumexp(logits, dim=-1) - picked, 0.0).sum()


def _piece(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, weight_grad: bool, vocab: int):
    """One piece: h (n, d), the padded w (V_pad, d), y (n,). Returns (loss sum, dh (n, d), dW (V_pad, d) fp32 or
    None)."""
    logits = _logits(h, w, vocab)  # (n, V_pad): the GEMM in the compute dtype, the softmax in fp32
    valid = y != IGNORE_INDEX
    y_safe = torch.where(valid, y, 0)
    lse = torch.logsumexp(logits, dim=-1)  # (n,)
    picked = logits.gather(1, y_safe[:, None]).squeeze(1)
    loss = torch.where(valid, lse - picked, 0.0).sum()
    # d(mean loss)/d(logits) = (softmax - onehot) / count, zero on ignored rows
    grad = torch.exp(logits - lse[:, None])
    grad.scatter_add_(1, y_safe[:, None], torch.full_like(picked[:, None], -1.0))
    grad = (grad * torch.where(valid, scale, 0.0)[:, None]).to(h.dtype)
    dw = (grad.t() @ h).float() if weight_grad else None
    return loss, grad @ w, dw


class _ChunkedHeadLoss(torch.autograd.Function):
    """Forward: the mean loss, computing the gradients piece by piece as it goes; backward: scales them."""

    @staticmethod
    def forward(ctx, h, w, y, chunks: int, weight_grad: bool):
        count = (y != IGNORE_INDEX).sum()
        scale = 1.0 / count.clamp(min=1).float()
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        dh = torch.empty_like(h)
        padded = aligned(w)
        dw = torch.zeros(padded.shape, dtype=torch.float32, device=w.device) if weight_grad else None
        for lo, hi in _bounds(h.shape[0], chunks):
            loss, dh_part, dw_part = _piece(h[lo:hi], padded, y[lo:hi], scale, weight_grad, w.shape[0])
            total = total + loss
            dh[lo:hi] = dh_part
            if weight_grad:
                dw += dw_part
        # the first V rows as a tensor of their own (a view would keep the padded rows until backward)
        ctx.save_for_backward(dh, dw[:w.shape[0]].to(w.dtype, copy=padded is not w) if weight_grad else None)
        # mean over counted targets; nothing counted gives 0, not F.cross_entropy's nan
        return total * scale

    @staticmethod
    def backward(ctx, grad_out):
        dh, dw = ctx.saved_tensors
        return dh * grad_out.to(dh.dtype), (dw * grad_out.to(dw.dtype) if dw is not None else None), None, None, None


def _bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """Piece bounds of n rows in `chunks` near-equal pieces (the first ones one row longer)."""
    size, extra = divmod(n, chunks)
    out, lo = [], 0
    for i in range(chunks):
        hi = lo + size + (1 if i < extra else 0)
        if hi > lo:
            out.append((lo, hi))
        lo = hi
    return out


def chunked_lm_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int) -> torch.Tensor:
    """Mean next-token cross-entropy of logits h @ weight^T without making them whole. h (B, T, d) after
    the final norm, weight (V, d), targets (B, T). Under autocast the GEMMs run in its dtype (as the plain
    head's would) and the softmax in fp32; else in h's dtype. `chunks` pieces over the B*T tokens."""
    dev = h.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    flat, y, w = h.reshape(-1, h.shape[-1]).to(dtype), targets.reshape(-1), weight.to(dtype)
    chunks = max(1, min(chunks, flat.shape[0]))
    if torch.is_grad_enabled() and (flat.requires_grad or w.requires_grad):
        return _ChunkedHeadLoss.apply(flat, w, y, chunks, w.requires_grad)
    # no backward to come (evaluation): the losses alone, no gradient GEMMs
    padded = aligned(w)
    total = sum(_piece_loss(flat[lo:hi], padded, y[lo:hi], w.shape[0]) for lo, hi in _bounds(flat.shape[0], chunks))
    return total / (y != IGNORE_INDEX).sum().clamp(min=1).float()


class ChunkedHeadLoss(nn.Module):
    """chunked_lm_loss as a parameter-free module (compiled as one unit where blocks are compiled apart).
    `chunks`: 0 picks `auto_chunks`; 1 is not used here (the model then takes the plain path)."""

    def __init__(self, chunks: int = 0):
        super().__init__()
        self.chunks = chunks

    def forward(self, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n = targets.numel()
        chunks = self.chunks or auto_chunks(n, weight.shape[0], weight.shape[1])
        return chunked_lm_loss(h, weight, targets, chunks)
