"""bench/moe.py --smoke: the benchmark script runs end to end on 2 gloo processes (tiny shapes, fp32)
and prints the JSON the GPU run reports, its parity check exact (the GPU figures themselves are a
benchmark, not a test)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_moe_bench_smoke():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "moe.py"), "--smoke"], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert (d["world"], d["ep"]) == (2, 2)
    assert d["parity"]["max_rel_loss_diff"] < 1e-5  # fp32: experts over 2 ranks equal one process
    moe, dense = d["moe"], d["dense"]
    assert moe["tokens_per_s"] > 0 and dense["tokens_per_s"] > 0
    assert d["moe_vs_dense"] == round(moe["tokens_per_s"] / dense["tokens_per_s"], 4)
    assert 0 < moe["all_to_all_share"] < 1 and 0 <= moe["dropped"] < 1
    # the same active weights but each of the 2 layers' router (8 x d_model)
    assert moe["active_params"] - dense["active_params"] == 2 * 8 * 64
    assert moe["params"] > 2 * dense["params"]
