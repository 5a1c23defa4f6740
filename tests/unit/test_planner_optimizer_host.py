"""The optimizer step's host term (planner/time.py optimizer_s): teratrain's AdamW kernel is one launch a group,
its step an HBM sweep; the runs recorded while it was launched a tensor at a time, so that a model of many small
tensors had its step paced by the host (gpt2-350m's 388 tensors on one H100, 24.7 ms against a 4.2 ms sweep:
tests/fixtures/planner_runs/h100_2026-12-05.json), are planned so."""

from dataclasses import replace

import pytest
import torch

from teratrain.cli import main
from teratrain.config import load_config
from teratrain.measure import build_engine
from teratrain.planner.hardware import GPUS
from teratrain.planner.inputs import layout_of, shape_of, training_of
from teratrain.planner.states import stepped_tensors
from teratrain.planner.time import optimizer_s


@pytest.mark.parametrize("sets", [["model.preset=tiny", "model.arch=gpt2"], ["model.preset=tiny"],
                                  ["model.preset=tiny", "lora.rank=4"]])
def test_the_tensors_planned_are_those_the_engine_steps(sets):
    cfg = load_config(None, sets + ["train.device=cpu", "train.micro_batch=1", "train.global_batch=1"])
    _, engine = build_engine(cfg, torch.device("cpu"))
    stepped = sum(len(g["params"]) for g in engine.optimizer.param_groups)
    assert stepped_tensors(shape_of(cfg), training_of(cfg), layout_of(cfg, 1)) == stepped


def test_the_kernel_step_is_its_sweep_and_the_recorded_per_tensor_launches_are_priced():
    cfg = load_config(None, ["model.preset=gpt2-350m"])
    shape, train, lay = shape_of(cfg), training_of(cfg), layout_of(cfg, 1)
    w, gpu, n = train.widths(0, "none"), GPUS["h100"], 3.5e8
    sweep = optimizer_s(train, w, n, gpu)
    many = stepped_tensors(shape, train, lay)
    assert many > 300 and optimizer_s(train, w, n, gpu, many) == sweep  # a launch a group: the sweep
    recorded = replace(train, adamw_per_tensor=True)  # a launch a tensor (the runs recorded before)
    assert optimizer_s(recorded, w, n, gpu, 10) == sweep
    assert optimizer_s(recorded, w, n, gpu, many) == pytest.approx(many * gpu.host_optimizer_tensor_s)
    torch_step = replace(train, torch_adamw=True)
    assert optimizer_s(torch_step, w, n, gpu, many) == optimizer_s(torch_step, w, n, gpu)


def test_as_ran_reads_how_a_recorded_run_launched_the_kernel():
    from teratrain.planner.refit import as_ran

    train = training_of(load_config(None, ["model.preset=gpt2-350m"]))
    assert as_ran(train, {"adamw": "teratrain kernel"}).adamw_per_tensor
    now = as_ran(train, {"adamw": "teratrain kernel, a launch a group"})
    assert not now.adamw_per_tensor and not now.torch_adamw
    assert as_ran(train, {}).torch_adamw and as_ran(train, {"adamw": "torch fused"}).torch_adamw


def test_plan_names_the_optimizer_step_a_sweep(capsys):
    assert main(["plan", "--model", "gpt2-350m", "--gpus", "1"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("optimizer step"))
    assert "teratrain's AdamW kernel" in line and "a launch a group" in line and "host-paced" not in line
    assert main(["plan", "--model", "gpt2-350m", "--gpus", "1", "--set", "optim.kernel=torch"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("optimizer step"))
    assert "fused AdamW sweep" in line
