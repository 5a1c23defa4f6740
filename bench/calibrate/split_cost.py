"""planner/time.py OPS_SPLIT_EXTRA: the aten ops ZB-H1's split backward adds per block and micro-batch.

What ZB-H1's split backward costs the host: the last stage of pp=2 x tp=2 (the split one: the first
stage has no input gradient to send and runs one backward) at two depths, ZB-H1 against 1F1B at the
same 8 micro-batches. One process runs that rank's program alone on a fake process group (no
communication: every collective returns at once), so the step is the host's and one GPU measures it.
Under torchrun (`--real`) every rank runs its own program over the real process group instead: pp=2
on 2 processes, pp=2 x tp=2 on 4; `--small` takes the host probe's width (planner_rows.PROBE_WIDTH:
kernels of microseconds, so the host paces every layout) to see whether the split's host time reaches
the step of a real pipeline.

    python bench/calibrate/split_cost.py --layers 8 32 --out split.json                # one GPU, ~2 min
    python bench/calibrate/split_cost.py --smoke --layers 4 8 --count-only             # CPU, op counts only
    torchrun --nproc-per-node 2 bench/calibrate/split_cost.py --real --small --layers 8 32 --out split2.json

Per depth: the aten ops of one step of each schedule (a TorchDispatchMode, as planner/time.py counts
OPS_PER_BLOCK), the median step over `--rounds` alternating rounds of `--steps` steps under the
trainer's garbage-collector policy (teratrain.collector), and from those the split's extra ops and
milliseconds per block and micro-batch. planner/time.py's OPS_SPLIT_EXTRA is the ops figure; the
milliseconds over the ops say what one of them costs against the step's average op.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, planner_multi, planner_rows
from common import count_ops, emit, sync
from planner_multi import build_row
from planner_rows import PROBE_WIDTH, Row, full_sets, pipeline_sets

WORLD, RANK, MICRO = 4, 2, 8  # pp=2 x tp=2: rank 2 is the last stage's first tp rank
TINY = ["model.n_kv_heads=2"]  # on planner_rows.dense's smoke model: grouped KV heads, as llama-1b's


def depth(layers: int, args, device: torch.device, runtimes: dict) -> dict:
    from teratrain.collector import Collector

    steps, ops = {}, {}
    tp = ("parallel.tp=2",) if dist.get_world_size() == 4 else ()
    for schedule in ("1f1b", "zb-h1"):
        sets = full_sets(Row(schedule, pipeline_sets(schedule, 2, MICRO, extra=tp)), layers, args.smoke)
        width = TINY if args.smoke else [*PROBE_WIDTH] if args.small else []
        step = build_row(sets + width, 120, device, runtimes)[-1]
        for _ in range(3):
            step()
        steps[schedule], ops[schedule] = step, count_ops(step)
    blocks = layers // 2
    out = {"layers": layers, "blocks_per_stage": blocks, "microbatches": MICRO, "ops": ops,
           "split_extra_ops_per_block_mb": (ops["zb-h1"] - ops["1f1b"]) / blocks / MICRO}
    if args.count_only:
        return out
    times = collections.defaultdict(list)
    with Collector() as collector:
        for _ in range(args.rounds):
            for schedule, step in steps.items():
                for _ in range(args.steps):
                    sync(device)
                    if args.real:
                        dist.barrier()
                    t0 = time.perf_counter()
                    step()
                    sync(device)
                    times[schedule].append(time.perf_counter() - t0)
                    collector.step()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    extra_ms = (med["zb-h1"] - med["1f1b"]) / blocks / MICRO
    out.update(median_ms=med, steps_ms={k: [round(t * 1e3, 1) for t in v] for k, v in times.items()},
               split_extra_ms_per_block_mb=extra_ms, us_per_1f1b_op=med["1f1b"] / ops["1f1b"] * 1e3,
               us_per_split_op=extra_ms / out["split_extra_ops_per_block_mb"] * 1e3
               if out["split_extra_ops_per_block_mb"] else None)  # the first stage does not split
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 32], help="the model's layers (a stage: half)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="steps of each schedule a round")
    ap.add_argument("--count-only", action="store_true", help="count the ops, time nothing")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    ap.add_argument("--real", action="store_true", help="under torchrun: every rank, the real process group")
    ap.add_argument("--small", action="store_true", help="the host probe's model (a host-paced step)")
    ap.add_argument("--out")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if args.real:
        local = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
        if dist.get_world_size() not in (2, 4):
            raise SystemExit("--real runs pp=2 on 2 processes or pp=2 x tp=2 on 4")
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        os.environ.update(RANK=str(RANK), WORLD_SIZE=str(WORLD), LOCAL_RANK="0")
        dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
        device = torch.device("cuda" if cuda else "cpu")
    runtimes: dict = {}
    rows = [depth(n, args, device, runtimes) for n in args.layers]
    result = {"bench": "split_cost", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "rank": dist.get_rank(), "world": dist.get_world_size(),
              "real": args.real, "small": args.small, "depths": rows}
    if len(rows) >= 2 and rows[0]["layers"] != rows[-1]["layers"]:  # per block from two depths: the head drops out
        a, b = rows[0], rows[-1]
        result["split_extra_ops_per_block_mb_slope"] = (
            (b["ops"]["zb-h1"] - b["ops"]["1f1b"]) - (a["ops"]["zb-h1"] - a["ops"]["1f1b"])) / (
            (b["blocks_per_stage"] - a["blocks_per_stage"]) * MICRO)
    if dist.get_rank() == (dist.get_world_size() - 1 if args.real else RANK):  # a rank of the last stage
        emit(result, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
