"""Under NCCL a rank does not block in a collective or a receive; it blocks later, wherever it next
waits for the GPU. A peer that never joins is still named within parallel.timeout_s, by the
operation that never completed (parallel/inflight.py), for a collective and for a pipeline receive."""

import json
import multiprocessing as mp
import os
import socket
import time

import pytest
import torch

TIMEOUT_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, reports: str, kind: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TERATRAIN_REPORTS=reports, TERATRAIN_LAUNCHER_PID=str(os.getppid()),
                      NCCL_NVLS_ENABLE="0")
    from teratrain.config import load_config
    from teratrain.mesh import init_runtime
    from teratrain.parallel.comm import all_reduce
    from teratrain.parallel.pipeline.p2p import Links

    pp = "2" if kind == "receive" else "1"
    cfg = load_config(None, ["train.device=cuda", f"parallel.timeout_s={TIMEOUT_S}", f"parallel.pp={pp}"])
    rt = init_runtime(cfg)
    links = Links(rt.mesh, {(0, 1), (1, 0)}, rt.device) if kind == "receive" else None
    if kind != "receive":
        rt.mesh.group("dp")
        rt.mesh.connect(rt.device)
    if rank == 1:
        time.sleep(12 * TIMEOUT_S)
        os._exit(0)
    if kind == "receive":
        _, recvs = links.post([(False, 1, torch.empty(4, device=rt.device))])
        recvs[0].wait()
    else:
        all_reduce(torch.ones(4, device=rt.device), rt.dp_group, async_op=True).wait()
    torch.cuda.synchronize(rt.device)  # where the host blocks under NCCL
    os._exit(3)


@pytest.mark.gpu(2)
@pytest.mark.parametrize("kind, what", [("all-reduce", "an all-reduce on group dp (ranks 0, 1)"),
                                        ("receive", "a receive from rank 1 on group pp_link1to0 (ranks 0, 1)")])
def test_a_peer_that_never_joins_is_named_under_nccl(tmp_path, kind, what):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), kind), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    procs[0].join(timeout=120)
    for p in procs:
        p.kill()
    assert procs[0].exitcode == 1, f"rank 0 ended with {procs[0].exitcode}"
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["kind"] == "hang" and what in report["message"], report["message"]
