"""`teratrain quantize` on a briefly trained run (the shared 50-step CLI run), then `teratrain generate`
on what it wrote.

Bound: 8-bit round-to-nearest moves the held-out loss by at most 0.005 nats (measured ~1e-4 on this
run; the weights move by at most half a grid step, 1/510 of each group's range). 4-bit GPTQ's change
is reported, not bounded: the command prints it and the test checks it is a finite number."""

import math
import re

import pytest

from teratrain.config import load_config
from teratrain.memory.quantize import QuantLinear, load_quantized
from tests.integration.runner import assert_user_error, metrics

PROMPT = "def main("

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quantized(cli, trained_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for bits, method in ((8, "rtn"), (4, "gptq")):
        folder = root / f"w{bits}-{method}"
        proc = cli("quantize", "--ckpt", trained_run, "--bits", bits, "--group-size", 128, "--method", method,
                   "--calib-batches", 4, "--out", folder)
        out[bits] = (folder, proc.stdout)
    return out


def _report(stdout: str) -> dict:
    loss = re.search(r"held-out loss: ([\d.]+) -> ([\d.]+) \(([-+][\d.]+)\)", stdout)
    linears = re.search(r"block linears ([\d,]+) -> ([\d,]+)", stdout)
    return {"before": float(loss[1]), "after": float(loss[2]), "change": float(loss[3]),
            "linears": [int(linears[i].replace(",", "")) for i in (1, 2)]}


def _expected_linear_bytes(run, bits: int | None, group: int = 128) -> int:
    """Codes (bits/8 per weight, 4-bit rows padded to whole bytes) + an fp16 scale and a uint8 zero
    point per group of each output row, over every linear of the blocks; bits None: fp32 weights."""
    m = load_config(run / "config.toml").model
    d, ff, kv = m.d_model, m.ffn_dim, m.kv_heads * m.head_width
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (ff, d), (ff, d), (d, ff)]  # (out, in): wq wk wv wo w1 w3 w2
    total = 0
    for out, inp in shapes:
        if bits is None:
            total += 4 * out * inp
        else:
            total += out * math.ceil(inp * bits / 8) + 3 * out * math.ceil(inp / min(group, inp))
    return m.n_layers * total


def test_8_bit_changes_the_heldout_loss_by_at_most_the_bound(quantized, trained_run):
    r = _report(quantized[8][1])
    assert r["before"] == pytest.approx(metrics(trained_run)[-1]["eval_loss"], abs=1e-4)  # training's own evaluation
    assert abs(r["after"] - r["before"]) <= 0.005
    assert r["linears"] == [_expected_linear_bytes(trained_run, None), _expected_linear_bytes(trained_run, 8)]


def test_4_bit_gptq_is_reported_and_packed(quantized, trained_run):
    folder, stdout = quantized[4]
    r = _report(stdout)
    assert math.isfinite(r["change"]) and r["before"] == _report(quantized[8][1])["before"]
    assert r["linears"][1] == _expected_linear_bytes(trained_run, 4)
    _, model = load_quantized(folder)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 14 and all(m.bits == 4 for m in layers)


@pytest.mark.parametrize("bits", [8, 4])
def test_generate_runs_the_quantized_model(cli, quantized, bits):
    proc = cli("generate", "--ckpt", quantized[bits][0], "--prompt", PROMPT, "--max-new-tokens", 10, in_process=True)
    assert proc.stdout.startswith(PROMPT) and len(proc.stdout.rstrip("\n")) > len(PROMPT)


def test_quantize_refuses_an_existing_out_and_a_missing_run(cli, quantized, trained_run, tmp_path):
    proc = cli("quantize", "--ckpt", trained_run, "--bits", 8, "--out", quantized[8][0], expect_rc=None,
               in_process=True)
    assert_user_error(proc, "already exists")
    proc = cli("quantize", "--ckpt", tmp_path / "nope", "--bits", 8, expect_rc=None, in_process=True)
    assert_user_error(proc, "does not exist")
    proc = cli("quantize", "--ckpt", quantized[4][0], "--bits", 8, expect_rc=None, in_process=True)
    assert_user_error(proc, "already a quantized model")
    proc = cli("export", "--ckpt", quantized[4][0], "--to", tmp_path / "hf", expect_rc=None, in_process=True)
    assert_user_error(proc, "is a quantized model", "teratrain generate")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for command, flag in (("quantize", "--out"), ("export", "--to")):  # a folder inside a file
        proc = cli(command, "--ckpt", trained_run, *(["--bits", 8] if command == "quantize" else []), flag,
                   blocker / "sub", expect_rc=None, in_process=True)
        assert_user_error(proc, f"cannot create {blocker / 'sub'}", flag)
