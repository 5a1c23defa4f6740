"""Each multi-GPU benchmark runs end to end in its --smoke mode (2 gloo CPU processes, tiny shapes),
so the scripts the GPU runs use are tested code. The GPU figures themselves are in bench/README.md."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["tensor_parallel.py"])
def test_bench_smoke(script, tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(ROOT / "bench" / script),
           "--smoke", "--out", str(out)] + (["--profile"] if script == "tensor_parallel.py" else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tp"] == 2  # bf16 autocast: one process and tp, plain and overlapped, agree within 2e-2
    assert result["parity"]["tp_max_rel_diff"] < 2e-2 and result["parity"]["tp_chunked_max_rel_diff"] < 2e-2
    (shape,) = result["shapes"].values()
    for variant in ("one_gpu", "ours_no_sp", "ours_sp", "ours_sp_chunked2", "ours_sp_chunked4", "dtensor_no_sp",
                    "dtensor_sp"):
        assert shape[variant]["tokens_per_s"] > 0, variant
    assert shape["ours_sp_chunked2"]["profile"]["top_ops"] and shape["dtensor_sp"]["profile"]["top_ops"]
