"""Transformer building blocks. Single-device code: strategies swap or wrap these from outside.

Linear layers carry stable names (`wq wk wv wo`, `w1 w2 w3`) so sharding plans can address them, and
head counts and lengths are read from the projections' shapes (`view(B, T, -1, hd)`) so a
tensor-parallel split of the projections (and sequence parallelism) needs no change here.

What attention knows of a forward's tokens beyond their values travels with the blocks' arguments as
`Positions` (RoPE tables at their positions, their documents, a strategy's layout), made once per
forward by the model's `SequenceLayout`: context parallelism swaps that module for one that keeps a
rank's chunks of the sequence, and each `CoreAttention` for one that talks across ranks
(parallel/context.py). Passed as an argument, not held as state, it reaches a recomputed block or a
pipeline stage's micro-batch as it was made.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from teratrain.models.swiglu_kernel import silu_mul


def to_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """x in the dtype autocast gives a matmul's fp32 input (unchanged outside autocast). The attention
    and the MLP cast their input once, so their projections share one cast instead of casting (and
    saving) a copy each; a tensor-parallel region entry casts before its collective, which then moves
    half the bytes."""
    dev = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(dev):
        return x.to(torch.get_autocast_dtype(dev))
    return x


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 and returned in x's dtype. Where x
    and the weight share a dtype (the residual stream over bf16 parameters, or fp32 throughout) the
    kernel takes x as it is: it computes in fp32 inside and keeps x itself for backward, not an fp32
    copy (half the bytes under bf16 parameters, as Megatron-LM's fused norm keeps). Otherwise (a bf16
    q/k norm over fp32 weights) x and the weight go up to fp32 first."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


class LayerNorm(nn.Module):
    """LayerNorm with optional bias (GPT-2)."""

    def __init__(self, dim: int, eps: float, bias: bool):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in x's dtype, as RMSNorm (the kernel computes in fp32 inside): CUDA autocast would run it on an fp32
        # copy of a bf16 residual stream and hand every following linear its own bf16 cast of the fp32 output
        dev = x.device.type
        if x.dtype == self.weight.dtype and dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
            with torch.autocast(dev, enabled=False):
                return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Rotary(nn.Module):
    """RoPE tables (Su et al. 2021), "rotate-half" layout as in HF Llama. Buffers are not saved.
    `scaling`: Llama 3's frequency scaling (dict of factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings), as Meta's reference code and HF apply it."""

    def __init__(self, head_dim: int, max_seq: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.max_seq, self.theta, self.scaling = head_dim, max_seq, theta, scaling
        self.register_buffer("cos", torch.empty(max_seq, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq, head_dim), persistent=False)

    def reset(self) -> None:
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, device=self.cos.device).float() / self.head_dim)
        if self.scaling:
            inv_freq = llama3_scaled(inv_freq, **self.scaling)
        t = torch.arange(self.max_seq, device=self.cos.device).float()
        freqs = torch.outer(t, inv_freq)  # (T, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (T, hd)
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[start:start + length], self.sin[start:start + length]


def llama3_scaled(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_max_position_embeddings: float) -> torch.Tensor:
    """Llama 3.1's RoPE scaling: wavelengths beyond original_len / low_freq_factor are stretched by
    `factor`, those below original_len / high_freq_factor kept, the band between interpolated."""
    old_len = original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high_freq_factor) & (wavelen <= old_len / low_freq_factor)
    return torch.where(medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, nh, T, hs); cos/sin: (T, hs)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Positions(NamedTuple):
    """Where the tokens of one forward sit. `rope`: (cos, sin) (T, hs) at their positions, or None
    (learned positions); `index`: their positions (T,) as a tensor, or None when they are start..start+T;
    `docs`: (B, T) the document of each token under data.document_mask, else None; `layout`: what a
    context-parallel attention needs of the whole sample (parallel/context.py), else None."""

    rope: tuple[torch.Tensor, torch.Tensor] | None
    index: torch.Tensor | None = None
    docs: torch.Tensor | None = None
    layout: object = None


def document_ids(tokens: torch.Tensor, eot: int) -> torch.Tensor:
    """(B, T) ids -> (B, T) document index of each token: how many end-of-text tokens come before it
    (an end-of-text token belongs to the document it ends)."""
    ends = (tokens == eot).to(torch.int32)
    return torch.cumsum(ends, dim=1) - ends


def document_mask(docs_q: torch.Tensor, docs_k: torch.Tensor, pos_q: torch.Tensor, pos_k: torch.Tensor) -> torch.Tensor:
    """(B, 1, Tq, Tk) bool: query i may see key j (causal, and the same document). docs (B, T), pos (T,)."""
    causal = pos_q[:, None] >= pos_k[None, :]  # (Tq, Tk)
    return (causal & (docs_q[:, :, None] == docs_k[:, None, :])).unsqueeze(1)


class SequenceLayout(nn.Module):
    """Which of a forward's tokens this process computes and where they sit (`Positions`): the whole
    sequence from `start`. data.document_mask sets `eot` (its token ids then give each token's
    document); context parallelism swaps the module for one that keeps this rank's chunks."""

    def __init__(self):
        super().__init__()
        self.eot: int | None = None

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None, start: int, rope: "Rotary | None"):
        """-> (tokens, targets, Positions) of this process; tokens (B, T) ids, or (B, T, d) hidden states."""
        T = tokens.shape[1]
        docs = document_ids(tokens, self.eot) if self.eot is not None and tokens.dim() == 2 else None
        return tokens, targets, Positions(rope(start, T) if rope is not None else None, None, docs)


