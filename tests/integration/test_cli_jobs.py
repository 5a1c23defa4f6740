"""A run directory belongs to one job, and a job ends cleanly however it is stopped.

Real processes: jobs are started in the background, stopped with the signals users and schedulers
send (SIGTERM, kill -9), and every wait is bounded. Ranks run in sessions of their own (torchrun's
choice), so they are found by the unique --out in their command line and killed at teardown if a
failing test left them behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from teratrain.checkpoint import find_valid
from teratrain.rundir import own
from tests.helpers import TINY_SETS
from tests.integration.runner import assert_user_error, metrics, pids_running

pytestmark = pytest.mark.slow

# a job that runs until stopped, no evaluation; its checkpoints by time (every 10 minutes) never come
# in a test: a checkpoint exists only if the job writes one when it is stopped
LONG = ["train.eval_batches=0", "train.steps=100000"]


def train_argv(cli, out: Path | None, *sets: str, nproc: int = 1) -> list[str]:
    argv = [sys.executable, "-m", "teratrain", "train"] + (["--out", str(out)] if out else [])
    argv += ["--nproc", str(nproc)] if nproc > 1 else []
    for s in [*TINY_SETS, f"data.cache_dir={json.dumps(cli.cache)}", *sets]:
        argv += ["--set", s]
    return argv


@pytest.fixture
def jobs(cli):
    """Start background jobs; at teardown kill whatever of them (launchers and ranks) is still alive."""
    started: list[tuple[subprocess.Popen, str]] = []

    def start(out: Path, *sets: str, nproc: int = 1, env: dict | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(train_argv(cli, out, *sets, nproc=nproc), cwd=cli.cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        started.append((proc, str(out)))
        return proc

    yield start
    for proc, out in started:
        for pid in pids_running(out) + ([proc.pid] if proc.poll() is None else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate(timeout=30)


def wait_for(what, timeout: float = 90.0, every: float = 0.2):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (got := what()):
            return got
        time.sleep(every)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def wait_for_a_step(run: Path, proc: subprocess.Popen) -> None:
    """Until the job has logged its first step."""
    path = run / "metrics.jsonl"
    wait_for(lambda: (path.exists() and path.stat().st_size > 0) or proc.poll() is not None)
    assert proc.poll() is None, proc.communicate()


def assert_one_stop_line(stderr: str, signame: str) -> None:
    """Only the start-up summary and one line saying the job stopped: no traceback, no torchrun log."""
    assert "Traceback" not in stderr and "torch.distributed" not in stderr and "Error" not in stderr, stderr
    others = [ln for ln in stderr.splitlines() if not ln.startswith(("teratrain: model", "teratrain: device",
              "teratrain: layout", "teratrain: batch", "teratrain: predicted", "teratrain: run directory"))]
    assert len(others) == 1 and others[0].startswith(f"teratrain: stopped by {signame}"), stderr


def assert_resumable(run: Path) -> int:
    """The newest checkpoint verifies; returns its step."""
    path, meta = find_valid(run / "checkpoints")
    assert path.name == (run / "checkpoints" / "latest").read_text()
    return meta["step"]


def assert_saved_at_the_stop(run: Path, stderr: str, resume: str) -> int:
    """The stopped job wrote a checkpoint of its last logged step, and its line names it and the command
    `resume` that continues the job. Returns the step."""
    step = assert_resumable(run)
    assert step == metrics(run)[-1]["step"] >= 1
    assert f"at step {step}: wrote checkpoint step_{step:08d}; continue with: {resume}" in stderr, stderr
    return step


@pytest.mark.long
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds processes through /proc")
def test_default_run_names_are_unique(cli, tmp_path):
    """Two jobs started in the same second each get a run directory of their own."""
    procs = [subprocess.Popen(train_argv(cli, None, "train.steps=2", "train.eval_batches=0"), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2
    for run in runs:
        assert [r["step"] for r in metrics(run)] == [1, 2]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds processes through /proc")
def test_a_second_writer_is_refused_and_sigterm_stops_a_run_cleanly(cli, jobs, tmp_path):
    run = tmp_path / "run"
    job = jobs(run, *LONG)
    wait_for_a_step(run, job)

    second = cli.train(run, steps=3, resume=True, expect_rc=None)
    assert_user_error(second, f"pid {job.pid}", socket.gethostname(), "in use")
    assert_user_error(cli.train(run, steps=3, expect_rc=None), "in use")

    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 143, err
    assert_one_stop_line(err, "SIGTERM")
    step = assert_saved_at_the_stop(run, err, f"teratrain train --out {run} --resume")

    cli.train(run, steps=step + 1, resume=True)  # the lock died with the job
    assert metrics(run)[-1]["step"] == step + 1


@pytest.mark.long
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds processes through /proc")
def test_killing_the_launcher_ends_its_ranks(jobs, tmp_path):
    run = tmp_path / "run"
    launcher = jobs(run, *LONG, nproc=2)
    wait_for_a_step(run, launcher)
    ranks = [p for p in pids_running(str(run)) if p != launcher.pid]  # (and torchrun, were it a process)
    assert len(ranks) >= 2

    launcher.kill()
    launcher.communicate(timeout=30)
    wait_for(lambda: not any(p in pids_running(str(run)) for p in ranks), timeout=30)
    with own(run, resume=True):  # the run directory is free again
        pass
    assert_resumable(run)  # the ranks saved before they stopped


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds processes through /proc")
@pytest.mark.parametrize("who", [pytest.param("launcher", marks=pytest.mark.long), "every process"])
def test_sigterm_ends_a_multi_process_job_with_one_message(jobs, tmp_path, who):
    """A user's SIGTERM reaches the launcher only (torchrun forwards it); a scheduler's reaches every
    process at once (and the launcher forwards it again). Either way: the ranks finish the step and
    save it, exit 143, one line naming the checkpoint and the command with the job's process count."""
    run = tmp_path / "run"
    launcher = jobs(run, *LONG, nproc=2)
    wait_for_a_step(run, launcher)
    for pid in [launcher.pid] if who == "launcher" else pids_running(str(run)):
        os.kill(pid, signal.SIGTERM)
    _, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 143, err
    assert_one_stop_line(err, "SIGTERM")
    wait_for(lambda: not pids_running(str(run)), timeout=30)
    assert_saved_at_the_stop(run, err, f"teratrain train --nproc 2 --out {run} --resume")


