"""bf16 and fp16 train on CPU, and fp16 holds its model state as the contract says: fp16 params and
grads (2 bytes each), fp32 masters + two fp32 AdamW moments under the optimizer (12 bytes)."""

import math

import pytest

from teratrain.config import load_config
from teratrain.models.transformer import count_params
from tests.integration.runner import metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["bf16", "fp16"])
def low_precision_run(request, cli, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "run"
    cli.train(out, f"memory.precision={request.param}", "train.eval_batches=1", steps=3)
    return request.param, out


def test_trains_with_finite_losses(low_precision_run):
    precision, run = low_precision_run
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert abs(records[0]["loss"] - math.log(4096)) < 0.15
    assert math.isfinite(records[-1]["eval_loss"])
    assert (records[0]["loss_scale"] is not None) == (precision == "fp16")


def test_model_state_bytes(low_precision_run):
    precision, run = low_precision_run
    n = count_params(load_config(run / "config.toml").model)["total"]
    state = metrics(run)[0]["model_state_bytes"]
    if precision == "fp16":
        assert state["params"] == 2 * n and state["grads"] == 2 * n
        assert 12 * n <= state["optimizer"] <= 12 * n + 1024  # fp32 masters + 2 moments (+ step counters)
    else:  # bf16: fp32 params, matmuls under autocast
        assert state["params"] == 4 * n and state["grads"] == 4 * n
        assert 8 * n <= state["optimizer"] <= 8 * n + 1024
