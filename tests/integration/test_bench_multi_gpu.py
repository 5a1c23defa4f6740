"""bench/multi_gpu.py --smoke (parity, scaling, offload, and bench/fsdp2_compare.py): the GPU benchmark's
scripts themselves on 2 gloo CPU processes, tiny shapes. Over two minutes on 2 cores: `long`, so
outside the default run (`pytest -m long tests/integration/test_bench_multi_gpu.py`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long
ROOT = Path(__file__).resolve().parents[2]


def test_multi_gpu_bench_smoke(tmp_path):
    out = tmp_path / "multi_gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "multi_gpu.py"), "--smoke", "--only",
                           "parity,scaling,offload,fsdp2", "--out", str(out)],
                          capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [row["zero"] for row in r["parity"]] == [0, 1, 2, 3]
    assert all(row["within_0.02"] for row in r["parity"])
    assert all(row["tokens_per_s_per_gpu_1"] > 0 and row["tokens_per_s_per_gpu_n"] > 0 for row in r["scaling"])
    assert r["offload"]["tokens_per_s"] > 0 and r["offload"]["model_state_bytes"]["optimizer"] > 0
    for side in ("ours_zero3", "fsdp2"):
        trace = r["fsdp2"][side]["traced_step_rank0"]
        assert trace["peak_mib"] > 0 and trace["largest_sites_at_peak"], side
    assert r["fsdp2"]["ours_zero3"]["model_state_gib"] == pytest.approx(r["fsdp2"]["fsdp2"]["model_state_gib"], rel=0.01)
