"""Memory savers through the CLI: SM3 trains the tiny model and resumes bitwise (its accumulators
round-trip through the checkpoint), and the combinations the engines cannot run are refused in one line."""

import pytest
import torch

from tests.integration.runner import assert_user_error, checkpoint_tensors, metrics

pytestmark = pytest.mark.slow

SM3 = ["optim.name=sm3", "optim.lr=0.03", "optim.warmup_steps=4", "optim.schedule=constant"]


@pytest.mark.long
def test_sm3_trains_and_resumes_bitwise(cli, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    cli.train(straight, *SM3, steps=24)
    cli.train(resumed, *SM3, steps=12)
    cli.train(resumed, *SM3, steps=24, resume=True)
    losses = [r["loss"] for r in metrics(straight)]
    assert sum(losses[-4:]) / 4 < losses[0] - 1.0  # measured: 8.33 -> ~6.9
    assert [r["loss"] for r in metrics(resumed)] == losses
    a, b = checkpoint_tensors(straight), checkpoint_tensors(resumed)
    accs = {k: v for k, v in a.items() if k.startswith("optim.acc_")}
    assert accs and all(torch.equal(v, b[k]) for k, v in accs.items())
    # (4096, 64) embedding: one accumulator per row and per column, not per entry
    assert sorted(v.numel() for k, v in accs.items() if k.endswith("/tok_embeddings.weight")) == [64, 4096]


@pytest.mark.parametrize("sets, words", [
    (["memory.compress_activations=int8", "train.compile=true"], ["memory.compress_activations", "train.compile"]),
    (["memory.compress_activations=int4"], ["memory.compress_activations"]),
])
def test_refused_combinations(cli, tmp_path, sets, words):
    proc = cli.train(tmp_path / "run", *sets, steps=2, expect_rc=None, in_process=True)
    assert_user_error(proc, *words)
