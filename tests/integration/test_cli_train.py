"""`teratrain train` learns, and leaves the run directory the contract describes."""

import math

import pytest

from teratrain.config import load_config
from teratrain.models.transformer import count_params
from teratrain.optim.lr import lr_at
from tests.integration.runner import metrics

RECORD_KEYS = {"step", "loss", "lr", "tokens_per_s", "mfu", "grad_norm", "peak_mem_bytes"}

pytestmark = pytest.mark.slow


def test_training_lowers_the_loss(trained_run):
    losses = [r["loss"] for r in metrics(trained_run)]
    assert len(losses) == 50
    assert abs(losses[0] - math.log(4096)) < 0.15, "a fresh model predicts ~uniformly over the vocabulary"
    # measured: 8.33 -> ~6.47 (mean of the last 5) for this shape and seed
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
    assert metrics(trained_run)[-1]["eval_loss"] < losses[0] - 1.5


def test_run_directory_holds_the_contract_files(trained_run):
    for name in ("config.toml", "metrics.jsonl", "loss.png", "tokenizer.json", "checkpoints/latest"):
        assert (trained_run / name).is_file(), name
    assert (trained_run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (trained_run / "checkpoints/latest").read_text() == "step_00000050"
    assert sorted(p.name for p in (trained_run / "checkpoints").glob("step_*")) == ["step_00000025", "step_00000050"]


def test_config_toml_is_the_resolved_config(trained_run):
    cfg = load_config(trained_run / "config.toml")
    assert (cfg.train.steps, cfg.model.n_layers, cfg.model.d_model, cfg.optim.warmup_steps) == (50, 2, 64, 10)
    assert cfg.model.d_ff == 384 and cfg.model.n_kv_heads == 2  # filled from the tiny preset


def test_every_metrics_record_has_the_contract_keys(trained_run):
    records = metrics(trained_run)
    assert [r["step"] for r in records] == list(range(1, 51))
    for r in records:
        assert RECORD_KEYS <= r.keys(), RECORD_KEYS - r.keys()
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0
        assert r["grad_norm"] > 0 and r["mfu"] > 0  # metrics.peak_tflops=1 gives MFU a denominator on CPU


def test_logged_lr_follows_the_schedule(trained_run):
    cfg = load_config(trained_run / "config.toml")
    o = cfg.optim
    for r in metrics(trained_run):
        expected = lr_at(r["step"] - 1, o.lr, o.warmup_steps, cfg.train.steps, o.schedule, o.min_lr_ratio)
        assert r["lr"] == pytest.approx(expected, rel=1e-12)


def test_first_record_counts_model_state_bytes_fp32(trained_run):
    first, rest = metrics(trained_run)[0], metrics(trained_run)[1:]
    n = count_params(load_config(trained_run / "config.toml").model)["total"]
    state = first["model_state_bytes"]
    assert state["params"] == 4 * n and state["grads"] == 4 * n
    assert 8 * n <= state["optimizer"] <= 8 * n + 1024  # AdamW: two fp32 moments (+ step counters)
    assert all("model_state_bytes" not in r for r in rest)
