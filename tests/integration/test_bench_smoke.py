"""Each multi-GPU benchmark runs end to end in its --smoke mode (2 gloo CPU processes, tiny shapes),
so the scripts the GPU runs use are tested code. The GPU figures themselves are in bench/README.md."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
@pytest.mark.parametrize("script", ["tensor_parallel.py"])
def test_bench_smoke(script, tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(ROOT / "bench" / script),
           "--smoke", "--out", str(out)]
    cmd += ["--profile", "--fp8", "tensorwise"] if script == "tensor_parallel.py" else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tp"] == 2  # bf16 autocast: one process and tp, plain and overlapped, agree within 2e-2
    assert result["parity"]["tp_max_rel_diff"] < 2e-2 and result["parity"]["tp_chunked_max_rel_diff"] < 2e-2
    (shape,) = result["shapes"].values()
    for variant in ("one_gpu", "ours_no_sp", "ours_sp", "ours_sp_chunked2", "ours_sp_chunked4", "dtensor_no_sp",
                    "dtensor_sp"):
        assert shape[variant]["tokens_per_s"] > 0, variant
    assert shape["ours_sp_chunked2"]["profile"]["top_ops"] and shape["dtensor_sp"]["profile"]["top_ops"]
    # eager only here: every tp row against the eager one-GPU run of its precision, and the headline lists each
    # with its mode
    (headline,) = result["per_gpu_efficiency_same_mode"].values()
    for variant, row in headline.items():
        one = shape["one_gpu_fp8" if variant.endswith("_fp8") else "one_gpu"]
        assert row == {"mode": "eager", "per_gpu_efficiency_same_mode": round(
            shape[variant]["tokens_per_s"] / one["tokens_per_s"] / 2, 4)}, variant
    assert set(headline) == {v for v in shape if not v.startswith(("one_gpu", "fp8_not_run"))
                             and isinstance(shape[v], dict)}
    # --fp8 (emulated on CPU): each variant again in float8 but the chunked ones, which memory.fp8 refuses
    # with its reason; each float8 row against its bf16 row of the same mode, both sides float8 in ours_vs_dtensor
    assert set(shape["fp8_not_run"]) == {"ours_no_sp_chunked2", "ours_sp_chunked2", "ours_sp_chunked4"}
    (fp8,) = result["fp8_over_bf16_same_mode"].values()
    assert set(fp8) == {"ours_no_sp_fp8", "ours_sp_fp8", "dtensor_no_sp_fp8", "dtensor_sp_fp8"}
    for variant, row in fp8.items():
        ratio = round(shape[variant]["tokens_per_s"] / shape[variant.removesuffix("_fp8")]["tokens_per_s"], 4)
        assert row == {"mode": "eager", "recipe": "tensorwise", "fp8_over_bf16_same_mode": ratio}, variant
    assert shape["ours_vs_dtensor_sp_fp8"] == round(shape["ours_sp_fp8"]["tokens_per_s"]
                                                    / shape["dtensor_sp_fp8"]["tokens_per_s"], 4)


def test_the_layout_matrix_counts_a_tensor_parallel_blocks_bytes_on_cpu(tmp_path):
    """bench/layouts.py --smoke (2 gloo processes, ~10 s): a pipeline whose first stage holds the embedding
    alone, and the per-op policy on tp shards, each like one process; the tp row's one block keeps exactly the
    bytes the planner counts (CPU kernels), the pipeline row counts none."""
    out = tmp_path / "layouts.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "layouts.py"), "--smoke", "--only",
                           "tp2-megatron-sp-selective-ops,pp2-1f1b-first-empty", "--fp32-steps", "1",
                           "--bf16-steps", "2", "--out", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())["layouts"]}
    tp, pp = rows["tp2-megatron-sp-selective-ops"], rows["pp2-1f1b-first-empty"]
    assert tp["ok"] and pp["ok"] and tp["fp32_rel_err"] < 1e-4 and pp["fp32_rel_err"] < 1e-4
    assert tp["block_bytes"] == tp["block_bytes_planned"] > 0 and tp["block_bytes_ok"]
    assert "block_bytes" not in pp


@pytest.mark.long
def test_gpu_suite_runs_the_layout_matrix_on_cpu(tmp_path):
    """bench/gpu_suite.sh, the one command a GPU machine runs, in its CPU form: the matrix (one dense and
    one MoE layout, ring context parallelism and FP8 (emulated; bf16 only), each against one process, with
    that process's bf16 noise floor recorded; the MoE row judged in bf16 on the mean of its last steps)."""
    env = {**os.environ, "SMOKE": "1", "PYTHON": sys.executable, "MATRIX_ONLY": "dp2-zero1,ep2,cp2,dp2-fp8"}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_suite.sh"), str(tmp_path), "matrix"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads((tmp_path / "layouts.json").read_text())["layouts"]}
    assert set(rows) == {"dp2-zero1", "ep2", "cp2", "dp2-fp8"} and all(r["ok"] for r in rows.values()), rows
    dense = {k: r for k, r in rows.items() if k != "ep2"}
    assert all(r["bf16_rel_err"] < r["bf16_tol"] == 2e-2 and "bf16_check" not in r for r in dense.values())
    moe = rows["ep2"]  # judged on the mean of its last bf16 steps, deterministic on both sides
    assert moe["bf16_check"] == "tail-mean" and moe["bf16_tail_rel_err"] < moe["bf16_tol"] == 1e-2
    assert 0 <= moe["bf16_tail_noise_floor"] < 1e-2
    assert all(r["fp32_rel_err"] < 1e-4 for name, r in rows.items() if name != "dp2-fp8")
    assert "fp32_rel_err" not in rows["dp2-fp8"] and rows["dp2-fp8"]["check"] == "parity-bf16"
    assert all(0 <= r["bf16_noise_floor"] < 2e-2 and "reason" not in r for r in rows.values())
    assert "== matrix: status 0" in (tmp_path / "suite.log").read_text()


def test_determinism_probe_on_cpu(tmp_path):
    """bench/determinism.py's CPU form: every probe runs (grouped_mm has no CPU kernel of its own: none) in
    both modes, and a CPU's kernels repeat bit for bit, so every probe must say so (the GPU's cuDNN
    attention backward does not: bench/README.md, "The layout matrix")."""
    out = tmp_path / "determinism.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "determinism.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for mode in ("default", "deterministic_algorithms"):
        probes = result[mode]
        assert probes.pop("grouped_mm") is None and len(probes) == 5
        assert all(p["bitwise_equal"] and p["max_abs_diff"] == 0.0 for p in probes.values()), (mode, probes)


@pytest.mark.long
def test_planner_validate_measures_the_host_probe_on_cpu(tmp_path):
    """bench/planner_validate.py --gpus 2 in its CPU form, one row: the job measures the machine, then
    the host probe's four layouts, whose fit (refit.fit_host) becomes the run's host terms, and each
    row records the host's speed around it and its prediction at that speed; one relaunch runs the
    probe and the (host-paced) row again in fresh processes. The processes start with objects frozen
    (gc.freeze), as Python 3.12's do, and every row's model is still freed."""
    out = tmp_path / "planner.json"
    (tmp_path / "site").mkdir()
    (tmp_path / "froze").mkdir()  # each process that froze leaves its pid here: proof the hook ran
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import gc, os\ngc.freeze()\nopen(os.path.join(os.environ['FROZE_DIR'], str(os.getpid())), 'w').close()\n")
    env = {**os.environ, "FROZE_DIR": str(tmp_path / "froze"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "planner_validate.py"), "--gpus", "2", "--smoke",
                           "--only", "tp2 megatron+sp", "--relaunches", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    probe = result["host_probe"]["rows"]
    assert [p["name"] for p in probe] == ["probe dp", "probe tp2", "probe tp2 sp", "probe dp zero3"]
    assert probe[0]["collectives"] == 0 < probe[1]["collectives"] < probe[2]["collectives"]
    assert 0 < probe[0]["launches"] < probe[3]["launches"]
    for p in probe:  # two passes in the main job, one in the relaunch: the fastest fitted
        assert len(p["passes_s"]) == 3 and p["measured_s"] == min(p["passes_s"])
    assert result["hw"]["host_op_s"] > 0 and "host_collective_s" in result["hw"] and "host_launch_s" in result["hw"]
    (row,) = result["rows"]
    assert result["host_probe"]["host_loop_us"] > 0
    assert row["host_loop_us"] > 0 and row["predicted_step_s_row_host"] > 0 and row["measured_step_s"] > 0
    assert len(row["visits_s"]) == 3 and row["measured_step_s"] == min(row["visits_s"])  # main job twice, relaunch
    assert row["model_freed"] and result["summary"]["models_kept_alive"] == []
    assert len(list((tmp_path / "froze").iterdir())) >= 5  # the driver, and two ranks in each of its two jobs


@pytest.mark.long
def test_ddp_compare_trains_what_ddp_trains_on_cpu(tmp_path):
    """bench/ddp_compare.py --smoke: our data parallelism (parallel.dp=2) and PyTorch DDP, eager and
    compiled (ours each block apart, and whole), from the same init on the same tokens: the same loss
    at every step (bf16 autocast on CPU; the same ops in the same order on both sides)."""
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(ROOT / "bench" / "ddp_compare.py"), "--smoke", "--compile", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ours_compiled"]["compile_scope"] == "block"
    assert result["ours_compiled_whole"]["compile_scope"] == "model"
    for pair in ("ours_over_ddp", "ours_compiled_over_ddp_compiled", "ours_compiled_whole_over_ddp_compiled"):
        assert result[pair]["loss_rel_diff"] < 1e-5, (pair, result[pair])
        assert result[pair]["tokens_per_s"] > 0
    assert len(result["ours"]["losses"]) == 3 and len(set(result["ours"]["losses"])) == 3  # it trains


@pytest.mark.long
def test_fsdp2_compare_rounds_and_capped_sides(tmp_path):
    """bench/fsdp2_compare.py's A/B options on 2 gloo processes: every side measured each round (the
    order reversed every other round), the ratio of the medians and each round's ratio; the NCCL-capped
    sides (`--dp-max-ctas`, `--fsdp2-max-ctas`) run on groups of their own, gloo taking no NCCL options;
    `--fp8 tensorwise` adds both sides in float8 (emulated on CPU, FSDP2 gathering float8 over gloo)."""
    out = tmp_path / "fsdp2.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(ROOT / "bench" / "fsdp2_compare.py"), "--smoke", "--steps", "1", "--rounds", "2",
                           "--dp-max-ctas", "8", "--fsdp2-max-ctas", "8", "--fp8", "tensorwise", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for side in ("ours_zero3", "fsdp2", "ours_zero3_ctas8", "fsdp2_ctas8", "ours_zero3_fp8", "fsdp2_fp8"):
        assert len(r[side]["tokens_per_s_rounds"]) == 2 and r[side]["tokens_per_s"] > 0, side
    fp8 = r["fp8"]  # like for like, eager here: each side's float8 over its bf16; ours over FSDP2 in float8 at the top
    assert fp8["mode"] == "eager" and fp8["recipe"] == "tensorwise"
    assert fp8["gathers"] == {"ours": "float8", "fsdp2": "float8"}
    ratios = {"ours_fp8_over_ours_bf16": ("ours_zero3_fp8", "ours_zero3"),
              "fsdp2_fp8_over_fsdp2_bf16": ("fsdp2_fp8", "fsdp2")}
    assert {k for k in fp8 if k.startswith("tokens_per_s_")} == {f"tokens_per_s_{k}{m}" for k in ratios
                                                                  for m in ("", "_median")}
    for key, (a, b) in ratios.items():
        assert fp8[f"tokens_per_s_{key}"] == round(r[a]["tokens_per_s"] / r[b]["tokens_per_s"], 4), key
        assert fp8[f"tokens_per_s_{key}_median"] > 0, key
    assert r["tokens_per_s_ratio_ours_over_fsdp2_fp8"] == r["ours_zero3_fp8"]["tokens_per_s"] / r["fsdp2_fp8"][
        "tokens_per_s"]
    for tag in ("", "_ctas8", "_both_ctas8", "_fp8"):
        rounds = r[f"tokens_per_s_ratio_ours_over_fsdp2{tag}_rounds"]
        assert len(rounds) == 2 and r[f"tokens_per_s_ratio_ours_over_fsdp2{tag}_median"] > 0, tag
    a, b = r["ours_zero3"]["tokens_per_s_rounds"], r["fsdp2"]["tokens_per_s_rounds"]
    assert r["tokens_per_s_ratio_ours_over_fsdp2_rounds"] == [round(x / y, 4) for x, y in zip(a, b)]


def test_split_cost_counts_the_planners_split_ops_on_cpu(tmp_path):
    """bench/calibrate/split_cost.py's count of what ZB-H1's split backward adds on its last stage (a fake
    process group, two depths) is planner/time.py's OPS_SPLIT_EXTRA."""
    from teratrain.planner.time import OPS_SPLIT_EXTRA

    out = tmp_path / "split.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "calibrate" / "split_cost.py"), "--smoke",
                           "--count-only", "--layers", "4", "8", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    slope = json.loads(out.read_text())["split_extra_ops_per_block_mb_slope"]
    assert abs(slope - OPS_SPLIT_EXTRA) <= 0.05 * OPS_SPLIT_EXTRA, slope


def test_moe_host_ops_counts_the_planners_moe_ops(tmp_path):
    """bench/calibrate/moe_host_ops.py (the host's cost of an MoE layer's own ops, what MOE_HOST_OP_SHARE
    stands for) times the ops planner/time.py OPS_MOE_EXTRA counts: the MoE block issues that many more
    than the dense one. Its timings, one round on a CI runner's shared cores, are only checked to exist: the MoE
    layer's share came out negative there once (-0.785)."""
    from teratrain.planner.time import OPS_MOE_EXTRA

    out = tmp_path / "moe_ops.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "calibrate" / "moe_host_ops.py"), "--rounds", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    extra = result["ops"]["moe"] - result["ops"]["dense"]
    assert abs(extra - sum(OPS_MOE_EXTRA)) <= 0.05 * sum(OPS_MOE_EXTRA), extra
    assert math.isfinite(result["extra_op_share"]) and result["us_per_op_fastest"]["dense"] > 0


def test_dtensor_compile_repro_runs_each_case_on_cpu(tmp_path):
    """bench/dtensor_compile_repro.py (why bench/tensor_parallel.py keeps DTensor's residual stream a DTensor
    when compiled, and compiles DTensor only with SP) reports every case; the plain stream passes uncompiled,
    and the DTensor stream with SP compiled, as the bench's compiled DTensor rows need."""
    out = tmp_path / "repro.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(ROOT / "bench" / "dtensor_compile_repro.py"), "--backends", "aot_eager", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["sequence_parallel"], r["stream"], r["compile"]): r["outcome"]
            for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(sp, stream, c) for sp in (True, False) for stream in ("local", "dtensor")
                         for c in ("none", "aot_eager")}
    assert rows[True, "local", "none"] == rows[False, "local", "none"] == rows[True, "dtensor", "aot_eager"] == "ok"
    assert all(rows.values())


def test_parallel_host_ops_counts_the_planners_collectives(tmp_path):
    """bench/calibrate/parallel_host_ops.py (a fake process group, two depths): the tensor- and expert-parallel
    collectives a block issues per micro-batch are planner/time.py issued_collectives' (4 all-reduces without
    sequence parallelism, the ep exchange's 5), and under sequence parallelism its 8 region crossings plus the 2
    all-gathers parallel/comm.py Regather launches in backward, which issued_collectives does not count (their host
    cost on a GPU is not measured; their GPU time is planner/comm.py regather_s's)."""
    from teratrain.config import load_config
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.time import issued_collectives

    out = tmp_path / "parallel_host_ops.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "calibrate" / "parallel_host_ops.py"), "--layers",
                           "1", "2", "--rounds", "1", "--steps", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counted = {k: v["collectives"] for k, v in json.loads(out.read_text())["per_block_micro_batch"].items()}
    sys.path[:0] = [str(ROOT / "bench" / "calibrate"), str(ROOT / "bench")]
    import parallel_host_ops

    planned = {}
    for name, layout in parallel_host_ops.LAYOUTS.items():
        per = []
        for layers in (1, 2):
            cfg = load_config(None, parallel_host_ops._sets(layout, layers))
            lay = layout_of(cfg, parallel_host_ops.WORLD)
            per.append(issued_collectives(shape_of(cfg), training_of(cfg), lay) / lay.num_microbatches)
        planned[name] = per[1] - per[0]
    assert counted == {**planned, "tp2_sp": planned["tp2_sp"] + 2}, (counted, planned)


def test_one_gpu_validation_is_refittable_on_cpu(tmp_path):
    """bench/planner_validate.py's one-process form records what planner/refit.py needs to fit a card on it:
    each row's settings and whether it is held out, the device, its memory and the host terms measured."""
    from teratrain.planner.refit import refit

    out = tmp_path / "validate.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "planner_validate.py"), "--smoke", "--only",
                           "tiny full", "--out", str(out), "--profile", "--table"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["held_out"] is False and "memory.recompute=full" in row["sets"] and row["measured_step_s"] > 0
    assert row["predicted_gpu_s"] > 0 and row["predicted_host_s"] > 0 and row["profile"]["window_ms"] >= 0
    assert "| tiny full | 0.0 / " in proc.stdout and result["garbage collector"].startswith("frozen")
    assert result["gpus"] == 1 and result["device_mem_gib"] > 0 and result["hw"]["host_adam_params_per_s"] > 0
    report = refit(result)  # the row plans again from its settings, with the host terms measured
    assert report["changes"]["host_adam_params_per_s"][1] == result["hw"]["host_adam_params_per_s"]
