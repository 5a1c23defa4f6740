"""bench/moe.py --smoke: the benchmark script runs end to end on 2 gloo processes (tiny shapes, fp32)
and prints the JSON the GPU run reports, its parity check exact (the GPU figures themselves are a
benchmark, not a test)."""

import json
import subprocess
import sys

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
def test_moe_bench_smoke():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "moe.py"), "--smoke", "--a2a-chunks", "4"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert (d["world"], d["eps"]) == (2, [1, 2])
    assert d["parity"]["max_rel_loss_diff"] < 1e-5  # fp32: experts over 2 ranks equal one process
    dense = d["dense"]
    assert set(d["moe_vs_dense"]) == {"moe_ep1", "moe_ep2", "moe_ep2_dropless", "moe_ep2_chunks4",
                                      "moe_ep2_dropless_chunks4", "one_gpu_moe_ep1"}
    # one GPU (the default): rank 0 alone, the same per-GPU batch; every run per GPU over one GPU's same model kind
    one = {"dense": d["one_gpu_dense"], "moe": d["one_gpu_moe_ep1"]}
    assert d["moe_vs_dense"].pop("one_gpu_moe_ep1") == round(one["moe"]["tokens_per_s"] / one["dense"]["tokens_per_s"], 4)
    assert d["modes"] == ["eager"] and set(d["per_gpu_efficiency_same_mode"]) == {"dense", *d["moe_vs_dense"]}
    for name, scaling in d["per_gpu_efficiency_same_mode"].items():
        base = one["dense" if name == "dense" else "moe"]["tokens_per_s"]
        assert scaling == round(d[name]["tokens_per_s"] / 2 / base, 4)
    for name, ratio in d["moe_vs_dense"].items():
        moe = d[name]
        assert moe["tokens_per_s"] > 0 and ratio == round(moe["tokens_per_s"] / dense["tokens_per_s"], 4)
        assert 0 <= moe["dropped"] < 1 and (moe["dropped"] == 0) == ("dropless" in name)
        if "ep2" in name and "dropless" not in name:  # every expert's 1.25x-share slots cross, used or not
            assert 1 - (1 - moe["dropped"]) / 1.25 - 1e-3 <= moe["exchange_padding"] < 1
        else:
            assert "exchange_padding" not in moe
        assert ("all_to_all_share" in moe) == (name != "moe_ep1")
        assert moe["active_params"] - dense["active_params"] == 2 * 8 * 64  # each of the 2 layers' router (8 x d_model)
        assert moe["params"] > 2 * dense["params"]
    assert 0 < d["moe_ep2"]["all_to_all_share"] < 1
    assert set(d["a2a_overlap"]) == {"ep2_chunks4", "ep2_dropless_chunks4"}  # chunked runs against whole ones
    for name, o in d["a2a_overlap"].items():
        whole, chunked = d[f"moe_{name.split('_chunks')[0]}"], d[f"moe_{name}"]
        assert (o["share_chunks1"], o["share_chunked"]) == (whole["all_to_all_share"], chunked["all_to_all_share"])
        assert 0 < o["share_chunked"] < 1
        assert o["tokens_per_s_vs_chunks1"] == round(chunked["tokens_per_s"] / whole["tokens_per_s"], 4)


@pytest.mark.long
def test_moe_bench_reorder_runs_each_exchanging_moe_once_more_compiled():
    """--reorder: the compiled MoE at ep > 1 once more with train.compile_overlap, no graph break."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "moe.py"), "--smoke", "--compile", "--compile-only",
                          "--reorder", "--a2a-chunks", "1", "--only", "moe_ep1,moe_ep2", "--parity-steps", "0",
                          "--no-one-gpu"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"moe_ep1_compiled", "moe_ep2_compiled", "moe_ep2_reorder_compiled"} <= set(d)
    assert "moe_ep1_reorder_compiled" not in d  # nothing to reorder without an exchange
    assert d["moe_ep2_reorder_compiled"]["graph_breaks"]["count"] == 0 and d["moe_ep2_reorder_compiled"]["tokens_per_s"] > 0
