"""A grouped GEMM that torch.compile can put into its graph in any dtype: one matmul per group, inside
one custom operator (torch.library), for where torch's own `_grouped_mm` cannot be traced.

Why. Under train.compile the experts run as grouped GEMMs (models/grouped.py), since the loop of
expert modules reads the group offsets back to the host, which would end the compiled graph at every
MoE layer. torch's `_grouped_mm` traces only in bf16 (its meta function refuses other dtypes: torch 2.13,
checked here), so an fp32 run (the CPU tests' parity checks, an fp32 GPU run) would have no traceable
grouped GEMM. This operator is opaque to the compiler: its fake function gives the output's shape,
which depends on no data, and its implementation reads the offsets back inside the operator, as
torch's own fallback off Hopper does. So the graph holds one node, and the read-back happens where
the op runs, not where the graph is traced. Same contract as `_grouped_mm` with 2-D rows and 3-D
weights: x (M, K), w (G, K, N), offs (G,) int32 cumulative row ends; rows past offs[-1] are zero here
(undefined there; nobody reads them, models/permute.py).

Backward (registered with the operator): grad_x = grad W_g^T per group (the same operator on the
transposed weights) and grad_W_g = x_g^T grad_g (the weight-gradient operator below).
"""

from __future__ import annotations

import torch


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()  # the read-back, inside the operator
    return list(zip([0] + ends[:-1], ends))


@torch.library.custom_op("teratrain::grouped_mm_loop", mutates_args=())
def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(M, N): rows [offs[g-1], offs[g]) of x times w[g]; rows past offs[-1] zero."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    for g, (a, b) in enumerate(_bounds(offs)):
        torch.mm(x[a:b], w[g], out=out[a:b])
    return out


@grouped_mm_loop.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("teratrain::grouped_mm_loop_weight_grad", mutates_args=())
def grouped_mm_loop_weight_grad(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(G, K, N): x_g^T grad_g over each group's rows (zero for a group of no rows)."""
    out = x.new_zeros(offs.shape[0], x.shape[1], grad.shape[1])
    for g, (a, b) in enumerate(_bounds(offs)):
        torch.mm(x[a:b].t(), grad[a:b], out=out[g])
    return out


@grouped_mm_loop_weight_grad.register_fake
def _(x, grad, offs):
    return x.new_empty(offs.shape[0], x.shape[1], grad.shape[1])


def _setup(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    gx = grouped_mm_loop(grad.contiguous(), w.transpose(-2, -1).contiguous(), offs) if ctx.needs_input_grad[0] else None
    gw = grouped_mm_loop_weight_grad(x, grad.contiguous(), offs) if ctx.needs_input_grad[1] else None
    return gx, gw, None


grouped_mm_loop.register_autograd(_backward, setup_context=_setup)
