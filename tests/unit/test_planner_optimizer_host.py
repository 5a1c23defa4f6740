"""The optimizer step's host term (planner/time.py optimizer_s): teratrain's AdamW kernel is launched a tensor at
a time, so a model of many small tensors has its step paced by the host (gpt2-350m's 388 tensors on one H100,
24.7 ms against a 4.2 ms sweep: tests/fixtures/planner_runs/h100_2026-12-05.json), torch's multi-tensor step not."""

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


def test_the_kernel_step_takes_the_longer_of_its_sweep_and_its_launches():
    cfg = load_config(None, ["model.preset=gpt2-350m"])
    shape, train, lay = shape_of(cfg), training_of(cfg), layout_of(cfg, 1)
    w, gpu, n = train.widths(0, "none"), GPUS["h100"], 3.5e8
    sweep = optimizer_s(train, w, n, gpu)
    assert optimizer_s(train, w, n, gpu, 10) == sweep  # a few tensors: the sweep
    many = stepped_tensors(shape, train, lay)
    assert many > 300 and optimizer_s(train, w, n, gpu, many) == pytest.approx(many * gpu.host_optimizer_tensor_s)
    torch_step = replace(train, torch_adamw=True)  # one multi-tensor launch: no host term
    assert optimizer_s(torch_step, w, n, gpu, many) == optimizer_s(torch_step, w, n, gpu)


def test_plan_says_when_the_host_paces_the_optimizer(capsys):
    assert main(["plan", "--model", "gpt2-350m", "--gpus", "1"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("optimizer step"))
    assert "host-paced" in line and "optim.kernel=torch" in line
    assert main(["plan", "--model", "gpt2-350m", "--gpus", "1", "--set", "optim.kernel=torch"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("optimizer step"))
    assert "host-paced" not in line and "fused AdamW sweep" in line
