"""A sharded checkpoint gives back the whole model: `checkpoint.consolidate.full_model` on ZeRO-3
(fp32 shards; bf16 with fp32 master shards) and tensor-parallel runs equals the parameters the
engine gathers."""

import pytest
import torch

from harness import run_ranks
from teratrain.checkpoint import find_valid
from teratrain.checkpoint.consolidate import full_model
from workers import train_many


@pytest.mark.parametrize("world, extra", [(2, ["parallel.zero=3", "memory.precision=fp32"]),
                                          (2, ["parallel.zero=3", "memory.precision=bf16"]),
                                          (2, ["parallel.tp=2"]),
                                          (4, ["parallel.tp=2", "parallel.zero=3", "memory.precision=bf16"])], ids=str)
def test_sharded_checkpoints_consolidate_to_the_full_model(world, extra, dist_workdir):
    """ZeRO-3 shards, tensor-parallel pieces (padding dropped) and both at once."""
    out = dist_workdir / f"consolidate-{world}-{'-'.join(extra)}"
    got = run_ranks(train_many, world, [(extra + ["train.steps=3"], str(out))])
    gathered = got[0][0]["params"]
    path, _ = find_valid(out / "checkpoints")
    weights = full_model(path)
    assert weights.keys() == gathered.keys()
    for name, value in gathered.items():
        assert torch.equal(weights[name].view_as(value).to(value.dtype), value), name
