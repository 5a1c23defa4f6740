"""optim/adamw_kernel.py on a GPU: teratrain's AdamW step against torch's fused AdamW, and the two
interchangeable through their state_dicts. Tolerance fixed before the run: after 5 steps (two groups,
weight decay on one, the clip's gradient scale on some steps, shapes of 1 to 3 x 2^20 + 5 elements)
every parameter and moment within 2e-6 relative in norm of torch's (the kernel's arithmetic is torch's
up to the rounding of lr x wd and of the powers of the betas)."""

import copy

import pytest
import torch

from teratrain.config import load_config
from teratrain.optim import adamw_kernel
from teratrain.optim.build import build_optimizer

SHAPES = [(3 << 20) + 5, (256, 1000), (17,), (1,), (4, 33, 7)]  # a launch a group covers 48 + 4 + 1 chunks, 1 + 1


def _pair(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.randn(s, device="cuda", generator=g) for s in SHAPES]
    clones = [p.clone() for p in params]
    groups = lambda ps: [{"params": ps[:3], "weight_decay": 0.1}, {"params": ps[3:], "weight_decay": 0.0}]  # noqa: E731
    ours = adamw_kernel.AdamW(groups(params), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    ref = torch.optim.AdamW(groups(clones), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    for opt in (ours, ref):
        for p in opt.param_groups[0]["params"] + opt.param_groups[1]["params"]:
            opt.state[p] = {"step": torch.zeros((), device="cuda"), "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p)}
    return params, clones, ours, ref, g


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).norm() <= 2e-6 * b.norm() + 1e-12)


@pytest.mark.gpu(1)
def test_the_kernel_steps_as_torchs_fused_adamw():
    if not adamw_kernel.available():
        pytest.skip("needs Triton")
    params, clones, ours, ref, g = _pair()
    for step in range(5):
        scale = torch.tensor(1.7, device="cuda") if step % 2 else None  # the clip's scale (optim/engine.py clip_)
        for p, c in zip(params, clones):
            p.grad = torch.randn(p.shape, device="cuda", generator=g)
            c.grad = p.grad.clone()
        for opt in (ours, ref):
            opt.grad_scale = scale
            opt.step()
            opt.grad_scale = None
    for p, c in zip(params, clones):
        assert _close(p, c)
        for key in ("exp_avg", "exp_avg_sq"):
            assert _close(ours.state[p][key], ref.state[c][key]), key
        assert float(ours.state[p]["step"]) == float(ref.state[c]["step"]) == 5


@pytest.mark.gpu(1)
def test_state_dicts_cross_between_the_kernel_and_torchs_adamw():
    """A checkpoint written by one loads into the other, which then steps as the writer would."""
    if not adamw_kernel.available():
        pytest.skip("needs Triton")
    params, clones, ours, ref, g = _pair(seed=1)
    for p, c in zip(params, clones):
        p.grad = torch.randn(p.shape, device="cuda", generator=g)
        c.grad = p.grad.clone()
    ours.step()
    ref.step()
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))  # the same moments and steps (copies, not shared)
    for c, p in zip(clones, params):
        c.data.copy_(p)
    for p, c in zip(params, clones):
        p.grad = torch.randn(p.shape, device="cuda", generator=g)
        c.grad = p.grad.clone()
    ours.step()
    ref.step()
    assert all(_close(p, c) for p, c in zip(params, clones))


@pytest.mark.gpu(1)
def test_build_picks_the_kernel_unless_told_and_falls_back_where_it_does_not_apply():
    named = [("w", torch.nn.Parameter(torch.randn(64, 64, device="cuda")))]
    cfg = load_config(None, []).optim
    opt = build_optimizer(named, cfg)
    assert isinstance(opt, adamw_kernel.AdamW) == adamw_kernel.available()
    assert type(build_optimizer(named, load_config(None, ["optim.kernel=torch"]).optim)) is torch.optim.AdamW
    half = [("w", torch.nn.Parameter(torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)))]
    opt = build_optimizer(half, cfg)
    half[0][1].grad = torch.randn_like(half[0][1])
    assert not adamw_kernel.kernel_applies(opt, opt.param_groups[0])  # bf16: torch's step
    opt.step()
    assert float(opt.state[half[0][1]]["step"]) == 1


@pytest.mark.gpu(1)
def test_steps_without_some_or_any_gradient_step_as_torchs():
    """A parameter without a gradient keeps its value, state and step counter (its row leaves the table, which
    is rebuilt); a step with no gradient at all does nothing."""
    if not adamw_kernel.available():
        pytest.skip("needs Triton")
    params, clones, ours, ref, g = _pair(seed=2)
    for step in range(4):
        for i, (p, c) in enumerate(zip(params, clones)):
            p.grad = None if (i + step) % 3 == 0 else torch.randn(p.shape, device="cuda", generator=g)
            c.grad = None if p.grad is None else p.grad.clone()
        ours.step()
        ref.step()
    for p, c in zip(params, clones):
        assert _close(p, c) and float(ours.state[p]["step"]) == float(ref.state[c]["step"])
    before = [p.clone() for p in params]
    for p in params:
        p.grad = None
    ours.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before))
