"""Checkpoints at the same layout resume bit for bit on CPU for every ZeRO stage (and DP): 16 steps
straight equal 8 steps + --resume to 16 in every logged loss and every saved tensor of every rank,
with dropout on (each rank's RNG stream is saved and restored)."""

import pytest

from harness import run_ranks
from teratrain.config import load_config
from teratrain.train import run
from workers import TINY, assert_bitwise_resume

# constant lr: a cosine schedule depends on train.steps, which the 8-step first half changes
COMMON = TINY + ["model.dropout=0.1", "train.steps=16", "checkpoint.every=4", "optim.schedule=constant"]


def straight_and_resumed(rank: int, world: int, extra: list[str], root: str) -> None:
    run(load_config(None, COMMON + extra), f"{root}/straight")
    run(load_config(None, COMMON + extra + ["train.steps=8"]), f"{root}/resumed")
    run(load_config(None, COMMON + extra), f"{root}/resumed", resume=True)


@pytest.mark.parametrize("world, extra", [pytest.param(2, ["parallel.zero=0"], marks=pytest.mark.long),
                                          pytest.param(2, ["parallel.zero=1"], marks=pytest.mark.long),
                                          pytest.param(2, ["parallel.zero=2"], marks=pytest.mark.long),
                                          (2, ["parallel.zero=3"]), pytest.param(4, ["parallel.tp=2", "parallel.zero=1"], marks=pytest.mark.long)], ids=str)
def test_resume_is_bitwise(world, extra, dist_workdir):
    """tp=2 x dp=2 also checks that dropout in split regions (local heads, sequence shards) replays
    its own streams after a resume."""
    root = dist_workdir / f"resume-{world}-{'-'.join(extra)}"
    run_ranks(straight_and_resumed, world, extra, str(root))
    assert_bitwise_resume(root, 16, world)
