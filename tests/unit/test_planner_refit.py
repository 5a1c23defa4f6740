"""Refitting the planner from measurements: collective terms recovered from timed sizes, time
constants refitted on the rows not held out, and the report of what would change."""

import json
from dataclasses import replace

import pytest

from teratrain.config import load_config
from teratrain.planner.comm import collective
from teratrain.planner.hardware import GPUS, read_hw_file
from teratrain.planner.inputs import layout_of, shape_of, training_of
from teratrain.planner.refit import fit_alpha_beta, fit_collectives, how_it_runs, refit, render, result_gpu
from teratrain.planner.search import evaluate

SIZES = [2**16, 2**20, 2**23, 2**26, 2**28]


def test_alpha_beta_recovered_from_timed_sizes():
    """Times made by the ring model itself give back its bandwidth and per-step latency."""
    for kind, ranks in (("all_reduce", 4), ("all_gather", 2), ("p2p", 2)):
        times = [collective(kind, ranks, b, 180.0, 7e-6) for b in SIZES]
        f = fit_alpha_beta(kind, ranks, SIZES, times)
        assert f["gbps"] == pytest.approx(180.0, rel=1e-6) and f["alpha_s"] == pytest.approx(7e-6, rel=1e-6)
        assert f["max_rel_err"] < 1e-9
    rows = [{"kind": "all_to_all", "ranks": 2, "bytes": b, "seconds": collective("all_to_all", 2, b, 90.0, 0.0)}
            for b in SIZES]
    hw = fit_collectives(rows)["hw"]
    assert hw["all_to_all_gbps"] == pytest.approx(90.0) and hw["all_to_all_alpha_s"] == pytest.approx(0.0, abs=1e-12)


def _result(scale: float) -> dict:
    """A planner_validate result whose 'measured' steps are the planner's own times x `scale` (as if
    the GPU sustained 1/scale of the assumed FLOP rate), with one row held out. Micro-batches of 2 and
    more: every row's GPU time is over its host's (at 1 the host's issue time binds, with the engine's
    launches: a slower GPU would not scale that row)."""
    sets = ["model.preset=llama-1b", "model.n_layers=4", "model.vocab_size=32000", "memory.precision=bf16"]
    rows = [{"name": f"mb{mb}", "held_out": mb == 8, "sets": sets + [f"train.global_batch={2 * mb}",
                                                                        f"train.micro_batch={mb}"]}
            for mb in (2, 4, 8)]
    result = {"device": "NVIDIA H100 80GB HBM3", "device_mem_gib": 79.2, "gpus": 2, "rows": rows,
              "hw": {"all_reduce_gbps": 200.0, "pcie_gbps": 40.0},
              **how_it_runs(), "adamw": "teratrain kernel, a launch a group"}  # today's code on a GPU
    gpu = result_gpu(result)
    for r in rows:
        cfg = load_config(None, r["sets"])
        r["measured_step_s"] = scale * evaluate(shape_of(cfg), training_of(cfg), layout_of(cfg, 2), gpu).time.step_time_s
    return result


def test_refit_says_what_changes_and_improves_the_held_out_row(tmp_path):
    result = _result(1.25)
    report = refit(result)
    assert report["changes"]["all_reduce_gbps"] == [None, 200.0] and report["changes"]["pcie_gbps"] == [55, 40.0]
    assert report["changes"]["flops_max"][1] < GPUS["h100"].flops_max  # slower than assumed: a lower efficiency
    errs = report["step_time_errors"]
    assert report["host_paced"] == {}  # every row's GPU time is over its host's
    assert errs["measured terms"]["held-out rows"]["max_abs_pct"] == pytest.approx(20.0, abs=0.5)  # 1/1.25 - 1
    assert errs["refit"]["held-out rows"]["max_abs_pct"] < 5 and errs["refit"]["fit rows"]["rows"] == 2
    text = render(report)
    assert "flops_max" in text and "unset (NVLink's) -> 200" in text and "--hw pcie_gbps=40" in text
    # the terms the planner would take, through the same file reader `teratrain plan --hw-file` uses
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    assert read_hw_file(str(path))[0] == {"all_reduce_gbps": 200.0, "pcie_gbps": 40.0}
    assert replace(GPUS["h100"], **read_hw_file(str(path))[0]).link("all_reduce", 2)[0] == 200.0


