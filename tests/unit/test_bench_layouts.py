"""bench/layouts.py's verdict on a parity row: tolerances fixed before the run (fp32 1e-4, bf16 2e-2; MoE rows in
bf16: the mean of the last half of the steps within 1%),
one GPU's own bf16 noise floor recorded beside the row but never widening the tolerance; a failing row
says why. The fine-grained MoE model and its rows."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import layouts  # noqa: E402


def test_an_moe_row_past_2e2_fails_even_inside_its_noise_floor():
    row = {"fp32_rel_err": 4.5e-5, "bf16_rel_err": 4.1e-2, "bf16_noise_floor": 2.6e-2}
    assert not layouts.parity_ok(row)
    assert layouts.parity_reason(row) == "bf16 4.1e-02 over 2e-02 (one GPU against itself: 2.6e-02)"


def test_a_row_within_both_tolerances_passes_with_no_reason():
    row = {"fp32_rel_err": 9.8e-8, "bf16_rel_err": 1.5e-3, "bf16_noise_floor": 9.5e-4}
    assert layouts.parity_ok(row) and layouts.parity_reason(row) is None


def test_the_table_shows_a_failing_row_as_failing_with_its_reason():
    rows = [{"name": "ep2-tp2", "gpus": 4, "fp32_rel_err": 4.5e-5, "bf16_rel_err": 4.1e-2, "bf16_noise_floor": 2.6e-2,
             "tokens_per_s": 64079.0, "speedup_vs_one_gpu": 0.91, "mfu": 0.048, "peak_gib": 9.18, "ok": False},
            {"name": "dp2-compile", "gpus": 2, "fp32_rel_err": 9.8e-8, "bf16_rel_err": 5.2e-4,
             "bf16_noise_floor": 6e-4, "tokens_per_s": 223908.0, "speedup_vs_eager_one_gpu": 2.1, "mfu": 0.4,
             "peak_gib": 12.3, "ok": True}]
    failing, compiled = layouts.table(rows).splitlines()[2:]
    assert failing.endswith("| no: bf16 4.1e-02 over 2e-02 (one GPU against itself: 2.6e-02) |")
    assert "| - (compiled) |" in compiled and compiled.endswith("| yes |")  # no ratio across modes


def test_an_fp8_row_is_judged_on_bf16_alone():
    row = {"name": "dp2-fp8", "gpus": 2, "check": "parity-bf16", "bf16_rel_err": 3e-3, "bf16_noise_floor": 1e-3,
           "tokens_per_s": 1.0, "speedup_vs_one_gpu": 1.9, "mfu": 0.3, "peak_gib": 1.0, "ok": True}
    assert layouts.parity_ok(row) and layouts.parity_reason(row) is None
    assert "| - (fp8: bf16 only) |" in layouts.table([row])
    assert not layouts.parity_ok({**row, "bf16_rel_err": 3e-2})


def test_an_moe_row_is_judged_in_bf16_on_the_mean_of_its_last_half():
    """MoE rows (fixed before their run): the mean loss of the last 10 of 20 bf16 steps within 1% of one GPU's;
    a worst step past 2e-2 no longer fails them, a mean past 1% does, and the reason says which check."""
    ref = [10.0 - 0.1 * i for i in range(20)]
    near = [x * (1 + (0.04 if i % 2 else -0.04)) for i, x in enumerate(ref)]  # 4% either way, step by step
    assert layouts.tail(ref) == ref[10:] and layouts.tail_rel(near, ref) < layouts.MOE_BF16_TOL
    row = {"fp32_rel_err": 4.5e-5, "bf16_rel_err": 4e-2, "bf16_noise_floor": 2.6e-2, "bf16_check": "tail-mean",
           "bf16_tail_rel_err": layouts.tail_rel(near, ref), "bf16_tail_noise_floor": 3e-3}
    assert layouts.parity_ok(row) and layouts.parity_reason(row) is None
    drifted = {**row, "bf16_tail_rel_err": layouts.tail_rel([x * 1.012 for x in ref], ref)}
    assert not layouts.parity_ok(drifted)
    assert layouts.parity_reason(drifted) == "bf16 mean of the last half 1.2e-02 over 1e-02 (one GPU against itself: 3.0e-03)"
    assert not layouts.parity_ok({**row, "fp32_rel_err": 2e-4})  # fp32 stays per step
    cells = layouts.table([{**row, "name": "ep2", "gpus": 2, "tokens_per_s": 1.0, "speedup_vs_one_gpu": 1.0,
                            "mfu": 0.1, "peak_gib": 1.0, "ok": True}])
    tail = f"{row['bf16_tail_rel_err']:.1e}"  # the 4% steps of either sign average to 2.3e-04
    assert tail == "2.3e-04" and cells.endswith("| yes |")
    assert f"| 4.5e-05 | {tail} (3.0e-03) mean of last half; worst step 4.0e-02 |" in cells


def test_moe_runs_are_deterministic_on_both_sides_and_dense_ones_are_not():
    from types import SimpleNamespace

    args = SimpleNamespace(smoke=True, small=False)
    for model, on in (("moe", True), ("moe-cp", True), ("moe-fine", True), ("dense", False)):
        for precision in ("fp32", "bf16"):
            assert layouts._config(args, {"sets": [], "model": model}, precision).train.deterministic is on


def test_the_fine_grained_moe_has_its_ep_rows_at_2_and_4_gpus():
    """The MoE of recent models (32 narrow experts, top-4, a gated shared expert, sigmoid scores normalized
    over the chosen, bias balancing) beside each 8-expert ep row: ep2, ep4, ep2 x tp2, ep2 x dp2 ZeRO-1, pp2 x ep2."""
    from types import SimpleNamespace

    fine = {n: {lay["name"]: lay for lay in layouts.layouts(n) if lay["model"] == "moe-fine"} for n in (2, 4)}
    assert set(fine[2]) == {"ep2-fine"}
    assert set(fine[4]) == {"ep4-fine", "ep2-tp2-fine", "ep2-dp2-zero1-fine", "pp2-ep2-fine"}
    eight = {lay["name"]: lay["sets"] for n in (2, 4) for lay in layouts.layouts(n) if lay["model"] == "moe"}
    assert all(lay["sets"] == eight[name.removesuffix("-fine")] and lay["check"] == "parity"
               for rows in fine.values() for name, lay in rows.items())
    assert "moe-fine" in layouts.MOE_MODELS  # judged in bf16 on the mean of the last half, like the 8 experts
    for smoke, small, width in ((True, False, 16), (False, True, 16), (False, False, 704)):
        cfg = layouts._config(SimpleNamespace(smoke=smoke, small=small), fine[4]["pp2-ep2-fine"], "fp32")
        moe = cfg.model.moe
        assert (moe.num_experts, moe.k, moe.capacity, cfg.model.expert_ffn_dim) == (32, 4, 0.0, width)
        assert (moe.shared_experts, moe.shared_gate, moe.score, moe.normalize_topk) == (1, True, "sigmoid", True)
        assert moe.balance == "bias" and moe.aux_loss_weight == 0.0
        assert 32 * width == 8 * cfg.model.d_ff  # the 8-expert model's expert parameters, cut in 4
        assert (cfg.parallel.pp, cfg.parallel.ep) == (2, 2)


def test_an_expert_bias_differs_by_its_largest_entry_and_other_layers_by_inf():
    ref = {"0": [0.0, 2e-3, -1e-3], "1": [1e-3, 0.0, -1e-3]}
    assert layouts._bias_diff(ref, ref) == 0.0
    assert layouts._bias_diff({**ref, "1": [1e-3, 2e-3, -1e-3]}, ref) == 2e-3
    assert layouts._bias_diff({"0": ref["0"]}, ref) == float("inf")  # a stage's layers missing


def test_the_matrix_has_empty_end_stages_and_the_per_op_policy_on_tensor_parallel_shards():
    """Pipelines whose first or last stage holds no block, and selective-ops on tp shards, at 2 and 4 GPUs; the
    rows of tensor parallelism alone (and only they) count one block's bytes against the planner."""
    rows = {n: {lay["name"]: lay for lay in layouts.layouts(n)} for n in (2, 4)}
    empty = {n: {k: v["sets"] for k, v in r.items() if "empty" in k} for n, r in rows.items()}
    assert set(empty[2]) == {"pp2-1f1b-first-empty", "pp2-zb-h1-last-empty", "pp2-interleaved-ends-empty"}
    assert set(empty[4]) == {"pp4-1f1b-ends-empty", "tp2-pp2-1f1b-first-empty"}
    assert all(any(s.startswith("parallel.stage_layers=[0") or s.endswith(", 0]") for s in sets)
               for by_name in empty.values() for sets in by_name.values())
    assert "memory.recompute=selective-ops" in rows[2]["tp2-megatron-sp-selective-ops"]["sets"]
    assert "memory.recompute=selective-ops" in rows[4]["tp2-dp2-zero3-selective-ops"]["sets"]
    counted = {n: sorted(k for k, v in r.items() if layouts._counts_blocks(v)) for n, r in rows.items()}
    assert counted[2] == sorted(k for k in rows[2] if k.startswith("tp2-") and k != "tp2-fp8")
    assert counted[4] == sorted(k for k in rows[4] if k.startswith("tp4-") and k != "tp4-fp8")


def test_the_table_shows_a_blocks_bytes_beside_the_planners_and_a_miss_as_a_miss():
    row = {"name": "tp2-megatron-sp", "gpus": 2, "fp32_rel_err": 0.0, "bf16_rel_err": 1e-3, "bf16_noise_floor": 1e-3,
           "tokens_per_s": 1.0, "speedup_vs_one_gpu": 1.0, "mfu": 0.1, "peak_gib": 1.0, "ok": True,
           "block_bytes": 127744, "block_bytes_planned": 127744, "block_bytes_ok": True}
    assert "| 1.0 | 125 (125) | yes |" in layouts.table([row])
    off = {**row, "block_bytes": 130 * 1024, "block_bytes_ok": False}
    assert "| 130 (125): off by more than 1% | yes; block bytes: no |" in layouts.table([off])
    assert "| 1.0 | - | yes |" in layouts.table([{k: v for k, v in row.items() if not k.startswith("block")}])
