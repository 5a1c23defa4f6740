"""The planner against recorded GPU measurements: bench/results/planner_validate_h200x4.json (28
layouts of `bench/planner_validate.py --gpus 4` on 4 x H200, torch 2.11) recomputed here with today's
planner and the terms that run measured. A change to the memory or time model that loses a row the
model now predicts within issue 24's targets (peak memory 5%, step time 15%) fails here; the counts
are what the model reached (docs/planner.md has the table), fit rows and held-out rows apart."""

import functools
import json
from pathlib import Path

import pytest

from teratrain.planner.refit import _prepared, result_gpu
from teratrain.planner.search import evaluate

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
RESULT = RESULTS / "planner_validate_h200x4.json"
# (fit rows, held-out rows) within the target, of (15, 13) (peak: of (9, 8), without the pipelines that
# ran the old gradient buffer, below).
REACHED = {"peak": (9, 7), "step": (12, 11)}  # step: without BEFORE_ZB_REWRITE's two rows
TARGET = {"peak": 0.05, "step": 0.15}
# The same 28 layouts on 4 x H100 (the next session, after the refit from the H200 rows: every row out
# of sample for the card). Its ZB-H1 rows ran after ZB-H1's memory change but before the head's weight
# gradient moved into I (parallel/pipeline/stage.py `early_weights`) and the received activation was
# freed at I: the planner, which counts both, is 6.7% and 2.5% under them (counting the code those rows
# ran, 1.9% and 1.0% under; +25.4% and +4.3% before it counted what W waits with). Its tp rows ran on a
# host faster than the fitted per-collective cost (+20-28%).
# MOE_SHARE_MOVES: since an MoE layer's own ops cost the host MOE_HOST_OP_SHARE (1.35) of a dense op
# (planner/time.py, fitted on the MoE fit rows of the runs below, session 17), 10 MoE steps came within
# 15% (6 of them moe tp2, under in 14 of the 15 runs, -12.5% on average before) and 5 left it: moe dp2
# ep1 in h100x2-session13 (+14.4 -> +21.4%) and h200x2-session17 (+9.6 -> +17.5%), moe tp2 dp2 ep2 in
# the first 4 x H100 run (+11.8 -> +16.4%), moe dp4 ep4 zero1 in h100x4-session12 (+9.1 -> +19.2%) and
# moe dp2 ep2 zero1 in the first 2 x H200 run (+12.5 -> +20.2%). Three floors moved down (the first
# 2 x H200 run had a row to spare), and those of the runs that gained rows up; over every run 526
# -> 531 of 601 steps within 15%, the held-out MoE rows 33 -> 37 of 44.
H100 = RESULTS / "planner_validate_h100x4.json"
REACHED_H100 = {"peak": (9, 7), "step": (12, 9)}  # MoE host share: see MOE_SHARE_MOVES
# The H200 rows of ZB-H1 ran the weight pass before it became one autograd call plus B's own weight
# kernels (parallel/pipeline/weight_rules.py): code that no longer exists, so their step times are not
# compared (their memory is).
BEFORE_ZB_REWRITE = {"pp4 zb-h1 m8", "pp2 tp2 zb-h1 m8"}
# 27 layouts of `bench/planner_validate.py --gpus 2` on 2 x H200 (this planner never fitted to them)
H200X2 = RESULTS / "planner_validate_h200x2.json"
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
# 4 x H200 (SESSION6, which also ran the planner's two later memory rules: the gradients' first
# backward and the experts' stacked weights in bf16) and the pipeline bench's
# (test_pipeline_bench_peaks_after_the_gradient_change).
SESSION6 = RESULTS / "planner_validate_h200x4_session6.json"
# Held-out step floors 12 -> 11 for session 6 and 9 since the planner charges ZB-H1's split backward its
# host ops (time.OPS_SPLIT_EXTRA, session 16): their pp2 tp2 zb-h1 m8 rows, 4 blocks a stage, took 1.00x
# and 1.06x twice their 1F1B step at m = 4 (271 and 313 ms against 2 x 136 and 2 x 148), now +15.1% and
# +21.5% over; the same row measured 1.13x and 1.30x 1F1B's rate in sessions 13 and 15 (-14.6% and
# -17.6% now, -30.8% and -29.1% before), and one stage's program alone on an H200 host ran 1.25-1.28x
# at 4 blocks (bench/split_cost.py). Over the six recorded 4-GPU runs the row's mean error went from
# -10.4% to +3.6% (root mean square 17.9% to 15.2%), but it is within 15% in 3 of the 6 runs against 4.
REACHED_SESSION6 = {"peak": (15, 13), "step": (14, 12)}  # 12 again: MOE_SHARE_MOVES
# The same 28 layouts on 4 x H200 in session 9, with sessions 7 and 8's planner and engine changes:
# every peak within 5%; the step misses are dp4 zero2/zero3 (-17%, -19%), the offload row (-16%) and the
# three eager MoE rows (-24..-30%), all measured slower than session 6 (dp4 zero1 96 against 83 ms,
# moe dp4 ep4 88 against 53). Session 6's code and today's, measured in one job at 4x the layers
# (planner_ab_session6_code_zero1_h200x4.json, planner_ab_session9_code_zero1_h200x4.json), agree within
# 8% (dp4 zero1 294 and 291 ms, moe dp4 ep4 zero1 217 and 200); the 8-layer shapes, which the host
# paces, were not compared in one job.
SESSION9 = RESULTS / "planner_validate_h200x4_session9.json"
REACHED_SESSION9 = {"peak": (15, 13), "step": (14, 11)}  # held out 12 -> 11: see REACHED_SESSION6
PIPELINE = RESULTS / "pipeline_h200x2of4_median3.json"
# Session 12, on 4 x H100 (the card's first runs since session 5's; the host probe fitted on each): the
# 28 layouts at 4 GPUs (8 layers) and the 27 at 2 GPUs of the same machine (16 layers). 4 GPUs: steps
# out on three held-out rows (dp4 zero2 offload -25.6%, tp2 dp2 zero3 -26.5%, moe tp2 dp2 ep2 -15.1%),
# one held-out peak (moe dp4 ep4 zero1 -5.7%); 2 GPUs: two eager tp rows the host paces over (+21.9%,
# +21.0%) and moe dp2 ep1 under (-23.7%, under in every recorded run).
# Since the planner charges the data-parallel engines' launches to the host (planner/time.py
# DP_LAUNCH_SHARE), the counts above rose where eager MoE, ZeRO-2/3 and dp rows missed: session 9's
# 4 x H200 run 22 -> 25 of 28, session 7d's 2 x H200 run 26 -> 27 of 27, the H200 run 20 -> 23 of 26,
# session 12's 25 -> 26 of 28 (4 GPUs) and 24 -> 25 of 27 (2 GPUs); none fell.
SESSION12 = {"h100x4-session12": (RESULTS / "planner_validate_h100x4_session12.json", (15, 13),
                                  {"peak": (15, 12), "step": (15, 10)}),  # MOE_SHARE_MOVES
             "h100x2-session12": (RESULTS / "planner_validate_h100x2of4_session12.json", (15, 12),
                                  {"peak": (15, 12), "step": (13, 12)})}