def test_host_costs_recovered_from_the_host_probe():
    """The host probe's rows (bench/planner_rows.py) timed as the planner's own host time with known
    costs per op and per tp collective give those costs back; the tp probes issue collectives (SP
    more than plain tp) and the same ops as the probe without tp."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from planner_rows import probe_rows

    from teratrain.planner.refit import fit_host
    from teratrain.planner.time import DP_LAUNCH_SHARE, eager_ops, host_s

    truth = replace(GPUS["h200"], host_op_s=21e-6, host_collective_s=0.35e-3, host_launch_s=0.12e-3)
    rows = []
    for gpus in (2, 4):
        for row in probe_rows(gpus):
            cfg = load_config(None, row["sets"])
            shape, train, lay = shape_of(cfg), training_of(cfg), layout_of(cfg, gpus)
            rows.append({**row, "measured_step_s": host_s(shape, train, lay, truth, eager_ops(shape, train, lay))})
        fit = fit_host(rows[-4:], gpus)
        assert fit["hw"]["host_op_s"] == pytest.approx(21e-6, rel=1e-6)
        assert fit["hw"]["host_collective_s"] == pytest.approx(0.35e-3, rel=1e-6)
        assert fit["hw"]["host_launch_s"] == pytest.approx(0.12e-3, rel=1e-6)
        dp, tp, sp, zero3 = fit["fit"]
        assert dp["collectives"] == zero3["collectives"] == 0 < tp["collectives"] < sp["collectives"]
        assert dp["ops"] == tp["ops"] and 0 < dp["launches"] < zero3["launches"]  # ZeRO-3: bf16 params, fewer casts
        # a run recorded without the ZeRO-3 probe: two costs, a launch at DP_LAUNCH_SHARE of one
        older = fit_host(rows[-4:-1], gpus)
        assert set(older["hw"]) == {"host_op_s", "host_collective_s"}
        assert older["fit"][0]["fitted_s"] == pytest.approx(
            dp["ops"] * older["hw"]["host_op_s"] + dp["launches"] * DP_LAUNCH_SHARE * older["hw"]["host_collective_s"])
    # without the probe that has neither tp nor ZeRO, nothing is fitted
    empty = fit_host(rows[-3:-1], 4)
    assert empty["hw"] == {} and empty["host_loop_us"] is None  # planner_report.measured_hw reads both


def test_costs_are_non_negative_least_squares():
    """refit._costs: exact where the rows allow it, and the best fit with a cost pinned at 0 where an
    unconstrained fit would make it negative (checked against every non-negative pair on a grid)."""
    from teratrain.planner.refit import _costs

    rows = [(10.0, 0.0, 1.0), (10.0, 4.0, 1.0), (8.0, 2.0, 6.0), (12.0, 7.0, 2.0)]
    truth = (2e-5, 3e-4, 1e-4)
    seconds = [sum(c * x for c, x in zip(r, truth)) for r in rows]
    assert _costs(rows, seconds) == pytest.approx(truth, rel=1e-9)
    # times that fall as collectives rise: the collective cost pins at 0, the op cost alone fits
    two = [(10.0, 0.0), (10.0, 5.0), (20.0, 10.0)]
    falling = [1.0, 0.9, 1.9]
    a, b = _costs(two, falling)
    assert b == 0.0 and a > 0

    def loss(x, y):
        return sum(((o * x + c * y) / t - 1) ** 2 for (o, c), t in zip(two, falling))

    grid = [(a * i / 50, j * 1e-3) for i in range(25, 76) for j in range(0, 30)]
    assert loss(a, b) <= min(loss(x, y) for x, y in grid) + 1e-12


def test_host_paced_rows_are_reported_not_fitted():
    """A row at micro-batch 1 whose host binds, visited twice: listed with its error and the host's spread."""
    result = _result(1.25)
    row = {"name": "mb1", "held_out": False, "visits_s": [0.2, 0.25],
           "sets": result["rows"][0]["sets"][:4] + ["train.global_batch=2", "train.micro_batch=1",
                                                   "model.d_model=64", "model.n_heads=2"]}
    cfg = load_config(None, row["sets"])
    cand = evaluate(shape_of(cfg), training_of(cfg), layout_of(cfg, 2), result_gpu(result))
    assert cand.time.host_paced
    row["measured_step_s"] = cand.time.step_time_s
    result["rows"].append(row)
    report = refit(result)
    assert report["host_paced"] == {"mb1": {"error_pct": 0.0, "spread_pct": 25.0}}
    assert report["step_time_errors"]["refit"]["fit rows"]["rows"] == 2
    assert "host-paced, not fitted: mb1 +0.0% (the host's spread over its visits 25.0%)" in render(report)


