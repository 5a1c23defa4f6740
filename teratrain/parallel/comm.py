"""Collectives used by the strategies, each a thin wrapper that also works for a group of one
(no process group at all: the collective degenerates to a local copy) and returns a handle
with `.wait()`, so callers overlap communication without special cases.

What runs:
- `all_reduce`: every rank ends with the sum (ring: each rank sends 2(n-1)/n of the bytes).
- `reduce_scatter`: rank r ends with the sum of slice r of every rank's input ((n-1)/n of the bytes).
- `all_gather`: every rank ends with all ranks' slices laid end to end ((n-1)/n of the bytes).
- `all_to_all`: rank r sends its i-th block of rows to rank i and receives rank i's r-th block;
  blocks may differ in size, or be empty, per pair of ranks (up to (n-1)/n of the bytes move).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from teratrain.compat import all_gather_single, reduce_scatter_single
from teratrain.parallel import inflight


# Reductions by name, the functional collectives' own spelling: a compiled graph reads a string,
# while hashing or comparing c10d's ReduceOp breaks it on torch 2.11 (a graph per loss all-reduce)
SUM, AVG, MAX = "sum", "avg", "max"
_C10D_OPS = {SUM: dist.ReduceOp.SUM, AVG: dist.ReduceOp.AVG, MAX: dist.ReduceOp.MAX}


def traced() -> bool:
    """Whether torch.compile is tracing this call (`train.compile`). Then each collective is the
    functional collective of the same name, which the compiler puts into its graph (and may overlap
    with independent kernels), not a c10d call with the hang watchdog's registry around it: that
    Python (clocks, CUDA events) cannot be traced, and every collective would split the compiled
    graph there, each split a return to Python that the host pays on every step (bench/common.py
    `graph_breaks` counts them). NCCL's own watchdog still times the collectives out.
    The result is the same: in place into the caller's tensor, and `async_op` gets a handle that is
    already done (the compiler orders the wait)."""
    return torch.compiler.is_compiling()


class Done:
    """Handle of a collective that already finished (or never needed to run)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def group_size(group) -> int:
    return 1 if group is None else group.size()  # the group's own count: no lookups in torch's registry


def _run(what: str, group, start, async_op: bool):
    """Launch `start()` (a torch collective with async_op=True) registered with the hang watchdog
    (inflight.py); return its handle, or wait for it here when `async_op` is False."""
    handle = inflight.launch(what, group, start)
    if async_op:
        return handle
    handle.wait()
    return Done()


def all_reduce(t: torch.Tensor, group, async_op: bool = False, op=SUM):
    if group_size(group) == 1:  # sum, average and max of one value are the value
        return Done()
    if traced():
        t.copy_(funcol.all_reduce(t, op, group))
        return Done()
    return _run("all-reduce", group, lambda: dist.all_reduce(t, op=_C10D_OPS[op], group=group, async_op=True), async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False, op=SUM):
    """out (n,) <- reduction (sum or average) over ranks of inp[r*n:(r+1)*n] on rank r; inp is
    (world*n,). For a group of one this is a copy, which also converts dtypes."""
    if group_size(group) == 1:
        out.copy_(inp)
        return Done()
    if traced():
        out.copy_(funcol.reduce_scatter_tensor(inp, op, 0, group))
        return Done()
    return _run("reduce-scatter", group,
                lambda: reduce_scatter_single(out, inp, op=_C10D_OPS[op], group=group, async_op=True), async_op)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """out (world*n,) <- every rank's inp (n,) in rank order. `inp` may be a slice of `out`."""
    if group_size(group) == 1:
        if inp.data_ptr() != out.data_ptr():
            out.copy_(inp)
        return Done()
    if traced():
        out.copy_(funcol.all_gather_tensor(inp, 0, group))
        return Done()
    return _run("all-gather", group, lambda: all_gather_single(out, inp, group=group, async_op=True), async_op)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
               async_op: bool = False):
    """out (sum(out_splits), ...) <- block i of every rank i's inp; inp's blocks (in_splits[r] rows
    for rank r) leave in rank order. For a group of one this is a copy."""
    if group_size(group) == 1:
        out.copy_(inp)
        return Done()
    if traced():
        out.copy_(funcol.all_to_all_single(inp.contiguous(), out_splits, in_splits, group))
        return Done()
    return _run("all-to-all", group,
                lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True), async_op)


