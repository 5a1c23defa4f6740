"""planner/time.py FP8_HOST_OP_SHARE: the host's time per op of the float8 casts and GEMMs, in dense ops.

The host's time per aten op that memory.fp8 adds to a block against a dense block's; prints one JSON object.

    python bench/calibrate/fp8_host_ops.py [--rounds 15] [--out fp8_host_ops.json]     # CPU, ~20 s
    python bench/calibrate/fp8_host_ops.py --fit [--write]      # the constant from recorded GPU runs

One Llama block at a width where every kernel costs next to nothing (d 16, 8 tokens; moe_host_ops.py's block
and timing), forward and backward under bf16 autocast over fp32 weights, its linears in bf16 and in tensorwise
float8 (memory/fp8.py Fp8Linear through torchao's emulation, which issues the ops a GPU's float8 path issues:
planner/time.py OPS_FP8_LINEAR), timed in interleaved rounds of 50 steps on one CPU thread; the ops are counted with a
dispatch mode. Eager, each float8 op passes through torchao's tensor subclass and its Python casts, so it
costs the host more than a dense op; the planner prices memory.fp8's ops (planner/time.py fp8_ops) at
`extra_op_share` of the host's cost per dense op (host_op_s): (float8 block - dense block) seconds per
extra op over the dense block's seconds per op, at the fastest round of each. CPU only: on a GPU host
each op also pays its kernel launch, which both kinds share.

`--fit`: the share at which the planner's eager fp8 step equals the recorded one-H200 run FIT (bench/fp8.py,
llama-8b width, 8 layers, seq 4096, one micro-batch), and the planner against the held-out run HELD_OUT
(4 layers, seq 2048, two micro-batches, the weights cast once a step); `--write` writes the share into
planner/calibration/common.toml. Both runs' bf16 rows are planned too: the bf16 step is the same code
without the float8 ops, so its error is what the share cannot mend.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/calibrate: moe_host_ops
import moe_host_ops  # noqa: E402  (the same block, timing and share)
from common import emit, weights_set  # noqa: E402  (it puts the checkout on the path)
from fp8 import WIDTH_8B  # noqa: E402  (bench/fp8.py: the recorded runs' shape)

from teratrain.config import load_config  # noqa: E402
from teratrain.memory.fp8 import Fp8Gemm, Fp8Linear  # noqa: E402


def block_step(recipe: str):
    """A forward and backward of one block with its linears in `recipe` ("none": bf16 autocast), and the
    aten ops it issues."""
    def to_fp8(block):
        gemm = Fp8Gemm(recipe, emulate=True)
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    setattr(parent, name, Fp8Linear(child, gemm))

    return moe_host_ops.block_step([], None if recipe == "none" else to_fp8)


def measure(rounds: int = 15, calls: int = 50, recipe: str = "tensorwise") -> dict:
    steps = {"bf16": lambda: block_step("none"), "fp8": lambda: block_step(recipe)}
    return {"bench": "fp8_host_ops", "recipe": recipe, **moe_host_ops.compare(steps, rounds, calls)}


RESULTS = Path(__file__).resolve().parents[1] / "results" / "h200"
FIT, HELD_OUT = "2026-12-02_fp8_modes.json", "2026-12-03_compiled_gradients_at_once.json"
RUN = [*WIDTH_8B, "memory.precision=bf16", "train.grad_clip=1.0"]  # as bench/fp8.py's rows ran


def _recorded(file: str, fp8: str):
    """(shape, training as the run ran, layout, measured eager step s) of `file`'s teratrain eager row."""
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.refit import as_ran

    result = json.loads((RESULTS / file).read_text())
    row = next(r for r in result["results"] if (r["impl"], r["mode"], r["fp8"]) == ("ours", "eager", fp8))
    mb, accum = result["micro_batch"], result.get("accumulation", 1)
    cfg = load_config(None, [*RUN, f"model.n_layers={result['n_layers']}", f"model.seq_len={result['seq_len']}",
                             f"train.micro_batch={mb}", f"train.global_batch={mb * accum}", f"memory.fp8={fp8}",
                             weights_set(result.get("weights", "fp32")), "parallel.dp=1"])
    return shape_of(cfg), as_ran(training_of(cfg), result), layout_of(cfg, 1), row["step_ms"] / 1e3


def _planned_s(recorded, share: float) -> float:
    from teratrain.planner import time as planner_time
    from teratrain.planner.hardware import GPUS
    from teratrain.planner.search import evaluate

    shape, train, lay, _ = recorded
    kept, planner_time.FP8_HOST_OP_SHARE = planner_time.FP8_HOST_OP_SHARE, share
    try:
        return evaluate(shape, train, lay, GPUS["h200"]).time.step_time_s
    finally:
        planner_time.FP8_HOST_OP_SHARE = kept


def fit() -> dict:
    """The share that puts the planned eager fp8 step of FIT on its measured one (bisection: the step grows
    with the share), and the errors it leaves on FIT and HELD_OUT, fp8 and bf16."""
    runs = {(f, r): _recorded(f, r) for f in (FIT, HELD_OUT) for r in ("tensorwise", "none")}
    target = runs[FIT, "tensorwise"]
    lo, hi = 1.0, 50.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _planned_s(target, mid) < target[3] else (lo, mid)
    share = round((lo + hi) / 2, 2)
    errors = {f"{'fit' if f == FIT else 'held out'} {f[:10]} {'bf16' if r == 'none' else 'fp8'}":
              round(_planned_s(run, share) / run[3] - 1, 4) for (f, r), run in runs.items()}
    return {"bench": "fp8_host_ops_fit", "fit": FIT, "held_out": HELD_OUT, "fp8_host_op_share": share,
            "step_errors": errors}


def write(result: dict) -> None:
    from teratrain.planner.refit import write_calibration

    errors = result["step_errors"]
    write_calibration("common", {"fp8_host_op_share": {
        "value": result["fp8_host_op_share"],
        "source": "bench/calibrate/fp8_host_ops.py --fit (the eager fp8 step of the fit run planned equal to its "
                  "measured one); on one CPU, before any kernel launch, the same script measures the float8 ops' "
                  "host cost in dense ops (extra_op_share of bench/results/cpu/2026-12-04_fp8_host_ops.json)",
        "runs": [f"bench/results/h200/{FIT}", f"held out: bench/results/h200/{HELD_OUT}"],
        "fit_error": "; ".join(f"{k} {v:+.1%}" for k, v in errors.items())}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--recipe", choices=("tensorwise", "rowwise"), default="tensorwise")
    ap.add_argument("--fit", action="store_true", help="fit the share on the recorded GPU runs instead")
    ap.add_argument("--write", action="store_true", help="with --fit: write it into calibration/common.toml")
    ap.add_argument("--out")
    args = ap.parse_args()
    result = fit() if args.fit else measure(args.rounds, recipe=args.recipe)
    if args.fit and args.write:
        write(result)
    emit(result, args.out)


if __name__ == "__main__":
    main()
