"""Training state to (tensors, JSON) and back, through a real safetensors file and json text:
optimizers continue exactly, RNG streams replay exactly."""

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from teratrain.checkpoint.io import write_safetensors
from teratrain.checkpoint.state import optimizer_from_flat, optimizer_to_flat, rng_state, set_rng_state
from teratrain.optim.build import build_optimizer
from tests.helpers import make_config


def through_disk(tensors: dict, meta: dict, tmp_path) -> tuple[dict, dict]:
    """What a checkpoint does to the state: safetensors for tensors, JSON text for the rest."""
    write_safetensors(tmp_path / "state.safetensors", tensors)
    return load_file(tmp_path / "state.safetensors"), json.loads(json.dumps(meta))


def make_params(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("w", torch.randn(6, 4, generator=g).requires_grad_()),  # decayed group
            ("b", torch.randn(4, generator=g).requires_grad_())]     # no-decay group


def step_with(opt, params, grads) -> None:
    for (_, p), g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


def random_grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for _, p in params]


@pytest.mark.parametrize("name", ["adamw", "sgd", "adafactor"])
def test_optimizer_round_trip_continues_exactly(name, tmp_path):
    cfg = make_config(f"optim.name={name}", "optim.lr=0.05").optim
    params = make_params()
    opt = build_optimizer(params, cfg)
    for i in range(3):
        step_with(opt, params, random_grads(params, i))

    tensors, meta = through_disk(*optimizer_to_flat(opt), tmp_path)
    params2 = [(n, p.detach().clone().requires_grad_()) for n, p in params]
    opt2 = build_optimizer(params2, cfg)
    optimizer_from_flat(opt2, tensors, meta)

    sd, sd2 = opt.state_dict(), opt2.state_dict()
    assert sd2["param_groups"] == sd["param_groups"]
    assert sd2["state"].keys() == sd["state"].keys()
    for pid, st in sd["state"].items():
        assert st.keys() == sd2["state"][pid].keys()
        for k, v in st.items():
            if torch.is_tensor(v):
                assert v.dtype == sd2["state"][pid][k].dtype and torch.equal(v, sd2["state"][pid][k]), (pid, k)
            else:
                assert v == sd2["state"][pid][k], (pid, k)
    for i in range(3, 6):  # the restored optimizer makes the very same updates
        grads = random_grads(params, i)
        step_with(opt, params, grads)
        step_with(opt2, params2, grads)
        for (n, p), (_, q) in zip(params, params2):
            assert torch.equal(p, q), (name, n, i)


def test_fresh_optimizer_would_differ(tmp_path):
    """The round-trip test above is not vacuous: without the loaded state the next step differs."""
    cfg = make_config("optim.name=adamw", "optim.lr=0.05").optim
    params = make_params()
    opt = build_optimizer(params, cfg)
    for i in range(3):
        step_with(opt, params, random_grads(params, i))
    params2 = [(n, p.detach().clone().requires_grad_()) for n, p in params]
    opt2 = build_optimizer(params2, cfg)
    grads = random_grads(params, 3)
    step_with(opt, params, grads)
    step_with(opt2, params2, grads)
    assert not torch.equal(params[0][1], params2[0][1])


def draw() -> tuple:
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.randn(),
            torch.rand(4).tolist(), torch.randint(0, 1000, (3,)).tolist())


def test_rng_state_round_trip(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.randn()  # leave a cached Gaussian in Python's and NumPy's state
    tensors, meta = through_disk(*rng_state(), tmp_path)
    expected = draw()
    draw()  # move every stream further on
    set_rng_state(tensors, meta)
    assert draw() == expected


def test_resumed_optimizer_takes_hyperparameters_from_the_current_config():
    """State (moments, step) comes from the checkpoint; weight decay and betas as configured now."""
    import torch

    from teratrain.checkpoint.state import optimizer_from_flat, optimizer_to_flat

    w = torch.nn.Parameter(torch.ones(3, 3))
    old = torch.optim.AdamW([w], lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    w.grad = torch.full_like(w, 0.5)
    old.step()
    tensors, meta = optimizer_to_flat(old)
    new = torch.optim.AdamW([w], lr=1e-3, weight_decay=0.5, betas=(0.8, 0.99))
    optimizer_from_flat(new, tensors, meta)
    assert new.param_groups[0]["weight_decay"] == 0.5 and tuple(new.param_groups[0]["betas"]) == (0.8, 0.99)
    assert torch.equal(new.state[w]["exp_avg"], old.state[w]["exp_avg"])
    assert float(new.state[w]["step"]) == 1.0