def any_rank(flag: bool, group, device) -> bool:
    """True on every rank if it is true on any rank (e.g. 'my gradients overflowed')."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    all_reduce(t, group, op=MAX)
    return bool(t.item())


def any_rank_false(flag: bool, group, device) -> bool:
    """True on every rank only if it is true on every rank (e.g. 'my checkpoint verified')."""
    return not any_rank(not flag, group, device)


def broadcast(t: torch.Tensor, src: int, group):
    """`t` of global rank `src` on every rank of `group`, in place."""
    if group_size(group) == 1:
        return Done()
    return _run("broadcast", group, lambda: dist.broadcast(t, src=src, group=group, async_op=True), False)


def all_gather_objects(obj, group) -> list:
    """Every rank's picklable `obj` (small control values), in group rank order."""
    if group_size(group) == 1:
        return [obj]
    out = [None] * group_size(group)
    inflight.blocking("all-gather of objects", group, lambda: dist.all_gather_object(out, obj, group=group))
    return out


def broadcast_object(obj, group):
    """Rank 0's picklable `obj` on every rank of `group` (small control values, e.g. a run folder)."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    inflight.blocking("broadcast of objects", group, lambda: dist.broadcast_object_list(box, src=0, group=group))
    return box[0]


# ---------------------------------------------------------------- autograd-aware collectives
# Megatron-LM's tensor-parallel communication (Shoeybi et al. 2019, sec. 3; Korthikanti et al.
# 2022 for the sequence-parallel pair). Each says what runs forward and what runs backward; `group`
# is the tensor-parallel group, and every function is the identity for a group of one.

class _CopyToTP(torch.autograd.Function):
    """Megatron's `f`: identity forward, all-reduce (sum) of the gradient backward. Enters a
    tensor-parallel region whose ranks each use the whole input for their own part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if traced():
            return funcol.all_reduce(grad, SUM, ctx.group), None
        grad = grad.contiguous()
        all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's `g`: all-reduce (sum) forward, identity backward. Leaves a region whose ranks
    each computed a partial sum (a row-parallel product)."""

    @staticmethod
    def forward(ctx, x, group):
        if traced():  # out of place: the compiler plans the buffers
            return funcol.all_reduce(x, SUM, group)
        if x.is_contiguous() and x._base is None:  # a fresh partial product nothing else reads: in place
            ctx.mark_dirty(x)
        else:  # a view (torchao's float8 GEMM returns its result reshaped) autograd forbids writing into
            x = x.clone(memory_format=torch.contiguous_format)
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim forward (each rank's columns side by side), keep this rank's
    slice of the gradient backward: the output side of the all-gather form (parallel.tp_form)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        n = group_size(ctx.group)
        if n == 1:
            return grad, None
        return grad.chunk(n, dim=-1)[dist.get_rank(ctx.group)].contiguous(), None


class _SplitLastDim(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward, all-gather the gradient backward: the input
    side of the all-reduce form (parallel.tp_form; X split along the inner dimension)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, n = group, group_size(group)
        return x if n == 1 else x.chunk(n, dim=-1)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """(..., d) on each rank -> (..., n * d), ranks' slices side by side."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    if traced():  # out of place (one graph on torch 2.13; the in-place form left 2.11 a graph per collective)
        out = funcol.all_gather_tensor(x, 0, group).view(n, *x.shape)
    else:
        out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
        all_gather(out.view(-1), x.view(-1), group)
    return torch.cat(out.unbind(0), dim=-1)


