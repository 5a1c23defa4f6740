"""The benches that compare against one GPU (bench/tensor_parallel.py, bench/moe.py) put each run against
the one-GPU run of its own mode: eager against eager, compiled against compiled, CUDA graphs against CUDA
graphs. Figures made up so that every mode's one-GPU run differs: a ratio taken across modes would not
give the numbers asserted here."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import moe  # noqa: E402
import tensor_parallel  # noqa: E402

ONE = {"one_gpu": 100.0, "one_gpu_compiled": 125.0, "one_gpu_graphed": 160.0}  # tokens/s, one GPU, per mode


@pytest.mark.parametrize("row, mode, one", [("ours_sp", "eager", "one_gpu"),
                                            ("ours_sp_compiled", "default", "one_gpu_compiled"),
                                            ("ours_sp_async_graphed", "reduce-overhead", "one_gpu_graphed")])
def test_tensor_parallel_efficiency_is_against_one_gpu_in_the_same_mode(row, mode, one):
    shape = {name: {"tokens_per_s": tps} for name, tps in ONE.items()}
    shape[row] = {"tokens_per_s": 240.0}
    shape[row].update(tensor_parallel.against_one_gpu(shape[row], shape[one], shape["one_gpu"], 4))
    assert tensor_parallel.mode_of(row) == mode
    assert shape[row]["per_gpu_efficiency_same_mode"] == round(240.0 / ONE[one] / 4, 4)
    if one == "one_gpu":  # eager: one figure, no second name for it
        assert "per_gpu_efficiency_vs_eager_one_gpu" not in shape[row]
    else:  # the eager baseline, where kept, says so in its name
        assert shape[row]["per_gpu_efficiency_vs_eager_one_gpu"] == round(240.0 / ONE["one_gpu"] / 4, 4)
    assert tensor_parallel.headline({"s": shape}) == {
        "s": {row: {"mode": mode, "per_gpu_efficiency_same_mode": round(240.0 / ONE[one] / 4, 4)}}}


def test_moe_efficiency_and_dense_ratio_are_taken_within_one_mode():
    results = {"dense": {"tokens_per_s": 400.0}, "moe_ep2": {"tokens_per_s": 240.0},
               "dense_graphed": {"tokens_per_s": 600.0}, "moe_ep2_graphed": {"tokens_per_s": 500.0},
               "one_gpu_dense": {"tokens_per_s": 210.0}, "one_gpu_moe_ep1": {"tokens_per_s": 130.0},
               "one_gpu_dense_graphed": {"tokens_per_s": 320.0}, "one_gpu_moe_ep1_graphed": {"tokens_per_s": 270.0}}
    eff = moe.per_gpu_efficiency_same_mode(results, 2)
    assert eff == {"dense": round(400 / 2 / 210, 4), "moe_ep2": round(240 / 2 / 130, 4),
                   "dense_graphed": round(600 / 2 / 320, 4), "moe_ep2_graphed": round(500 / 2 / 270, 4)}
    ratios = moe._vs_dense(results)
    assert ratios["moe_ep2"] == round(240 / 400, 4) and ratios["moe_ep2_graphed"] == round(500 / 600, 4)
    assert ratios["one_gpu_moe_ep1_graphed"] == round(270 / 320, 4)
    assert results["moe_ep2_graphed"]["vs_eager"] == round(500 / 240, 4)


def test_moe_names_its_graphed_runs_graphed():
    class Args:
        compile, compile_only, reorder = True, True, False
        set = ["train.compile_mode=reduce-overhead"]

    assert list(moe.in_modes({"dense": [], "moe_ep2": []}, Args)) == ["dense_graphed", "moe_ep2_graphed"]
    Args.set = []
    assert list(moe.in_modes({"dense": []}, Args)) == ["dense_compiled"]
