"""Ring attention over the cp ranks (Liu et al. 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"; the load-balanced causal form of Megatron-LM's and torchtitan's context
parallelism). cp_plan.py says which chunks a rank holds and which calls each ring step makes.

Forward, at cp rank r of N: its queries stay; key/value chunks travel. At step s it holds rank
(r - s) mod N's keys and values, and before it computes with them it posts their send to rank r+1
and the receive of the next ones from rank r-1 (waited for after the step's attention: the transfer
runs under the attention where the backend progresses both at once, as NCCL does on its own stream).
Every call returns its output and log-sum-exp, and partial results merge exactly (in fp32):

    lse = log(e^lse_a + e^lse_b),   out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b

Backward: the same ring again, the key/value chunks travelling with the partial gradient of their
keys and values (fp32). Each rank adds its queries' share, from the fused kernel's backward given
the merged output and log-sum-exp (each call's share then adds up to the whole gradient), and
passes it on; after N steps every chunk's gradient is back at its owner.

Kernels: torch's fused attention that returns the log-sum-exp (compat.attention_lse: flash or
memory-efficient on CUDA, flash on CPU) for FULL and CAUSAL calls. MASKED calls (a document boundary
inside a chunk pair, data.document_mask), and any call where this build has no such kernel, run
`math_forward` / `math_backward`: the scores of the call in fp32, (B, H, Tq, Tk) at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from teratrain import compat
from teratrain.models.layers import document_mask
from teratrain.parallel.comm import ring_shift
from teratrain.parallel.cp_plan import CAUSAL, MASKED, Block

KV_TAG, GRAD_TAG = 1, 2  # the two streams of ring messages (comm.ring_shift)


@dataclass
class Ring:
    """One forward's ring: the cp group (`ranks` in ring order, this rank at `r`), the calls of each step
    (`steps[s]`: those with rank (r - s) mod N's chunks), the positions of every rank's tokens (device
    tensors) and, under data.document_mask, the documents of the whole samples (B, T)."""

    group: object
    ranks: list[int]
    r: int
    steps: list[list[Block]]
    positions: list[torch.Tensor]
    docs: torch.Tensor | None
    fused: bool = True  # torch's fused kernels where this build has them (False: `math_forward` throughout)
    kernel: str | None = None  # compat.attention_lse_kind of the queries (None: math), set by ring_attention
    rest: tuple = ()  # what the kernel's backward needs of a forward (compat.attention_lse)

    @property
    def n(self) -> int:
        return len(self.ranks)

    def mask(self, src: int, b: Block) -> torch.Tensor:
        """(B, 1, Tq, Tk) what the queries of call `b` see of rank `src`'s keys (causal, same document)."""
        pq, pk = self.positions[self.r][b.q0:b.q1], self.positions[src][b.k0:b.k1]
        return document_mask(self.docs[:, pq], self.docs[:, pk], pq, pk)


def math_forward(q, k, v, scale: float, mask: torch.Tensor | None, causal: bool):
    """(out, lse) in fp32 (fp64 inputs: fp64) of one call from its scores; rows that see no key get
    out 0 and lse -inf."""
    acc = _acc(q.dtype)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # (B, H, Tq, Tk)
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Tq)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(p, v.to(acc)), lse


