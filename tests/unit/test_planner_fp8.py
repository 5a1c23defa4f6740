"""The planner under memory.fp8: float8 GEMMs at their measured speed-up, the casts' traffic, what it keeps
for backward, and the cards it refuses."""

import json
from pathlib import Path

import pytest

from teratrain.config import ConfigError, load_config
from teratrain.planner.weight_casts import fp8_linears, fp8_weights
from teratrain.planner.hardware import GPUS
from teratrain.planner.inputs import layout_of, shape_of, training_of
from teratrain.planner.search import evaluate

WIDTH_8B = ["model.preset=llama-8b", "model.n_layers=8", "model.seq_len=4096", "train.micro_batch=1",
            "train.global_batch=4", "memory.precision=bf16", "parallel.zero=0"]


def _plan(*sets, gpu="h200"):
    cfg = load_config(None, [*WIDTH_8B, *sets])
    return evaluate(shape_of(cfg), training_of(cfg), layout_of(cfg, 1), GPUS[gpu])


def test_compiled_fp8_is_faster_than_bf16_by_less_than_the_gemm_speedup():
    bf16, fp8 = _plan("train.compile=true"), _plan("train.compile=true", "memory.fp8=tensorwise")
    speedup = bf16.time.step_time_s / fp8.time.step_time_s
    assert 1.05 < speedup < GPUS["h200"].fp8_speedup_tensorwise  # the head, attention and optimizer stay bf16
    # compiled rowwise casts the activations below HBM speed (fp8_rowwise_cast_gbps): at one sequence a
    # micro-batch it plans at bf16's step (as it measured 0.97x bf16 at llama-1b's width on one H200)
    rowwise = _plan("train.compile=true", "memory.fp8=rowwise")
    assert fp8.time.step_time_s < rowwise.time.step_time_s
    assert rowwise.time.step_time_s == pytest.approx(bf16.time.step_time_s, rel=0.05)


def test_a_step_of_several_micro_batches_casts_its_float8_weights_once():
    """memory/step_casts.py: 4 micro-batches, tensorwise: each weight's amax and cast (4 + 4 + 1 bytes an
    element from fp32) once a step, not forward and backward in each (4 x 18); only its layout copy (2)
    stays per micro-batch. Rowwise and the runs recorded before cast per micro-batch."""
    import dataclasses

    from teratrain.planner.time import fp8_terms

    cfg = load_config(None, [*WIDTH_8B, "memory.fp8=tensorwise"])
    shape, train, lay, gpu = shape_of(cfg), training_of(cfg), layout_of(cfg, 1), GPUS["h200"]
    assert lay.num_microbatches == 4
    once = fp8_terms(shape, train, lay, gpu, 4 * 4096)[1]
    every = fp8_terms(shape, dataclasses.replace(train, casts_per_micro_batch=True), lay, gpu, 4 * 4096)[1]
    weights = cfg.model.n_layers * fp8_weights(shape)[0] / (gpu.hbm_gbps * 1e9 * gpu.mem_efficiency)
    assert every - once == pytest.approx(weights * (4 * 18 + 4 * 2 - (9 + 4 * 2)))


def test_eager_fp8_pays_its_cast_ops_on_the_host_and_gpu():
    eager, compiled = _plan("memory.fp8=tensorwise"), _plan("memory.fp8=tensorwise", "train.compile=true")
    assert eager.time.ops_s > compiled.time.ops_s


def test_fp8_keeps_no_weight_copy_where_autocast_keeps_a_bf16_one():
    from teratrain.planner.weight_casts import weight_copies
    from teratrain.planner.layout import widths

    shape = shape_of(load_config(None, WIDTH_8B))
    weights, rest = fp8_weights(shape)
    assert rest == 0  # every block linear of llama-8b's width is 16-aligned
    copies = {r: weight_copies(shape, widths("bf16", False, r)) for r in ("none", "tensorwise", "rowwise")}
    assert copies == {"none": 2 * weights, "tensorwise": 0, "rowwise": 0}
    totals = [_plan("memory.fp8=" + r).memory.total for r in ("none", "tensorwise")]
    assert totals[0] > totals[1]


