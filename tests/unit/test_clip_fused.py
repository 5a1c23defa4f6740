"""Gradient clipping handed to fused AdamW's kernel (optim/engine.py `clip_`): the same update as
multiplying the gradients first (torch.nn.utils.clip_grad_norm_ then AdamW), without that pass over
them, and no scale left behind for the next step."""

import pytest
import torch

from teratrain.optim.engine import LocalEngine
from tests.helpers import make_config, small_model


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 50, (4, 16), generator=g), torch.randint(0, 50, (4, 16), generator=g)


@pytest.mark.parametrize("clip", [0.05, 100.0])  # clipping every step, and never (the scale is 1)
def test_clipping_in_the_fused_kernel_equals_multiplying_first(clip, monkeypatch):
    cfg = make_config("optim.lr=1e-2", f"train.grad_clip={clip}")
    ours, ref = small_model(dtype=torch.float32, seed=0), small_model(dtype=torch.float32, seed=0)
    engine = LocalEngine(ours, cfg.optim, cfg.memory, clip, master_weights=False)
    assert engine.optimizer.param_groups[0]["fused"]  # what the engines build wherever they can
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(cfg.optim.beta1, cfg.optim.beta2),
                            eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
    decay = {id(p) for group in engine.optimizer.param_groups if group["weight_decay"] for p in group["params"]}
    opt.param_groups[0]["params"] = [p for p, q in zip(ref.parameters(), ours.parameters()) if id(q) in decay]
    opt.add_param_group({"params": [p for p, q in zip(ref.parameters(), ours.parameters()) if id(q) not in decay],
                         "weight_decay": 0.0})
    multiplies = []
    real = torch._foreach_mul_
    x, y = _batch()
    for _ in range(3):
        ours(x, y).backward()
        with monkeypatch.context() as m:  # counted in our step only (clip_grad_norm_ below multiplies)
            m.setattr(torch, "_foreach_mul_", lambda *a, **k: (multiplies.append(1), real(*a, **k))[1])
            norm = engine.step(1e-2).grad_norm
        ref(x, y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        assert norm == pytest.approx(float(ref_norm), rel=1e-5)
        assert engine.optimizer.grad_scale is None  # nothing carried into the next step
    assert multiplies == []  # the kernel scaled the gradients: no pass of their own
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_optimizers_without_the_kernel_hook_get_multiplied_gradients():
    cfg = make_config("optim.name=sgd", "optim.weight_decay=0", "train.grad_clip=0.05")
    model = small_model(dtype=torch.float32, seed=0)
    engine = LocalEngine(model, cfg.optim, cfg.memory, 0.05, master_weights=False)
    x, y = _batch()
    model(x, y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.step(1.0)
    coef = 0.05 / (float(norm) + 1e-6)
    for n, p in model.named_parameters():  # plain SGD, lr 1: the parameter moved by the clipped gradient
        torch.testing.assert_close(before[n] - p.detach(), grads[n] * coef, rtol=1e-4, atol=1e-7)
