"""Tensor-parallel communication overlapped with the matmuls that depend on it
(`parallel.tp_overlap=chunked`): Wang et al. 2022, "Overlap communication with dependent computation
via decomposition in large deep learning models" (ASPLOS '23), the idea of Megatron-LM's TP
communication overlap and of PyTorch's async-TP micro-pipelining, here with plain NCCL collectives.

A region's collective and the GEMMs next to it are split into `chunks` units of token rows (for
sequence parallelism, the units of comm.sequence_rows, so every unit is one all-gather or
reduce-scatter of contiguous blocks). Each collective is launched asynchronously: ProcessGroupNCCL
runs it on its own stream, ordered after what the compute stream had queued when it was issued, and
`wait()` makes the compute stream wait for it, so the host never blocks. Issue order decides the
overlap:
- column-parallel entry, forward (SP): all units' all-gathers are issued first; unit k's GEMMs (every
  projection of the region: wq, wk, wv or w1, w3, or the head) wait only for all-gather k, so
  all-gather k+1 runs under them. Without SP the forward has no collective.
- column-parallel entry, backward: under SP the forward kept only this rank's shard of the input
  (Korthikanti et al. 2022, sec. 4.2.2); its all-gather is issued first, under the dgrad GEMMs. Unit k's input gradient (the sum over projections of dY W) is
  reduce-scattered (all-reduced without SP) as soon as it is computed, under unit k+1's dgrad GEMMs
  and then under every weight gradient (dW = dY^T X, whole), which is computed last for that reason.
- row-parallel exit, forward: unit k's partial product is reduce-scattered (all-reduced) under unit
  k+1's GEMM.
- row-parallel exit, backward (SP): all units' all-gathers of the output gradient are issued first;
  unit k's dgrad waits for gather k; the weight gradient comes last. Without SP there is none.
Every rank issues the same collectives in the same order. Weights come in already cast to the
compute dtype (through autograd, as autocast casts them, so the cast's backward returns fp32 grads
and activation compression recognizes them as weights); the inputs come cast by the region entry.
No symmetric memory and no multicast: NVLink SHARP stays off on our machines.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from teratrain.parallel import comm


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1, t.shape[-1])


class _ColumnGroup(torch.autograd.Function):
    """X = gather(x) (identity without SP), Y_i = X W_i^T + b_i for every projection i reading it.
    Returns (X, Y_0, Y_1, ...): X for adapters that read the region input (memory/lora.py)."""

    @staticmethod
    def forward(ctx, x, group, sp: bool, chunks: int, *params):
        weights, biases = params[0::2], params[1::2]
        X, works = comm.start_seq_gather(x, group, chunks) if sp else (x.contiguous().view_as(x), [])
        rows = X.view(-1, X.shape[-1])  # (N, d): gathered in place, contiguous
        unit = rows.shape[0] // (chunks if works else 1)
        ys = [rows.new_empty(rows.shape[0], w.shape[0]) for w in weights]
        for k, lo in enumerate(range(0, rows.shape[0], unit)):
            if works:
                works[k].wait()
            for w, b, y in zip(weights, biases, ys):
                _linear_into(y[lo:lo + unit], rows[lo:lo + unit], w, b)
        ctx.save_for_backward(x, *weights)  # the shard under SP: gathered again in backward
        ctx.group, ctx.sp, ctx.chunks, ctx.x_shape = group, sp, chunks, x.shape
        ctx.biases = [b is not None for b in biases]
        ctx.set_materialize_grads(False)  # unused outputs (X without adapters) get no zero-filled gradient
        return (X, *(y.view(*X.shape[:-1], -1) for y in ys))

    @staticmethod
    def backward(ctx, grad_x_full, *grad_ys):
        x, *weights = ctx.saved_tensors
        X, gathers = comm.start_seq_gather(x, ctx.group, ctx.chunks) if ctx.sp else (x, [])
        rows = X.contiguous().view(-1, X.shape[-1])  # read only by the weight gradients, after every dgrad
        n_rows = rows.shape[0]
        gys = [_rows(g) if g is not None else None for g in grad_ys]
        gx = _rows(grad_x_full) if grad_x_full is not None else None
        dx = rows.new_empty(rows.shape)
        out, works = _reduce_out(dx, ctx)
        unit = n_rows // ctx.chunks
        for k, lo in enumerate(range(0, n_rows, unit)):
            piece = dx[lo:lo + unit]
            _dgrad_into(piece, [(g[lo:lo + unit], w) for g, w in zip(gys, weights) if g is not None],
                        gx[lo:lo + unit] if gx is not None else None)
            works.append(_reduce_unit(out, piece, k, ctx))
        for work in gathers:  # the input's all-gather ran under the dgrad GEMMs
            work.wait()
        grads = []  # weight gradients last: the reductions above run under them
        for i, (g, has_bias) in enumerate(zip(gys, ctx.biases)):
            wanted = g is not None and ctx.needs_input_grad[4 + 2 * i]  # frozen under LoRA: none
            grads.append(g.t().mm(rows) if wanted else None)
            grads.append(g.sum(0) if g is not None and has_bias else None)
        for work in works:
            work.wait()
        return (out.view(ctx.x_shape), None, None, None, *grads)


class _RowExit(torch.autograd.Function):
    """y = reduce_scatter(X W^T + extra) along the sequence (all-reduce without SP), `extra` a
    partial term joining the reduction (an adapter's) or None."""

    @staticmethod
    def forward(ctx, x, w, extra, group, sp: bool, chunks: int):
        rows = _rows(x)
        partial = rows.new_empty(rows.shape[0], w.shape[0])
        ex = _rows(extra) if extra is not None else None
        out, works = _reduce_out(partial, ctx, group, sp, chunks)
        unit = rows.shape[0] // chunks
        for k, lo in enumerate(range(0, rows.shape[0], unit)):
            piece = partial[lo:lo + unit]
            _linear_into(piece, rows[lo:lo + unit], w, None)
            if ex is not None:
                piece.add_(ex[lo:lo + unit])
            works.append(_reduce_unit(out, piece, k, ctx))
        for work in works:
            work.wait()
        ctx.save_for_backward(rows, w)
        ctx.has_extra, ctx.x_shape = extra is not None, x.shape
        ctx.set_materialize_grads(False)
        n = comm.group_size(group) if sp else 1
        return out.view(x.shape[0], x.shape[1] // n, w.shape[0])

    @staticmethod
    def backward(ctx, grad):
        rows, w = ctx.saved_tensors
        if ctx.sp:
            G, works = comm.start_seq_gather(grad.contiguous(), ctx.group, ctx.chunks)
        else:
            G, works = grad.contiguous(), []
        G = G.view(-1, G.shape[-1])  # (N, d_out), natural row order
        dx = rows.new_empty(rows.shape)
        unit = rows.shape[0] // (ctx.chunks if works else 1)
        for k, lo in enumerate(range(0, rows.shape[0], unit)):
            if works:
                works[k].wait()
            torch.mm(G[lo:lo + unit], w, out=dx[lo:lo + unit])
        dw = G.t().mm(rows) if ctx.needs_input_grad[1] else None  # frozen under LoRA: none
        extra = G.view(ctx.x_shape[:-1] + (-1,)) if ctx.has_extra else None
        return dx.view(ctx.x_shape), dw, extra, None, None, None


def _linear_into(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """out = x w^T (+ b), written in place (a contiguous block of rows of a larger output)."""
    if b is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(b, x, w.t(), out=out)


def _dgrad_into(out: torch.Tensor, pairs: list, extra: torch.Tensor | None) -> None:
    """out = sum_i g_i w_i (+ extra): the input gradient of one unit, summed over projections."""
    if not pairs:  # no projection's output was used: only the adapters' gradient, if any
        if extra is not None:
            out.copy_(extra)
        else:
            out.zero_()
        return
    torch.mm(pairs[0][0], pairs[0][1], out=out)
    for g, w in pairs[1:]:
        out.addmm_(g, w)
    if extra is not None:
        out.add_(extra)


def _reduce_out(partial: torch.Tensor, ctx, group=None, sp=None, chunks=None):
    """Where the units' reductions land: this rank's sequence shard (SP) or `partial` itself (an
    in-place all-reduce); records the collective's settings on ctx."""
    if group is not None:
        ctx.group, ctx.sp, ctx.chunks = group, sp, chunks
    if not ctx.sp:
        return partial, []
    n = comm.group_size(ctx.group)
    return partial.new_empty(ctx.chunks, partial.numel() // (ctx.chunks * n)), []


def _reduce_unit(out: torch.Tensor, piece: torch.Tensor, k: int, ctx):
    """Launch unit k's reduction: reduce-scatter into this rank's block k, or all-reduce in place."""
    if ctx.sp:
        return comm.reduce_scatter(out[k], piece.view(-1), ctx.group, async_op=True)
    return comm.all_reduce(piece, ctx.group, async_op=True)


def column_group(x: torch.Tensor, weights: list, biases: list, group, sp: bool, chunks: int):
    """(X, [Y_i]) of _ColumnGroup; weights and biases are cast to x's dtype here, through autograd."""
    params = []
    for w, b in zip(weights, biases):
        params += [w.to(x.dtype), b.to(x.dtype) if b is not None else None]
    if comm.traced():
        return _traced_column_group(x, params[0::2], params[1::2], group, sp, chunks)
    X, *ys = _ColumnGroup.apply(x, group, sp, chunks, *params)
    return X, ys


def row_exit(x: torch.Tensor, w: torch.Tensor, extra: torch.Tensor | None, group, sp: bool, chunks: int):
    if comm.traced():
        return _traced_row_exit(x, w.to(x.dtype), extra, group, sp, chunks)
    return _RowExit.apply(x, w.to(x.dtype), extra, group, sp, chunks)


# Under torch.compile the units are written as plain differentiable ops over traced (functional)
# collectives, in the order the eager functions above issue them. A traced collective is waited for
# where it is issued; inductor's overlap passes (turned on with this mode: parallelize.py) move each
# wait to the unit's use, so one unit's collective runs on NCCL's stream under another unit's GEMMs.
# Autograd differentiates unit by unit: each unit's gather reduce-scatters its input gradient
# (all-reduces without SP) as soon as it exists.

def _traced_column_group(x: torch.Tensor, weights: list, biases: list, group, sp: bool, chunks: int):
    units = x.reshape(chunks, -1, x.shape[-1]).unbind(0)  # (sequence_rows: unit k is every rank's block k)
    if sp:
        gathered = [comm.gather_sequence(u.unsqueeze(0), group).squeeze(0) for u in units]  # all issued first
    else:
        gathered = [comm.copy_to_tp(u, group) for u in units]
    ys = [torch.cat([F.linear(X, w, b) for X in gathered]) for w, b in zip(weights, biases)]
    full = torch.cat(gathered)  # the region input, all tokens (read only by adapters: dropped otherwise)
    shape = (x.shape[0], full.shape[0] // x.shape[0])
    return full.view(*shape, -1), [y.view(*shape, -1) for y in ys]


def _traced_row_exit(x: torch.Tensor, w: torch.Tensor, extra: torch.Tensor | None, group, sp: bool, chunks: int):
    rows = x.reshape(chunks, -1, x.shape[-1]).unbind(0)
    extras = extra.reshape(chunks, -1, extra.shape[-1]).unbind(0) if extra is not None else [None] * chunks
    outs = []
    for r, e in zip(rows, extras):
        partial = F.linear(r, w) if e is None else F.linear(r, w) + e
        outs.append(comm.reduce_scatter_sequence(partial.unsqueeze(0), group).squeeze(0) if sp
                    else comm.reduce_from_tp(partial, group))
    n = comm.group_size(group) if sp else 1
    return torch.cat(outs).view(x.shape[0], x.shape[1] // n, w.shape[0])


class ColumnJoint:
    """The column-parallel layers that read one region input (wq, wk, wv; w1, w3; the head alone),
    computed together by the first of them to be called, so the entry collective overlaps all of
    their GEMMs and its backward reduction all of their gradients. The others take their output
    when the model calls them with the same input; a call with another input recomputes."""

    def __init__(self, ctx):
        self.ctx, self.members = ctx, []
        self._x, self._full, self._out = None, None, {}

    def add(self, layer) -> None:
        self.members.append(layer)
        layer.joint = self

    def take(self, layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the region input X, all tokens; this layer's output X W^T + b)."""
        if self._x is not x or id(layer) not in self._out:
            c = self.ctx
            full, ys = column_group(x, [m.weight for m in self.members], [m.bias for m in self.members],
                                    c.group, c.sp, c.chunks)
            self._x, self._full, self._out = x, full, {id(m): y for m, y in zip(self.members, ys)}
        y, full = self._out.pop(id(layer)), self._full
        if not self._out:  # every member served: hold nothing between forwards
            self._x = self._full = None
        return full, y
