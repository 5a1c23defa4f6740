"""The offload engine's host step gets CPU threads of its own (half the rank's share of the CPUs), not
the one thread torchrun leaves each rank, and reports its time by part."""

from pathlib import Path

import pytest
import torch

from teratrain import startup
from teratrain.memory import offload
from teratrain.memory.offload import host_threads
from teratrain.mesh import Runtime
from teratrain.optim.engine import train_step
from teratrain.measure import build_engine, random_batch
from tests.helpers import make_config


@pytest.fixture
def sixteen_cpus(monkeypatch):
    monkeypatch.setattr(offload.os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    was = torch.get_num_threads()
    yield
    torch.set_num_threads(was)


def test_each_local_rank_gets_half_its_share_of_the_cpus(sixteen_cpus, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_threads() == 2
    assert host_threads(3) == 3  # parallel.offload_threads given: kept
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert host_threads() == 1  # as many ranks as CPUs: one each
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    torch.set_num_threads(6)
    assert host_threads() == 6  # a count the user gave (torchrun gives 1) is kept
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    torch.set_num_threads(5)
    assert host_threads() == 5  # one process: torch's own count, untouched
    monkeypatch.setenv("WORLD_SIZE", "4")  # several ranks without torchrun's LOCAL_WORLD_SIZE: one a GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert host_threads() == 2


def test_an_offload_engine_takes_the_threads_and_times_its_host_step(sixteen_cpus, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    torch.set_num_threads(1)  # what torchrun leaves a rank of a several-process job
    cfg = make_config("parallel.zero=2", "parallel.offload=optimizer")
    model, engine = build_engine(cfg)
    assert torch.get_num_threads() == 2
    stats, _ = train_step(model, engine, [random_batch(cfg, 2)], cfg.memory.precision, 1e-3)
    parts = stats.metrics
    assert parts["offload_threads"] == 2
    assert set(parts) == {"offload_threads", "offload_wait_ms", "offload_optimizer_ms", "offload_publish_ms",
                          "offload_upload_wait_ms", "offload_host_ms"}
    assert parts["offload_optimizer_ms"] > 0 and parts["offload_host_ms"] >= parts["offload_optimizer_ms"]
    text = startup.summary(cfg, Runtime.single("cpu"), Path("runs/x"), 0)
    assert "offload=optimizer (host step on 2 CPU threads a rank)" in text
    assert "offload=none " in startup.summary(make_config(), Runtime.single("cpu"), Path("runs/x"), 0)
