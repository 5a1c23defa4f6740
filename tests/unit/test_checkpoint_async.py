"""checkpoint.async: a save returns once the state is copied; `latest` moves only after the background
write is complete and agreed on; the files are those a synchronous save writes; a failed write stops
training with its sentence and leaves `latest` alone; a write a crash cut short is cleared later."""

import errno
import threading
from types import SimpleNamespace

import pytest
import torch

from teratrain.checkpoint import io
from teratrain.checkpoint.background import Saver
from teratrain.checkpoint.format import CheckpointError

RT = SimpleNamespace(rank=0, world=1, barrier=lambda: None, device=torch.device("cpu"), group=lambda name: None)


def state(step: int):
    """What stage_training returns: tensors (views of live state), this rank's JSON, the checkpoint's meta."""
    weight = torch.arange(1000, dtype=torch.float32) * step
    return {"param/w": weight[::2], "rng.x": torch.tensor([step])}, {"step": step, "pieces": []}, {"dims": {}}


@pytest.fixture
def held(monkeypatch):
    """Background writes wait for `release` before writing."""
    release, original = threading.Event(), io.write_safetensors

    def write(path, tensors, metadata=None):
        release.wait(timeout=30)
        return original(path, tensors, metadata)

    monkeypatch.setattr(io, "write_safetensors", write)
    return release


def latest(root):
    return (root / "latest").read_text() if (root / "latest").exists() else None


def test_latest_moves_only_once_the_write_is_complete_and_agreed(tmp_path, held):
    live = {}

    def stage(step, _signum):
        tensors, meta, g = state(step)
        live.update(tensors)
        return tensors, meta, g

    saver = Saver(tmp_path, RT, keep=2, background=True, stage=stage)
    saver.save(2)
    live["param/w"].mul_(0)  # training goes on and changes the state: the save copied it first
    assert saver.flags()[0] == 1 and latest(tmp_path) is None
    saver.agree(saver.flags())  # a step's agreement while the write runs: nothing moves
    assert latest(tmp_path) is None and saver.take() == []
    held.set()
    saver.pending.thread.join()
    flags = saver.flags()
    assert flags[:2] == [0, 0]
    saver.agree(flags)
    assert latest(tmp_path) == "step_00000002"
    (done,) = saver.take()
    assert done["step"] == 2 and done["async"] and done["write_s"] >= 0 and done["block_s"] >= 0

    sync = Saver(tmp_path / "sync", RT, keep=2, background=False, stage=lambda step, _: state(step))
    sync.save(2)
    for name in ("rank00000.safetensors", "rank00000.json"):
        assert (tmp_path / "step_00000002" / name).read_bytes() == (tmp_path / "sync/step_00000002" / name).read_bytes()
    io.verify(tmp_path / "step_00000002", 0)


def test_the_next_save_waits_for_the_previous_one(tmp_path, held):
    saver = Saver(tmp_path, RT, keep=3, background=True, stage=lambda step, _: state(step))
    saver.save(2)
    threading.Timer(0.2, held.set).start()
    saver.save(4, wait=True)  # waits for step 2's write, completes it, then writes step 4 and completes it
    assert latest(tmp_path) == "step_00000004"
    assert [d["step"] for d in saver.take()] == [2, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000004"]


def test_a_failed_write_stops_with_its_sentence_and_keeps_latest(tmp_path, monkeypatch):
    saver = Saver(tmp_path, RT, keep=2, background=True, stage=lambda step, _: state(step))
    saver.save(2, wait=True)

    def full(path, tensors, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(io, "write_safetensors", full)
    saver.save(4)
    with pytest.raises(CheckpointError, match="could not write checkpoint step_00000004 .* free space"):
        saver.finish()
    assert latest(tmp_path) == "step_00000002" and not (tmp_path / "step_00000004.tmp").exists()


def test_a_write_cut_short_by_a_crash_is_cleared_at_the_next_save(tmp_path):
    (tmp_path / "step_00000004.tmp").mkdir(parents=True)
    (tmp_path / "step_00000004.tmp" / "rank00000.safetensors").write_bytes(b"\0" * 10)
    saver = Saver(tmp_path, RT, keep=2, background=True, stage=lambda step, _: state(step))
    saver.save(6, wait=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000006"]


def test_not_with_a_parameter_server():
    from teratrain.config import ConfigError
    from tests.helpers import make_config

    with pytest.raises(ConfigError, match="checkpoint.async is not supported with parallel.sync=param-server"):
        make_config("checkpoint.async=true", "parallel.sync=param-server")
    assert make_config("checkpoint.async=true").checkpoint.async_