def _seq_gather(x: torch.Tensor, group, chunks: int = 1) -> torch.Tensor:
    """(B, T/n, ...) sequence shards on each rank -> (B, T, ...). See `sequence_rows` for which tokens
    a shard holds: each of the `chunks` units is one all-gather written in place, so no layout copy."""
    n = group_size(group)
    if n > 1 and traced() and chunks == 1:  # the token rows gathered as one (rows, d) matrix, which the
        # region's GEMMs read as it is: the pattern inductor's async TP fuses (parallel.tp_overlap=async)
        rows = funcol.all_gather_tensor(x.reshape(-1, x.shape[-1]).contiguous(), 0, group)
        return rows.view(x.shape[0], n * x.shape[1], *x.shape[2:])
    if n > 1 and traced():  # unit k's rank blocks side by side, out of place; gathered along dim 0, as
        # another dim makes torch 2.11 call a helper dynamo will not trace (a graph break per collective)
        out = funcol.all_gather_tensor(x.contiguous().view(chunks, -1), 0, group).view(n, chunks, -1)
        return out.transpose(0, 1).reshape(x.shape[0], n * x.shape[1], *x.shape[2:])  # a view when chunks == 1
    out, works = start_seq_gather(x, group, chunks)
    for w in works:
        w.wait()
    return out


def start_seq_gather(x: torch.Tensor, group, chunks: int = 1) -> tuple[torch.Tensor, list]:
    """`_seq_gather` launched asynchronously: the output and one handle per unit (unit k of the
    output may be read once handle k is waited for)."""
    n = group_size(group)
    if n == 1:
        return x, []
    if chunks == 1:  # one unit: the output is the ranks' blocks end to end, written through flat views
        out = x.new_empty((x.shape[0], n * x.shape[1], *x.shape[2:]))
        return out, [all_gather(out.view(-1), x.contiguous().view(-1), group, async_op=True)]
    pieces = x.contiguous().view(chunks, -1)  # (units, this rank's rows of a unit)
    out = x.new_empty((chunks, n, pieces.shape[1]))
    works = [all_gather(out[k].view(-1), pieces[k], group, async_op=True) for k in range(chunks)]
    return out.view(x.shape[0], n * x.shape[1], *x.shape[2:]), works


