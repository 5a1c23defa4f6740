"""planner/time.py host_s: the host's ops and seconds per block that tensor and expert parallelism add.

What a tensor- or expert-parallel rank's eager step issues per block beyond a data-parallel rank's, counted
and timed with no communication; prints one JSON object.

    python bench/calibrate/parallel_host_ops.py [--layers 2 6] [--rounds 5] [--out parallel_host_ops.json]  # CPU

One process runs rank 0's program of a 2-rank job alone on a fake process group (every collective returns
at once: split_cost.py's setup), at a tiny width (d 32, 8 tokens) on CPU under bf16 autocast (kernels of
microseconds, so the step is the host's), for each layout at two depths: dp=2 (the plain block), tp=2
with and without sequence parallelism, and an MoE model (4 experts, top-2) at dp=2 and at ep=2. Per block
and micro-batch, from the two depths (the embedding, head, loss and optimizer drop out): the aten ops
(a TorchDispatchMode, as planner/time.py counts OPS_PER_BLOCK), how many of them are collectives (c10d
and functional collectives), and the median step's microseconds. Against its data-parallel twin, each
layout's extra ops and microseconds per collective it issues: what the eager step's host pays for a
tensor-parallel region or an expert exchange besides its kernels, which the planner prices as
gpu.host_collective_s per collective (fitted on GPU runs, where it also holds the ranks' skew) and the
collective's ops at host_op_s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common, planner_multi, planner_rows
from common import count_ops, emit  # noqa: E402  (it puts the checkout on the path)
from planner_multi import build_row  # noqa: E402
from planner_rows import COMMON  # noqa: E402

WORLD, MICRO = 2, 2
# a width at which every kernel costs the CPU next to nothing (moe_host_ops.py's idea): the step is the host's
TINY = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64", "model.seq_len=8",
        "model.vocab_size=64"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.capacity_factor=0"]
LAYOUTS = {"dp2": [], "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
           "tp2_no_sp": ["parallel.tp=2", "parallel.sequence_parallel=false"],
           "moe_dp2": MOE, "moe_ep2": [*MOE, "parallel.ep=2"]}
TWINS = {"tp2_sp": "dp2", "tp2_no_sp": "dp2", "moe_ep2": "moe_dp2"}  # each layout against its data-parallel twin


def launches_collective(func) -> bool:
    """Does this op launch a collective (c10d or functional; a functional collective's wait is an op of its own)?"""
    return func.namespace in ("c10d", "_c10d_functional", "c10d_functional") and "wait" not in func.__name__


def _sets(layout: list[str], layers: int) -> list[str]:
    """The layout at this depth, MICRO micro-batches of one sequence on every rank (tp=2 leaves dp=1)."""
    dp = 1 if "parallel.tp=2" in layout else WORLD
    return [*COMMON, "model.preset=llama-1b", f"model.n_layers={layers}", *TINY, "memory.precision=bf16",
            "train.device=cpu", f"train.global_batch={dp * MICRO}", "train.micro_batch=1", *layout]


def depth(layers: int, rounds: int, steps: int, runtimes: dict) -> dict:
    """Per layout at this depth: ops, collectives and the median step (us), the layouts interleaved."""
    built = {}
    for name, layout in LAYOUTS.items():
        *_, step = build_row(_sets(layout, layers), 120, torch.device("cpu"), runtimes)
        for _ in range(2):
            step()
        built[name] = (step, *count_ops(step, launches_collective))
    times = {name: [] for name in built}
    for _ in range(rounds):
        for name, (step, _, _) in built.items():
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
    return {name: {"ops": ops, "collectives": coll, "step_us": statistics.median(times[name]) * 1e6}
            for name, (_, ops, coll) in built.items()}


def per_block(a: dict, b: dict, blocks: float) -> dict:
    """The slope between two depths' rows, per block and micro-batch."""
    return {k: (b[k] - a[k]) / blocks / MICRO for k in ("ops", "collectives", "step_us")}


def measure(layers: list[int], rounds: int, steps: int) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.update(RANK="0", WORLD_SIZE=str(WORLD), LOCAL_RANK="0")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    torch.set_num_threads(1)
    runtimes: dict = {}
    rows = {n: depth(n, rounds, steps, runtimes) for n in layers}
    lo, hi = rows[layers[0]], rows[layers[-1]]
    slopes = {name: per_block(lo[name], hi[name], layers[-1] - layers[0]) for name in LAYOUTS}
    extra = {}
    for name, twin in TWINS.items():
        s, t = slopes[name], slopes[twin]
        coll = s["collectives"] - t["collectives"]
        extra[name] = {"ops": s["ops"] - t["ops"], "collectives": coll, "us": s["step_us"] - t["step_us"],
                       "us_per_collective": (s["step_us"] - t["step_us"]) / coll if coll else None,
                       "ops_per_collective": (s["ops"] - t["ops"]) / coll if coll else None}
    return {"bench": "parallel_host_ops", "torch": torch.__version__, "device": "cpu (one thread, fake process group)",
            "layers": layers, "micro_batches": MICRO, "depths": rows, "per_block_micro_batch": slopes,
            "beyond_data_parallel": extra,
            "us_per_op_dp2": slopes["dp2"]["step_us"] / slopes["dp2"]["ops"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs=2, default=[2, 6], help="two depths (blocks)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps of each layout a round")
    ap.add_argument("--out")
    args = ap.parse_args()
    emit(measure(args.layers, args.rounds, args.steps), args.out)


if __name__ == "__main__":
    main()
