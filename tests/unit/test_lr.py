"""Learning-rate rules: gradual warmup, batch-size scaling, decay endpoints (Goyal et al. 2017)."""

import math

import pytest

from teratrain.optim.lr import lr_at, scaled_lr, suggested_warmup

PEAK, WARMUP, TOTAL = 0.01, 10, 110


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_warmup_is_linear_in_t(schedule):
    # alpha_t = alpha_max * t / T_w for t = 1..T_w; optimizer step s is t = s + 1.
    for t in range(1, WARMUP + 1):
        assert lr_at(t - 1, PEAK, WARMUP, TOTAL, schedule, 0.1) == pytest.approx(PEAK * t / WARMUP, rel=1e-12)


def test_warmup_reaches_the_peak_on_its_last_step():
    assert lr_at(WARMUP - 1, PEAK, WARMUP, TOTAL, "cosine", 0.1) == pytest.approx(PEAK)


def test_constant_stays_at_the_peak():
    assert all(lr_at(s, PEAK, WARMUP, TOTAL, "constant", 0.1) == PEAK for s in range(WARMUP, TOTAL + 5))


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
@pytest.mark.parametrize("min_ratio", [0.0, 0.1, 0.5])
def test_decay_ends_at_min_lr_ratio(schedule, min_ratio):
    assert lr_at(TOTAL - 1, PEAK, WARMUP, TOTAL, schedule, min_ratio) == pytest.approx(PEAK * min_ratio, abs=1e-15)
    # and stays there if the loop runs past train.steps
    assert lr_at(TOTAL + 20, PEAK, WARMUP, TOTAL, schedule, min_ratio) == pytest.approx(PEAK * min_ratio, abs=1e-15)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_is_monotone_and_below_the_peak(schedule):
    lrs = [lr_at(s, PEAK, WARMUP, TOTAL, schedule, 0.1) for s in range(WARMUP, TOTAL)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert lrs[0] <= PEAK and lrs[-1] == pytest.approx(0.1 * PEAK)


@pytest.mark.parametrize("schedule, shape", [("cosine", 0.5), ("linear", 0.5)])
def test_decay_midpoint(schedule, shape):
    # halfway through the decay: cos(pi/2) -> shape 0.5; linear -> 0.5
    mid = WARMUP + (TOTAL - WARMUP) // 2 - 1  # step s with t - T_w = (total - T_w) / 2
    expected = PEAK * (0.2 + 0.8 * shape)
    assert lr_at(mid, PEAK, WARMUP, TOTAL, schedule, 0.2) == pytest.approx(expected, rel=1e-12)


def test_cosine_quarter_point():
    quarter = WARMUP + (TOTAL - WARMUP) // 4 - 1
    shape = 0.5 * (1 + math.cos(math.pi * 0.25))
    assert lr_at(quarter, PEAK, WARMUP, TOTAL, "cosine", 0.0) == pytest.approx(PEAK * shape, rel=1e-12)


def test_no_warmup_starts_at_the_peak_region():
    assert lr_at(0, PEAK, 0, TOTAL, "constant", 0.1) == PEAK
    assert 0.99 * PEAK < lr_at(0, PEAK, 0, TOTAL, "cosine", 0.1) <= PEAK


@pytest.mark.parametrize("rule, base, batch, expected", [
    ("linear", 256, 1024, 4 * 0.1),
    ("linear", 256, 64, 0.25 * 0.1),
    ("sqrt", 256, 1024, 2 * 0.1),
    ("sqrt", 256, 64, 0.5 * 0.1),
    ("none", 256, 1024, 0.1),
    ("linear", None, 1024, 0.1),  # no base batch: nothing to scale from
])
def test_batch_scaling(rule, base, batch, expected):
    assert scaled_lr(0.1, rule, base, batch) == pytest.approx(expected, rel=1e-12)


def test_unknown_rule_and_schedule_are_errors():
    with pytest.raises(ValueError):
        scaled_lr(0.1, "cubic", 8, 16)
    with pytest.raises(ValueError):
        lr_at(50, PEAK, WARMUP, TOTAL, "step", 0.1)


def test_suggested_warmup_grows_with_the_batch_only():
    assert suggested_warmup(256, 256, 100) == 100
    assert suggested_warmup(64, 256, 100) == 100
    assert suggested_warmup(1024, 256, 100) == 200
    assert suggested_warmup(1024, None, 100) == 100
