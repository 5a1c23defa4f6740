"""`teratrain train --nproc N` end to end: torchrun underneath, one run directory, the same losses as
one process on the same global batch (the trainer's data order does not depend on the layout). ZeRO-3
on 2 processes: test_cli_reshard.py."""

import pytest

from teratrain.metrics import read_metrics
from tests.integration.runner import assert_user_error


def test_nproc_with_a_layout_that_does_not_fit_fails_before_launch(cli):
    proc = cli("train", "--nproc", "3", "--set", "parallel.dp=2", expect_rc=None, in_process=True)
    assert_user_error(proc, "parallel.dp", "--nproc")



@pytest.mark.long
@pytest.mark.slow
def test_nproc_2_tensor_parallel_trains_and_generates(cli, tmp_path):
    """tp=2 with sequence parallelism through the CLI: the same losses as one process, half the
    parameters per rank (vocabulary and every matrix split), and `generate` from its pieces."""
    sets = ["train.eval_batches=0", "optim.lr=0.01"]
    cli.train(tmp_path / "one", *sets, steps=3)
    cli.train(tmp_path / "tp", *sets, "parallel.tp=2", steps=3, nproc=2)
    one, tp = read_metrics(tmp_path / "one" / "metrics.jsonl"), read_metrics(tmp_path / "tp" / "metrics.jsonl")
    for a, b in zip(one, tp):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
    assert tp[0]["model_state_bytes"]["params"] < 0.55 * one[0]["model_state_bytes"]["params"]
    out = cli("generate", "--ckpt", tmp_path / "tp", "--prompt", "def ", "--max-new-tokens", "5", "--temperature", "0")
    ref = cli("generate", "--ckpt", tmp_path / "one", "--prompt", "def ", "--max-new-tokens", "5", "--temperature", "0")
    assert out.stdout == ref.stdout  # same weights after 3 identical steps (greedy decoding)