def test_unaligned_linears_stay_out_under_tensor_parallelism():
    """8 heads of 8 at tp=8: each rank's q/k/v hold 8 rows and wo 8 columns (not multiples of 16); the MLP's
    256 / 8 = 32 stay aligned."""
    shape = shape_of(load_config(None, ["model.d_model=64", "model.n_heads=8", "model.n_kv_heads=8", "model.d_ff=256"]))
    assert len(fp8_linears(shape, 1)) == 7
    assert fp8_linears(shape, 8) == [(32, 64, 1.0), (32, 64, 1.0), (64, 32, 1.0)]


def test_cards_without_float8_tensor_cores_are_refused():
    with pytest.raises(ConfigError, match="a100 has none"):
        _plan("memory.fp8=tensorwise", gpu="a100")


def test_zero3_gathers_tensorwise_float8_weights_at_one_byte():
    """Under ZeRO-3 with memory.fp8=tensorwise each block's float8 weights are gathered at 1 byte an
    element instead of the parameters' 2, as a flat group of their own (parallel/zero_fp8.py): one more
    gather a block, and the gather term is the collective's time for the bytes that remain. rowwise,
    and memory.fp8_gather=false, gather them at 2 bytes in the block's one group."""
    from teratrain.planner.comm import float8_gathered, on_link, reduce_messages, step_comm
    from teratrain.planner.states import stage_params

    base = [*WIDTH_8B, "parallel.zero=3", "memory.fp8=tensorwise"]
    cfg, wide = load_config(None, base), load_config(None, [*base, "memory.fp8_gather=false"])
    shape, lay, gpu = shape_of(cfg), layout_of(cfg, 8), GPUS["h200"]
    on, off = (step_comm(shape, training_of(c), lay, gpu)["zero_gather"] for c in (cfg, wide))
    float8 = float8_gathered(shape, training_of(cfg), lay)
    assert float8 == cfg.model.n_layers * fp8_weights(shape)[0] > 0
    assert float8_gathered(shape, training_of(wide), lay) == 0
    local = stage_params(shape, lay)["first"]
    g_on, g_off = (reduce_messages(shape, training_of(c), lay, False, local)[1] for c in (cfg, wide))
    assert g_on == g_off + cfg.model.n_layers
    passes = 2 * lay.num_microbatches  # before each micro-batch's forward and its backward
    want_on = on_link(gpu, "all_gather", 8, 8, 2 * local - float8, g_on)
    assert on == pytest.approx(passes * want_on, rel=1e-9)
    assert off == pytest.approx(passes * on_link(gpu, "all_gather", 8, 8, 2 * local, g_off), rel=1e-9)
    assert on < off
    rowwise = load_config(None, [*WIDTH_8B, "parallel.zero=3", "memory.fp8=rowwise"])
    assert float8_gathered(shape_of(rowwise), training_of(rowwise), layout_of(rowwise, 8)) == 0


def _bench_on_path():
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root / "bench"), str(root / "bench" / "calibrate")]


@pytest.mark.parametrize("recipe, micro_batches, recompute", [
    ("tensorwise", 1, "none"), ("rowwise", 1, "none"), ("tensorwise", 3, "none"), ("tensorwise", 3, "full")])
def test_the_ops_fp8_adds_to_an_eager_step_are_the_ones_the_step_issues(recipe, micro_batches, recompute):
    """time.fp8_ops against the aten ops teratrain's train step dispatches, fp8 (torchao's emulation) less
    bf16, counted on CPU: by recipe, with the step's casts once for three micro-batches, and with the forward
    replayed. Within 2% (the counts per linear hold a layer's few ops of its own)."""
    import torch

    _bench_on_path()
    from common import count_ops

    from teratrain.measure import build_engine
    from teratrain.optim.engine import train_step
    from teratrain.planner.time import fp8_ops

    tiny = ["model.arch=llama", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
            "model.vocab_size=512", "model.seq_len=32", "model.n_layers=2", "memory.precision=bf16",
            f"memory.recompute={recompute}", "train.micro_batch=1", f"train.global_batch={micro_batches}"]
    counted = {}
    for fp8 in ("none", recipe):
        cfg = load_config(None, [*tiny, f"memory.fp8={fp8}", f"memory.fp8_emulate={fp8 != 'none'}"])
        model, engine = build_engine(cfg)
        x = torch.randint(0, 512, (micro_batches, 1, 33))
        batches = [(b[:, :-1], b[:, 1:]) for b in x]
        train_step(model, engine, batches, "bf16", 1e-4)
        counted[fp8] = count_ops(lambda: train_step(model, engine, batches, "bf16", 1e-4))
    cfg = load_config(None, [*tiny, f"memory.fp8={recipe}"])
    planned = fp8_ops(shape_of(cfg), training_of(cfg), layout_of(cfg, 1))
    assert planned == pytest.approx(counted[recipe] - counted["none"], rel=0.02)


