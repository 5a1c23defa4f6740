"""The offload engine's host step gets half the rank's share of the CPUs, not torchrun's one thread."""

from pathlib import Path

import pytest
import torch

from teratrain import startup
from teratrain.memory import offload
from teratrain.memory.offload import HostUpdate, host_threads, use_host_threads
from teratrain.mesh import Runtime
from tests.helpers import make_config


@pytest.fixture
def sixteen_cpus(monkeypatch):
    monkeypatch.setattr(offload.os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)


def test_each_local_rank_gets_half_its_share_of_the_cpus(sixteen_cpus, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_threads() == 2
    assert host_threads(3) == 3  # parallel.offload_threads given: kept
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert host_threads() == 1  # as many ranks as CPUs: one each
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert host_threads() == torch.get_num_threads()  # one process: torch's own count, untouched


def test_the_host_update_sets_the_threads_and_the_summary_says_so(sixteen_cpus, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # what torchrun leaves a rank of a several-process job
        assert use_host_threads() == 2 and torch.get_num_threads() == 2
        assert HostUpdate([10], torch.device("cpu"), torch.float32, torch.float32).threads == 2
    finally:
        torch.set_num_threads(was)
    cfg = make_config("parallel.zero=2", "parallel.offload=optimizer")
    text = startup.summary(cfg, Runtime.single("cpu"), Path("runs/x"), 0)
    assert "offload=optimizer (host step on 2 CPU threads a rank)" in text
    assert "offload=none " in startup.summary(make_config(), Runtime.single("cpu"), Path("runs/x"), 0)
