"""Run a test body on N spawned gloo processes (the DeepSpeed `DistributedTest` idea).

Every rank reports its result or its traceback through a queue. The first failure terminates the
other ranks (which would otherwise wait in a collective until the timeout) and is re-raised in the
test, so ranks fail together instead of hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback

from tests.helpers import free_port


def _entry(fn, rank: int, world: int, port: int, results, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)  # 2-4 ranks share 2 cores
    try:
        # plain pickle bytes: a tensor put on the queue directly would travel as a shared-memory
        # handle that dies with this process
        results.put((rank, None, pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # noqa: BLE001 - report everything, including assertion errors
        results.put((rank, traceback.format_exc(), None))
    finally:
        from teratrain.mesh import shutdown

        shutdown()


def run_ranks(fn, world: int, *args, timeout_s: float = 300.0) -> list:
    """fn(rank, world, *args) on `world` processes; their return values in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, results, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world:
            try:
                rank, err, value = results.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    why = f"rank exit codes {[p.exitcode for p in procs]}" if dead else f"timeout after {timeout_s:.0f}s"
                    raise AssertionError(f"distributed test failed: {why}; results from ranks {sorted(out)}")
                continue
            if err is not None:
                raise AssertionError(f"rank {rank} of {world} failed:\n{err}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=10)
    return [out[r] for r in range(world)]