def test_refit_refuses_a_held_out_run():
    with pytest.raises(ValueError, match='split = "held_out".*only fits on runs marked split = "fit"'):
        refit(_result(1.0), split="held_out")


def test_calibration_files_give_every_preset_its_constants():
    """Each card's preset takes every constant its calibration/<card>.toml names; each entry says the term it
    scales, where it was fitted and its error there; common.toml's constants are time.py's."""
    from dataclasses import fields

    from teratrain.planner import time as planner_time
    from teratrain.planner.hardware import GPU, calibration

    names = {f.name for f in fields(GPU)}
    for card, gpu in GPUS.items():
        entries = calibration(card)
        assert {"flops_max", "flops_d_half", "op_overhead_s"} <= set(entries) <= names, card
        for key, entry in entries.items():
            assert getattr(gpu, key) == entry["value"] and {"term", "source", "runs", "fit_error"} <= set(entry), key
    common = calibration("common")
    assert planner_time.MOE_HOST_OP_SHARE_SORTED == common["moe_host_op_share"]["value"]
    assert planner_time.MOE_HOST_OP_SHARE == common["moe_host_op_share"]["value"] * common["moe_running_count_op_share"]["value"]
    assert planner_time.DP_LAUNCH_SHARE == common["dp_launch_share"]["value"]
    for key in ("compiled_ops_share", "compiled_loss_bytes_per_logit", "compiled_fused_bytes"):
        assert getattr(planner_time, key.upper()) == common[key]["value"], key
    assert all({"term", "source", "runs", "fit_error"} <= set(entry) for entry in common.values())


def test_write_calibration_rewrites_one_entry(tmp_path):
    from teratrain.planner.hardware import CALIBRATION, calibration
    from teratrain.planner.refit import write_calibration

    path = tmp_path / "a100.toml"
    path.write_text((CALIBRATION / "a100.toml").read_text())
    write_calibration("a100", {"flops_max": {"value": 0.5, "source": "s.py", "runs": ["r1"], "fit_error": "2%"}}, path)
    text = path.read_text()
    assert text.startswith("# The A100 preset")  # the header comment stays
    import tomllib

    new, old = tomllib.loads(text), calibration("a100")
    assert new["flops_max"] == {**old["flops_max"], "value": 0.5, "source": "s.py", "runs": ["r1"], "fit_error": "2%"}
    assert {k: v for k, v in new.items() if k != "flops_max"} == {k: v for k, v in old.items() if k != "flops_max"}
    with pytest.raises(ValueError, match=r"no \[nope\] entry"):
        write_calibration("a100", {"nope": {"value": 1.0}}, path)


def test_calibration_updates_take_the_fitted_constants_of_a_report():
    from teratrain.planner.refit import calibration_updates

    report = {"changes": {"flops_max": [0.84, 0.7], "pcie_gbps": [55, 40.0], "context_gib": [0.75, 0.6]},
              "step_time_errors": {"refit": {"fit rows": {"rows": 2, "max_abs_pct": 1.0, "median_abs_pct": 0.5},
                                             "held-out rows": {"rows": 0, "max_abs_pct": None, "median_abs_pct": None}}}}
    updates = calibration_updates(report, "r.json")
    assert updates["flops_max"] == {
        "value": 0.7, "source": "bench/planner_validate.py --refit", "runs": ["r.json"],
        "fit_error": "fit rows: 2 rows, max 1.0%, median 0.5%"}
    # the allowance's context is measured, not fitted to the step times; measured terms (pcie_gbps) stay --hw-file's
    assert updates["context_gib"]["value"] == 0.6 and "outside the allocator" in updates["context_gib"]["fit_error"]
    assert set(updates) == {"flops_max", "context_gib"}
