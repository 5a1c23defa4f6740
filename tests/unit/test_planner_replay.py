"""Recomputation as the planner prices it (planner/replay.py): the ops a block adds under selective-ops
(OPS_SELECTIVE_REPLAY), the detaches under recompute=full (FULL_REPLAY_DETACHES), and the HBM bytes of the
ops selective-ops' backward replays (replay_bytes), counted again here with a TorchDispatchMode over our model
on CPU."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from teratrain.compat import gemm_ops
from teratrain.memory import recompute
from teratrain.memory.precision import autocast
from teratrain.models import layers
from teratrain.models.transformer import lm_loss
from teratrain.planner.layout import ModelShape, widths
from teratrain.planner.replay import (FULL_REPLAY_DETACHES, OPS_ALTERNATE_REPLAY, OPS_SELECTIVE_REPLAY, SILU_KEPT_OPS,
                                      replay_bytes)
from teratrain.planner.time import OPS_PER_BLOCK
from tests.helpers import small_model

GEMMS = gemm_ops()
PER_OP_CONTEXTS = recompute.per_op_contexts  # _step wraps it: a second _step in a test must find this one
MODES = {"fp32": ("fp32", torch.float32), "autocast": ("bf16", torch.float32), "low": ("bf16", torch.bfloat16)}


class Ops(TorchDispatchMode):
    """Counts the ops of the step (forward and backward apart), its detaches, and the bytes of those run
    while `replaying` is set: every tensor an op reads and writes, an op that returns a view of its input
    (detach, view, transpose, split) none, a matrix product none (its FLOPs are priced instead)."""

    def __init__(self):
        super().__init__()
        self.phase, self.replaying, self.bytes, self.detaches = "forward", False, 0, 0
        self.ops = {"forward": 0, "backward": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[self.phase] += 1
        self.detaches += func is torch.ops.aten.detach.default
        if self.replaying and func not in GEMMS:
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            held = {t.untyped_storage().data_ptr() for t in ins}
            inplace = func._schema.name.endswith("_")
            if inplace or not any(t.untyped_storage().data_ptr() in held for t in outs):
                self.bytes += sum(t.numel() * t.element_size() for t in ins + outs)
        return out


def _step(arch: str, mode: str, policy: str, n_layers: int, monkeypatch, **keys) -> Ops:
    precision, dtype = MODES[mode]
    model = recompute.apply_recompute(small_model(arch=arch, n_layers=n_layers, dtype=dtype, dropout=0.0, **keys),
                                      policy)
    count = Ops()

    def flagged():  # the replay runs inside the recompute context: mark it
        fwd, rec = PER_OP_CONTEXTS(policy)()

        @contextlib.contextmanager
        def replaying():  # the checkpoint stops a replay early by raising through it
            count.replaying = True
            try:
                with rec:
                    yield
            finally:
                count.replaying = False
        return fwd, replaying()

    monkeypatch.setattr(recompute, "per_op_contexts", lambda policy: flagged)
    x = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    with count:
        with autocast(precision, x.device):  # backward outside it, as optim/engine.py train_step runs it
            loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        count.phase = "backward"
        loss.backward()
    return count, model.cfg


@pytest.mark.parametrize("policy, counted", [("selective-ops", OPS_SELECTIVE_REPLAY),
                                             ("selective-ops-alternate", OPS_ALTERNATE_REPLAY)])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", list(MODES))
def test_the_ops_a_block_adds_are_counted_again(arch, mode, policy, counted, monkeypatch):
    """Per block (two depths, so the embedding, head and loss drop out), a per-op policy's step less
    recompute=none's, forward and backward apart."""
    got = {}
    for each in ("none", policy):
        one, two = (_step(arch, mode, each, n, monkeypatch)[0].ops for n in (1, 2))
        got[each] = [two[k] - one[k] for k in ("forward", "backward")]
    extra = tuple(s - n for s, n in zip(got[policy], got["none"]))
    assert extra == counted[(arch, mode)]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", list(MODES))
