"""Where a host-paced eager step's time goes, collective by collective, on every rank: when each rank's
host launched each collective and came back from its wait, and when its GPU reached it and finished it.
Made to tell the host's share of a tensor-parallel step from the GPU's and from the ranks' skew
(bench/README.md, "The host's speed between launches", session 15).

    torchrun --nproc-per-node 2 bench/collective_timeline.py --rows "probe dp" "probe tp2" "tp2 megatron" --out t.json
    python -m torch.distributed.run --nproc-per-node 2 bench/collective_timeline.py --smoke --rows "probe tp2"
    python bench/collective_timeline.py --summarize t1.json t2.json ...   # one line per file and row

Rows name planner_rows' layouts (bench/step_profile.py `row_sets`) at `--layers` layers, built as
planner_validate builds them and run in order in the same processes. Each row runs warm-up steps, 3
plain synchronized steps (`plain_ms`) and `--steps` recorded ones: every collective that goes through
parallel/inflight.py (tensor-parallel, data-parallel and expert-parallel ones alike) is recorded with
the host's clock before and after its launch call and around its wait call (CLOCK_MONOTONIC, which the
processes of one machine share), and on GPUs with a timing event on the current stream before the launch
and after the wait. Per rank and step the summary gives the host's time inside launch and wait calls, the
host's gaps between collectives (its time issuing everything else), how far the host ran ahead of its
GPU at each collective (`lead`: GPU arrival minus host launch; ~0 where the GPU waits on its own host) and
the GPU's time inside collectives (transfer plus waiting for a later peer; a collective waited for later, as
the data-parallel engines' buckets are, holds the compute issued in between: read that figure for tp rows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import sync  # noqa: E402
from planner_multi import _free, build_row  # noqa: E402
from step_profile import measure, row_sets  # noqa: E402

from teratrain.collector import Collector  # noqa: E402
from teratrain.parallel import inflight  # noqa: E402

_STATE = {"on": False, "cuda": False, "items": [], "tags": {}}
_launch, _wait = inflight.launch, inflight.Op.wait


def _event():
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _recorded_launch(what, group, start):
    if not _STATE["on"]:
        return _launch(what, group, start)
    item = {"what": what, "h0": time.perf_counter_ns(), "g0": _event() if _STATE["cuda"] else None}
    op = _launch(what, group, start)
    item["h1"] = time.perf_counter_ns()
    _STATE["tags"][id(op)] = item
    _STATE["items"].append(item)
    return op


def _recorded_wait(self):
    item = _STATE["tags"].pop(id(self), None)
    if item is None:
        return _wait(self)
    item["w0"] = time.perf_counter_ns()
    out = _wait(self)
    item["w1"] = time.perf_counter_ns()
    item["g1"] = _event() if _STATE["cuda"] else None
    return out


def recorded_step(step, device: torch.device) -> dict:
    """One step with every collective recorded; times in microseconds from the step's start."""
    dist.barrier()
    sync(device)
    _STATE.update(items=[], tags={}, on=True)
    t0 = time.perf_counter_ns()
    e0 = _event() if _STATE["cuda"] else None
    try:
        step()
    finally:
        _STATE["on"] = False
    returned = time.perf_counter_ns()
    sync(device)
    synced = time.perf_counter_ns()
    items = []
    for it in _STATE["items"]:
        row = {"what": it["what"], "launch_us": (it["h0"] - t0) / 1e3, "launched_us": (it["h1"] - t0) / 1e3}
        if "w0" in it:
            row.update(wait_us=(it["w0"] - t0) / 1e3, waited_us=(it["w1"] - t0) / 1e3)
        if e0 is not None:
            row["gpu_reach_us"] = e0.elapsed_time(it["g0"]) * 1e3
            if it.get("g1") is not None:
                row["gpu_done_us"] = e0.elapsed_time(it["g1"]) * 1e3
        items.append(row)
    return {"t0_ns": t0, "returned_us": (returned - t0) / 1e3, "synced_us": (synced - t0) / 1e3, "items": items}


def _q(xs: list[float], p: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p * len(xs)))], 1) if xs else None


def _gap(before: dict, item: dict) -> float:
    """The host's time from the end of one collective's calls to the next launch: its time issuing
    everything between them (a wait that comes after the next launch, as for the data-parallel
    engines' buckets, is not in between)."""
    waited = before.get("waited_us")
    end = waited if waited is not None and waited <= item["launch_us"] else before["launched_us"]
    return item["launch_us"] - end


