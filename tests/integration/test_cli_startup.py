"""What a run prints: the start-up summary (rank 0), and plain progress lines when stderr is a file or
a pipe, as in a batch job's log (a terminal gets the progress bar)."""

import pytest

from teratrain.config import load_config
from teratrain.models.transformer import count_params

pytestmark = pytest.mark.slow


def test_summary_and_plain_log_lines(cli, tmp_path):
    run = tmp_path / "run"
    proc = cli.train(run, "metrics.progress=true", "train.log_every=2", "train.eval_batches=0", steps=4)
    err = proc.stderr
    n = count_params(load_config(run / "config.toml").model)["total"]
    for words in ("teratrain: model: tiny preset with n_layers, d_model changed (llama, 2 layers, d_model 64), "
                  f"{n / 1e6:,.2f} M parameters",
                  "teratrain: device: cpu, 1 process(es)",
                  "layout: dp=1 tp=1 pp=1 ep=1 zero=0 offload=none sync=allreduce precision=fp32 recompute=none, "
                  "accumulation 2 x micro-batch 4", "8 sequences x 64 tokens = 512 tokens per step, 4 steps",
                  "teratrain: predicted memory per process:", f"run directory: {run}"):
        assert words in err, (words, err)
    assert "\r" not in err, "no carriage-return redraws in a log file"
    steps = [ln.split()[1] for ln in err.splitlines() if ln.startswith("step ")]
    assert steps == ["2/4", "4/4"]
    assert all("| loss " in ln and "tokens/s" in ln for ln in err.splitlines() if ln.startswith("step "))

    resumed = cli.train(run, "metrics.progress=false", "train.log_every=2", "train.eval_batches=0", steps=6,
                        resume=True).stderr
    assert f"resumed from step 4 of {run}; changed since then: train.steps: 4 -> 6" in resumed
    assert "metrics.progress: True -> False" in resumed
    assert not any(ln.startswith("step ") for ln in resumed.splitlines())


def test_auto_layout_is_chosen_said_and_recorded(cli, tmp_path):
    """parallel.auto on CPU: the unset layout keys follow the CPU rule (docs/planner.md), the summary
    says so and what was kept, and the run directory's config records the choice."""
    run = tmp_path / "auto"
    err = cli.train(run, "parallel.auto=true", "parallel.zero=1", "train.eval_batches=0", steps=1, in_process=True).stderr
    assert ("teratrain: auto layout: dp=1 tp=1 pp=1 ep=1 offload=none recompute=none chosen, the simplest of "
            in err), err
    assert "kept as given: parallel.zero, train.micro_batch" in err and "layout: dp=1 tp=1 pp=1 ep=1 zero=1" in err
    saved = load_config(run / "config.toml")
    assert (saved.parallel.auto, saved.parallel.dp, saved.parallel.zero, saved.memory.recompute) == (True, 1, 1, "none")
