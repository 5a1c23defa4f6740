"""--resume continues the run's own config: the saved config.toml is the base, a config file and --set
apply on top (each change reported), and a longer --steps keeps the learning-rate schedule's length
unless optim.decay_steps asks otherwise."""

import shutil

import pytest

from teratrain.config import load_config, tomllib  # tomli on Python 3.10
from teratrain.optim.lr import lr_at
from tests.integration.runner import metrics

pytestmark = pytest.mark.slow

CONFIG = """
[optim]
lr = 1e-4
warmup_steps = 2
schedule = "cosine"
[checkpoint]
every = 2
keep = 3
[train]
eval_batches = 0
"""


@pytest.fixture(scope="module")
def first_half(cli, tmp_path_factory):
    """4 steps of a run configured by a file (lr 1e-4, cosine over 4 steps, a checkpoint every 2)."""
    root = tmp_path_factory.mktemp("resume_config")
    (root / "my.toml").write_text(CONFIG)
    run = root / "run"
    cli.train(run, steps=4, config=root / "my.toml")
    return run


def expected_lr(step: int, lr: float, schedule_steps: int) -> float:
    return lr_at(step - 1, lr, 2, schedule_steps, "cosine", 0.1)


def test_resume_without_the_config_file_continues_its_settings(cli, first_half, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(first_half, run)
    proc = cli.train(run, steps=8, resume=True)  # the file is not passed again

    cfg = load_config(run / "config.toml")
    assert (cfg.optim.lr, cfg.checkpoint.every, cfg.train.steps) == (1e-4, 2, 8)
    records = metrics(run)
    assert [r["step"] for r in records] == list(range(1, 9))
    # the schedule keeps its 4-step length: steps 5-8 run at the final lr, 0.1 x 1e-4
    for r in records:
        assert r["lr"] == pytest.approx(expected_lr(r["step"], 1e-4, 4), rel=1e-12)
    assert records[-1]["lr"] == pytest.approx(1e-5)
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [
        "step_00000004", "step_00000006", "step_00000008"]  # checkpoint.every=2 carried over
    assert "train.steps: 4 -> 8" in proc.stderr and "optim.decay_steps: None -> 4" in proc.stderr
    # and it is the run that was given optim.decay_steps=4 from the start, bit for bit
    straight = tmp_path / "straight"
    cli.train(straight, "optim.decay_steps=4", steps=8, config=first_half.parent / "my.toml")
    assert [r["loss"] for r in metrics(straight)] == [r["loss"] for r in records]


def test_changes_given_on_resume_apply_and_are_reported(cli, first_half, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(first_half, run)
    proc = cli.train(run, "optim.lr=2e-4", "optim.decay_steps=8", steps=8, resume=True)

    changed = [ln for ln in proc.stderr.splitlines() if "changed since then" in ln]
    assert len(changed) == 1
    assert "optim.lr: 0.0001 -> 0.0002" in changed[0] and "optim.decay_steps: None -> 8" in changed[0]
    assert "train.steps: 4 -> 8" in changed[0] and "model." not in changed[0]
    # asked for: the cosine re-stretched over 8 steps at the new peak, from step 5 on
    for r in metrics(run)[4:]:
        assert r["lr"] == pytest.approx(expected_lr(r["step"], 2e-4, 8), rel=1e-12)
    assert tomllib.loads((run / "config.toml").read_text())["optim"]["lr"] == 2e-4


def test_print_config_of_a_resume_shows_the_saved_run(cli, first_half):
    out = cli("train", "--out", first_half, "--resume", "--steps", 6, "--print-config", in_process=True).stdout
    cfg = tomllib.loads(out)
    assert cfg["optim"]["lr"] == 1e-4 and cfg["train"]["steps"] == 6 and cfg["optim"]["decay_steps"] == 4
    assert cfg["model"]["d_model"] == 64 and cfg["checkpoint"]["every"] == 2