def test_eager_fp8_steps_are_planned_host_paced_and_slower_than_bf16():
    """The recorded eager fp8 steps of one H200 (bench/fp8.py), planned with the host's float8 op share fitted
    on the first (bench/calibrate/fp8_host_ops.py --fit; calibration/common.toml): the fit row within 1%; the
    held-out one was planned 10.6% slow when the share was fitted, its bf16 step 11.6% fast (which the share
    does not touch), and is held within 15%. Eager fp8 is planned slower than eager bf16, as both ran
    (0.56x and 0.54x), where the planner had it at 0.97x before the share."""
    _bench_on_path()
    import fp8_host_ops as fit


    for file, tol in ((fit.FIT, 0.01), (fit.HELD_OUT, 0.15)):
        fp8, bf16 = fit._recorded(file, "tensorwise"), fit._recorded(file, "none")
        plan = evaluate(*fp8[:3], GPUS["h200"]).time  # at the calibrated share
        assert plan.step_time_s == pytest.approx(fp8[3], rel=tol)
        assert evaluate(*bf16[:3], GPUS["h200"]).time.step_time_s / plan.step_time_s < 0.75
        assert plan.terms["host_s"] > plan.terms["gpu_s"]  # the host paces it


def test_the_plan_says_what_runs_in_float8(capsys):
    """`teratrain plan` with memory.fp8: the header names the recipe, the compute line the float8 GEMMs'
    FLOPs and rate, the host line the float8 ops' cost; without it, none of these."""
    from teratrain.cli import main

    sets = [a for s in WIDTH_8B for a in ("--set", s)] + ["--gpu", "h200", "--gpus", "1"]
    assert main(["plan", *sets, "--set", "memory.fp8=tensorwise"]) == 0
    out = capsys.readouterr().out
    assert "bf16 + fp8 tensorwise" in out.splitlines()[0]
    assert "in float8 GEMMs (tensorwise) at" in out and "memory.fp8's" in out
    assert main(["plan", *sets]) == 0
    assert "float8" not in capsys.readouterr().out


def test_replicated_key_value_heads_count_whole_in_float8():
    """4 key/value heads at tp=8 are replicated, each rank holding one whole head's wk and wv (as
    parallel/tp_plan.py places them): every local weight is 16-aligned, so none stays bf16."""
    shape = shape_of(load_config(None, ["model.d_model=2048", "model.n_heads=16", "model.n_kv_heads=4",
                                        "model.d_ff=8192"]))
    fp8, rest = fp8_weights(shape, 8)
    assert rest == 0 and fp8 == 2048 * 2048 * 2 // 8 + 2 * 128 * 2048 + 3 * 2048 * 8192 // 8


@pytest.mark.parametrize("tp", [4, 8])
def test_autocast_copies_of_replicated_key_value_heads_are_whole_heads(tp):
    """8 query heads and 2 key/value heads at tp 4 and 8: each rank holds one whole key/value head's wk and wv
    (parallel/tp_plan.py colwise_kv), and autocast copies those local weights to bf16: weight_copies is
    `block_matrices`' elements in 2 bytes, as memory.fp8 counts the same weights."""
    from teratrain.planner.layout import widths
    from teratrain.planner.weight_casts import block_matrices, weight_copies

    shape = shape_of(load_config(None, ["model.d_model=512", "model.n_heads=8", "model.n_kv_heads=2",
                                        "model.d_ff=1024"]))
    local = sum(r * k * share for r, k, share in block_matrices(shape, tp))
    assert local == 2 * 512 * 512 // tp + 2 * 64 * 512 + 3 * 512 * 1024 // tp  # q and wo split, k and v one head
    assert weight_copies(shape, widths("bf16", False), tp) == 2 * local