def summarize(result: dict) -> list[dict]:
    """Per row: the slowest rank's median plain step, and per rank the medians over its recorded
    steps' collectives (module docstring)."""
    out = []
    for row in result["rows"]:
        ranks = []
        for r in row["ranks"]:
            items = [i for s in r["steps"] for i in s["items"]]
            gaps = [_gap(s["items"][k - 1], s["items"][k]) for s in r["steps"] for k in range(1, len(s["items"]))]
            lead = [i["gpu_reach_us"] - i["launch_us"] for i in items if "gpu_reach_us" in i]
            inside = [sum(i["gpu_done_us"] - i["gpu_reach_us"] for i in s["items"] if "gpu_done_us" in i)
                      for s in r["steps"]]
            ranks.append({"plain_ms": statistics.median(r["plain_ms"]),
                          "collectives_a_step": len(r["steps"][0]["items"]) if r["steps"] else 0,
                          "launch_us_median": _q([i["launched_us"] - i["launch_us"] for i in items], 0.5),
                          "wait_us_median": _q([i["waited_us"] - i["wait_us"] for i in items if "wait_us" in i], 0.5),
                          "host_gap_us_median": _q(gaps, 0.5),
                          "lead_us_p10_p50_p90": [_q(lead, 0.1), _q(lead, 0.5), _q(lead, 0.9)] if lead else None,
                          "gpu_in_collectives_ms": round(statistics.median(inside) / 1e3, 2) if lead else None})
        out.append({"name": row["name"], "step_ms": round(max(r["plain_ms"] for r in ranks), 2), "ranks": ranks})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+")
    ap.add_argument("--layers", type=int, default=16, help="the dense rows' layers (MoE rows: half)")
    ap.add_argument("--steps", type=int, default=2, help="recorded steps per row")
    ap.add_argument("--smoke", action="store_true", help="gloo on CPU, tiny shapes")
    ap.add_argument("--summarize", nargs="+", metavar="RESULT", help="summarize results of earlier runs instead")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.summarize:
        summary = {path: summarize(json.loads(Path(path).read_text())) for path in args.summarize}
        for path, rows in summary.items():
            for row in rows:
                ranks = "; ".join(f"launch {r['launch_us_median']} wait {r['wait_us_median']} gap {r['host_gap_us_median']} us"
                                  for r in row["ranks"])
                print(f"{Path(path).name}: {row['name']}: {row['step_ms']} ms ({ranks})")
        if args.out:
            Path(args.out).write_text(json.dumps(summary, indent=1))
        return
    if not args.rows:
        raise SystemExit("--rows: name the layouts to record (planner_rows.py, or a probe row), or give --summarize")
    cuda = torch.cuda.is_available() and not args.smoke
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    _STATE["cuda"] = cuda
    inflight.launch, inflight.Op.wait = _recorded_launch, _recorded_wait
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=180),
                            device_id=device if cuda else None)
    n = dist.get_world_size()
    env = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL", "TORCH_FR", "CUDA_DEVICE_MAX"))}
    result = {"bench": "collective_timeline", "world": n, "torch": torch.__version__, "layers": args.layers,
              "device": torch.cuda.get_device_name(device) if cuda else "cpu", "env": env, "rows": []}
    runtimes: dict = {}
    for name in args.rows:
        _free(device)
        built = build_row(row_sets(name, n, 2 * n if args.smoke else args.layers, args.smoke), 180, device, runtimes)
        step = built[-1]
        with Collector(built[0].train.gc_every) as collector:  # the garbage collector as `teratrain train` runs it
            plain = measure(step, device, 2 if args.smoke else 4, 3, collector)["steps_ms"]  # nothing recorded
            mine = {"plain_ms": plain, "steps": [recorded_step(step, device) for _ in range(args.steps)]}
        del built
        ranks = [None] * n
        dist.all_gather_object(ranks, mine)
        result["rows"].append({"name": name, "ranks": ranks})
        del step
    if dist.get_rank() == 0:
        for row in summarize(result):
            print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    from teratrain.mesh import shutdown

    shutdown()


if __name__ == "__main__":
    main()
