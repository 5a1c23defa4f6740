"""The planner against recorded GPU measurements: `bench/planner_validate.py --gpus N` runs (28 layouts at 4
GPUs, 27 at 2; torch 2.11) recomputed here with today's planner and the terms each run measured. A change to
the memory or time model that loses a row the model now predicts within the planner's aims (peak memory 5%,
step time 15%) fails here; the counts are what the model reached (docs/planner.md has the table), fit rows
and held-out rows apart. Runs are named by machine and date (tests/fixtures/planner_runs/, and the newest
run of each machine in bench/results/)."""

import functools
import json
from pathlib import Path

import pytest

from teratrain.planner.refit import _prepared, result_gpu
from teratrain.planner.search import evaluate

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
RUNS = ROOT / "tests" / "fixtures" / "planner_runs"
TARGET = {"peak": 0.05, "step": 0.15}
# The first 4 x H200 run: (fit rows, held-out rows) within the target, of (15, 13) (peak: of (9, 8), without
# the pipelines that ran the old gradient buffer, below).
H200X4 = RUNS / "h200x4_2026-11-26.json"
REACHED = {"peak": (9, 7), "step": (12, 11)}  # step: without BEFORE_ZB_REWRITE's two rows
# The same 28 layouts on 4 x H100 (after the refit from the H200 rows: every row out of sample for the
# card). Its ZB-H1 rows ran after ZB-H1's memory change but before the head's weight gradient moved into I
# (parallel/pipeline/stage.py `early_weights`) and the received activation was freed at I: the planner,
# which counts both, is 6.7% and 2.5% under them (counting the code those rows ran, 1.9% and 1.0% under;
# +25.4% and +4.3% before it counted what W waits with). Its tp rows ran on a host faster than the fitted
# per-collective cost (+20-28%).
# MOE_SHARE_MOVES: since an MoE layer's own ops cost the host MOE_HOST_OP_SHARE (1.35) of a dense op
# (planner/time.py, fitted on the MoE fit rows of the runs below), 10 MoE steps came within 15% (6 of them
# moe tp2, under in 14 of the 15 runs, -12.5% on average before) and 5 left it: moe dp2 ep1 in
# h100x2_2026-11-28_2 (+14.4 -> +21.4%) and h200x2_2026-11-28 (+9.6 -> +17.5%), moe tp2 dp2 ep2 in
# h100x4_2026-11-27 (+11.8 -> +16.4%), moe dp4 ep4 zero1 in h100x4_2026-11-28_1 (+9.1 -> +19.2%) and moe
# dp2 ep2 zero1 in h200x2_2026-11-27_1 (+12.5 -> +20.2%). Three floors moved down (h200x2_2026-11-27_1 had a
# row to spare), and those of the runs that gained rows up; over every run 526 -> 531 of 601 steps within
# 15%, the held-out MoE rows 33 -> 37 of 44.
H100X4 = RUNS / "h100x4_2026-11-27.json"
REACHED_H100X4 = {"peak": (9, 7), "step": (12, 9)}  # MoE host share: see MOE_SHARE_MOVES
# The first H200 run's ZB-H1 rows ran the weight pass before it became one autograd call plus B's own
# weight kernels (parallel/pipeline/weight_rules.py): code that no longer exists, so their step times are
# not compared (their memory is).
BEFORE_ZB_REWRITE = {"pp4 zb-h1 m8", "pp2 tp2 zb-h1 m8"}
# 27 layouts of `bench/planner_validate.py --gpus 2` on 2 x H200 (this planner never fitted to them)
H200X2 = RUNS / "h200x2_2026-11-27_1.json"
REACHED_H200X2 = {"peak": (9, 5), "step": (12, 9)}
# Offload steps since the planner counts the host's cast of the masters (planner/time.py `_offload_s`,
# at twice the measured AdamW rate where a run did not measure the cast): 4 x H200 -28% -> -4%, the
# older 4 x H200 run -38% -> -18%, 4 x H100 -42% -> -25%, but 2 x H200 -9% -> +27% (its held-out
# offload row leaves the step count). The runs disagree on the host's speed; bench/machine.py now
# measures the cast on each machine (host_cast_params_per_s).
# Pipelines at dp = 1 (zero 0) in the three files above ran with a flat gradient buffer the
# data-parallel engine has since stopped keeping where nothing reduces it (parallel/data.py): the
# planner now counts no gradients until a rank's first backward (GPipe; 1F1B's first rank at m = p).
# Their memory is compared instead with rows measured after the change: the same 28 layouts again on
# 4 x H200 (PIPELINE_MEMORY_RUN, which also ran the planner's two later memory rules: the gradients'
# first backward and the experts' stacked weights in bf16) and the pipeline bench's
# (test_pipeline_bench_peaks_after_the_gradient_change).
# Held-out step floors 12 -> 11 for h200x4_2026-11-27_1 and _2 since the planner charges ZB-H1's split
# backward its host ops (time.OPS_SPLIT_EXTRA): their pp2 tp2 zb-h1 m8 rows, 4 blocks a stage, took 1.00x
# and 1.06x twice their 1F1B step at m = 4 (271 and 313 ms against 2 x 136 and 2 x 148), now +15.1% and
# +21.5% over; the same row measured 1.13x and 1.30x 1F1B's rate in h100x4_2026-11-28_2 and h200x4_2026-11-28
# (-14.6% and -17.6% now, -30.8% and -29.1% before), and one stage's program alone on an H200 host ran
# 1.25-1.28x at 4 blocks (bench/calibrate/split_cost.py). Over the six recorded 4-GPU runs the row's mean
# error went from -10.4% to +3.6% (root mean square 17.9% to 15.2%), but it is within 15% in 3 of the 6
# runs against 4.
PIPELINE_MEMORY_RUN = RUNS / "h200x4_2026-11-27_1.json"
PIPELINE = RESULTS / "h200x2" / "2026-11-27_pipeline.json"


