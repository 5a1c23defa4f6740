"""A peer lost under plain torchrun: one sentence naming this rank, the operation that failed (the
registry of parallel/inflight.py knows which) and what comes next, kept in error.log and in
torchrun's error file; every rank must see the run directory as rank 0 does."""

from __future__ import annotations

import json

import pytest

from teratrain import jobenv, launch, rundir
from teratrain.config import ConfigError
from teratrain.parallel import inflight

GLOO = ("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:56995: Connection reset by peer. This is typically "
        "caused by a remote worker hanging or bugs in the application. GLHF!")


class _Broken:
    def wait(self):
        raise RuntimeError(GLOO)

    def is_completed(self):
        return True


@pytest.fixture
def torchrun(monkeypatch, tmp_path):
    """This process as rank 1 of plain torchrun (2 restarts allowed, 1 used), its run in tmp_path/run."""
    env = {"TORCHELASTIC_RUN_ID": "job", "WORLD_SIZE": "2", "RANK": "1", "TORCHELASTIC_MAX_RESTARTS": "2",
           "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TERATRAIN_LAUNCHER_PID", raising=False)
    (tmp_path / "run").mkdir()
    monkeypatch.setattr(jobenv, "run_dir", tmp_path / "run")
    inflight.reset()
    yield tmp_path / "run"
    inflight.reset()


def test_the_sentence_names_the_rank_the_operation_and_what_comes_next(torchrun, tmp_path):
    with pytest.raises(RuntimeError) as caught:
        inflight.launch("all-reduce", None, lambda: _Broken()).wait()
    sentence = inflight.lost_peer(caught.value)
    assert sentence == (f"rank 1: a peer was lost during an all-reduce (Connection reset by peer: its process or node "
                        f"ended); torchrun restarts the job (1 restart left on this node); details in "
                        f"{torchrun / 'error.log'}")
    assert inflight.lost_peer(RuntimeError("CUDA out of memory")) is None
    assert inflight.lost_peer(ValueError("Connection reset by peer")) is None
    assert inflight.lost_peer(BrokenPipeError(32, "Broken pipe")) is None  # `torchrun ... | head`

    launch.record_failure(sentence, "Traceback ...\n")
    launch.record_failure("rank 0: another", None)  # ranks append to the same log
    log = (torchrun / "error.log").read_text()
    assert sentence in log and "Traceback ..." in log and log.index(sentence) < log.index("rank 0: another")
    assert json.loads((tmp_path / "error.json").read_text())["message"]["message"] == "rank 0: another"


def test_without_restarts_left_it_names_the_command_that_continues(torchrun, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank a node: several nodes
    with pytest.raises(RuntimeError) as caught:
        inflight.blocking("barrier", None, lambda: _Broken().wait())
    assert "no checkpoint was written yet" in inflight.lost_peer(caught.value)
    (torchrun / "checkpoints").mkdir()
    (torchrun / "checkpoints" / "latest").write_text("step_00000005")
    assert (f"during a barrier (Connection reset by peer: its process or node ended); continue with: the same "
            f"torchrun command with --out {torchrun} --resume auto;") in inflight.lost_peer(caught.value)


class _Rank0:
    is_main, world_group = True, None


def test_every_rank_must_see_the_run_directory_as_rank_0(monkeypatch, tmp_path):
    from teratrain.parallel import comm

    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.LOCK_NAME).write_text('{"pid": 1, "host": "node0"}')
    views: list = []  # what rank 1 sees: (whether it resumes, its run.lock)
    monkeypatch.setattr(comm, "broadcast_object", lambda obj, group: obj)
    monkeypatch.setattr(comm, "all_gather_objects", lambda obj, group: [obj, *views])
    rt = _Rank0()
    views[:] = [(False, '{"pid": 1, "host": "node0"}')]
    assert rundir.agree_run_dir(run, False, rt) == run
    views[:] = [(False, None)]  # rank 1's node has a folder of its own there
    with pytest.raises(ConfigError, match="rank 1 does not see the run directory .* filesystem that every node shares"):
        rundir.agree_run_dir(run, False, rt)
    views[:] = [(True, '{"pid": 1, "host": "node0"}')]
    with pytest.raises(ConfigError, match="rank 1 decided to resume the run in .*, rank 0 the opposite"):
        rundir.agree_run_dir(run, False, rt)


def test_a_user_error_under_torchrun_is_quoted_in_its_failure_report(torchrun, tmp_path, capsys):
    """torchrun's report shows the error file's message: the sentence, not `error_file: <N/A>`."""
    from teratrain.cli import _exit_status

    assert _exit_status(ConfigError("data.path names no file; give a corpus."), None) == 2
    assert json.loads((tmp_path / "error.json").read_text())["message"]["message"] == \
        "data.path names no file; give a corpus."
    assert "teratrain: error: data.path names no file" in capsys.readouterr().err
