"""bench/common.py GpuClocks: what nvidia-smi printed while a step ran, summarised over the samples that found the
GPU busy (an idle sample's clock says nothing of the step's), fields a card does not report skipped;
bench/sustained_gemm.py end to end on CPU; and bench/train_step.py's rows carrying the planner's step for them."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
from common import GpuClocks  # noqa: E402


def test_clocks_summarise_the_busy_samples_only(monkeypatch):
    clocks = GpuClocks()
    monkeypatch.setattr("common.card_limits", lambda index=0: {"sm_mhz_max": 1980.0, "power_limit_w": 700.0})
    # sm MHz, power W, temperature C, utilization %
    clocks.lines = ["1980, 120.5, 40, 0", "1740, 690.0, 58, 100", "1620, 699.5, 59, 100", "1700, 680.0, 58, 97",
                    "[N/A], 650.0, 58, 100", "1980, 300.0, 50, 45"]
    assert clocks.summary() == {"sm_mhz": 1700.0, "sm_mhz_min": 1620.0, "power_w": 690.0, "power_w_max": 699.5,
                                "temp_c": 58.0, "busy_samples": 3, "samples": 5, "sm_mhz_max": 1980.0,
                                "power_limit_w": 700.0}
    clocks.lines = ["1980, 120.5, 40, 0"]
    assert clocks.summary() == {}  # no busy sample: nothing to say of the step


def test_sustained_gemm_runs_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH / "sustained_gemm.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["burst_tflops"] > 0 and row["sustained_tflops"] > 0 and row["second_half_clocks"] == {}


def test_train_step_rows_carry_the_planners_step(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(BENCH / "train_step.py"), "--smoke", "--micro-batch", "2", "--impls",
                           "ours_plain", "--modes", "eager", "--steps", "1", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["results"]
    sys.path.insert(0, str(BENCH))
    from common import planned_step
    from train_step import SMOKE

    sets = [*SMOKE, "memory.precision=bf16", "train.grad_clip=1.0", "optim.lr=1e-4", "memory.master_weights=false",
            "memory.loss_chunks=1", "train.micro_batch=2", "train.global_batch=2"]
    step_s, peak = planned_step(sets, "h200")  # off a GPU, the H200's preset
    assert row["planned_step_ms"] == round(step_s * 1e3, 2) > 0 and row["planned_peak_gib"] == round(peak, 2)
    assert row["planned_error_pct"] == round(100 * (row["planned_step_ms"] / row["step_ms"] - 1), 1)