# bench/fp8.py --width 1b: llama-1b's width, untied
WIDTH_1B = ["model.arch=llama", "model.d_model=2048", "model.n_heads=32", "model.n_kv_heads=8", "model.d_ff=8192",
            "model.vocab_size=32000", "model.tie_embeddings=false", "model.seq_len=2048", "train.micro_batch=8",
            "train.global_batch=8", "memory.precision=bf16", "train.compile=true"]
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _forward_saved(cfg, device):
    from teratrain.planner.memory import forward_saved

    return forward_saved(shape_of(cfg), training_of(cfg), layout_of(cfg, 1), device)


@pytest.mark.slow
@pytest.mark.parametrize("recipe, scope, extra", [
    ("rowwise", "model", []), pytest.param("tensorwise", "block", [], marks=pytest.mark.long),
    pytest.param("rowwise", "model", ["memory.master_weights=true"], marks=pytest.mark.long)])
def test_compiled_float8_blocks_keep_what_the_planner_counts(recipe, scope, extra):
    """Compiled, float8 linears keep neither the norms' outputs nor SwiGLU's product: the partition casts them
    again in backward from the block's input, the norms' statistics and w1x, w3x (planner/compiled.py
    block_saved). Counted on CPU with the GEMMs emulated, 2 blocks, 96 tokens: exact for rowwise; the emulated
    tensorwise GEMMs keep 7 of the 14 fp32 scales a block that one H100's keep (the next test), so 28 bytes a
    block fewer than planned. Under bf16 parameters (fp32 masters in the optimizer) too."""
    from teratrain.measure import build_engine, random_batch, saved_bytes

    cfg = load_config(None, ["model.preset=tiny", "model.arch=llama", "model.n_layers=2", "model.seq_len=48",
                             "train.micro_batch=2", "train.global_batch=2", "memory.precision=bf16",
                             "train.compile=true", f"train.compile_scope={scope}", f"memory.fp8={recipe}",
                             "memory.fp8_emulate=true", *extra])
    model, _ = build_engine(cfg)
    x, y = random_batch(cfg, 2)
    saved_bytes(model, x, y, "bf16", targets_in_model=True)  # compiles
    measured = saved_bytes(model, x, y, "bf16", targets_in_model=True)
    assert _forward_saved(cfg, "cpu") - measured == (2 * 7 * 4 if recipe == "tensorwise" else 0)


@pytest.mark.parametrize("scope", ["model", "block"])
def test_compiled_float8_saved_tensors_against_one_h100(scope):
    """`python bench/fp8.py --saved --width 1b --seq 2048 --micro-batch 8` on one H100 (torch 2.11): what the
    compiled model keeps, bf16 and each recipe, at 1 and 2 blocks. The planner counts every byte but the two
    int64 scalars (the random generator's seed and offset) cuDNN's attention keeps a block, in bf16 as well.
    Planned with eager's tensors before, the float8 rows of the model scope were 1.96x what they keep."""
    rows = json.loads((RESULTS / "h100" / f"2026-12-06_fp8_saved_{scope}.json").read_text())["results"]
    recipes = ("none", "tensorwise", "rowwise")
    assert {(r["fp8"], r["layers"]) for r in rows} == {(f, n) for f in recipes for n in (1, 2)}
    for r in rows:
        cfg = load_config(None, [*WIDTH_1B, f"model.n_layers={r['layers']}", f"train.compile_scope={scope}",
                                 f"memory.fp8={r['fp8']}"])
        assert r["saved_bytes"] - _forward_saved(cfg, "cuda") == 16 * r["layers"], r


@pytest.mark.parametrize("file", ["2026-12-06_fp8_1b_tensorwise.json", "2026-12-06_fp8_1b_tensorwise_b.json",
                                  "2026-12-06_fp8_1b_rowwise.json"])
def test_compiled_float8_peak_against_recorded_runs(file):
    """llama-1b's step compiled whole in float8 on one H200 (bench/README.md, "FP8 at llama-1b's width"): planned
    29.08 GiB against 28.37 (tensorwise) and 28.68 (rowwise) measured, within the 3% the compiled rows keep
    (test_planner_compiled_memory.py); planned with eager's tensors before, 43.06. Not held out: the runs were
    measured before the partition was counted."""
    from teratrain.planner.memory import GIB, plan_memory

    row = next(r for r in json.loads((RESULTS / "h200" / file).read_text())["results"]
               if r["impl"] == "ours" and r["fp8"] != "none")
    cfg = load_config(None, [*WIDTH_1B, "model.n_layers=16", "train.compile_scope=model", f"memory.fp8={row['fp8']}"])
    planned = plan_memory(shape_of(cfg), training_of(cfg), layout_of(cfg, 1), GPUS["h200"]).peak_allocated / GIB
    assert planned == pytest.approx(row["peak_gib"], rel=0.03)