# Each machine's newest run is in bench/results (bench/README.md shows it); the rest are test fixtures.
NEWEST = {"h200x4_2026-11-28": RESULTS / "h200x4" / "2026-11-28_planner_validate.json",
          "h200x2_2026-11-28": RESULTS / "h200x2" / "2026-11-28_planner_validate.json"}


def path_of(stem: str) -> Path:
    return NEWEST.get(stem, RUNS / f"{stem}.json")


def _run(sizes: tuple, peak: tuple, step: tuple) -> tuple:
    """((fit rows, held-out rows) measured, {"peak": reached, "step": reached})."""
    return sizes, {"peak": peak, "step": step}


# Every later run, by machine and date (a same-day run's number orders it within the day).
LATER = {
    # 4 x H200, the 28 layouts with the later memory rules (PIPELINE_MEMORY_RUN)
    "h200x4_2026-11-27_1": _run((15, 13), (15, 13), (14, 12)),  # 12 again: MOE_SHARE_MOVES
    # 4 x H200 again, with later planner and engine changes: every peak within 5%; the step misses are
    # dp4 zero2/zero3 (-17%, -19%), the offload row (-16%) and the three eager MoE rows (-24..-30%), all
    # measured slower than the run before (dp4 zero1 96 against 83 ms, moe dp4 ep4 88 against 53). The
    # two runs' code, measured in one job at 4x the layers, agreed within 8% (dp4 zero1 294 and 291 ms,
    # moe dp4 ep4 zero1 217 and 200); the 8-layer shapes, which the host paces, were not compared in one
    # job. Held out 12 -> 11: see OPS_SPLIT_EXTRA above.
    "h200x4_2026-11-27_2": _run((15, 13), (15, 13), (14, 11)),
    # 4 x H100 (the host probe fitted on each run): the 28 layouts at 4 GPUs (8 layers) and the 27 at 2 GPUs
    # of the same machine (16 layers). 4 GPUs: steps out on three held-out rows (dp4 zero2 offload -25.6%,
    # tp2 dp2 zero3 -26.5%, moe tp2 dp2 ep2 -15.1%), one held-out peak (moe dp4 ep4 zero1 -5.7%); 2 GPUs:
    # two eager tp rows the host paces over (+21.9%, +21.0%) and moe dp2 ep1 under (-23.7%, under in every
    # recorded run).
    # Since the planner charges the data-parallel engines' launches to the host (planner/time.py
    # DP_LAUNCH_SHARE), the counts rose where eager MoE, ZeRO-2/3 and dp rows missed: h200x4_2026-11-27_2
    # 22 -> 25 of 28, h200x2_2026-11-27_5 26 -> 27 of 27, the first H200 run 20 -> 23 of 26,
    # h100x4_2026-11-28_1 25 -> 26 of 28 (4 GPUs) and h100x2_2026-11-28_1 24 -> 25 of 27 (2 GPUs); none fell.
    "h100x4_2026-11-28_1": _run((15, 13), (15, 12), (15, 10)),  # MOE_SHARE_MOVES
    "h100x2_2026-11-28_1": _run((15, 12), (15, 12), (13, 12)),
    # Two other 4 x H100 machines, the same commands: every peak within 5% but moe dp4 ep4 zero1 (-5.3%, as
    # above). The steps move with the host probe's fit (a tp collective 0.16 ms and a dp launch 0 ms at 4
    # GPUs, against 0.23 ms and unmeasured before): the tp2 rows at 4 GPUs are 21-31% under where the runs
    # above were within 15% but one, and the offload rows ran the host step on 16 CPU threads a rank (32 at 2
    # GPUs) with host rates measured on 50M parameters, 1.8x and 2.6x the rates at a shard's size
    # (bench/machine.py HOST_NUMEL since).
    "h100x4_2026-11-28_2": _run((15, 13), (15, 12), (13, 10)),  # ZB-H1 x tp within 15% since OPS_SPLIT_EXTRA
    "h100x2_2026-11-28_2": _run((15, 12), (15, 12), (13, 9)),  # MOE_SHARE_MOVES
    # 2 x H200 (32 layers), `--gpus 2` twice: the probe's two passes (both runs) and the second visit of
    # host-paced rows (the second run, `visits_s`). Every peak within 5%; the step misses are the eager tp
    # and MoE-with-tp rows, whose host-paced steps moved up to 1.4x between the runs (tp2 all-gather 621 and
    # 433 ms), and the offload row in the first (-16.1%, -8.5% in the second); the first's dp2 zero1 (+15.0%
    # then) is within 15% since the H200's per-op share.
    "h200x2_2026-11-28_1": _run((15, 12), (15, 12), (14, 10)),
    "h200x2_2026-11-28_2": _run((15, 12), (15, 12), (13, 10)),
    # 2 x H200, two machines, each run with two relaunches (bench/planner_multi.py: the host probe and the
    # host-paced rows again in fresh processes, the fastest kept on both sides). The first: every peak and
    # every step within target (moe tp2 -11%, since the MoE overhead is not split by tp). The second: tp2
    # megatron+sp +26.6% (its fastest of 4 visits, 275 ms, came from a relaunch; the others took 331-359),
    # moe dp2 ep1 +20.4% (164 ms at its first visit, 185-194 after), moe tp2 -17.6%.
    "h200x2_2026-11-28_3": _run((15, 12), (15, 12), (15, 12)),
    "h200x2_2026-11-28_4": _run((15, 12), (15, 12), (13, 12)),
    # 4 x H200, 32 layers, one relaunch: every fit row's step within 15%; held out, tp4 all-gather +18.1% and
    # tp2 dp2 zero3 +17.3% (their fastest visits), pp2 tp2 zb-h1 m8 -29.1% (-29..-31% on every 4-GPU run:
    # ZB-H1 with tp is slower than its host and GPU terms say), moe tp2 dp2 ep2 -21.7%, the offload row
    # -15.0%; one peak out, moe dp4 ep4 zero1 -5.1% (random routing)
    "h200x4_2026-11-28": _run((15, 13), (15, 12), (15, 8)),
    # 2 x H200, two relaunches, the trainer's garbage-collector policy in every row (teratrain/collector.py):
    # every peak within 5%; steps out: tp2 all-gather +16.7%, tp2 all-reduce +27.3% (their four visits
    # 481-565 and 441-589 ms; this machine's probe fitted 0.39 ms a tp collective, the two before 0.25-0.32),
    # moe dp2 ep1 -15.1% (under in every run)
    "h200x2_2026-11-28_5": _run((15, 12), (15, 12), (14, 11)),
    # 2 x H200, two relaunches, with the collector freeing each finished run's model (a run that froze its
    # model never unfroze it: an earlier run's rows kept every model and ran out of memory): every peak
    # within 5%, every fit row's step within 15%; out: moe tp2 -20.5% (its four visits 331-414 ms)
    "h200x2_2026-11-28": _run((15, 12), (15, 12), (14, 12)),  # MOE_SHARE_MOVES
    # and again at 8 layers, one relaunch; out: tp2 megatron+sp +15.8% (visits 81-107 ms), moe tp2 -16.6%
    # (76-101 ms; -11.3% since MOE_HOST_OP_SHARE)
    "h200x2_2026-11-28_6": _run((15, 12), (15, 12), (14, 12)),
    # The 27 layouts of --gpus 2 measured four times on 2 x H200 (three 16-layer runs, _2, _3 and _5, and
    # one of 8 layers, _4), the later three with the host probe (refit.fit_host) and the first two before
    # the planner counted the engines' own buckets and the loss's pass over the logits. Every peak within 5%
    # in all four. The step misses are host-paced rows: tp2 megatron measured 150, 187 and 183 ms in the
    # three 16-layer runs, moe dp2 ep2 146, 87 and 113 ms, where every pipeline row stayed within 2%; moe
    # dp2 ep1 is 15-18% under in every run. _6: the same 27 layouts once more after the data-parallel
    # engine stopped waiting mid-backward for in-place reductions (parallel/data.py): moe dp2 ep1 -10.5%;
    # the misses are two eager tp rows (-18%) and the offload row (+21%). Since the planner stopped counting
    # the clip's own pass over the gradients (now inside fused AdamW, 4 bytes a parameter less), which these
    # runs' code still made, _2's held-out `tp2 sp mb4 selective` went from -14.8% to -15.1%, out by 0.3
    # points, so that run reaches 10 held-out rows, not 11. Since the H200's per-op cost became 0.85 of the
    # H100's (planner/hardware.py H200_OP_SHARE), _3's moe dp2 ep1 (-16.4%) and _4's tp2 sp mb4 selective
    # (-16.8%), host-paced rows measured once in one launch, are out, and 5 rows in other H200 runs came in.
    **{stem: _run((15, 12), (15, 12), step)
       for stem, step in (("h200x2_2026-11-27_2", (12, 11)), ("h200x2_2026-11-27_3", (12, 10)),
                          ("h200x2_2026-11-27_5", (15, 12)), ("h200x2_2026-11-27_4", (14, 11)),
                          ("h200x2_2026-11-27_6", (14, 10)))},
}
BEFORE_BUFFER_CHANGE = (H200X4, H100X4, H200X2)


