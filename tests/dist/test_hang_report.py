"""A hang ends within parallel.timeout_s with one sentence naming the rank, the operation and its
peers (parallel/inflight.py), for a collective and for a pipeline transfer: rank 1 never joins,
rank 0's watchdog reports and ends the process with status 1; the launcher prints the report."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

import pytest
import torch

from harness import free_port

TIMEOUT_S = 2.0


def _rank(rank: int, port: int, reports: str, kind: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TERATRAIN_REPORTS=reports, TERATRAIN_LAUNCHER_PID=str(os.getppid()))
    torch.set_num_threads(1)
    from teratrain.config import load_config
    from teratrain.mesh import init_runtime
    from teratrain.parallel.comm import all_reduce
    from teratrain.parallel.pipeline.p2p import Links

    pp = "2" if kind == "receive" else "1"
    cfg = load_config(None, ["train.device=cpu", f"parallel.timeout_s={TIMEOUT_S}", f"parallel.pp={pp}"])
    rt = init_runtime(cfg)
    links = Links(rt.mesh, {(0, 1), (1, 0)}, rt.device) if kind == "receive" else None
    if rank == 1:  # never joins: stays away past rank 0's timeout
        time.sleep(30 * TIMEOUT_S)
        os._exit(0)
    if kind == "receive":
        _, recvs = links.post([(False, 1, torch.empty(4))])
        recvs[0].wait()
    else:
        all_reduce(torch.ones(4), rt.dp_group, async_op=True).wait()
    os._exit(3)  # not reached: the watchdog ends the process first


@pytest.mark.parametrize("kind, what", [("all-reduce", "an all-reduce on group dp (ranks 0, 1)"),
                                        ("receive", "a receive from rank 1 on group pp_link1to0 (ranks 0, 1)")])
def test_a_peer_that_never_joins_is_named_within_the_timeout(tmp_path, kind, what):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), kind), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    start = time.monotonic()
    procs[0].join(timeout=60)
    waited = time.monotonic() - start
    for p in procs:
        p.kill()
    assert procs[0].exitcode == 1, f"rank 0 ended with {procs[0].exitcode}"
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["kind"] == "hang"
    assert report["message"].startswith(f"rank 0 waited over parallel.timeout_s={TIMEOUT_S:g} s for {what} that "
                                        "never completed")
    assert "--- thread main" in report["traceback"]  # every thread's stack, for error.log
    assert waited < 30, f"the hang took {waited:.0f} s to be reported (start-up included)"


def test_the_launcher_prints_a_hang_in_one_sentence(tmp_path, capsys):
    from types import SimpleNamespace

    from teratrain.launch import _summarize

    reports = tmp_path / "reports"
    reports.mkdir()
    msg = "rank 2 waited over parallel.timeout_s=60 s for a reduce-scatter on group pp_ends (ranks 0, 1, 2, 3) that never completed"
    (reports / "rank2.json").write_text(json.dumps({"rank": 2, "time": 1.0, "kind": "hang", "message": msg,
                                                    "traceback": "--- thread main\n  stack"}))
    status = _summarize({2: SimpleNamespace(exitcode=1), 0: SimpleNamespace(exitcode=143)}, reports, tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1
    assert err[0].startswith(f"teratrain: error: {msg}; the other ranks were stopped")
    assert "stack" in (tmp_path / "error.log").read_text()