# Session 13, on two other 4 x H100 machines (a fresh one per call), the same commands: every peak within 5%
# but moe dp4 ep4 zero1 (-5.3%, as in session 12). The steps move with the host probe's fit (a tp
# collective 0.16 ms and a dp launch 0 ms at 4 GPUs, against 0.23 ms and unmeasured in session 12): the
# tp2 rows at 4 GPUs are 21-31% under where session 12's were within 15% but one, and the offload rows ran
# the host step on 16 CPU threads a rank (32 at 2 GPUs) with host rates measured on 50M parameters, 1.8x
# and 2.6x the rates at a shard's size (bench/machine.py HOST_NUMEL since).
SESSION13 = {"h100x4-session13": (RESULTS / "planner_validate_h100x4_session13.json", (15, 13),  # ZB-H1 x tp
                                  {"peak": (15, 12), "step": (13, 10)}),  # within 15% since OPS_SPLIT_EXTRA
             "h100x2-session13": (RESULTS / "planner_validate_h100x2of4_session13.json", (15, 12),
                                  {"peak": (15, 12), "step": (13, 9)})}  # MOE_SHARE_MOVES
# Session 14, on 2 x H200 (fresh machines, 32 layers), `--gpus 2` twice: the probe's two passes (both runs)
# and the second visit of host-paced rows (the second run, `visits_s`). Every peak within 5%; the step
# misses are the eager tp and MoE-with-tp rows, whose host-paced steps moved up to 1.4x between the runs
# (tp2 all-gather 621 and 433 ms), and the offload row in the first (-16.1%, -8.5% in the second); the
# first's dp2 zero1 (+15.0% then) is within 15% since the H200's per-op share (session 15).
SESSION14 = {"h200x2-session14": (RESULTS / "planner_validate_h200x2_session14.json", (15, 12),
                                  {"peak": (15, 12), "step": (14, 10)}),
             "h200x2-session14b": (RESULTS / "planner_validate_h200x2_session14b.json", (15, 12),
                                   {"peak": (15, 12), "step": (13, 10)}),
             # Session 15, 2 x H200, two machines, each run with two relaunches (bench/planner_multi.py: the
             # host probe and the host-paced rows again in fresh processes, the fastest kept on both sides).
             # The first: every peak and every step within target (moe tp2 -11%, since the MoE overhead is
             # not split by tp). The second: tp2 megatron+sp +26.6% (its fastest of 4 visits, 275 ms, came
             # from a relaunch; the others took 331-359), moe dp2 ep1 +20.4% (164 ms at its first visit,
             # 185-194 after), moe tp2 -17.6%.
             "h200x2-session15": (RESULTS / "planner_validate_h200x2_session15.json", (15, 12),
                                  {"peak": (15, 12), "step": (15, 12)}),
             "h200x2-session15b": (RESULTS / "planner_validate_h200x2_session15b.json", (15, 12),
                                   {"peak": (15, 12), "step": (13, 12)}),
             # 4 x H200, 32 layers, one relaunch: every fit row's step within 15%; held out, tp4 all-gather
             # +18.1% and tp2 dp2 zero3 +17.3% (their fastest visits), pp2 tp2 zb-h1 m8 -29.1% (-29..-31% on
             # every 4-GPU run: ZB-H1 with tp is slower than its host and GPU terms say), moe tp2 dp2 ep2
             # -21.7%, the offload row -15.0%; one peak out, moe dp4 ep4 zero1 -5.1% (random routing)
             "h200x4-session15": (RESULTS / "planner_validate_h200x4_session15.json", (15, 13),
                                  {"peak": (15, 12), "step": (15, 8)}),
             # Session 16, 2 x H200, two relaunches, the trainer's garbage-collector policy in every row
             # (teratrain/collector.py): every peak within 5%; steps out: tp2 all-gather +16.7%, tp2
             # all-reduce +27.3% (their four visits 481-565 and 441-589 ms; this machine's probe fitted 0.39
             # ms a tp collective, session 15's 0.25-0.32), moe dp2 ep1 -15.1% (under in every run)
             "h200x2-session16": (RESULTS / "planner_validate_h200x2_session16.json", (15, 12),
                                  {"peak": (15, 12), "step": (14, 11)}),
             # Session 17, 2 x H200, two relaunches, after the Collector fix (a run that froze its model
             # never unfroze it on these machines: an earlier run's rows kept every model and ran out of
             # memory): every peak within 5%, every fit row's step within 15%; out: moe tp2 -20.5% (its
             # four visits 331-414 ms)
             "h200x2-session17": (RESULTS / "planner_validate_h200x2_session17.json", (15, 12),
                                  {"peak": (15, 12), "step": (14, 12)}),  # MOE_SHARE_MOVES
             # and again on a fresh lease in the device time left: 8 layers (the budget's choice), one
             # relaunch; out: tp2 megatron+sp +15.8% (visits 81-107 ms), moe tp2 -16.6% (76-101 ms; -11.3%
             # since MOE_HOST_OP_SHARE)
             "h200x2-session17b": (RESULTS / "planner_validate_h200x2_session17b.json", (15, 12),
                                   {"peak": (15, 12), "step": (14, 12)})}
