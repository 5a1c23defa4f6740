"""bench/common.py GpuClocks: what nvidia-smi printed while a step ran, summarised over the samples that found the
GPU busy (an idle sample's clock says nothing of the step's), fields a card does not report skipped; and
bench/sustained_gemm.py end to end on CPU."""

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
