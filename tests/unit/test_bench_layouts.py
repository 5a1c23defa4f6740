"""bench/layouts.py's verdict on a parity row: tolerances fixed before the run (fp32 1e-4, bf16 2e-2),
one GPU's own bf16 noise floor recorded beside the row but never widening the tolerance; a failing row
says why."""

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