def test_the_ops_of_a_block_are_counted_again(arch, mode, monkeypatch):
    """OPS_PER_BLOCK, which prices every eager step's host and per-op time: a block's ops per micro-batch (two
    depths, so the embedding, head, loss and optimizer drop out, but a block's tensors' optimizer ops, which
    eager_ops counts apart), forward and backward apart."""
    one, two = (_step(arch, mode, "none", n, monkeypatch)[0].ops for n in (1, 2))
    got = tuple(two[k] - one[k] for k in ("forward", "backward"))
    assert got == OPS_PER_BLOCK[(arch, mode)]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_recomputed_block_adds_its_forward_and_the_counted_detaches(arch, mode, monkeypatch):
    """Per block, recompute=full's step less recompute=none's: FULL_REPLAY_DETACHES detaches, and other ops
    the forward's count (OPS_PER_BLOCK, which the planner charges for the rerun) covers within 10."""
    ops, detaches = {}, {}
    for policy in ("none", "full"):
        one, two = (_step(arch, mode, policy, n, monkeypatch)[0] for n in (1, 2))
        ops[policy] = sum(two.ops.values()) - sum(one.ops.values())
        detaches[policy] = two.detaches - one.detaches
    added = detaches["full"] - detaches["none"]
    assert added == FULL_REPLAY_DETACHES[arch]
    assert 0 <= OPS_PER_BLOCK[(arch, mode)][0] - (ops["full"] - ops["none"] - added) <= 10


@pytest.mark.parametrize("mode", list(MODES))
def test_a_swiglu_keeping_silus_output_issues_the_counted_ops(mode, monkeypatch):
    """SILU_KEPT_OPS, how the runs recorded before silu_mul are planned: a llama block with the plain SwiGLU
    expression (autograd keeps silu's output) against today's, per block, in each policy it changes."""
    def per_block(policy):
        one, two = (_step("llama", mode, policy, n, monkeypatch)[0] for n in (1, 2))
        return two.ops["backward"] - one.ops["backward"], two.detaches - one.detaches

    today = {policy: per_block(policy) for policy in ("none", "selective-ops", "full")}
    monkeypatch.setattr(layers, "silu_mul", lambda a, b: torch.nn.functional.silu(a) * b)
    kept = {policy: per_block(policy) for policy in ("none", "selective-ops", "full")}
    backward = kept["none"][0] - today["none"][0]
    assert backward == SILU_KEPT_OPS["backward"]
    assert kept["selective-ops"][0] - today["selective-ops"][0] - backward == SILU_KEPT_OPS["selective_backward"]
    detaches = kept["full"][1] - kept["none"][1] - (today["full"][1] - today["none"][1])
    assert detaches == SILU_KEPT_OPS["replay_detaches"]


@pytest.mark.parametrize("arch, keys", [("llama", {}), ("gpt2", {}), ("llama", {"qk_norm": "head"}),
                                        ("llama", {"qk_norm": "full", "n_kv_heads": 4})])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("policy", ["selective-ops", "selective-ops-alternate"])
def test_the_replayed_bytes_are_the_dispatched_ones(arch, keys, mode, policy, monkeypatch):
    """replay_bytes, with the CPU's decomposed RMSNorm, equals the bytes the replayed ops read and write; the
    alternate policy's replayed products are FLOPs (time.recompute_flops), left out of the count."""
    count, cfg = _step(arch, mode, policy, 2, monkeypatch, **keys)
    w = widths(MODES[mode][0], MODES[mode][1] == torch.bfloat16)
    planned = cfg.n_layers * replay_bytes(ModelShape(cfg=cfg), w, 2, cfg.seq_len, norm="decomposed")
    assert planned == count.bytes


def _planned(*sets: str):
    from teratrain.config import load_config
    from teratrain.planner.inputs import shape_of, training_of

    cfg = load_config(None, ["model.preset=llama-1b", "model.n_layers=4", "memory.precision=bf16", *sets])
    return shape_of(cfg), training_of(cfg)


