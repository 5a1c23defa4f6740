"""Collectives used by the strategies, each a thin wrapper that also works for a group of one
(no process group at all: the collective degenerates to a local copy) and returns a handle
with `.wait()`, so callers overlap communication without special cases.

What runs:
- `all_reduce`: every rank ends with the sum (ring: each rank sends 2(n-1)/n of the bytes).
- `reduce_scatter`: rank r ends with the sum of slice r of every rank's input ((n-1)/n of the bytes).
- `all_gather`: every rank ends with all ranks' slices laid end to end ((n-1)/n of the bytes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from teratrain.compat import all_gather_single, reduce_scatter_single


SUM, AVG, MAX = dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX


class Done:
    """Handle of a collective that already finished (or never needed to run)."""

    def wait(self) -> bool:
        return True


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce(t: torch.Tensor, group, async_op: bool = False, op=SUM):
    if group_size(group) == 1:  # sum, average and max of one value are the value
        return Done()
    return dist.all_reduce(t, op=op, group=group, async_op=async_op) or Done()


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False, op=SUM):
    """out (n,) <- reduction (sum or average) over ranks of inp[r*n:(r+1)*n] on rank r; inp is
    (world*n,). For a group of one this is a copy, which also converts dtypes."""
    if group_size(group) == 1:
        out.copy_(inp)
        return Done()
    return reduce_scatter_single(out, inp, op=op, group=group, async_op=async_op) or Done()


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """out (world*n,) <- every rank's inp (n,) in rank order. `inp` may be a slice of `out`."""
    if group_size(group) == 1:
        if inp.data_ptr() != out.data_ptr():
            out.copy_(inp)
        return Done()
    return all_gather_single(out, inp, group=group, async_op=async_op) or Done()


def any_rank(flag: bool, group, device) -> bool:
    """True on every rank if it is true on any rank (e.g. 'my gradients overflowed')."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    all_reduce(t, group, op=MAX)
    return bool(t.item())


def any_rank_false(flag: bool, group, device) -> bool:
    """True on every rank only if it is true on every rank (e.g. 'my checkpoint verified')."""
    return not any_rank(not flag, group, device)


def broadcast_object(obj, group):
    """Rank 0's picklable `obj` on every rank of `group` (small control values, e.g. a run folder)."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
