"""Dropout under tensor parallelism: replicated regions draw the same mask on every tp rank, split
regions (local heads, sequence shards) draw different ones, recomputation replays the same masks,
and training with dropout keeps replicated parameters identical across tp ranks."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from harness import run_ranks
from layout_workers import batches, build, train_random

P = 0.3


def masks(rank: int, world: int) -> dict:
    from teratrain.parallel.tp_layers import ForkedRNG

    torch.manual_seed(7)  # tp peers share the default stream (seeded by data-parallel rank only)
    x = torch.ones(20000)
    plain, forked = torch.nn.Dropout(P).train(), ForkedRNG(torch.nn.Dropout(P), tp_rank=rank).train()
    out = {"plain": plain(x) == 0, "forked": forked(x) == 0, "plain_after": plain(x) == 0}
    w = torch.ones(20000, requires_grad=True)  # recomputed under checkpoint: backward sees the forward's mask
    y = checkpoint(forked, x * w, use_reentrant=False, preserve_rng_state=True)
    y.sum().backward()
    out["replayed"] = bool(torch.equal(w.grad, (y != 0).float() / (1 - P)))
    return out


def test_split_regions_differ_replicated_regions_agree():
    a, b = run_ranks(masks, 2)
    assert torch.equal(a["plain"], b["plain"]) and torch.equal(a["plain_after"], b["plain_after"])
    assert not torch.equal(a["forked"], b["forked"])
    n = a["forked"].numel()
    for m in (a["forked"], b["forked"], a["plain"]):
        assert abs(m.float().mean().item() - P) < 5 * (P * (1 - P) / n) ** 0.5  # 5 sigma of a binomial
    assert a["replayed"] and b["replayed"]


def local_replicas(rank: int, world: int, sp: bool) -> dict:
    from teratrain.optim.engine import train_step

    overrides = ["parallel.tp=2", f"parallel.sequence_parallel={str(sp).lower()}", "model.dropout=0.1"]
    cfg, rt, model, engine = build(overrides)
    losses = []
    for batch in batches(cfg, 3):
        micro = [(batch[i:i + 2, :-1], batch[i:i + 2, 1:]) for i in range(0, 8, 2)]
        _, loss = train_step(model, engine, micro, "fp32", cfg.optim.lr)
        losses.append(float(loss))
    return {"losses": losses,
            "replicated": {n: p.detach().clone() for n, p in model.named_parameters() if p.placement.dim is None}}


@pytest.mark.long
def test_training_with_dropout_keeps_replicas_identical():
    """Without sequence parallelism the norms see identical inputs on both tp ranks only if the
    residual dropout masks agree; with it they are reduced over dp x tp. Either way both ranks'
    copies stay bitwise equal, and the loss matches one process with dropout statistically."""
    for sp in (False, True):
        a, b = run_ranks(local_replicas, 2, sp)
        assert a["replicated"].keys() and a["replicated"].keys() == b["replicated"].keys()
        for name in a["replicated"]:
            assert torch.equal(a["replicated"][name], b["replicated"][name]), (sp, name)
        assert a["losses"] == b["losses"]
    ref = train_random(0, 1, ["model.dropout=0.1"], steps=3)["losses"]
    assert max(abs(x - y) for x, y in zip(a["losses"], ref)) < 0.05, (a["losses"], ref)