def ran_gradient_buffer(path: Path, lay) -> bool:
    return path in BEFORE_BUFFER_CHANGE and lay.dp == 1 and lay.zero == 0 and lay.pp > 1


def ran_gathered_inputs(lay, train) -> bool:
    """Every recorded run's column-parallel linears kept their gathered input whole under sequence
    parallelism (now they keep the sequence shard: parallel/comm.py Regather), so those rows' measured
    peaks are not this code's; every such row was within the peak target before, so it leaves both the
    count and the target (a GPU run of the same layouts brings them back)."""
    return lay.tp > 1 and lay.sequence_parallel and lay.tp_form == "megatron" and train.fp8 == "none"


@functools.cache
def _errors(path: Path) -> list[dict]:
    result = json.loads(path.read_text())
    gpu = result_gpu(result)
    out = []
    for shape, train, lay, row in _prepared(result):
        cand = evaluate(shape, train, lay, gpu)
        out.append({"name": row["name"], "held_out": row["held_out"], "old_buffer": ran_gradient_buffer(path, lay),
                    "gathered_inputs": ran_gathered_inputs(lay, train),
                    "peak": cand.memory.peak_allocated / 2**30 / row["measured_peak_gib"] - 1,
                    "step": cand.time.step_time_s / row["measured_step_s"] - 1})
    return out


