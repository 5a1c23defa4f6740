"""bench/step_kernels.py --smoke: the AdamW and MoE-gather benchmark in miniature on the CPU (torch's compiled
foreach AdamW only: the fused and Triton steps need CUDA), so the script the GPU runs use is tested code. The
two gather forms, each compiled, agree with the eager reduction as closely as each other."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_step_kernels_bench_smoke(tmp_path):
    out = tmp_path / "kernels.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "step_kernels.py"), "--smoke", "--iters", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for kind in ("llama-1b", "qwen3-30b-a3b"):
        row = result["adamw"][kind]
        assert row["tensors"] == 10 and row["compiled_foreach_ms"] > 0
    for row in result["moe_gather"].values():
        assert row["dispatch_backward_by_choice_rel_diff"] < 1e-6  # fp32 sums of the same bf16 rows
        assert row["combine_by_choice_rel_diff"] == pytest.approx(row["combine_reduced_rel_diff"], abs=1e-3)
        assert row["combine_by_choice_ms"] > 0 and row["dispatch_backward_reduced_ms"] > 0


def test_vocab_alignment_bench_smoke(tmp_path):
    """bench/vocab_alignment.py --smoke: each of its three forms trains a tiny gpt2-124m (vocabulary 50,257) and
    is timed against the unpadded one."""
    out = tmp_path / "vocab.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vocab_alignment.py"), "--smoke", "--presets",
                           "gpt2-124m", "--steps", "1", "--rounds", "1", "--micro-batch", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(out.read_text())["rows"]["gpt2-124m"]
    assert all(len(row[form]) == 1 and row[form][0] > 0 for form in ("unpadded", "padded", "vocab_rounded"))
    assert row["padded_over_unpadded"] > 0 and row["vocab_rounded_over_unpadded"] > 0
