"""`--resume` continues the job as it ran: on the run's own process count unless --nproc is given.
examples/moe-ep2.toml (experts over 2 data-parallel ranks: it cannot run on one process) at a tiny
shape: 2 steps on 2 processes, then `--resume` alone goes on with 2 processes."""

import pytest

from tests.integration.runner import metrics
from tests.integration.test_examples_run import EXAMPLES, SHAPE

pytestmark = pytest.mark.slow


def test_resume_keeps_the_process_count_of_the_run(cli, tmp_path):
    run = tmp_path / "run"
    cli.train(run, *SHAPE, "train.eval_batches=0", steps=2, nproc=2, config=EXAMPLES / "moe-ep2.toml")
    proc = cli("train", "--out", run, "--resume", "--steps", 3)  # no --nproc, no --set: the run's own
    assert "teratrain: device: cpu, 2 process(es)" in proc.stderr
    assert "dp=2 tp=1 pp=1 ep=2 zero=2" in proc.stderr
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3] and "moe" in records[-1]