@pytest.mark.parametrize("what", ["peak", "step"])
@pytest.mark.parametrize("run", ["h200x4_2026-11-26", "h100x4_2026-11-27", "h200x2_2026-11-27_1", *LATER])
def test_recorded_rows_stay_within_the_targets(what, run):
    path, reached, sizes = {"h200x4_2026-11-26": (H200X4, REACHED, (15, 13)),
                            "h100x4_2026-11-27": (H100X4, REACHED_H100X4, (15, 13)),
                            "h200x2_2026-11-27_1": (H200X2, REACHED_H200X2, (15, 12)),
                            **{k: (path_of(k), reached, sizes) for k, (sizes, reached) in LATER.items()}}[run]
    rows = _errors(path)
    if path == H200X4 and what == "step":
        rows = [e for e in rows if e["name"] not in BEFORE_ZB_REWRITE]
        sizes = (14, 12)
    if what == "peak":
        sizes = tuple(n - sum(e["old_buffer"] and e["held_out"] == held for e in rows)
                      for n, held in zip(sizes, (False, True)))
        rows = [e for e in rows if not e["old_buffer"]]
        gone = tuple(sum(e["gathered_inputs"] and e["held_out"] == held for e in rows) for held in (False, True))
        sizes = tuple(n - k for n, k in zip(sizes, gone))
        reached = {**reached, "peak": tuple(n - k for n, k in zip(reached["peak"], gone))}
        rows = [e for e in rows if not e["gathered_inputs"]]
    fit = [e for e in rows if not e["held_out"]]
    held = [e for e in rows if e["held_out"]]
    assert (len(fit), len(held)) == sizes
    got = tuple(sum(abs(e[what]) <= TARGET[what] for e in group) for group in (fit, held))
    missed = {e["name"]: round(100 * e[what], 1) for e in rows if abs(e[what]) > TARGET[what]}
    assert got[0] >= reached[what][0] and got[1] >= reached[what][1], f"{what}: {got} within target; out: {missed}"


