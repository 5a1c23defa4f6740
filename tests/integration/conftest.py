"""Fixtures of the CLI tier: the shared data cache, the runner, one trained run.

Every run shares one tokenizer/token cache (the first use tokenizes the ~30 MB stdlib corpus once,
~20 s; later runs memory-map the cached file). Set TERATRAIN_TEST_CACHE to use another folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from teratrain.config import DataConfig
from teratrain.data.loader import cache_dir, prepare
from tests.integration.runner import Cli

VOCAB = 4096  # the tiny preset's vocabulary: the size of the cached BPE


@pytest.fixture(scope="session")
def data_cache() -> str:
    """The shared cache, filled once here (so its one-time cost shows up in one place)."""
    path = os.environ.get("TERATRAIN_TEST_CACHE") or str(cache_dir(None))
    prepare(DataConfig(cache_dir=path), VOCAB)
    return path


@pytest.fixture(scope="session")
def cli(data_cache, tmp_path_factory) -> Cli:
    return Cli(cwd=tmp_path_factory.mktemp("cwd"), cache=data_cache)


@pytest.fixture(scope="session")
def trained_run(cli, tmp_path_factory) -> Path:
    """One real training run shared by the read-only tests: 50 steps, checkpoints at 25 and 50."""
    out = tmp_path_factory.mktemp("trained") / "run"
    cli.train(out, "optim.warmup_steps=10", "checkpoint.every=25", "metrics.peak_tflops=1", steps=50)
    return out
