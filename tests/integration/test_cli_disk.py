"""A checkpoint's size is known before the first step: the planner's count (planner/disk.py) is within
1% of the checkpoint the run writes, and a run directory whose disk cannot hold one is refused at
start-up in one sentence with both figures; one that cannot hold checkpoint.keep of them is warned."""

import pytest

from teratrain import startup
from teratrain.config import load_config
from tests.integration.runner import assert_user_error, latest_checkpoint

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sets", [[], ["memory.precision=bf16", "parallel.zero=1"], ["lora.rank=4"],
                                  ["optim.name=adafactor"], ["optim.name=sgd", "optim.momentum=0.9"]],
                         ids=["adamw", "bf16-masters-zero1", "lora", "adafactor", "sgd"])
def test_the_predicted_size_is_the_checkpoint_written(cli, tmp_path, sets):
    run = tmp_path / "run"
    cli.train(run, "train.eval_batches=0", *sets, steps=1, in_process=True)
    written = sum(f.stat().st_size for f in latest_checkpoint(run).glob("*.safetensors"))
    predicted = startup.checkpoint_size(load_config(run / "config.toml"), 1)
    assert abs(predicted - written) <= 0.01 * written, (predicted, written)


def test_a_disk_too_small_for_one_checkpoint_is_refused_at_start_up(cli, tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(startup, "free_bytes", lambda path: 2**20)  # 1 MiB free
    proc = cli.train(run, steps=1, expect_rc=None, in_process=True)
    assert_user_error(proc, "a checkpoint of this run needs", "MiB", "1.0 MiB free", "--out")
    assert not run.exists()

    size = startup.checkpoint_size(load_config(None, ["model.n_layers=2", "model.d_model=64", "model.n_heads=4"]), 1)
    monkeypatch.setattr(startup, "free_bytes", lambda path: 2 * size)  # one fits, keep=2 x one beside a third not
    err = cli.train(run, "checkpoint.every=1", "train.eval_batches=0", steps=3, in_process=True).stderr
    assert "teratrain: warning: checkpoint.keep=2 keeps 2 checkpoint(s)" in err
    assert "up to 3 more on disk at once" in err
    assert latest_checkpoint(run).name == "step_00000003"