def math_backward(dout, q, k, v, out, lse, scale: float, mask: torch.Tensor | None, causal: bool):
    """(dq, dk, dv) in fp32 (fp64 inputs: fp64) of one call given the merged output and log-sum-exp of its rows
    (dS = P * (dP - rowsum(dO * O)), as flash attention's backward)."""
    qf, kf, vf, do = (t.to(_acc(q.dtype)) for t in (q, k, v, dout))
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # (B, H, Tq, Tk)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    ds = p * (dp - (do * out.to(do.dtype)).sum(-1, keepdim=True))
    return torch.matmul(ds, kf) * scale, torch.matmul(ds.transpose(-1, -2), qf) * scale, torch.matmul(p.transpose(-1, -2), do)


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads they serve (grouped-query attention)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of expanded key/value heads summed back onto each head."""
    B, H, T, D = g.shape
    return g if H == kv_heads else g.view(B, kv_heads, H // kv_heads, T, D).sum(2)


def _call_forward(ring: Ring, src: int, b: Block, q, k, v, scale: float):
    qb = q[:, :, b.q0:b.q1].contiguous()
    kb, vb = (_expand(t[:, :, b.k0:b.k1], q.shape[1]).contiguous() for t in (k, v))
    if b.kind == MASKED or ring.kernel is None:
        return math_forward(qb, kb, vb, scale, ring.mask(src, b) if b.kind == MASKED else None, b.kind == CAUSAL)
    out, lse, rest = compat.attention_lse(qb, kb, vb, b.kind == CAUSAL, scale, ring.kernel)
    ring.rest = ring.rest or rest
    return out, lse


def _call_backward(ring: Ring, src: int, b: Block, q, k, v, out, lse, dout, scale: float):
    rows = slice(b.q0, b.q1)
    qb, ob, dob = (t[:, :, rows].contiguous() for t in (q, out, dout))
    lb = lse[:, :, rows].contiguous()
    kb, vb = (_expand(t[:, :, b.k0:b.k1], q.shape[1]).contiguous() for t in (k, v))
    if b.kind == MASKED or ring.kernel is None:
        return math_backward(dob, qb, kb, vb, ob, lb, scale, ring.mask(src, b) if b.kind == MASKED else None,
                             b.kind == CAUSAL)
    return compat.attention_lse_backward(dob, qb, kb, vb, ob, lb, b.kind == CAUSAL, scale, ring.kernel, ring.rest)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """What outputs, log-sum-exps and gradients accumulate in: fp32 (fp64 for fp64 inputs, as tests run)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, o: torch.Tensor, l: torch.Tensor) -> None:
    """Fold a call's (o, l) into the running fp32 (out, lse) of its query rows, in place."""
    O, L = out[:, :, rows], lse[:, :, rows]
    new = torch.logaddexp(L, l)
    wa, wb = torch.exp(L - new).nan_to_num(0.0), torch.exp(l - new).nan_to_num(0.0)  # -inf - -inf: no key yet
    O.mul_(wa.unsqueeze(-1)).add_(o.to(O.dtype) * wb.unsqueeze(-1))
    L.copy_(new)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float):
        n, r = ring.n, ring.r
        kv = torch.stack([k, v])  # (2, B, Hkv, T, D): one message a step
        acc = _acc(q.dtype)
        B, H, T, D = q.shape  # out laid out (B, T, H, D) as SDPA's is: wo reads it as a view, nothing copied
        out = torch.zeros((B, T, H, D), dtype=acc, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        for s in range(n):
            src = (r - s) % n
            if s + 1 < n:
                nxt = torch.empty_like(kv)
                shift = ring_shift(kv, nxt, ring.ranks, ring.group, KV_TAG)
            for b in ring.steps[s]:
                o, l = _call_forward(ring, src, b, q, kv[0], kv[1], scale)
                _merge(out, lse, slice(b.q0, b.q1), o, l)
            if s + 1 < n:
                shift.wait()
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        n, r = ring.n, ring.r
        dout = dout.contiguous()
        acc = _acc(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        passing = None  # (handle, buffer): the partial key/value gradient arriving from rank r-1
        for s in range(n):
            src = (r - s) % n
            if s + 1 < n:
                nxt = torch.empty_like(kv)
                shift = ring_shift(kv, nxt, ring.ranks, ring.group, KV_TAG)
            grad = torch.zeros(kv.shape, dtype=acc, device=q.device)  # this rank's share for src
            for b in ring.steps[s]:
                dqb, dkb, dvb = _call_backward(ring, src, b, q, kv[0], kv[1], out, lse, dout, scale)
                dq[:, :, b.q0:b.q1] += dqb
                grad[0, :, :, b.k0:b.k1] += _fold(dkb.to(acc), k.shape[1])
                grad[1, :, :, b.k0:b.k1] += _fold(dvb.to(acc), k.shape[1])
            if passing is not None:
                passing[0].wait()
                grad += passing[1]
            got = torch.empty_like(grad)
            passing = (ring_shift(grad, got, ring.ranks, ring.group, GRAD_TAG), got)
            if s + 1 < n:
                shift.wait()
                kv = nxt
        passing[0].wait()
        dkv = passing[1]  # after N passes: the gradient of this rank's own keys and values
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, scale: float) -> torch.Tensor:
    """Causal attention of this rank's queries q (B, H, T, D) over the whole samples' keys and values,
    k and v (B, Hkv, T, D) this rank's share of them -> (B, H, T, D). Point-to-point transfers between
    kernels: context.RingCore calls it through torch.compiler.disable, eager between compiled pieces."""
    ring.kernel = compat.attention_lse_kind(q) if ring.fused else None
    return _RingAttention.apply(q, k, v, ring, scale)
