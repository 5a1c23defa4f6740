"""bench/context.py --smoke: every part of the context-parallel benchmark in miniature on 2 CPU processes
(gloo), through the same worker the GPU runs use; torch's context_parallel peer is skipped there (CUDA
kernels only) and says so. The targets are the GPU runs' (`targets_apply` false here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.mark.long
def test_context_bench_smoke(tmp_path):
    out = tmp_path / "context.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "context.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["part"], r["name"]): r for r in result["rows"]}
    assert set(p for p, _ in rows) == {"memory", "speed", "scaling", "forms"}
    assert not [r for r in rows.values() if "error" in r], [r["error"] for r in rows.values() if "error" in r]
    assert "CUDA" in rows[("speed", "torch-cp2-fsdp2")]["skipped"]
    assert rows[("speed", "cp2-zero3-compiled")]["mode"] == "compiled"
    v = result["verdicts"]
    assert not result["targets_apply"] and 0.45 < v["activations"]["ratio"] < 0.55  # cp=2 keeps half
    assert v["forms_cp2"]["picked"] in ("ring", "all-to-all") and set(v["forms_cp2"]["step_s"]) == {"ring", "all-to-all"}
    assert all(r["tokens_per_s_per_gpu"] > 0 for r in rows.values() if "step_s" in r)
