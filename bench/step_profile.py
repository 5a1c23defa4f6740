"""Where an eager step's time goes on every rank, for layouts of bench/planner_validate.py: the
host's time to issue the step against the step's wall time, the GPU's busy and idle time and its
NCCL kernels, and the runtime calls and ops that take the host's time (cudaMalloc, a blocking
synchronize, the autograd engine). Made to explain what the planner's host terms stand for: the
host probe's rows (planner_rows.probe_rows: a model whose kernels take microseconds) and the
validation rows the planner misses (eager MoE with expert parallelism).

    torchrun --nproc-per-node 2 bench/step_profile.py --rows "probe dp" "probe tp2" "moe dp2 ep2" --out r.json
    python -m torch.distributed.run --nproc-per-node 2 bench/step_profile.py --smoke --rows "probe tp2"

Per row and rank: the median step (synchronized), the median time until the step call returned (the
step ends by reading the gradient norm, so this waits for the GPU too: it is the host's issue time
only where the host sets the pace), and a profile of 2
steps (bench/trace_summary.py: kernel account and host account), and the host's speed apart from
any model (a Python loop, a small CPU op, a tiny kernel's launch), to tell a slower host from more
work. Rows name planner_rows' layouts at `--layers` layers (the MoE rows take half, as planner_rows
does), run in the order given in the same processes, as planner_validate runs its rows: a row named
twice shows what the rows between did to it. `--no-profile` times the rows only; `--pin` gives each
local rank its own share of the CPUs before CUDA and NCCL start threads (session 10: it did not steady
the host-paced rows, bench/README.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, sync
from machine import host_loop_us
from planner_multi import _free, build_row
from planner_rows import full_sets, probe_rows, rows_for
from trace_summary import profile_steps

from teratrain.collector import Collector


def row_sets(name: str, gpus: int, layers: int, smoke: bool) -> list[str]:
    for p in probe_rows(gpus, smoke):
        if p["name"] == name:
            return p["sets"]
    for r in rows_for(gpus):
        if r.name == name:
            return full_sets(r, layers, smoke)
    raise SystemExit(f"--rows: no layout named {name!r} at {gpus} GPUs (planner_rows.py, or a probe row)")


def host_speed(device: torch.device, repeats: int = 3) -> dict:
    """The host's speed at this moment, apart from any model: microseconds per iteration of a pure
    Python loop, per small CPU tensor op, and per launch of a tiny device kernel (host side)."""
    def best(fn, n: int) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(n)
            times.append((time.perf_counter() - t0) / n * 1e6)
        return round(min(times), 4)

    cpu = torch.zeros(16)
    x = torch.zeros(16, device=device)
    out = {"python_loop_us": round(host_loop_us(), 4),
           "cpu_op_us": best(lambda n: [cpu.add_(1) for _ in range(n)], 5000),
           "launch_us": best(lambda n: [x.add_(1) for _ in range(n)], 5000)}
    sync(device)
    return out


def measure(step, device: torch.device, warmup: int, steps: int, collector) -> dict:
    """`warmup` steps, then `steps` timed ones, each told to the caller's teratrain.collector.Collector
    (the garbage collector as `teratrain train` runs it)."""
    for _ in range(warmup):
        step()
        collector.step()
    sync(device)
    issue, whole = [], []
    for _ in range(steps):
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        step()
        issue.append(time.perf_counter() - t0)
        sync(device)
        whole.append(time.perf_counter() - t0)
        collector.step()
    return {"step_ms": round(1e3 * statistics.median(whole), 3), "issue_ms": round(1e3 * statistics.median(issue), 3),
            "steps_ms": [round(1e3 * t, 3) for t in whole]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", required=True)
    ap.add_argument("--layers", type=int, default=16, help="the dense rows' layers (MoE rows: half)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--smoke", action="store_true", help="gloo on CPU, tiny shapes")
    ap.add_argument("--no-profile", action="store_true", help="time the rows only (no torch.profiler steps)")
    ap.add_argument("--pin", action="store_true",
                    help="each local rank on its own share of this process's CPUs (before CUDA and NCCL start threads)")
    ap.add_argument("--out")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin:
        share = len(cpus) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        cpus = cpus[local * share:(local + 1) * share] or cpus
        os.sched_setaffinity(0, cpus)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=180),
                            device_id=device if cuda else None)
    n = dist.get_world_size()
    out = {"bench": "step_profile", "world": n, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "torch": torch.__version__, "layers": args.layers, "pin": args.pin, "rows": []}
    ranks_cpus = [None] * n
    dist.all_gather_object(ranks_cpus, f"{cpus[0]}-{cpus[-1]} ({len(cpus)})")
    out["cpus"] = ranks_cpus
    runtimes: dict = {}
    for name in args.rows:
        sets = row_sets(name, n, 2 * n if args.smoke else args.layers, args.smoke)
        _free(device)
        built = build_row(sets, 180, device, runtimes)
        step = built[-1]
        with Collector(built[0].train.gc_every) as collector:
            mine = measure(step, device, 1 if args.smoke else 3, 2 if args.smoke else args.steps, collector)
            mine["host_speed"] = host_speed(device)
            if not args.no_profile:
                mine["profile"] = profile_steps(step, device, steps=2, top=12)
        del built, step  # the row's model, engine and batches go before the next row is built
        ranks = [None] * n
        dist.all_gather_object(ranks, mine)
        out["rows"].append({"name": name, "sets": sets, "ranks": ranks})  # in order: a row may come again
        if dist.get_rank() == 0:
            each = {"step ms": [r["step_ms"] for r in ranks], "issue ms": [r["issue_ms"] for r in ranks],
                    "GPU idle ms": [r.get("profile", {}).get("idle_ms") for r in ranks], "host speed": [r["host_speed"] for r in ranks]}
            print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in each.items()), file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        emit(out, args.out)
    from teratrain.mesh import shutdown

    shutdown()


if __name__ == "__main__":
    main()
