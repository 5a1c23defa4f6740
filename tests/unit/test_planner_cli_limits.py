"""`teratrain plan` at its limits: hardware assumptions out of range are one sentence (not a
ZeroDivisionError), a layout that does not fit still prints its JSON, and a bare parameter count is
not held to a batch size it never uses."""

import json

import pytest

from tests.unit.test_planner_cli import GIB, KEYS, plan, plan_json


@pytest.mark.parametrize("hw, words", [
    ("pcie_gbps=0", "--hw pcie_gbps=0"),  # was a ZeroDivisionError
    ("hbm_gbps=-5", "--hw hbm_gbps"),
    ("mem_efficiency=2", "<= 1"),
    ("gpus_per_node=0", ">= 1"),
    ("nvlink_gbps=nan", "--hw nvlink_gbps"),
])
def test_hardware_out_of_range_is_one_sentence(capsys, hw, words):
    rc, out, err = plan(capsys, "--model", "gpt2-124m", "--hw", hw)
    assert rc == 2 and out == "" and "Traceback" not in err
    assert err.startswith("teratrain: error: ") and err.count("\n") == 1 and words in err
    assert plan(capsys, "--model", "gpt2-124m", "--hw", "fragmentation=0")[0] == 0  # zero is fine where it means none


@pytest.mark.long
def test_json_when_nothing_fits_prints_the_leanest_layout_and_exits_2(capsys):
    """Scripts read the JSON; the exit status and the sentence on stderr say it does not fit."""
    rc, out, err = plan(capsys, "--model", "llama-70b", "--gpus", "1", "--gpu-mem", "80", "--json")
    assert rc == 2
    d = json.loads(out)
    assert d["fits"] is False and d["total"] > 80 * GIB and "--gpus" in d["error"]
    assert KEYS <= d.keys() and d["candidates"] and not any(c["fits"] for c in d["candidates"])
    assert err.startswith("teratrain: error: no layout of llama-70b fits") and err.count("\n") == 1
    assert plan_json(capsys, "--model", "gpt2-124m")["fits"] is True


def test_bare_count_with_fixed_degrees_needs_no_batch(capsys):
    """A bare parameter count has no activations, so train.global_batch (32 by default) cannot rule
    out dp=64; its states are sharded 64 ways under ZeRO-3."""
    d = plan_json(capsys, "--params", "1e9", "--set", "parallel.dp=64", "--set", "parallel.zero=3")
    assert d["layout"]["dp"] == 64 and d["layout"]["zero"] == 3
    assert d["optimizer"] == pytest.approx(12e9 / 64, rel=0.01)  # fp32 masters + moments (no 2-byte copy at stage 3)


OFFLOADING = ["--model", "gpt2-124m", "--gpus", "2", "--gpu-mem", "2.2", "--set", "train.global_batch=8",
              "--set", "parallel.tp=1", "--set", "parallel.pp=1"]  # only offloading layouts fit 2.2 GiB


def test_offloaded_state_of_a_node_must_fit_the_host(capsys):
    """Pinned host bytes per GPU x the node's GPUs are held against --host-mem: a plan that fits says
    so, and one that no host of that size can hold is refused in one sentence naming the need."""
    d = plan_json(capsys, *OFFLOADING, "--host-mem", "100", "--top", "100")
    assert d["layout"]["offload"] != "none" and d["host_fits"] and d["host_mem_gib"] == 100
    assert d["host_per_node"] == 2 * d["host"] > 0
    leanest = min(c["host"] for c in d["candidates"] if c["fits"])
    rc, out, err = plan(capsys, *OFFLOADING, "--host-mem", f"{0.99 * 2 * leanest / GIB:.4f}")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert "of host memory on 2 GPU(s)" in err and f"pins 2 x {leanest / GIB:,.1f}" in err
    rc, _, err = plan(capsys, *OFFLOADING, "--host-mem", "-1")
    assert rc == 2 and "--host-mem" in err


def test_host_memory_is_the_targets_unless_the_gpus_are_this_machines(capsys, monkeypatch):
    """Planning 8 GPUs from a machine with none (23.5 GiB of memory): their hosts are assumed to have
    256 GiB per GPU, said in a note, and llama-8b with its optimizer offloaded plans; planning this machine's own 8 GPUs holds the
    offloaded state against its own memory, as --host-mem does against the figure given."""
    from teratrain.planner import cli

    monkeypatch.setattr(cli, "host_memory_gib", lambda: 23.5)
    monkeypatch.setattr(cli, "local_gpu_count", lambda: 0)
    args = ["--model", "llama-8b", "--gpus", "8", "--gpu", "h200", "--set", "parallel.offload=optimizer",
            "--set", "memory.recompute=full", "--set", "parallel.tp=1", "--set", "parallel.pp=1"]
    d = plan_json(capsys, *args)
    assert d["fits"] and d["host_mem_gib"] == 2048 and d["host_fits"] and d["host_per_node"] > 23.5 * GIB
    assert any(n.startswith("host memory: 2,048 GiB per node assumed (256 GiB per GPU x 8 GPUs per node), as "
                            "--gpus 8 is more than the 0 GPU(s) of this machine") for n in d["notes"])
    monkeypatch.setattr(cli, "local_gpu_count", lambda: 8)
    rc, _, err = plan(capsys, *args)
    assert rc == 2 and "23.5 GiB of host memory" in err and "--host-mem" in err
    assert plan_json(capsys, *args, "--host-mem", "2048")["host_mem_gib"] == 2048


def test_the_gpu_count_advised_is_the_fewest_that_fits():
    """Not the next power of two: gpt2-124m in 1.2 GiB a GPU does not fit 2 GPUs, fits 3 (doubling said 4)."""
    from teratrain.config import load_config
    from teratrain.planner.hardware import GPUS
    from teratrain.planner.inputs import fixed_of, shape_of, training_of
    from teratrain.planner.search import search, smallest_gpu_count

    cfg = load_config(None, ["model.preset=gpt2-124m", "train.global_batch=8", "memory.precision=bf16"])
    shape, train, h100 = shape_of(cfg), training_of(cfg), GPUS["h100"]
    assert smallest_gpu_count(shape, train, 2, h100, fixed_of(cfg), 1.2) == 3
    for n, fits in ((2, False), (3, True)):
        assert any(c.fits for c in search(shape, train, n, h100, fixed_of(cfg), 1.2)) == fits


def test_the_states_floor_is_under_every_layouts_total():
    """smallest_gpu_count skips a layout whose least_total (states, context, fragmentation) overfills the GPU:
    sound only if the floor is never above plan_memory's total, dense or MoE, any ZeRO stage or offload."""
    from teratrain.config import load_config
    from teratrain.planner.hardware import GPUS
    from teratrain.planner.inputs import fixed_of, shape_of, training_of
    from teratrain.planner.memory import least_total, plan_memory
    from teratrain.planner.search import layouts

    for preset in ("gpt2-124m", "moe-tiny"):
        cfg = load_config(None, [f"model.preset={preset}", "train.global_batch=8", "memory.precision=bf16"])
        shape, train, h100 = shape_of(cfg), training_of(cfg), GPUS["h100"]
        for n in (1, 4):
            lays = list(layouts(shape, train, n, h100, fixed_of(cfg)))
            assert {lay.zero for lay in lays} >= {0, 3} and len({lay.offload for lay in lays}) > 1
            for lay in lays:
                assert least_total(shape, train, lay, h100) <= plan_memory(shape, train, lay, h100).total, lay