@pytest.mark.parametrize("file", ["2026-12-06_fp8_1b_tensorwise.json", "2026-12-06_fp8_1b_tensorwise_b.json",
                                  "2026-12-06_fp8_1b_rowwise.json"])
def test_compiled_float8_step_against_recorded_runs(file):
    """The same runs' steps, planned with the H200 preset: tensorwise 166.2 ms against 174.2 and 175.0 (-4.6%);
    rowwise 211.6 against 214.5 (-1.3%; 179.0, 16.5% fast, while its casts ran at HBM speed in the plan). Within
    8%, as the llama-8b width's compiled row (test_planner_compiled.py); chosen with these rows in view, so a
    guard, not a validation. No constant was fitted on them (the rowwise cast rate: below)."""
    from teratrain.planner.memory import plan_memory
    from teratrain.planner.time import plan_time

    row = next(r for r in json.loads((RESULTS / "h200" / file).read_text())["results"]
               if r["impl"] == "ours" and r["fp8"] != "none")
    cfg = load_config(None, [*WIDTH_1B, "model.n_layers=16", "train.compile_scope=model", f"memory.fp8={row['fp8']}",
                             "train.grad_clip=1.0"])
    shape, train, lay = shape_of(cfg), training_of(cfg), layout_of(cfg, 1)
    planned = plan_time(shape, train, lay, GPUS["h200"], plan_memory(shape, train, lay)).step_time_s
    assert planned * 1e3 == pytest.approx(row["step_ms"], rel=0.08)


def _rowwise_cast(width: list[str], path: Path, gpu: str) -> tuple[float, float]:
    """(planned, measured) seconds of a compiled rowwise run's casts: fp8_terms' against the copy and elementwise
    kernels' device time over the bf16 row's in the same job (bench/fp8.py --profile)."""
    from teratrain.planner.time import fp8_terms

    kinds = {r["fp8"]: r["profile"]["kinds"] for r in json.loads(path.read_text())["results"]}
    extra = sum(kinds["rowwise"][k]["ms"] - kinds["none"][k]["ms"] for k in ("copy", "elementwise")) / 1e3
    cfg = load_config(None, [*width, "train.compile_scope=model", "memory.fp8=rowwise"])
    shape, train, lay = shape_of(cfg), training_of(cfg), layout_of(cfg, 1)
    return fp8_terms(shape, train, lay, GPUS[gpu], lay.tokens(cfg.model.seq_len) * lay.num_microbatches)[1], extra


WIDTH_8B_MB4 = [s for s in WIDTH_8B if not s.startswith("train.micro_batch")] + ["train.micro_batch=4",
                                                                                   "train.compile=true"]


def test_compiled_rowwise_casts_run_at_one_rate_on_both_cards():
    """calibration/common.toml fp8_rowwise_cast_gbps, fitted on llama-8b's width on one H100: the planned casts
    equal the measured ones there. Held out at llama-1b's width, within 8% fixed before the H100's run: on an
    H100, 216.4 ms against 230.7 (-6.2%; planned before its run as 214.2 by a first form that cast the weights at
    the same rate), and on an H200, 211.6 against 214.5 (-1.3%; measured before the fit; the form, one rate on both
    cards, chosen after seeing both cards' 1b casts take the same time)."""
    from teratrain.planner.memory import plan_memory
    from teratrain.planner.time import plan_time

    planned, measured = _rowwise_cast(WIDTH_8B_MB4, RESULTS / "h100" / "2026-12-06_fp8_8b_rowwise_profile.json", "h100")
    assert planned == pytest.approx(measured, rel=0.01)
    one_b = [*WIDTH_1B, "model.n_layers=16", "train.grad_clip=1.0"]
    for gpu in ("h100", "h200"):
        path = RESULTS / gpu / "2026-12-06_fp8_1b_rowwise_profile.json"
        cfg = load_config(None, [*one_b, "train.compile_scope=model", "memory.fp8=rowwise"])
        shape, train, lay = shape_of(cfg), training_of(cfg), layout_of(cfg, 1)
        step = plan_time(shape, train, lay, GPUS[gpu], plan_memory(shape, train, lay)).step_time_s
        row = next(r for r in json.loads(path.read_text())["results"] if r["fp8"] == "rowwise")
        assert step == pytest.approx(row["step_ms"] / 1e3, rel=0.08)
        planned, measured = _rowwise_cast(one_b, path, gpu)
        assert planned == pytest.approx(measured, rel=0.05)  # 74.8 / 74.7 and 72.2 / 73.3 ms: a guard