def test_a_failing_rank_is_named_in_one_sentence(cli, jobs, tmp_path):
    """Rank 1 raises its own error at step 3 (injected by a sitecustomize module on PYTHONPATH); rank 0
    then fails in a collective. The job ends with one line naming rank 1 and its error."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import teratrain.data.loader as loader\n"
        "    get = loader.Batches.get\n"
        "    def failing(self, step, *a, **kw):\n"
        "        if step == 2:\n"
        "            raise RuntimeError('injected failure on rank 1')\n"
        "        return get(self, step, *a, **kw)\n"
        "    loader.Batches.get = failing\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")])}
    run = tmp_path / "run"
    job = jobs(run, *LONG, nproc=2, env=env)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 1, err
    errors = [ln for ln in err.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "Traceback" not in err and "torch.distributed" not in err, err
    assert errors[0].startswith("teratrain: error: rank 1 failed: RuntimeError: injected failure on rank 1")
    assert "injected failure on rank 1" in (run / "error.log").read_text()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds processes through /proc")
def test_a_rank_killed_without_a_word_is_named(jobs, tmp_path):
    """kill -9 (what the OOM killer sends) leaves no report: the launcher names the rank and the signal,
    not the connection errors the other rank then sees."""
    run = tmp_path / "run"
    launcher = jobs(run, *LONG, nproc=2)
    wait_for_a_step(run, launcher)
    env = {p: (Path("/proc") / str(p) / "environ").read_bytes().split(b"\0") for p in pids_running(str(run))}
    (victim,) = [p for p, e in env.items() if b"RANK=1" in e]
    os.kill(victim, signal.SIGKILL)
    _, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 1, err
    errors = [ln for ln in err.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith("teratrain: error: rank 1 was killed by SIGKILL")