# The 27 layouts of --gpus 2 measured four times on 2 x H200 in session 7 (three 16-layer runs, one of
# 8 layers), the later three with the host probe (refit.fit_host) and the first two before the planner
# counted the engines' own buckets and the loss's pass over the logits. Every peak within 5% in all
# four. The step misses are host-paced rows: tp2 megatron measured 150, 187 and 183 ms in the three
# 16-layer runs, moe dp2 ep2 146, 87 and 113 ms, where every pipeline row stayed within 2%
# (bench/README.md); moe dp2 ep1 is 15-18% under in every run. session8: the same 27 layouts once more
# after the data-parallel engine stopped waiting mid-backward for in-place reductions (parallel/data.py):
# moe dp2 ep1 -10.5%; the misses are two eager tp rows (-18%) and the offload row (+21%). Session 11:
# the planner stopped counting the clip's own pass over the gradients (now inside fused AdamW, 4 bytes a
# parameter less), which these runs' code still made: session7's held-out `tp2 sp mb4 selective` went
# from -14.8% to -15.1%, out by 0.3 points, so that run reaches 10 held-out rows, not 11.
# Session 15: the H200's per-op cost became 0.85 of the H100's (planner/hardware.py H200_OP_SHARE), which
# lost session7b's moe dp2 ep1 (-16.4%) and session7c's tp2 sp mb4 selective (-16.8%), host-paced rows
# measured once in one launch, and gained 5 rows in other H200 runs.
SESSION7 = {name: (RESULTS / f"planner_validate_h200x2_{name}.json", {"peak": (15, 12), "step": step})
            for name, step in (("session7", (12, 11)), ("session7b", (12, 10)), ("session7d", (15, 12)),
                               ("session7c", (14, 11)), ("session8", (14, 10)))}
