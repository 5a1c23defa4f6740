"""fp16 dynamic loss scaling: the scaler's rules, and the engine skipping an overflowing step."""

import pytest
import torch

from teratrain.memory.precision import LossScaler, autocast, has_inf_or_nan
from teratrain.models.transformer import lm_loss
from teratrain.optim.engine import LocalEngine
from tests.helpers import make_config, small_model


def test_backoff_halves_the_scale_and_counts_the_skip():
    s = LossScaler(init_scale=1024.0, window=3)
    s.update(found_inf=True)
    assert (s.scale, s.skipped_steps, s.clean_steps) == (512.0, 1, 0)
    s.update(found_inf=True)
    assert (s.scale, s.skipped_steps) == (256.0, 2)


def test_growth_doubles_after_window_clean_steps():
    s = LossScaler(init_scale=1024.0, window=3)
    s.update(False)
    s.update(False)
    assert s.scale == 1024.0
    s.update(False)
    assert (s.scale, s.clean_steps) == (2048.0, 0)
    for _ in range(3):
        s.update(False)
    assert s.scale == 4096.0 and s.skipped_steps == 0


def test_an_overflow_restarts_the_clean_window():
    s = LossScaler(init_scale=1024.0, window=3)
    s.update(False)
    s.update(False)
    s.update(True)  # 512, window restarts
    s.update(False)
    s.update(False)
    assert s.scale == 512.0
    s.update(False)
    assert s.scale == 1024.0


def test_scale_never_drops_below_min_scale():
    s = LossScaler(init_scale=4.0, window=10, min_scale=1.0)
    for _ in range(5):
        s.update(True)
    assert s.scale == 1.0 and s.skipped_steps == 5


def test_state_dict_round_trip():
    a = LossScaler(init_scale=1024.0, window=3)
    for flag in (False, True, False, False):
        a.update(flag)
    b = LossScaler(window=3)
    b.load_state_dict(a.state_dict())
    for flag in (False, False, True, False):
        a.update(flag)
        b.update(flag)
        assert b.state_dict() == a.state_dict()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_has_inf_or_nan(bad):
    clean = [torch.ones(3), torch.zeros(2, 2, dtype=torch.float16)]
    assert not has_inf_or_nan(clean)
    dirty = [t.clone() for t in clean]
    dirty[1][1, 0] = bad
    assert has_inf_or_nan(dirty)
    assert not has_inf_or_nan([])


def fp16_engine(**memory):
    cfg = make_config("memory.precision=fp16", *(f"memory.{k}={v}" for k, v in memory.items()))
    model = small_model(dtype=torch.float32)
    engine = LocalEngine(model, cfg.optim, cfg.memory, cfg.train.grad_clip, cfg.use_master_weights)
    return model, engine


def fp16_backward(model, engine):
    x = torch.randint(0, model.cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with autocast("fp16", torch.device("cpu")):
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
    engine.backward(loss)


def optimizer_state(opt) -> dict:
    """A comparable snapshot of the optimizer state (tensors as lists), whether torch made it lazily or not."""
    return {pid: {k: v.tolist() if torch.is_tensor(v) else v for k, v in st.items()}
            for pid, st in opt.state_dict()["state"].items()}


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_engine_skips_the_step_when_a_gradient_overflows(bad):
    model, engine = fp16_engine(loss_scale_init=1024.0)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters = [m.clone() for m in engine.masters]
    opt_state = optimizer_state(engine.optimizer)
    fp16_backward(model, engine)
    model.layers[0].attention.wq.weight.grad[0, 0] = bad

    stats = engine.step(lr=1e-2)

    assert stats.skipped and engine.skipped_steps == 1
    assert engine.scaler.scale == 512.0 == stats.loss_scale
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None
    assert all(torch.equal(m, m0) for m, m0 in zip(engine.masters, masters))
    assert optimizer_state(engine.optimizer) == opt_state, "a skipped step must not touch moments or step counts"


def test_engine_steps_normally_after_a_skip():
    model, engine = fp16_engine(loss_scale_init=1024.0, loss_scale_window=1)
    fp16_backward(model, engine)
    model.layers[0].attention.wq.weight.grad[0, 0] = float("inf")
    engine.step(lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    fp16_backward(model, engine)
    stats = engine.step(lr=1e-2)

    assert not stats.skipped and stats.grad_norm > 0
    assert engine.scaler.scale == 1024.0  # 512 after the skip, x2 after window=1 clean step
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    # the fp16 params are the masters rounded to fp16
    for (n, p), m in zip(model.named_parameters(), engine.masters):
        assert torch.equal(p, m.to(torch.float16)), n


def test_engine_unscales_gradients_before_the_update():
    """A plain SGD step (no momentum, clip or decay) moves the masters by lr * the unscaled gradient, so two
    loss scales give the same update (up to fp16 rounding; a missing unscale would differ by 8x)."""
    updates = {}
    for scale in (1024.0, 8192.0):
        cfg = make_config("memory.precision=fp16", f"memory.loss_scale_init={scale}", "optim.name=sgd",
                          "optim.momentum=0", "optim.weight_decay=0", "train.grad_clip=0")
        model = small_model(dtype=torch.float32)
        engine = LocalEngine(model, cfg.optim, cfg.memory, cfg.train.grad_clip, cfg.use_master_weights)
        masters = [m.clone() for m in engine.masters]
        fp16_backward(model, engine)
        engine.step(lr=1.0)
        updates[scale] = torch.cat([(m0 - m).flatten() for m0, m in zip(masters, engine.masters)])
    assert updates[1024.0].abs().max() > 1e-4
    torch.testing.assert_close(updates[8192.0], updates[1024.0], rtol=1e-3, atol=1e-6)
