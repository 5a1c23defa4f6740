"""Routed rows grouped by expert, and every expert's matmuls as one grouped GEMM per weight over exactly
those rows (MegaBlocks, Gale et al. 2023: dropless MoE as grouped matmuls over a permutation of the
tokens, instead of one matmul per expert or a padded (experts, capacity, d) batch).

Nothing here reads a device value back to the host: the layout is a stable sort on the device and
every buffer has a size known on the host in advance, so the host can queue the next layers while the
GPU works. (Only the loop fallback reads the group offsets back, once per call: free on a CPU.)

Layout. Each row (a token's choice, or a row received from an expert-parallel peer) has a key: its
group (the local expert) or `num_groups` for a row that goes nowhere (dropped for capacity, not
sampled by random routing, an empty slot of a padded exchange). `grouped_layout` gives each row its
place in a buffer of `M + num_groups * (align - 1) + 1` rows: group g's rows are consecutive, in their
input order, from a multiple of `align`; the rows that go nowhere lie past the last group's end,
`offsets[-1]`. `slotted_layout` gives group g the fixed slots [g * slot, (g + 1) * slot) instead (the
padded all-to-all of parallel/expert.py).

Rows the GEMM sees but nobody reads. Padding rows (between a group's last row and the next aligned
start) read a zero row: their outputs are never gathered, so their output gradient is zero and they add
nothing to any weight's gradient. Rows past offsets[-1] are not computed by the grouped GEMM (their
output memory is uninitialized, possibly NaN), and neither is their input gradient: they read the zero
row, whose gradient is dropped; their outputs are only gathered for rows that go nowhere, which the
caller discards with torch.where (a select, where a product with zero would keep a NaN); biases are
gathered per row from a table whose extra zero row serves them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from teratrain import compat


@dataclass
class Layout:
    dest: torch.Tensor  # (M,) long: the buffer row of each input row
    offsets: torch.Tensor  # (G,) int32: where each group's rows end (cumulative; the grouped GEMM's `offs`)
    rows: int  # buffer rows, known on the host
    sent: torch.Tensor  # (M,) bool: the row belongs to a group (else it goes nowhere)


def _ranks(key: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts (num_keys,) rows per key, rank (M,) of each row among the rows of its key, in input order)."""
    counts = torch.zeros(num_keys, dtype=torch.long, device=key.device).scatter_add_(0, key, torch.ones_like(key))
    order = torch.argsort(key, stable=True)
    first = counts.cumsum(0) - counts  # start of each key in the sorted order
    rank = torch.empty_like(key)
    rank[order] = torch.arange(key.numel(), device=key.device) - first[key[order]]
    return counts, rank


def grouped_layout(key: torch.Tensor, num_groups: int, align: int = 1) -> Layout:
    """Rows of key g < num_groups to group g, each group from a multiple of `align`; key num_groups past the end."""
    counts, rank = _ranks(key, num_groups + 1)
    size = (counts[:num_groups] + align - 1) // align * align
    ends = size.cumsum(0)
    starts = torch.cat([ends - size, ends[-1:]])  # (G + 1,): the rows that go nowhere follow the last group
    rows = key.numel() + num_groups * (align - 1) + 1  # + 1: never empty (a rank may receive no row)
    return Layout(starts[key] + rank, ends.to(torch.int32), rows, key < num_groups)


def slotted_layout(key: torch.Tensor, num_groups: int, slot: int) -> Layout:
    """Rows of key g < num_groups to slots [g * slot, g * slot + count_g); every row that goes nowhere
    to the one row num_groups * slot. The caller guarantees count_g <= slot (the expert capacity)."""
    _, rank = _ranks(key, num_groups + 1)
    dest = torch.where(key < num_groups, key * slot + rank, num_groups * slot)
    ends = torch.arange(1, num_groups + 1, device=key.device, dtype=torch.int32) * slot
    return Layout(dest, ends, num_groups * slot + 1, key < num_groups)


def row_align(grouped: bool) -> int:
    """Each group's rows start at a multiple of this: the grouped GEMM's alignment, 1 for the loop."""
    return compat.GROUPED_MM_ROW_ALIGN if grouped else 1