ROWWISE_HELD_OUT = [  # (shape, file, casts planned before the run, seconds)
    ([s for s in WIDTH_8B_MB4 if not s.startswith(("train.micro_batch", "train.global_batch"))]
     + ["train.micro_batch=2", "train.global_batch=4"], "2026-12-06_fp8_8b_accum2_rowwise_profile.json", 0.0929),
    ([*WIDTH_1B, "model.n_layers=16", "train.micro_batch=4", "train.global_batch=4"],
     "2026-12-06_fp8_1b_mb4_rowwise_profile.json", 0.0417)]


@pytest.mark.parametrize("sets, file, planned_casts", ROWWISE_HELD_OUT, ids=["llama-8b-2x2x4096", "llama-1b-4x2048"])
def test_compiled_rowwise_casts_planned_before_the_run(sets, file, planned_casts):
    """Held out, planned before each run at the fitted rate (one H100, compiled whole), bounds fixed then: casts
    within 10%, the step within 8%, the peak within 3% (as the compiled rows). llama-8b's width in 2 micro-batches
    of 2 x 4096: casts 92.9 ms against 87.4, step 395.7 against 420.8, peak 53.76 GiB against 53.11. llama-1b's
    width at 4 x 2048: casts 41.7 against 42.2, step 127.4 against 130.9, peak 20.77 against 20.77."""
    from teratrain.planner.memory import GIB, plan_memory
    from teratrain.planner.time import plan_time

    sets = [*sets, "train.grad_clip=1.0"]
    path = RESULTS / "h100" / file
    planned, measured = _rowwise_cast(sets, path, "h100")
    assert planned == pytest.approx(planned_casts, abs=1e-4) and planned == pytest.approx(measured, rel=0.10)
    cfg = load_config(None, [*sets, "train.compile_scope=model", "memory.fp8=rowwise"])
    shape, train, lay = shape_of(cfg), training_of(cfg), layout_of(cfg, 1)
    mem = plan_memory(shape, train, lay, GPUS["h100"])
    row = next(r for r in json.loads(path.read_text())["results"] if r["fp8"] == "rowwise")
    assert plan_time(shape, train, lay, GPUS["h100"], mem).step_time_s == pytest.approx(row["step_ms"] / 1e3, rel=0.08)
    assert mem.peak_allocated / GIB == pytest.approx(row["peak_gib"], rel=0.03)


@pytest.mark.parametrize("fp8, planned_gib", [("none", 19.51), ("tensorwise", 15.90)])
def test_compiled_float8_peak_planned_before_the_run(fp8, planned_gib):
    """Held out: 12 blocks at micro-batch 4, each compiled apart, planned before the run (one H100; bench/README.md,
    "FP8 at llama-1b's width"): 19.57 and 15.97 GiB measured. 3%, fixed before it, as the compiled rows."""
    from teratrain.planner.memory import GIB, plan_memory

    cfg = load_config(None, [*WIDTH_1B, "model.n_layers=12", "train.micro_batch=4", "train.global_batch=4",
                             "train.compile_scope=block", f"memory.fp8={fp8}"])
    planned = plan_memory(shape_of(cfg), training_of(cfg), layout_of(cfg, 1), GPUS["h100"]).peak_allocated / GIB
    assert planned == pytest.approx(planned_gib, abs=0.005)  # the prediction, as written before the run
    row = next(r for r in json.loads((RESULTS / "h100" / "2026-12-06_fp8_1b_block_mb4.json").read_text())["results"]
               if r["fp8"] == fp8)
    assert planned == pytest.approx(row["peak_gib"], rel=0.03)
