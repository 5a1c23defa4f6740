"""The hang registry (parallel/inflight.py) costs a launch O(1) however many operations are pending:
the host runs a step's collectives ahead of the GPU, and a registry that looked at every pending one
on each launch would make the step quadratic in its collectives."""

from __future__ import annotations

from teratrain.parallel import inflight


class _Work:
    def __init__(self, done: bool):
        self.done, self.asked = done, 0

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        self.asked += 1
        return self.done


def test_launches_ask_pending_operations_a_bounded_number_of_times():
    inflight.reset()
    pending = [_Work(False) for _ in range(1000)]
    for w in pending:  # a long step's worth, none complete yet
        inflight.launch("all-gather", None, lambda w=w: w)
    done = _Work(True)
    for _ in range(4000):
        inflight.launch("reduce-scatter", None, lambda: done).wait()
    asked = sum(w.asked for w in pending)
    assert asked <= 3 * (1000 + 4000), f"pending operations were asked {asked} times over 5000 launches"
    op = inflight.oldest_pending()
    assert op is not None and op.what == "all-gather"  # still named by the watchdog
    assert len(inflight._ops) == 1000  # completed ones dropped, pending ones kept
    inflight.reset()


def test_shutdown_forgets_the_groups_before_destroying_them(tmp_path):
    """mesh.shutdown: the registry's operations hold their groups; left there, a destroyed gloo group
    is freed in the interpreter's teardown, where its threads abort the process."""
    import sys
    import weakref

    import torch
    import torch.distributed as dist

    from teratrain.mesh import shutdown
    from teratrain.parallel import comm

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        comm.all_reduce(torch.ones(2), group, async_op=True).wait()  # size 1: nothing registered
        inflight.launch("all-reduce", group, lambda: dist.all_reduce(torch.ones(2), group=group, async_op=True)).wait()
        assert any(op.group is group for op in inflight._ops)
        held = weakref.ref(group)
        del group
        shutdown()
        assert not dist.is_initialized() and not inflight._ops
        assert held() is None, sys.getrefcount(held())  # nothing of ours keeps it past its destruction
    finally:
        inflight.reset()
        if dist.is_initialized():
            dist.destroy_process_group()