BEFORE_BUFFER_CHANGE = (RESULT, H100, H200X2)


def ran_gradient_buffer(path: Path, lay) -> bool:
    return path in BEFORE_BUFFER_CHANGE and lay.dp == 1 and lay.zero == 0 and lay.pp > 1


@functools.cache
def _errors(path: Path) -> list[dict]:
    result = json.loads(path.read_text())
    gpu = result_gpu(result)
    out = []
    for shape, train, lay, row in _prepared(result):
        cand = evaluate(shape, train, lay, gpu)
        out.append({"name": row["name"], "held_out": row["held_out"], "old_buffer": ran_gradient_buffer(path, lay),
                    "peak": cand.memory.peak_allocated / 2**30 / row["measured_peak_gib"] - 1,
                    "step": cand.time.step_time_s / row["measured_step_s"] - 1})
    return out


@pytest.fixture(scope="module")
def errors() -> list[dict]:
    return _errors(RESULT)


@pytest.mark.parametrize("what", ["peak", "step"])
@pytest.mark.parametrize("card", ["h200", "h100", "h200x2", "h200-session6", "h200-session9", *SESSION7, *SESSION12,
                                  *SESSION13, *SESSION14])
def test_recorded_rows_stay_within_the_targets(errors, what, card):
    rows, reached, sizes = {"h200": (errors, REACHED, (15, 13)), "h100": (_errors(H100), REACHED_H100, (15, 13)),
                            "h200x2": (_errors(H200X2), REACHED_H200X2, (15, 12)),
                            "h200-session6": (_errors(SESSION6), REACHED_SESSION6, (15, 13)),
                            "h200-session9": (_errors(SESSION9), REACHED_SESSION9, (15, 13)),
                            **{k: (_errors(path), reached, (15, 12)) for k, (path, reached) in SESSION7.items()},
                            **{k: (_errors(path), reached, sizes)
                               for k, (path, sizes, reached) in {**SESSION12, **SESSION13, **SESSION14}.items()}}[card]
    if card == "h200" and what == "step":
        rows = [e for e in rows if e["name"] not in BEFORE_ZB_REWRITE]
        sizes = (14, 12)
    if what == "peak":
        sizes = tuple(n - sum(e["old_buffer"] and e["held_out"] == held for e in rows)
                      for n, held in zip(sizes, (False, True)))
        rows = [e for e in rows if not e["old_buffer"]]
    fit = [e for e in rows if not e["held_out"]]
    held = [e for e in rows if e["held_out"]]
    assert (len(fit), len(held)) == sizes
    got = tuple(sum(abs(e[what]) <= TARGET[what] for e in group) for group in (fit, held))
    missed = {e["name"]: round(100 * e[what], 1) for e in rows if abs(e[what]) > TARGET[what]}
    assert got[0] >= reached[what][0] and got[1] >= reached[what][1], f"{what}: {got} within target; out: {missed}"


PICKS = ["planner_pick_h200x2.json", "planner_pick_h200x4.json", "planner_pick_h100x4.json",
         "planner_pick_h200x4_session6.json", "planner_pick_h200x2_session7.json", "planner_pick_h200x2_session7b.json",
         "planner_pick_h200x2_session7d.json", "planner_pick_h200x2_session8.json", "planner_pick_h200x4_session9.json",
         "planner_pick_h100x4_session12.json"]


