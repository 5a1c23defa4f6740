"""Engines build the buckets the config asks for, and the gradient norm is exact.

- `parallel.bucket_mb` is the real size of a flat group in the dtype the engine holds it in (counted
  on the fp32 meta model, bf16 buckets would come out at a quarter of it).
- The global norm sums squares in fp64: fp32 accumulation over millions of elements drifts ~1e-5."""

import pytest
import torch

from teratrain.config import load_config
from teratrain.mesh import Runtime
from teratrain.models.transformer import Transformer
from teratrain.optim.engine import sum_sq
from teratrain.parallel.buckets import ordered_buckets
from teratrain.parallel.parallelize import parallelize


@pytest.mark.parametrize("precision, zero", [("bf16", 1), ("bf16", 2), ("fp32", 1), ("fp16", 2)])
def test_zero_buckets_have_the_configured_size(precision, zero):
    mb = 0.25
    cfg = load_config(None, ["model.preset=tiny", f"memory.precision={precision}", f"parallel.zero={zero}",
                             f"parallel.bucket_mb={mb}", "memory.loss_scale_init=1"])
    with torch.device("meta"):
        model = Transformer(cfg.model)
    engine = parallelize(model, Runtime.single("cpu"), cfg)
    limit = mb * 2**20
    sizes = [(sum(q.numel() for q in g.params) * g.params[0].element_size(), g.params[0].element_size() * g.params[-1].numel())
             for g in engine.groups]
    assert engine.groups[0].params[0].dtype == (torch.float32 if precision == "fp32" else getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[precision]))
    for nbytes, last in sizes[:-1]:  # every closed bucket: reached the size, and not before its last member
        assert limit <= nbytes < limit + last
    assert sizes[-1][0] < limit + sizes[-1][1]
    assert len(sizes) > 2


def test_ordered_buckets_close_at_the_size_in_the_given_itemsize():
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(1000))) for i in range(10)]
    buckets = ordered_buckets(named, 4000, key=lambda p: p.dtype, itemsize=lambda p: 2)
    assert [len(b.members) for b in buckets] == [2, 2, 2, 2, 2]
    assert buckets[0].members[0][0] == "p9"  # reverse registration order: backward's order


def test_global_norm_accumulates_in_fp64():
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(10_000_000, generator=g), torch.randn(69_792, generator=g) * 1e-3]
    exact = sum(float((t.double() ** 2).sum()) for t in shards)
    assert abs(float(sum_sq(shards)) - exact) / exact < 1e-12