def _seq_reduce_scatter(x: torch.Tensor, group, chunks: int = 1) -> torch.Tensor:
    """(B, T, ...) partial sums on each rank -> this rank's (B, T/n, ...) shard of their sum: one
    reduce-scatter per unit, each reading a contiguous block of rows, so no layout copy."""
    n = group_size(group)
    if n == 1:
        return x
    if traced() and chunks == 1:  # the GEMM's (rows, d) output scattered by rows: inductor's async TP
        out = funcol.reduce_scatter_tensor(x.reshape(-1, x.shape[-1]).contiguous(), SUM, 0, group)  # (as above)
        return out.view(x.shape[0], x.shape[1] // n, *x.shape[2:])
    if traced():  # unit k's block r to rank r, out of place, scattered along dim 0 (as in _seq_gather)
        blocks = x.contiguous().view(chunks, n, -1).transpose(0, 1).contiguous()  # no copy when chunks == 1
        out = funcol.reduce_scatter_tensor(blocks, SUM, 0, group)
        return out.view(x.shape[0], x.shape[1] // n, *x.shape[2:])
    if chunks == 1:  # one unit: rank r's block is the r-th of the flat input
        out = x.new_empty((x.shape[0], x.shape[1] // n, *x.shape[2:]))
        reduce_scatter(out.view(-1), x.contiguous().view(-1), group)
        return out
    units = x.contiguous().view(chunks, n, -1)  # (units, ranks, rows of a unit's block)
    out = x.new_empty((chunks, units.shape[2]))
    for k in range(chunks):
        reduce_scatter(out[k], units[k].view(-1), group)
    return out.view(x.shape[0], x.shape[1] // n, *x.shape[2:])


def sequence_rows(total: int, n: int, rank: int, chunks: int = 1) -> list[tuple[int, int]]:
    """[start, end) ranges of the flattened (B*T) token rows that tp rank `rank` of `n` holds under
    sequence parallelism (Korthikanti et al. 2022 shard the sequence; we shard the flattened batch,
    which is the same set of tokens when B = 1): the rows form `chunks` units of total/chunks
    consecutive rows, and rank r holds the r-th of each unit's n equal blocks. Norms, dropout and
    residuals are per token, so any assignment is correct; this one makes every gather and
    reduce-scatter a set of contiguous blocks (no transposes for B > 1), and its units are what the
    chunked overlap (parallel/tp_overlap.py) pipelines."""
    unit, block = total // chunks, total // (chunks * n)
    return [(k * unit + rank * block, k * unit + (rank + 1) * block) for k in range(chunks)]


class _GatherSequence(torch.autograd.Function):
    """Sequence parallelism's entry to a tensor-parallel region: all-gather the sequence shards
    forward, reduce-scatter the (partial) gradient backward."""

    @staticmethod
    def forward(ctx, x, group, chunks):
        ctx.group, ctx.chunks = group, chunks
        return _seq_gather(x, group, chunks)

    @staticmethod
    def backward(ctx, grad):
        return _seq_reduce_scatter(grad, ctx.group, ctx.chunks), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallelism's exit: reduce-scatter the partial sums along the sequence forward,
    all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, chunks):
        ctx.group, ctx.chunks = group, chunks
        return _seq_reduce_scatter(x, group, chunks)

    @staticmethod
    def backward(ctx, grad):
        return _seq_gather(grad, ctx.group, ctx.chunks), None, None


class Regather:
    """A sequence-parallel region input kept for backward as this rank's shard (Korthikanti et al.
    2022, sec. 4.2.2: Megatron-LM saves the sequence-sharded input of a column-parallel linear and
    all-gathers it again in backward). Every linear reading the gathered input (wq, wk, wv; w1, w3;
    the head; an adapter's A) saves the shard and asks here for the whole input in its backward: the
    first of them launches the all-gather, the others reuse it, the last drops it. Every rank runs the
    same graph, so every rank issues the gather at the same point of its backward."""

    def __init__(self, group, chunks: int):
        self.group, self.chunks = group, chunks
        self.users = 0  # linears that saved the shard and have not run their backward yet
        self._whole, self._works = None, []

    def start(self, shard: torch.Tensor) -> None:
        """Launch the all-gather of `shard` (asynchronously) unless a linear already did."""
        if self._whole is None:
            self._whole, self._works = start_seq_gather(shard, self.group, self.chunks)

    def finish(self) -> torch.Tensor:
        """The whole input (B, T, d), waited for; dropped here once its last linear took it."""
        for w in self._works:
            w.wait()
        whole, self._works = self._whole, []
        self.users -= 1
        if self.users <= 0:
            self._whole = None
        return whole


def gather_sequence_to_linears(x, group, chunks: int = 1):
    """`gather_sequence` into a region whose linears keep only the shard (`Regather`, read by
    parallel/tp_layers.py from the returned tensor's `regather`). Traced by torch.compile the plain
    gather: the compiler's partitioner decides what its graph keeps."""
    whole = gather_sequence(x, group, chunks)
    if whole is not x and torch.is_grad_enabled() and not traced():
        whole.regather = (Regather(group, chunks), x)
    return whole


def copy_to_tp(x, group):
    return _CopyToTP.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tp(x, group):
    return _ReduceFromTP.apply(x, group) if group_size(group) > 1 else x


def gather_last_dim(x, group):
    return _GatherLastDim.apply(x, group) if group_size(group) > 1 else x


def split_last_dim(x, group):
    return _SplitLastDim.apply(x, group) if group_size(group) > 1 else x


def gather_sequence(x, group, chunks: int = 1):
    return _GatherSequence.apply(x, group, chunks) if group_size(group) > 1 else x


def reduce_scatter_sequence(x, group, chunks: int = 1):
    return _ReduceScatterSequence.apply(x, group, chunks) if group_size(group) > 1 else x


# ---------------------------------------------------------------- expert parallelism
# GShard's dispatch and combine (Lepikhin et al. 2020, sec. 3.2): tokens go to the ranks holding
# their experts and the outputs come back, one all-to-all each way (or one per chunk: expert.py
# pipelines them, Tutel's and DeepSpeed-MoE's overlap), over the `ep` group. Launch and landing are
# two autograd nodes, so compute placed between them runs under the exchange, forward and backward.

class RowExchange:
    """One all-to-all of rows between its launch and its landing: the splits (out_splits[r] rows come
    from rank r, in_splits[r] go to it), the group, and while in flight the torch work with the two
    tensors it reads and writes, held until the work is waited for (so the caching allocator cannot
    hand their memory to the compute stream while NCCL still uses it, whatever torch's own policy)."""

    __slots__ = ("out_splits", "in_splits", "group", "work", "held")

    def __init__(self, out_splits: list[int], in_splits: list[int], group):
        self.out_splits, self.in_splits, self.group = out_splits, in_splits, group
        self.work = self.held = None

    def start(self, x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
        """Launch the exchange of x (reverse: the way back, splits swapped); the returned rows are
        valid once `finish` has run."""
        out_splits, in_splits = (self.in_splits, self.out_splits) if reverse else (self.out_splits, self.in_splits)
        x = x.contiguous()
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        self.work = all_to_all(out, x, out_splits, in_splits, self.group, async_op=True)
        self.held = (x, out)
        return out

    def finish(self) -> torch.Tensor:
        """Order the current stream after the exchange (NCCL), or block until it is done (gloo);
        returns the received rows."""
        self.work.wait()
        out = self.held[1]
        self.work = self.held = None
        return out


class _LaunchRows(torch.autograd.Function):
    """Forward: launch the exchange; its output is valid only after the paired `_LandRows`. Backward:
    land the reverse exchange that `_LandRows`'s backward launched, whose received rows are x's
    gradient (the gradient arriving here only carries the order)."""

    @staticmethod
    def forward(ctx, x, ex):
        ctx.ex = ex
        return ex.start(x)

    @staticmethod
    def backward(ctx, _carrier):
        return ctx.ex.finish(), None


class _LandRows(torch.autograd.Function):
    """Forward: wait for the exchange `_LaunchRows` launched (identity on its rows). Backward: launch
    the reverse exchange of the gradient (each row back to the rank it came from) and return at once,
    so that the autograd engine runs other ready work before `_LaunchRows`'s backward waits for it.
    What it returns is the gradient itself, unread: the reverse exchange's rows have the launch's
    input shape and reach it through the shared `RowExchange`."""

    @staticmethod
    def forward(ctx, y, ex):
        ex.finish()
        ctx.ex = ex
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        ctx.ex.start(grad, reverse=True)
        return grad, None


def launch_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group) -> tuple[torch.Tensor, RowExchange]:
    """Start an all-to-all of rows, autograd-aware: x (sum(in_splits), ...), in blocks of in_splits[r]
    rows for rank r, -> (sum(out_splits), ...) received in rank order, readable after `land_rows`.
    Backward: the same exchange reversed, launched by land_rows' backward and waited for by this one's,
    so that work between the two runs under it in both directions. Traced (`traced`): one functional
    all-to-all whose autograd formula is the reverse all-to-all, and no exchange object (the compiler
    orders the wait; land_rows passes the rows through)."""
    if traced():
        return funcol.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group), None
    ex = RowExchange(out_splits, in_splits, group)
    return _LaunchRows.apply(x, ex), ex


def land_rows(y: torch.Tensor, ex: RowExchange | None) -> torch.Tensor:
    """The rows of `launch_rows`, once arrived (traced: already the functional collective's output)."""
    return y if ex is None else _LandRows.apply(y, ex)


# ---------------------------------------------------------------- whole tensors from placed pieces

def to_global(t: torch.Tensor, pl, mesh) -> torch.Tensor:
    """The whole logical tensor from this rank's piece: all-gather the pieces over `pl.axis` and put
    each where it belongs, then a stack of experts' ep ranks' experts along dim 0 (collectives over
    those axes; a whole parameter is returned as is)."""
    if pl.dim is not None:
        t = _gather_pieces(t, pl, mesh)
    if pl.experts is not None and mesh is not None and mesh.size("ep") > 1:
        t = _stacked(t, mesh, "ep").flatten(0, 1)  # ep rank r holds experts r*E/ep ..
    return t


def _stacked(t: torch.Tensor, mesh, axis: str) -> torch.Tensor:
    """(n, *t.shape): every rank's `t` along `axis` (n ranks), in rank order (all-gather)."""
    n = mesh.size(axis)
    flat = torch.empty(n * t.numel(), dtype=t.dtype, device=t.device)
    all_gather(flat, t.detach().contiguous().reshape(-1), mesh.group(axis))
    return flat.view(n, *t.shape)


def _gather_pieces(t: torch.Tensor, pl, mesh) -> torch.Tensor:
    """The tensor whole along `pl.dim` from the pieces of the ranks along `pl.axis`."""
    pieces = _stacked(t, mesh, pl.axis)
    shape = list(pl.global_shape)
    shape[0] = t.shape[0] if pl.experts is not None else shape[0]  # this rank's experts only
    out = torch.empty(shape, dtype=t.dtype, device=t.device)
    rep = pieces.shape[0] // pl.count  # ranks holding each piece (1 unless pieces repeat)
    for index, local in enumerate(pieces[::rep]):
        peer = pl.with_(index=index, experts=None)
        out[peer.global_slices()] = local[peer.local_slices()]
    return out


def gather_stages(tensors: dict[str, torch.Tensor], mesh) -> dict[str, torch.Tensor]:
    """The whole model from every pipeline stage's part, by global name, on every rank (collective
    over the pp group; a tied embedding, held whole at both ends, arrives twice, identical)."""
    if mesh is None or mesh.size("pp") == 1:
        return tensors
    out: dict[str, torch.Tensor] = {}
    for part in all_gather_objects(tensors, mesh.group("pp")):
        out.update(part)
    return out


# ---------------------------------------------------------------- context parallelism
# Ring attention (Liu et al. 2023) passes key/value chunks around the cp ranks, point to point;
# Ulysses (Jacobs et al. 2023) swaps sequence shards for head shards, one all-to-all each way.

def ring_shift(send: torch.Tensor, recv: torch.Tensor, ranks: list[int], group, tag: int = 0):
    """Post: `send` to the next rank of the ring `ranks` (the cp group, in ring order), the previous
    rank's into `recv`. Returns the handle; `recv` is valid, and `send` may be freed, after its wait.
    `tag` keeps two streams of messages between the same ranks apart (gloo matches by it)."""
    i, n = ranks.index(dist.get_rank()), len(ranks)
    nxt, prev = ranks[(i + 1) % n], ranks[(i - 1) % n]
    ops = [dist.P2POp(dist.isend, send, nxt, group, tag), dist.P2POp(dist.irecv, recv, prev, group, tag)]
    return inflight.launch(f"ring exchange with ranks {prev} and {nxt}", group, lambda: dist.batch_isend_irecv(ops))


def _swap_blocks(x: torch.Tensor, group) -> torch.Tensor:
    """x (n, ...): block i to rank i; block i of the result came from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)
    all_to_all(out, x, [x.shape[0] // group_size(group)] * group_size(group),
               [x.shape[0] // group_size(group)] * group_size(group), group)
    return out


class _SwapBlocks(torch.autograd.Function):
    """Forward: rank r sends block i of dim 0 (n equal blocks) to rank i and puts rank i's block r at
    place i. Backward: the same exchange of the gradient (the exchange is its own inverse)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _swap_blocks(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _swap_blocks(grad, ctx.group), None


def swap_blocks(x: torch.Tensor, group) -> torch.Tensor:
    """Autograd-aware all-to-all of x's n equal blocks along dim 0 over `group` (Ulysses' exchange);
    traced (`traced`), the functional collective, whose autograd formula is the same exchange."""
    if group_size(group) == 1:
        return x
    if traced():
        return funcol.all_to_all_single_autograd(x.contiguous(), None, None, group)
    return _SwapBlocks.apply(x, group)