@pytest.mark.parametrize("result", PICKS)
def test_recorded_pick_checks(result):
    """The pick checks' measured candidates (llama-1b and llama-8b, the planner's 6 best of their run)
    ranked by today's planner: the one it puts first is within 5% of the fastest measured (issue 24's
    target), on every recorded run: it guards the ranking against later changes (the planner before
    session 7's changes ranks them within 5% too). The 2 x H200 session-7 llama-8b check failed as run
    (ZeRO-3 with selective recompute picked, 1.062 of dp=1 x tp=2); over the same candidates the
    planner now puts ZeRO-3 without recompute first (1.048)."""
    from dataclasses import replace

    from teratrain.config import load_config
    from teratrain.planner.hardware import GPUS, hw_keys
    from teratrain.planner.inputs import layout_of, shape_of, training_of

    data = json.loads((RESULTS / result).read_text())
    gpu = replace(GPUS[data["gpu_preset"]], **{k: v for k, v in data["hw"].items() if k in set(hw_keys())})
    for model in data["models"]:
        timed = [c for c in model["candidates"] if "measured_step_s" in c]
        assert len(timed) >= 5, (result, model["model"])
        planned = []
        for c in timed:
            cfg = load_config(None, c["sets"])
            cand = evaluate(shape_of(cfg), training_of(cfg), layout_of(cfg, data["gpus"]), gpu)
            planned.append((cand.time.step_time_s, c["measured_step_s"]))
        first = planned[min(range(len(planned)), key=lambda i: planned[i][0])][1]  # ties: the run's order
        assert first <= 1.05 * min(m for _, m in planned), (result, model["model"], first, planned)


def test_pipeline_memory_follows_the_schedule():
    """Every pp=4 schedule's peak on 4 x H200 (SESSION6) within 5%, 1F1B's at m = 4 within 2%: 1F1B's
    first rank holds p micro-batches (planner/memory.py), and at m = p it holds them before its first
    backward, so before any gradient exists (7.01 GiB measured; 7.40 planned when every 1F1B was
    counted with its gradients, +5.6%)."""
    pipes = {e["name"]: e["peak"] for e in _errors(SESSION6) if e["name"].startswith("pp4")}
    assert len(pipes) == 9 and max(abs(v) for v in pipes.values()) < 0.05, pipes
    assert abs(pipes["pp4 1f1b m4"]) < 0.02, pipes["pp4 1f1b m4"]


def test_pipeline_bench_peaks_after_the_gradient_change():
    """bench/pipeline.py's 12 rows on 2 H200s (GPipe, 1F1B, interleaved 1F1B, ZB-H1 at m = 4, 8, 16;
    20 llama-1b-width layers), measured after the data-parallel engine stopped keeping gradients
    nothing reduces: the planner's peak of each within 1% (GPipe's was 2-7% over with the buffer
    counted; every row within 0.7% now)."""
    import sys

    sys.path.insert(0, str(RESULTS.parent))
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


@pytest.mark.parametrize("result, tp", [("tp_graphed_llama8b_h200x2.json", 2), ("tp_reorder_llama8b_h200x4.json", 4)])
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


EAGER_TP = [("tp_eager_llama8b_h200x2of4.json", 2), ("tp_graphed_llama8b_h200x2.json", 2),
            ("tp_reorder_llama8b_h200x4.json", 4), ("tp_chunked_compiled_llama8b_h200x4.json", 4)]


def test_eager_tp_step_times_at_the_8b_width():
    """bench/tensor_parallel.py's eager rows at the llama-8b width (one GPU, tp with and without SP;
    2 and 4 H200s, four runs): the planner within 15% on 10 of 11. The miss is tp=4 SP in session 6's
    run (+24%): the same row measured 63.6 ms the session before (+14%) and 58.3 ms there, so runs
    differ by 9% there."""
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
    """Smoke test of bench/planner_plot.py: it draws the session-6 rows against today's planner and
    counts the rows in each band as the tests above do."""
    import sys

    sys.path.insert(0, str(RESULTS.parent))
    from planner_plot import plot

    counts = plot(json.loads(SESSION6.read_text()), tmp_path / "v.png")
    errors = _errors(SESSION6)
    assert counts == {"rows": 28, **{f"{w}_within": sum(abs(e[w]) <= TARGET[w] for e in errors) for w in TARGET}}
    assert (tmp_path / "v.png").stat().st_size > 10_000
