"""A hang on purpose, for the watchdog's tests (tests/dist/test_hang_report.py on gloo, tests/gpu/
test_hang_nccl.py under NCCL): rank 1 never joins; rank 0 launches an all-reduce or posts a pipeline
receive, then waits (under NCCL the host blocks only where it next waits for the GPU). Returns rank
0's exit status and the report it left for the launcher."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

from tests.helpers import free_port


def _rank(rank: int, port: int, reports: str, kind: str, device: str, timeout_s: float) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TERATRAIN_REPORTS=reports, TERATRAIN_LAUNCHER_PID=str(os.getppid()),
                      NCCL_NVLS_ENABLE="0")
    import torch

    torch.set_num_threads(1)
    from teratrain.config import load_config
    from teratrain.mesh import init_runtime
    from teratrain.parallel.comm import all_reduce
    from teratrain.parallel.pipeline.p2p import Links

    pp = "2" if kind == "receive" else "1"
    sets = [f"train.device={device}", f"parallel.timeout_s={timeout_s}", f"parallel.pp={pp}"]
    rt = init_runtime(load_config(None, sets))
    links = Links(rt.mesh, {(0, 1), (1, 0)}, rt.device) if kind == "receive" else None
    if kind != "receive":
        rt.mesh.group("dp")
        rt.mesh.connect(rt.device)
    if rank == 1:  # never joins: stays away well past rank 0's timeout
        time.sleep(12 * timeout_s)
        os._exit(0)
    if kind == "receive":
        links.post([(False, 1, torch.empty(4, device=rt.device))])[0].wait()
    else:
        all_reduce(torch.ones(4, device=rt.device), rt.dp_group, async_op=True).wait()
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)  # where the host blocks under NCCL
    os._exit(3)  # not reached: the watchdog ends the process first


def hang(reports: str, kind: str, device: str, timeout_s: float) -> tuple[int | None, dict, float]:
    """(rank 0's exit status, its report, seconds until it ended, start-up included)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, reports, kind, device, timeout_s), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    start = time.monotonic()
    procs[0].join(timeout=120)
    waited = time.monotonic() - start
    for p in procs:
        p.kill()
    path = os.path.join(reports, "rank0.json")
    return procs[0].exitcode, json.loads(open(path).read()) if os.path.exists(path) else {}, waited