class KVCache:
    """Per-layer key/value cache for incremental decoding: (B, n_kv, max_len, hs) each."""

    def __init__(self, batch: int, n_kv: int, max_len: int, head_dim: int, device, dtype):
        self.k = torch.zeros(batch, n_kv, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class CoreAttention(nn.Module):
    """softmax(QK^T/sqrt(d))V through `scaled_dot_product_attention` (flash/cuDNN kernels keep no
    T x T score matrix). A module of its own so selective recomputation can wrap just this part."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                pos: Positions | None = None) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        p = self.dropout if self.training else 0.0
        T, S = q.shape[2], k.shape[2]
        if pos is not None and pos.docs is not None and T == S:  # packed documents: each sees its own
            at = torch.arange(T, device=q.device)
            mask = document_mask(pos.docs, pos.docs, at, at)  # (B, 1, T, T)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, enable_gqa=gqa)
        if causal and T != S:  # a chunk after cached keys: SDPA's is_causal aligns top-left, we need bottom-right
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal, enable_gqa=gqa)


class Attention(nn.Module):
    """Multi-head (grouped-query) self-attention. `qkv_bias`: biases on wq, wk, wv only (Qwen2).
    `qk_norm`: RMSNorm of q and k before RoPE, "head" per head over head_dim with one (hs,) weight
    shared by the heads (Qwen3), "full" over the whole projection, (nh*hs,) and (nkv*hs,) weights (OLMoE).
    `head_dim`: hs, d_model / n_heads unless given (Qwen3-MoE 30B-A3B: nh*hs = 4096 at d_model 2048)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, bias: bool, dropout: float,
                 qkv_bias: bool = False, qk_norm: str = "none", norm_eps: float = 1e-5, head_dim: int | None = None):
        super().__init__()
        self.head_dim = hd = head_dim or d_model // n_heads
        self.wq = nn.Linear(d_model, n_heads * hd, bias=bias or qkv_bias)
        self.wk = nn.Linear(d_model, n_kv_heads * hd, bias=bias or qkv_bias)
        self.wv = nn.Linear(d_model, n_kv_heads * hd, bias=bias or qkv_bias)
        self.wo = nn.Linear(n_heads * hd, d_model, bias=bias)
        self.qk_norm = qk_norm
        if qk_norm != "none":
            full = qk_norm == "full"
            self.q_norm = RMSNorm(n_heads * hd if full else hd, norm_eps)
            self.k_norm = RMSNorm(n_kv_heads * hd if full else hd, norm_eps)
        self.core = CoreAttention(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, pos: Positions | None, cache: KVCache | None = None, start: int = 0):
        hd = self.head_dim
        x = to_compute_dtype(x)  # one cast for the three projections, not a cast (and a saved copy) each
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # (B, T, nh*hs), (B, T, nkv*hs) x 2
        B, T = q.shape[:2]  # from the projections: sequence parallelism gathers x's T/tp tokens in wq
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, -1, hd)  # (B, T, nh, hs)
        k = k.view(B, T, -1, hd)  # (B, T, nkv, hs)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hs), (B, nkv, T, hs)
        v = v.view(B, T, -1, hd).transpose(1, 2)  # (B, nkv, T, hs)
        if pos is not None and pos.rope is not None:
            q, k = apply_rotary(q, *pos.rope), apply_rotary(k, *pos.rope)
        if cache is not None:
            k, v = cache.update(k, v, start)
        # One cached decode token attends to everything before it; longer chunks are causal.
        y = self.core(q, k, v, T > 1, pos)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh*hs)
        return self.resid_dropout(self.wo(y))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) (Shazeer 2020)."""

    def __init__(self, d_model: int, d_ff: int, bias: bool, dropout: float):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=bias)
        self.w3 = nn.Linear(d_model, d_ff, bias=bias)
        self.w2 = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = to_compute_dtype(x)  # one cast for w1 and w3
        return self.dropout(self.w2(silu_mul(self.w1(x), self.w3(x))))  # keeps w1 x, w3 x: not silu's output


class GeluMLP(nn.Module):
    """w2(gelu(w1 x)) (GPT-2, tanh approximation)."""

    def __init__(self, d_model: int, d_ff: int, bias: bool, dropout: float):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=bias)
        self.w2 = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.gelu(self.w1(x), approximate="tanh")))
