"""A sharded checkpoint gives back the whole model: `checkpoint.consolidate.full_model` on a ZeRO-3
run of 2 ranks (fp32 shards; bf16 with fp32 master shards) equals the parameters the engine gathers."""

import pytest
import torch

from harness import run_ranks
from teratrain.checkpoint import find_valid
from teratrain.checkpoint.consolidate import full_model
from workers import train_many


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero3_shards_consolidate_to_the_full_model(precision, dist_workdir):
    out = dist_workdir / f"consolidate-{precision}"
    got = run_ranks(train_many, 2, [(["parallel.zero=3", f"memory.precision={precision}", "train.steps=3"], str(out))])
    gathered = got[0][0]["params"]
    path, _ = find_valid(out / "checkpoints")
    weights = full_model(path)
    assert weights.keys() == gathered.keys()
    for name, value in gathered.items():
        assert torch.equal(weights[name].view_as(value).to(value.dtype), value), name