def test_the_step_pays_the_replays_ops_and_bytes():
    """eager_ops adds OPS_SELECTIVE_REPLAY per block and micro-batch; the GPU's time adds replay_bytes at
    the card's sustained HBM rate; nothing else of the step moves (no FLOPs replayed)."""
    from teratrain.planner.hardware import GPUS
    from teratrain.planner.layout import Layout
    from teratrain.planner.search import evaluate
    from teratrain.planner.time import eager_ops

    shape, train = _planned()
    gpu = GPUS["h200"]
    lay = Layout(micro_batch=2, num_microbatches=3)
    ops = lay.with_(recompute="selective-ops")
    assert eager_ops(shape, train, ops) - eager_ops(shape, train, lay) == 4 * 3 * sum(OPS_SELECTIVE_REPLAY[("llama",
                                                                                                       "autocast")])
    base, replayed = (evaluate(shape, train, x, gpu).time for x in (lay, ops))
    w = train.widths(0)
    moved = 4 * 3 * replay_bytes(shape, w, 2, shape.cfg.seq_len)
    assert replayed.compute_s - base.compute_s == pytest.approx(moved / (gpu.hbm_gbps * 1e9 * gpu.mem_efficiency))
    assert replayed.ops_s - base.ops_s == pytest.approx((eager_ops(shape, train, ops) - eager_ops(shape, train, lay))
                                                        * gpu.op_overhead_s)
    assert replayed.terms["recompute_flops"] == 0


def test_the_alternate_policy_pays_its_replayed_products_at_the_gemm_rate():
    """selective-ops-alternate: selective-ops' step plus wk's, wo's and w3's products once more a block and
    micro-batch (2 x tokens x their weights) at the sustained GEMM rate, its own op counts, the same bytes."""
    from teratrain.planner.hardware import GPUS
    from teratrain.planner.layout import Layout
    from teratrain.planner.search import evaluate
    from teratrain.planner.time import eager_ops

    shape, train = _planned()
    c, gpu = shape.cfg, GPUS["h200"]
    ops, alternate = (Layout(micro_batch=2, num_microbatches=3, recompute=r)
                      for r in ("selective-ops", "selective-ops-alternate"))
    a, b = (evaluate(shape, train, x, gpu).time for x in (ops, alternate))
    weights = c.d_model * (c.kv_heads * c.head_width + c.n_heads * c.head_width + c.ffn_dim)
    flops = 2 * weights * 4 * 3 * 2 * c.seq_len
    assert b.terms["recompute_flops"] == flops
    assert b.compute_s - a.compute_s == pytest.approx(flops / gpu.sustained_flops("bf16", c.d_model))
    counted = [sum(d[("llama", "autocast")]) for d in (OPS_SELECTIVE_REPLAY, OPS_ALTERNATE_REPLAY)]
    assert eager_ops(shape, train, alternate) - eager_ops(shape, train, ops) == 4 * 3 * (counted[1] - counted[0])


def test_the_search_tries_selective_ops_on_dense_models_only():
    from teratrain.planner.hardware import GPUS
    from teratrain.planner.search import layouts

    dense = {lay.recompute for lay in layouts(*_planned(), 1, GPUS["h200"], {"micro_batch": 1})}
    assert {"selective-ops", "selective-ops-alternate"} <= dense
    moe = _planned("model.moe.num_experts=4", "model.moe.top_k=2")
    tried = {lay.recompute for lay in layouts(*moe, 1, GPUS["h200"], {"micro_batch": 1})}
    assert not tried & {"selective-ops", "selective-ops-alternate"}


@pytest.mark.parametrize("changes, compiled", [({"pp": 2, "schedule": "zb-h1"}, False), ({"zero": 3}, True),
                                               ({"pp": 2}, True)])
def test_the_planner_refuses_per_op_policies_where_the_run_would_not_keep_by_them(changes, compiled):
    """config_schema.per_op_problem: ZB-H1's split backward, and blocks compiled apart, refused as the config is."""
    import dataclasses

    from teratrain.planner.layout import Layout
    from teratrain.planner.states import PlanError, check_layout

    shape, train = _planned()
    train = dataclasses.replace(train, compiled=compiled)
    for policy in ("selective-ops", "selective-ops-alternate"):
        with pytest.raises(PlanError, match=f"memory.recompute={policy} keeps"):
            check_layout(shape, train, Layout(recompute=policy, num_microbatches=4, **changes))
    check_layout(shape, train, Layout(recompute="none", num_microbatches=4, **changes))
