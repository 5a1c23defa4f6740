"""bench/reshard.py --smoke: the GPU benchmark's script itself, on 2 then 1 gloo CPU processes (fp32):
its resumed run continues like the unchanged one (1e-5), and it reports sizes and speeds."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
def test_reshard_bench_smoke(tmp_path):
    out = tmp_path / "reshard.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "reshard.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["saved_at"] == {"dp": 2, "zero": 3, "world": 2} and r["resumed_at"] == {"dp": 1, "zero": 1, "world": 1}
    assert r["ok"] and r["max_rel_loss_diff"] <= 1e-5 and len(r["losses_resumed"]) == 5
    assert r["checkpoint_gb"] > 0 and r["save_s"] > 0 and r["load_s"] > 0 and r["load_gb_per_s"] > 0
