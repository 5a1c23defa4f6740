"""`--resume auto` (checkpoint.resume = "auto", the default under plain torchrun): the same command
starts a run and continues it, so a restarted job needs no other command; a folder holding another
run is still refused."""

import pytest

from teratrain.config import load_config
from teratrain.config_toml import to_toml
from tests.integration.runner import assert_user_error, metrics

pytestmark = pytest.mark.slow

SETS = ["train.eval_batches=0", "checkpoint.every=2"]


def test_one_command_starts_and_continues_a_run(cli, tmp_path):
    run = tmp_path / "run"
    err = cli.train(run, *SETS, steps=2, resume="auto", in_process=True).stderr
    assert f"teratrain: resume=auto: {run} holds no run: starting it" in err
    err = cli.train(run, *SETS, steps=3, resume="auto", in_process=True).stderr
    assert f"teratrain: resume=auto: {run} holds checkpoints: continuing its run" in err
    assert f"resumed from step 2 of {run}" in err
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]

    other = cli.train(run, *SETS, "model.n_layers=3", steps=4, resume="auto", expect_rc=None, in_process=True)
    assert_user_error(other, f"--out {run} holds another run (model.n_layers = 2 there, 3 here)", "another --out")
    assert_user_error(cli.train(None, *SETS, steps=1, resume="auto", expect_rc=None, in_process=True),
                      "checkpoint.resume=auto", "--out")

    config = tmp_path / "more.toml"  # a bare --resume before a config file leaves the file a config
    config.write_text("[train]\nsteps = 4\n")
    cli("train", "--resume", config, "--out", run, in_process=True)
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]


def test_a_run_that_stopped_before_its_first_checkpoint_starts_over(cli, tmp_path):
    """A restart before the first checkpoint: nothing can resume the steps it logged, so auto starts
    the run again (its metrics.jsonl replaced) where a fresh start would refuse the folder."""
    run = tmp_path / "run"
    run.mkdir()
    cli.train(tmp_path / "shape", *SETS, steps=1, in_process=True)  # for its config.toml
    (run / "config.toml").write_text((tmp_path / "shape" / "config.toml").read_text())
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 9.0}\n')
    assert_user_error(cli.train(run, *SETS, steps=2, expect_rc=None, in_process=True), "before its first checkpoint")
    err = cli.train(run, *SETS, steps=2, resume="auto", in_process=True).stderr
    assert "holds a run that stopped before its first checkpoint: starting it over" in err
    assert [r["step"] for r in metrics(run)] == [1, 2] and metrics(run)[0]["loss"] != 9.0


def test_the_default_is_auto_under_plain_torchrun_only(monkeypatch):
    from teratrain.rundir import resume_mode

    for key in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "TERATRAIN_LAUNCHER_PID"):
        monkeypatch.delenv(key, raising=False)
    assert resume_mode(None) is False and resume_mode(True) is True
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resume_mode(None) == "auto" and resume_mode(False) is False
    monkeypatch.setenv("TERATRAIN_LAUNCHER_PID", "1")  # a rank of `--nproc`: its launcher decided
    assert resume_mode(None) is False
    assert load_config(None, ["checkpoint.resume=auto"]).checkpoint.resume == "auto"
    assert 'resume = "auto"' in to_toml(load_config(None, ["checkpoint.resume=auto"]))


def test_a_resume_keeps_the_global_batch_or_is_refused(cli, tmp_path):
    """At another data-parallel degree (torchrun restarted the job on other nodes) the global batch
    stays: accumulation follows, or a degree it does not split over is refused before any process starts."""
    run = tmp_path / "run"
    cli.train(run, *SETS, steps=1, in_process=True)  # 8 sequences, micro-batches of 4: accumulation 2 at dp=1
    for nproc, words in ((3, "over which its train.global_batch=8 does not split"),
                         (4, "each rank takes 2 of its train.global_batch=8 sequences, not a multiple of "
                             "train.micro_batch=4; set train.micro_batch to a divisor of 2")):
        proc = cli.train(run, *SETS, steps=2, nproc=nproc, resume=True, expect_rc=None, in_process=True)
        assert_user_error(proc, f"the run in {run} resumes at dp={nproc} on {nproc} processes (its checkpoint: 1)",
                          words)
