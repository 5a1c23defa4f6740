"""The layout matrix at small shapes under NCCL (bench/layouts.py --small): every strategy and
composition that fits the machine's GPUs trains like one GPU (fp32 within 1e-4 relative on every
step's loss over 3 steps, bf16 within 2e-2 over 5), asynchronous schedules keep their weight-stashing
invariants, the rows of tensor parallelism alone keep one block's bytes within 1% of the planner's count, and
nothing hangs. One run checks a change to any engine."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu(2)
@pytest.mark.parametrize("gpus", [2, 4])
def test_every_layout_matches_one_gpu(gpus, tmp_path):
    import torch

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    out = tmp_path / "layouts.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "layouts.py"), "--small", "--gpus", str(gpus),
                           "--fp32-steps", "3", "--bf16-steps", "5", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert out.exists(), done.stderr[-3000:]
    rows = json.loads(out.read_text())["layouts"]
    bad = [r for r in rows if not r["ok"] or not r.get("block_bytes_ok", True)]
    assert not bad, json.dumps(bad, indent=1)[:3000]
    assert any("block_bytes" in r for r in rows)
