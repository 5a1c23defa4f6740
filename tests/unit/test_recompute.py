"""Activation recomputation changes memory, never the math: every policy's gradients equal those of
policy none in float64, with dropout on (so the checkpoint must replay the dropout RNG)."""

import math

import pytest
import torch

from teratrain.memory.recompute import RecomputedBlocks, apply_recompute, segment_size
from teratrain.models.layers import CoreAttention
from teratrain.models.transformer import Block, lm_loss
from tests.helpers import small_model

POLICIES = ["full", "every-k", "sqrt", "selective", "selective-ops", "selective-ops-alternate"]
SHAPE = dict(n_layers=5, dropout=0.1)  # 5 blocks: every-2 and sqrt (k=2) leave a 1-block tail segment


def gradients(policy: str, arch: str = "llama", rng_seed: int = 0, every: int = 2) -> dict[str, torch.Tensor]:
    model = apply_recompute(small_model(arch=arch, **SHAPE), policy, every)
    model.train()
    x = torch.randint(0, model.cfg.vocab_size, (3, model.cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(rng_seed)  # the dropout stream
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_equal_policy_none(policy, arch):
    ref, got = gradients("none", arch), gradients(policy, arch)
    assert got.keys() == ref.keys(), "recomputation must not rename parameters"
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-10, atol=1e-13, msg=name)


def test_dropout_is_live_so_rng_replay_is_tested():
    a, b = gradients("none", rng_seed=0), gradients("none", rng_seed=1)
    assert any(not torch.allclose(a[n], b[n]) for n in a)


@pytest.mark.parametrize("every", [1, 3, 5, 7])
def test_every_k_for_several_k(every):
    ref, got = gradients("none"), gradients("every-k", every=every)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-10, atol=1e-13, msg=name)


@pytest.mark.parametrize("policy, hooked, forwards_per_step", [
    ("none", "block", 1), ("full", "block", 2), ("every-k", "block", 2), ("sqrt", "block", 2),
    ("selective", "core", 2), ("selective", "block", 1),
])
def test_policy_recomputes_what_it_says(policy, hooked, forwards_per_step):
    """A recomputed module starts its forward twice per step (once more in backward); a kept one once.
    (Pre-hooks: the non-reentrant checkpoint may stop a recomputation early, before a forward hook fires.)"""
    model = apply_recompute(small_model(**SHAPE), policy, 2)
    kind = Block if hooked == "block" else CoreAttention
    calls = []
    for module in model.modules():
        if isinstance(module, kind):
            module.register_forward_pre_hook(lambda *_: calls.append(1))
    x = torch.randint(0, model.cfg.vocab_size, (2, 9))
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    assert len(calls) == forwards_per_step * SHAPE["n_layers"]


def _matmuls(policy: str, arch: str, dropout: float = SHAPE["dropout"]) -> tuple[int, int, int]:
    """(matrix products, other ops, the linear products' multiply-adds) one training step of a small model
    dispatches under `policy`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    gemms = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    counts = [0, 0, 0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[func not in gemms] += 1
            if func in (aten.mm.default, aten.addmm.default):
                a, b = args[-2:]
                counts[2] += a.shape[0] * a.shape[1] * b.shape[1]
            return func(*args, **(kwargs or {}))

    model = apply_recompute(small_model(arch=arch, **{**SHAPE, "dropout": dropout}), policy, 2)
    x = torch.randint(0, model.cfg.vocab_size, (2, 9))
    with Count():
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    return counts[0], counts[1], counts[2]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_selective_ops_runs_no_matrix_product_twice(arch):
    """selective-ops keeps every GEMM's output (dropout on: attention takes the math path, its two
    batched products kept too) and replays only the rest: as many products as no recomputation, more
    other ops; full recomputation runs every block's forward products again."""
    none, ops, full = (_matmuls(p, arch)[:2] for p in ("none", "selective-ops", "full"))
    assert ops[0] == none[0] < full[0]
    assert ops[1] > none[1]


@pytest.mark.parametrize("dropout", [0.1, 0.0])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_selective_ops_alternate_runs_every_other_product_again(arch, dropout):
    """selective-ops-alternate keeps the 1st, 3rd, ... linear product's output of a block and runs the others
    again in backward (dropout on: attention takes the math path, whose two batched products it keeps): per
    block, the products replay.alternate_replayed prices (GPT-2 without dropout: not its last, w2), fewer than
    full recomputation runs again."""
    from teratrain.planner.layout import ModelShape
    from teratrain.planner.replay import alternate_replayed

    none, alternate, full = (_matmuls(p, arch, dropout) for p in ("none", "selective-ops-alternate", "full"))
    replayed = 3 if arch == "llama" or dropout else 2
    assert alternate[0] - none[0] == replayed * SHAPE["n_layers"] < full[0] - none[0]
    cfg = small_model(arch=arch, **{**SHAPE, "dropout": dropout}).cfg
    tokens = 2 * 8
    assert alternate[2] - none[2] == SHAPE["n_layers"] * tokens * alternate_replayed(ModelShape(cfg=cfg))


@pytest.mark.parametrize("policy, every, k", [("full", 3, 1), ("every-k", 3, 3), ("sqrt", 3, 2)])
def test_apply_sets_the_segment_size(policy, every, k):
    model = apply_recompute(small_model(**SHAPE), policy, every)
    assert isinstance(model.layers, RecomputedBlocks) and model.layers.k == k


@pytest.mark.parametrize("n_layers, k", [(1, 1), (2, 1), (3, 2), (4, 2), (5, 2), (9, 3), (12, 3), (13, 4),
                                         (16, 4), (32, 6), (80, 9)])
def test_sqrt_segment_is_round_sqrt_l(n_layers, k):
    assert k == round(math.sqrt(n_layers))
    assert segment_size("sqrt", n_layers, every=7) == k


def test_segment_size_of_other_policies():
    assert segment_size("full", 12, every=3) == 1
    assert segment_size("every-k", 12, every=3) == 3
    with pytest.raises(ValueError):
        segment_size("selective", 12, every=3)


def test_no_recompute_without_grad_or_with_a_cache():
    """Inference (no_grad, KV cache) runs the blocks plainly and matches the unwrapped model."""
    plain, wrapped = small_model(**SHAPE).eval(), apply_recompute(small_model(**SHAPE), "full").eval()
    x = torch.randint(0, plain.cfg.vocab_size, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), plain(x), rtol=0, atol=0)
        caches = wrapped.make_caches(2, 8)
        torch.testing.assert_close(wrapped(x, caches=caches), plain(x), rtol=1e-12, atol=1e-12)
