"""Routed rows laid out by expert, and back: permutations whose forward and backward are both plain
row gathers (MegaBlocks, Gale et al. 2023, sec. 5: gather / scatter kernels that are each other's
backward; Megatron-Core's moe permute / unpermute). No scatter-add, no atomics, no sort in backward.

Why. Advanced indexing `x[idx]` has as backward an accumulating `index_put_`, which on CUDA sorts
the indices and gives each run of equal indices to one warp that walks it serially: every row that
goes nowhere (a capacity drop, a padding row, an empty slot of a padded exchange) read one shared
zero row, so its gradient was a run as long as the drops.

Layout. Each of M input rows (a token's choice, or a row received from an expert-parallel peer) has
a key: its group (the local expert) or `num_groups` for a row that goes nowhere (dropped for
capacity, not sampled by random routing, an empty slot of a padded exchange). A layout is a partial
bijection between the M input rows and `rows` buffer rows, stored both ways so that each direction
is a gather: `dest` (M,) the buffer row of each input row (0 for a row not sent, read only under the
`sent` mask) and `src` (rows,) the input row of each buffer row (M for a buffer row that holds none:
a padding row, a row past the last group, an empty slot). `grouped_layout` puts group g's rows
consecutively, in input order, from a multiple of `align`, in a buffer of `M + num_groups * (align -
1) + 1` rows whose rows past `offsets[-1]` no group covers; `slotted_layout` gives group g the fixed
slots [g * slot, (g + 1) * slot).

The two permutations, with N = M / k tokens of k choices each (choice c = t * k + i of token t):
- `dispatch(x, lay, k)`: buffer row j holds x[src[j] // k], or zero where src[j] = M (padding rows
  compute on zeros: finite, and their output gradient is zero, so they add nothing to any weight's
  gradient). Backward: grad_x[t] = sum_i grad_buf[dest[t*k + i]] over its sent choices: a gather by
  `dest`, a mask, a sum over the (N, k, d) view.
- `combine(y, lay, w, k)`: out[t] = sum_i w[t, i] y[dest[t*k + i]] over the sent choices (w None:
  k = 1, weight 1, a plain unpermute). The rows nobody reads (past offsets[-1]: uninitialized memory
  of the grouped GEMM) are masked out by a fill (a product with zero would keep a NaN). Backward:
  grad_y[j] = w[src[j]] grad_out[src[j] // k], a gather by `src` times the weight (zero where src[j]
  = M); grad_w[c] = <y[dest[c]], grad_out[t]>.

Copies per MoE layer at ep=1 (N tokens, M = N k choices, R >= M buffer rows, all d wide), forward: 1
N-row copy (the cast to the compute dtype with the zero row appended; before, a cast and a
concatenation), 1 R-row gather (dispatch); 1 M-row gather, 1 M-row mask, the weighted sum over k
(combine: eager a batched GEMM, (1, k) x (k, d) a token). Backward: 1 R-row gather and 1 R-row product
(combine), grad_w's dot products over d (eager a batched GEMM); 1 M-row gather, 1 M-row mask, 1 sum over
k that also casts back (dispatch). Before: the same forward (with a select in place of the mask), and in
backward two accumulating index_put_ (R and N + 1 rows) and a select, where now there are gathers and
masks. Where no choice can go nowhere (no capacity, no random routing), `sent` is None and neither mask
is made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Layout:
    dest: torch.Tensor  # (M,) long: the buffer row of each input row (0 where not sent)
    src: torch.Tensor  # (rows,) long: the input row of each buffer row, M where none
    offsets: torch.Tensor  # (G,) int32: where each group's rows end (cumulative; the grouped GEMM's `offs`)
    rows: int  # buffer rows, known on the host
    # (M,) bool: the row belongs to a group (else it goes nowhere); None where every row does (known on the
    # host: nothing dropped), and the permutations mask nothing
    sent: torch.Tensor | None
    counts: torch.Tensor  # (G,) long: rows of each group

    def first(self, rows: int) -> "Layout":
        """The same layout cut to its first `rows` buffer rows, which must hold every sent row."""
        return Layout(self.dest, self.src[:rows], self.offsets, rows, self.sent, self.counts)


def _ranked(key: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank (M,): each row's place among the rows of its key, in input order; counts (G,) rows of each
    group) from a running count of the rows' one-hot keys, (G + 1, M): five kernels, no sort, no
    scatter-add. The running count holds M * (G + 1) integers; past RANKED_MAX of them (fine-grained
    experts, long sequences) a stable sort ranks the rows instead (`_sorted_rank`), in more kernels."""
    m = key.numel()
    if m == 0 or m * (num_groups + 1) > RANKED_MAX:
        return _sorted_rank(key, num_groups)
    # (G + 1, M): a scan along each key's row (along the M rows of a few columns it is a slow kernel on GPUs)
    run = (torch.arange(num_groups + 1, device=key.device).unsqueeze(1) == key).cumsum(1)
    return run.gather(0, key.unsqueeze(0)).squeeze(0) - 1, run[:num_groups, -1].contiguous()  # the counts are exchanged