def fill(x: torch.Tensor, lay: Layout, source: torch.Tensor | None = None) -> torch.Tensor:
    """(lay.rows, d): row lay.dest[i] of a row i that is sent holds x[source[i]] (source: the rows of
    x in order when None); every other row is zero. A gather, so its backward sums each row's
    gradients into x (those of the zero row, the undefined ones of rows past the groups, are dropped)."""
    n = x.shape[0]
    src = torch.full((lay.rows,), n, dtype=torch.long, device=x.device)  # n: the zero row
    source = source if source is not None else torch.arange(n, device=x.device)
    src[lay.dest] = torch.where(lay.sent, source, n)
    return torch.cat([x, x.new_zeros(1, x.shape[1])])[src]


# ---------------------------------------------------------------- the experts on a laid-out buffer

def affine(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight (out, in), bias or None) of a layer that computes exactly x W^T + b on its input, else
    None (a LoRA adapter, a quantized weight, a layer that communicates): those run one by one."""
    if type(linear) is nn.Linear:
        return linear.weight, linear.bias
    own = getattr(linear, "affine", None)  # tensor-parallel pieces (parallel/tp_layers.py) say it themselves
    return own() if callable(own) else None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's where it is on, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def use_grouped(experts: list[nn.Module], x: torch.Tensor, kernel: str) -> bool:
    """Whether `experts` run as grouped GEMMs: `kernel` "grouped" wherever torch has one (tests force it
    on the CPU), "loop" never, "auto" where it needs no read-back (compat.grouped_mm_without_sync) and
    the weights' rows are 16-byte aligned (8 bf16 values) as its kernel requires."""
    if kernel == "loop" or compat.grouped_mm is None:
        return False
    parts = [affine(getattr(e, leaf)) for e in experts for leaf in ("w1", "w3", "w2") if getattr(e, leaf) is not None]
    if any(p is None for p in parts):
        return False
    if kernel == "grouped":
        return True
    aligned = all(s % compat.GROUPED_MM_ROW_ALIGN == 0 for w, _ in parts for s in w.shape)
    return aligned and compat.grouped_mm_without_sync(x.device, compute_dtype(x))


def run_experts(experts: list[nn.Module], x: torch.Tensor, offsets: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Expert g on rows [offsets[g-1], offsets[g]) of x (lay.rows, d); outputs (lay.rows, d_out), undefined
    past offsets[-1]. Every expert enters the autograd graph, also on zero rows, so every rank builds
    the same graph (its gradient hooks, and the collectives they launch, fire in the same order)."""
    if grouped:
        return _grouped(experts, x, offsets)
    ends = offsets.tolist()  # the loop's one read-back
    outs = [e(x[a:b]) for e, a, b in zip(experts, [0] + ends[:-1], ends)]
    return torch.cat(outs + [outs[0].new_zeros(x.shape[0] - ends[-1], outs[0].shape[1])])


def _grouped(experts: list[nn.Module], x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The Expert MLP (models/moe.py) of every group at once: SwiGLU w2(silu(w1 x) * w3 x) or GELU
    w2(gelu(w1 x)), with the experts' dropout on the hidden activations."""
    dtype = compute_dtype(x)
    x = x.to(dtype)
    group = None
    if experts[0].w1.bias is not None:  # each row's expert, for its bias (len(experts): past the end)
        group = torch.searchsorted(offsets, torch.arange(x.shape[0], device=x.device, dtype=torch.int32), right=True)
    h = _gmm(x, [e.w1 for e in experts], offsets, dtype, group)
    if experts[0].w3 is not None:
        h = F.silu(h) * _gmm(x, [e.w3 for e in experts], offsets, dtype, group)
    else:
        h = F.gelu(h, approximate="tanh")
    return _gmm(experts[0].dropout(h), [e.w2 for e in experts], offsets, dtype, group)


def _gmm(x: torch.Tensor, linears: list[nn.Module], offsets: torch.Tensor, dtype: torch.dtype,
         group: torch.Tensor | None) -> torch.Tensor:
    """x W_g^T (+ b_g) for each row of group g: one grouped GEMM over the stacked (G, out, in) weights."""
    parts = [affine(m) for m in linears]
    w = torch.stack([p[0].to(dtype) for p in parts])  # (G, out, in)
    y = compat.grouped_mm(x, w.transpose(-2, -1), offs=offsets)  # (rows, out)
    if group is None:
        return y
    b = torch.stack([p[1].to(dtype) for p in parts] + [parts[0][1].new_zeros(w.shape[1], dtype=dtype)])
    return y + b[group]