# each with the validation run of the same machine and date
PICKS = ["h200x2_2026-11-27_1", "h200x4_2026-11-26", "h100x4_2026-11-27", "h200x4_2026-11-27_1",
         "h200x2_2026-11-27_2", "h200x2_2026-11-27_3", "h200x2_2026-11-27_5", "h200x2_2026-11-27_6",
         "h200x4_2026-11-27_2", "h100x4_2026-11-28_1"]


@pytest.mark.parametrize("run", PICKS)
def test_recorded_pick_checks(run):
    """The pick checks' measured candidates (llama-1b and llama-8b, the planner's 6 best of their run)
    ranked by today's planner: the one it puts first is within 5% of the fastest measured (the planner's
    aim), on every recorded run: it guards the ranking against later changes. The h200x2_2026-11-27_2
    llama-8b check failed as run (ZeRO-3 with selective recompute picked, 1.062 of dp=1 x tp=2); over the
    same candidates the planner now puts ZeRO-3 without recompute first (1.048)."""
    from dataclasses import replace

    from teratrain.config import load_config
    from teratrain.planner.hardware import GPUS, hw_keys
    from teratrain.planner.inputs import layout_of, shape_of, training_of

    data = json.loads((RUNS / f"{run}_pick.json").read_text())
    gpu = replace(GPUS[data["gpu_preset"]], **{k: v for k, v in data["hw"].items() if k in set(hw_keys())})
    for model in data["models"]:
        timed = [c for c in model["candidates"] if "measured_step_s" in c]
        assert len(timed) >= 5, (run, model["model"])
        planned = []
        for c in timed:
            cfg = load_config(None, c["sets"])
            cand = evaluate(shape_of(cfg), training_of(cfg), layout_of(cfg, data["gpus"]), gpu)
            planned.append((cand.time.step_time_s, c["measured_step_s"]))
        first = planned[min(range(len(planned)), key=lambda i: planned[i][0])][1]  # ties: the run's order
        assert first <= 1.05 * min(m for _, m in planned), (run, model["model"], first, planned)