# The one-hot running count's size limit (integers): 64 MiB of int64. An MoE layer of 8 experts top-2 at
# 8,192 tokens counts 147,456; 128 experts top-8 at 8,192 tokens 8.5 M.
RANKED_MAX = 1 << 23


def _sorted_rank(key: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_ranked` by a stable sort of the keys and searches in it."""
    m = key.numel()
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    bounds = torch.searchsorted(sorted_key, torch.arange(num_groups + 1, device=key.device, dtype=key.dtype))
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(m, device=key.device) - bounds[sorted_key])
    return rank, bounds[1:] - bounds[:-1]


def _placed(key: torch.Tensor, rank: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, rows: int,
            offsets: torch.Tensor, every: bool) -> Layout:
    """The layout putting row i (of key < G) at buffer row starts[key[i]] + rank[i]: `dest` by that sum,
    `src` by scattering the rows' indices to their buffer rows (distinct; the rows not sent all write one
    extra row, cut off). `every`: the caller knows every key is < G."""
    m, groups = key.numel(), counts.numel()
    index = torch.arange(m, device=key.device)
    if every:  # exactly `rows` sources: no extra row to cut off (a view of it would keep the row alive)
        dest = starts[key] + rank
        return Layout(dest, key.new_full((rows,), m).scatter_(0, dest, index), offsets.to(torch.int32), rows, None,
                      counts)
    sent = key < groups
    dest = torch.where(sent, starts[key.clamp(max=groups - 1)] + rank, 0)
    src = key.new_full((rows + 1,), m).scatter_(0, torch.where(sent, dest, rows), index)
    return Layout(dest, src[:rows], offsets.to(torch.int32), rows, sent, counts)


def laid_out_rows(routed: int, num_groups: int, align: int = 1) -> int:
    """Rows of `grouped_layout`'s buffer for `routed` rows: each group's start padded to a multiple of
    `align`, and one more so that it is never empty (a rank may receive no row)."""
    return routed + num_groups * (align - 1) + 1


def grouped_layout(key: torch.Tensor, num_groups: int, align: int = 1, every: bool = False) -> Layout:
    """Rows of key g < num_groups to group g, each group from a multiple of `align`; key num_groups to none.
    `every`: no key is num_groups (the caller knows it on the host: every routed choice is sent)."""
    rank, counts = _ranked(key, num_groups)
    if align & (align - 1):
        raise ValueError(f"grouped_layout aligns groups to powers of 2, not {align}")
    size = counts if align == 1 else (counts + (align - 1)) & -align
    ends = size.cumsum(0, dtype=torch.int32)  # the grouped GEMM's offsets
    return _placed(key, rank, ends - size, counts, laid_out_rows(key.numel(), num_groups, align), ends, every)


def slotted_layout(key: torch.Tensor, num_groups: int, slot: int) -> Layout:
    """Rows of key g < num_groups to slots [g * slot, g * slot + count_g); key num_groups to none. The
    caller guarantees count_g <= slot (the expert capacity)."""
    rank, counts = _ranked(key, num_groups)
    starts = torch.arange(num_groups + 1, device=key.device) * slot
    return _placed(key, rank, starts[:-1], counts, num_groups * slot, starts[1:], False)


def piece_bounds(extent, chunks: int):
    """Where each of `chunks` near-equal pieces of `extent` rows starts, and the end: extent * c // chunks
    for c = 0..chunks (host integers, or a tensor of extents -> (chunks + 1, *extent.shape))."""
    if isinstance(extent, torch.Tensor):
        c = torch.arange(chunks + 1, device=extent.device).view(-1, *[1] * extent.dim())
        return extent.unsqueeze(0) * c // chunks
    return [extent * c // chunks for c in range(chunks + 1)]


def chunk_major(lay: Layout, extents: torch.Tensor, chunks: int) -> Layout:
    """`lay` with its buffer reordered for a chunked exchange (parallel/expert.py): group g's extents[g]
    buffer rows (its rows, or its slots), which `lay` holds contiguously, groups in order from row 0
    (grouped_layout with align 1, slotted_layout), are cut into `chunks` pieces by `piece_bounds`, and
    the buffer holds piece 0 of every group in group order, then piece 1 of every group, ... Rows past
    the last group keep their place. `offsets` becomes the ends of the chunks * G pieces in that order.
    A permutation of buffer rows, computed on the device: `dest` and `src` are gathered through it."""
    G, rows = extents.numel(), lay.rows
    ends = lay.offsets.long()
    lo = piece_bounds(extents, chunks)  # (C + 1, G)
    sizes = (lo[1:] - lo[:-1]).flatten()  # (C * G,) piece c of group g at c * G + g
    piece_ends = sizes.cumsum(0)
    j = torch.arange(rows, device=extents.device)
    g = torch.searchsorted(ends, j, right=True).clamp(max=G - 1)  # rows past the groups: masked below
    q = j - (ends - extents)[g]  # rank in its group's extent
    c = (((q + 1) * chunks - 1) // extents[g].clamp(min=1)).clamp(0, chunks - 1)  # lo[c] <= q < lo[c + 1]
    piece = c * G + g
    perm = torch.where(j < ends[-1], piece_ends[piece] - sizes[piece] + q - lo[c, g], j)  # (rows,) new row of each
    src = torch.empty_like(lay.src).scatter_(0, perm, lay.src)
    return Layout(perm[lay.dest], src, piece_ends.to(torch.int32), rows, lay.sent, lay.counts)


# ---------------------------------------------------------------- the two permutations

class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dest, sent, k: int, dtype: torch.dtype):
        n, d = x.shape
        table = x.new_empty(n + 1, d, dtype=dtype)  # x in the compute dtype, then the zero row
        table[:n].copy_(x)
        table[n].zero_()
        ctx.save_for_backward(dest, sent)
        ctx.k, ctx.dtype, ctx.by_choice = k, x.dtype, k > 1 and torch.compiler.is_compiling()
        return table.index_select(0, src // k)  # src = M = n * k: row n, zero

    @staticmethod
    def backward(ctx, grad):
        dest, sent = ctx.saved_tensors
        if ctx.by_choice:  # compiled: one elementwise kernel that reads each token's k rows (_by_choice)
            return _by_choice(grad, dest, sent, ctx.k, None, ctx.dtype), None, None, None, None, None
        g = _kept(grad.index_select(0, dest), sent)  # a row not sent: no gradient
        if ctx.k > 1:
            g = g.view(-1, ctx.k, g.shape[1]).sum(1, dtype=ctx.dtype)
        return g.to(ctx.dtype), None, None, None, None, None


def _kept(rows: torch.Tensor, sent: torch.Tensor | None) -> torch.Tensor:
    """rows (M, d), each of an input row, zeroed (in place) where that row was not sent; `sent` None:
    every row was (Layout.sent), as they are."""
    return rows if sent is None else rows.masked_fill_(~sent.unsqueeze(1), 0)


def _by_choice(y: torch.Tensor, dest: torch.Tensor, sent: torch.Tensor | None, k: int, w: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    """(N, d): sum over each token's k choices i of y[dest[t, i]] (times w[t, i]), zero where not sent,
    summed in `dtype`, written as k gathers added elementwise. Compiled, inductor makes it one pointwise
    kernel reading k rows per output row, where a gather of all N * k rows reduced over k is a reduction
    whose every element loads k rows: on an H200 at N 8,192 tokens, d 2,048, k 8, dispatch's backward
    0.13 ms against 0.35, the combine 0.10 against 0.39; k 2: 0.12 against 0.15-0.16 (bench/step_kernels.py).
    Eager, it would be 3k kernels instead of 3."""
    d2, s2 = dest.view(-1, k), None if sent is None else sent.view(-1, k)
    out = None
    for i in range(k):
        term = y.index_select(0, d2[:, i])
        term = (term if s2 is None else torch.where(s2[:, i, None], term, 0)).to(dtype)
        if w is not None:
            term = term * w[:, i, None]
        out = term if out is None else out + term
    return out


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w, src, dest, sent, k: int):
        ctx.k, ctx.rows, ctx.weighted, ctx.compiled = k, y.shape[0], w is not None, torch.compiler.is_compiling()
        if w is not None and k > 1 and ctx.compiled:  # as _Dispatch's compiled backward
            ctx.by_choice = True
            ctx.save_for_backward(src, y, w, dest, sent)
            return _by_choice(y, dest, sent, k, w, y.dtype)
        ctx.by_choice = False
        g = _kept(y.index_select(0, dest), sent)  # (M, d): zero where not sent
        if w is None:
            ctx.save_for_backward(src)
            return g
        ctx.save_for_backward(src, g, w)
        # k > 1: each token's (1, k) weights times its (k, d) rows, one batched GEMM: a product broadcast to
        # (N, k, d) and reduced over k took two kernels and wrote N k d values
        return g * w if k == 1 else torch.bmm(w.unsqueeze(1), g.view(w.shape[0], k, -1)).squeeze(1)  # (N, d)

    @staticmethod
    def backward(ctx, grad):
        src, *saved = ctx.saved_tensors
        m, d = grad.shape[0] * ctx.k, grad.shape[1]
        if m == 0:  # no input row: nothing to gather from
            return grad.new_zeros(ctx.rows, d), (torch.zeros_like(saved[1]) if saved else None), None, None, None, None
        g = grad.index_select(0, (src // ctx.k).clamp(max=grad.shape[0] - 1))  # (rows, d); src = M: any row...
        if not ctx.weighted:
            return g.masked_fill_((src == m).unsqueeze(1), 0), None, None, None, None, None  # ... then zero
        if ctx.by_choice:  # the kept rows gathered again from y (the forward wrote none)
            y, w, dest, sent = saved
            kept = _kept(y.index_select(0, dest), sent)
        else:
            kept, w = saved
        scale = torch.cat([w.flatten(), w.new_zeros(1)])[src]  # ... times weight zero
        grad_w = None
        if ctx.needs_input_grad[1]:  # <kept row, grad row>: compiled, one fused reduction; eager, a batched GEMM
            rows = kept.view(-1, ctx.k, d)  # (not a product of N k d values reduced over d: two kernels)
            grad_w = (rows * grad.unsqueeze(1)).sum(-1) if ctx.compiled else \
                torch.bmm(rows, grad.unsqueeze(-1).to(rows.dtype)).squeeze(-1)
        return g.mul_(scale.unsqueeze(1)), grad_w, None, None, None, None


def dispatch(x: torch.Tensor, lay: Layout, k: int = 1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(lay.rows, d) in `dtype` (x's by default): buffer row j holds x[lay.src[j] // k], zero where it
    holds no row. x: (M / k, d), each row the source of its k consecutive input rows."""
    return _Dispatch.apply(x, lay.src, lay.dest, lay.sent, k, dtype or x.dtype)


def combine(y: torch.Tensor, lay: Layout, weights: torch.Tensor | None = None, k: int = 1) -> torch.Tensor:
    """(M / k, d): each input row's buffer row of y, zero where not sent, weighted by `weights` (M / k,
    k) and summed over each token's k rows; weights None: k = 1, the rows unweighted (an unpermute)."""
    return _Combine.apply(y, weights, lay.src, lay.dest, lay.sent, k)
