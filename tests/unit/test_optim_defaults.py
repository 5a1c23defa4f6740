"""Choosing an optimizer alone trains: each gets its own default learning rate (config.DEFAULT_LR).
At AdamW's 3e-3, SM3, Adafactor and SGD barely moved the loss (30 tiny CLI steps: 8.33 -> 8.07-8.29,
AdamW 6.89). Here: 30 steps on one fixed batch of the small test model, the optimizer built from the
config as the engines build it, at its configured lr."""

import pytest
import torch

from teratrain.optim.build import build_optimizer
from tests.helpers import make_config, small_model


def losses(*sets: str, steps: int = 30) -> tuple[float, float]:
    """(first, last) loss of `steps` optimizer steps on one batch."""
    cfg = make_config(*sets)
    model = small_model(dtype=torch.float32, seed=0)
    opt = build_optimizer(model.named_parameters(), cfg.optim)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 50, (8, 16), generator=g), torch.randint(0, 50, (8, 16), generator=g)
    seen = []
    for _ in range(steps):
        loss = model(x, y)
        seen.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return seen[0], model(x, y).item()


@pytest.mark.parametrize("name", ["sgd", "sm3", "adafactor"])
def test_each_optimizer_learns_with_its_default_lr(name):
    first, adamw = losses()
    _, mine = losses(f"optim.name={name}")
    assert first - mine > 0.5 * (first - adamw), (name, first, mine, adamw)  # at least half AdamW's progress


def test_stacked_expert_biases_are_vectors_and_get_no_decay():
    """The experts' weights are stacks of matrices (decayed), their biases stacks of vectors (not), as each
    expert's own linear would have them; other names keep the rule by dimensions."""
    from teratrain.models.transformer import build_model
    from teratrain.optim.build import param_groups
    from tests.helpers import model_config

    model = build_model(model_config(arch="gpt2", moe=dict(num_experts=4)))
    decay, no_decay = (set(map(id, g["params"])) for g in param_groups(model.named_parameters(), 0.1))
    named = dict(model.named_parameters())
    assert named["layers.0.feed_forward.experts.b1"].dim() == 2 and id(named["layers.0.feed_forward.experts.b1"]) in no_decay
    assert id(named["layers.0.feed_forward.experts.b2"]) in no_decay and id(named["layers.0.feed_forward.experts.w1"]) in decay
    assert id(named["layers.0.attention.wq.weight"]) in decay and id(named["layers.0.attention.wq.bias"]) in no_decay