def test_pipeline_memory_follows_the_schedule():
    """Every pp=4 schedule's peak on 4 x H200 (PIPELINE_MEMORY_RUN) within 5%, 1F1B's at m = 4 within 2%:
    1F1B's first rank holds p micro-batches (planner/memory.py), and at m = p it holds them before its
    first backward, so before any gradient exists (7.01 GiB measured; 7.40 planned when every 1F1B was
    counted with its gradients, +5.6%)."""
    pipes = {e["name"]: e["peak"] for e in _errors(PIPELINE_MEMORY_RUN) if e["name"].startswith("pp4")}
    assert len(pipes) == 9 and max(abs(v) for v in pipes.values()) < 0.05, pipes
    assert abs(pipes["pp4 1f1b m4"]) < 0.02, pipes["pp4 1f1b m4"]


def test_pipeline_bench_peaks_after_the_gradient_change():
    """bench/pipeline.py's 12 rows on 2 H200s (GPipe, 1F1B, interleaved 1F1B, ZB-H1 at m = 4, 8, 16;
    20 llama-1b-width layers), measured after the data-parallel engine stopped keeping gradients
    nothing reduces: the planner's peak of each within 1% (GPipe's was 2-7% over with the buffer
    counted; every row within 0.7% now)."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from pipeline import GIB, _layout, model_sets  # bench/pipeline.py: the configs it measured

    from teratrain.config import load_config
    from teratrain.planner.hardware import GPUS
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.memory import plan_memory

    result = json.loads(PIPELINE.read_text())
    layers, mb = result["sizing"]["layers"], result["sizing"]["micro_batch"]
    errors = {}
    for row in result["schedules"]:
        cfg = load_config(None, model_sets(layers, mb, smoke=False) + _layout(row["schedule"], 2, row["m"], mb))
        planned = plan_memory(shape_of(cfg), training_of(cfg), layout_of(cfg, 2), GPUS["h200"]).peak_allocated
        errors[(row["schedule"], row["m"])] = planned / GIB / row["peak_gib"] - 1
    assert len(errors) == 12 and max(abs(e) for e in errors.values()) < 0.01, errors


@pytest.mark.parametrize("result, tp", [("h200x2/2026-11-27_tensor_parallel_graphed.json", 2),
                                        ("h200x4/2026-11-27_tensor_parallel_dtensor.json", 4)])
def test_graphed_step_times(result, tp):
    """Under CUDA graphs (train.compile_mode=reduce-overhead) the planner charges no host issue time:
    the step is the GPU's timeline. bench/tensor_parallel.py's graphed rows at the llama-8b width (one
    GPU, tp with and without SP; 2 and 4 H200s) within 15% of the planner (it is 0.4% to 9.7% over),
    where the eager model (host-bound at tp) is up to 79% over them."""
    from teratrain.config import load_config
    from teratrain.planner.hardware import GPUS
    from teratrain.planner.inputs import layout_of, shape_of, training_of

    shape = json.loads((RESULTS / result).read_text())["shapes"]["llama8b_width"]
    common = shape["shape"] + ["memory.precision=bf16", "train.grad_clip=1.0", "train.micro_batch=1",
                               "train.global_batch=1", "train.compile=true", "train.compile_mode=reduce-overhead"]
    rows = {"one_gpu_graphed": [], "ours_no_sp_graphed": [f"parallel.tp={tp}", "parallel.sequence_parallel=false"],
            "ours_sp_graphed": [f"parallel.tp={tp}", "parallel.sequence_parallel=true"]}
    errors = {}
    for name, sets in rows.items():
        cfg = load_config(None, common + sets)
        planned = evaluate(shape_of(cfg), training_of(cfg), layout_of(cfg, cfg.parallel.tp), GPUS["h200"])
        errors[name] = planned.time.step_time_s * 1e3 / shape[name]["step_ms"] - 1
    assert max(abs(e) for e in errors.values()) < TARGET["step"], errors


EAGER_TP = [("h200x2/2026-11-27_tensor_parallel_dtensor.json", 2),
            ("h200x2/2026-11-27_tensor_parallel_graphed.json", 2),
            ("h200x4/2026-11-27_tensor_parallel_dtensor.json", 4),
            ("h200x4/2026-11-27_tensor_parallel_chunked.json", 4)]


def test_eager_tp_step_times_at_the_8b_width():
    """bench/tensor_parallel.py's eager rows at the llama-8b width (one GPU, tp with and without SP;
    2 and 4 H200s, four runs): the planner within 15% on 10 of 11. The miss is tp=4 SP in the
    chunked-overlap run (+24%, 58.3 ms measured): the same row measured 63.6 ms in the other 4-GPU run
    (+14%), so runs differ by 9% there."""
    from teratrain.config import load_config
    from teratrain.planner.hardware import GPUS
    from teratrain.planner.inputs import layout_of, shape_of, training_of

    errors = {}
    for result, tp in EAGER_TP:
        shape = json.loads((RESULTS / result).read_text())["shapes"]["llama8b_width"]
        common = shape["shape"] + ["memory.precision=bf16", "train.grad_clip=1.0", "train.micro_batch=1",
                                   "train.global_batch=1"]
        rows = {"one_gpu": [], "ours_no_sp": [f"parallel.tp={tp}", "parallel.sequence_parallel=false"],
                "ours_sp": [f"parallel.tp={tp}", "parallel.sequence_parallel=true"]}
        for name, sets in rows.items():
            if name in shape:
                cfg = load_config(None, common + sets)
                planned = evaluate(shape_of(cfg), training_of(cfg), layout_of(cfg, cfg.parallel.tp), GPUS["h200"])
                errors[(result, name)] = planned.time.step_time_s * 1e3 / shape[name]["step_ms"] - 1
    assert len(errors) == 11
    assert sum(abs(e) <= TARGET["step"] for e in errors.values()) >= 10, errors


def test_validation_picture(tmp_path):
    """Smoke test of bench/planner_plot.py: it draws PIPELINE_MEMORY_RUN's rows against today's planner
    and counts the rows in each band as the tests above do."""
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from planner_plot import plot

    counts = plot(json.loads(PIPELINE_MEMORY_RUN.read_text()), tmp_path / "v.png")
    errors = _errors(PIPELINE_MEMORY_RUN)
    assert counts == {"rows": 28, **{f"{w}_within": sum(abs(e[w]) <= TARGET[w] for e in errors) for w in TARGET}}
    assert (tmp_path / "v.png").stat().st_size > 10_000
