"""Where the planner charges the host ops its dense probe does not measure: ZB-H1's split backward
(planner/time.py OPS_SPLIT_EXTRA; the count itself is checked live by tests/integration/test_bench_smoke.py)
and an MoE layer's own ops (MOE_HOST_OP_SHARE)."""

import dataclasses

from teratrain.config import load_config
from teratrain.planner.hardware import GPUS
from teratrain.planner.inputs import shape_of, training_of
from teratrain.planner.layout import Layout
from teratrain.planner.search import evaluate
from teratrain.planner import time as planner_time
from teratrain.planner.time import MOE_HOST_OP_SHARE, OPS_MOE_EXTRA, OPS_SPLIT_EXTRA, moe_ops, split_ops


def _host(shape, train, lay) -> float:
    return evaluate(shape, train, lay, GPUS["h200"]).time.terms["host_s"]


def test_only_a_split_schedule_pays_the_host_for_it():
    cfg = load_config(None, ["model.preset=llama-1b", "model.n_layers=8", "train.global_batch=16",
                             "train.micro_batch=2"])
    shape, train = shape_of(cfg), training_of(cfg)
    lays = {s: Layout(pp=2, tp=2, micro_batch=2, num_microbatches=8, schedule=s) for s in ("1f1b", "zb-h1")}
    assert split_ops(shape, lays["1f1b"]) == 0
    assert split_ops(shape, lays["zb-h1"]) == 4 * OPS_SPLIT_EXTRA * 8  # 4 blocks a stage, 8 micro-batches
    extra = _host(shape, train, lays["zb-h1"]) - _host(shape, train, lays["1f1b"])
    assert abs(extra - 4 * OPS_SPLIT_EXTRA * 8 * GPUS["h200"].host_op_s) < 1e-12
    assert split_ops(shape, Layout(tp=2, micro_batch=2, num_microbatches=8, schedule="zb-h1")) == 0  # no pipeline
    graphed = dataclasses.replace(train, graphed=True, compiled=True)
    assert _host(shape, graphed, lays["zb-h1"]) == 0  # CUDA graphs: the host issues nothing


def test_an_moe_layers_ops_cost_the_host_more_than_a_dense_blocks(monkeypatch):
    sets = ["model.preset=llama-1b", "model.n_layers=8", "train.global_batch=4", "train.micro_batch=2"]
    moe_sets = sets + ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.every=2"]  # 4 of the 8 layers
    dense, moe = (load_config(None, s) for s in (sets, moe_sets))
    lay = Layout(tp=2, micro_batch=2, num_microbatches=2)
    assert moe_ops(shape_of(dense), training_of(dense), lay) == 0
    fwd, bwd = OPS_MOE_EXTRA
    assert moe_ops(shape_of(moe), training_of(moe), lay) == 4 * (fwd + bwd) * 2
    assert moe_ops(shape_of(moe), training_of(moe), dataclasses.replace(lay, recompute="full")) == 4 * (2 * fwd + bwd) * 2
    charged = _host(shape_of(moe), training_of(moe), lay)
    monkeypatch.setattr(planner_time, "MOE_HOST_OP_SHARE", 1.0)
    plain = _host(shape_of(moe), training_of(moe), lay)
    assert MOE_HOST_OP_SHARE > 1
    assert abs(charged - plain - (MOE_HOST_OP_SHARE - 1) * moe_ops(shape_of(moe), training_of(moe), lay) * GPUS["h200"].host_op_s) < 1e-12


def test_the_moe_share_follows_the_stage_and_the_dropless_readback(monkeypatch):
    """A pipeline stage counts its own MoE blocks; dropless expert parallelism's read-back (the forward's
    host time, when shorter than its GPU time) prices the forward's MoE ops as host_s does."""
    cfg = load_config(None, ["model.preset=llama-1b", "model.n_layers=8", "train.global_batch=4", "train.micro_batch=2",
                             "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.every=2"])
    shape, train, gpu = shape_of(cfg), training_of(cfg), GPUS["h200"]
    fwd, bwd = OPS_MOE_EXTRA
    assert moe_ops(shape, train, Layout(pp=2, micro_batch=2, num_microbatches=4)) == 2 * (fwd + bwd) * 4  # 2 of a stage's 4
    lay = Layout(dp=2, ep=2, micro_batch=2, num_microbatches=1)
    assert moe_ops(shape, train, lay, forward_only=True) == 4 * fwd
    charged = planner_time._readback_s(shape, train, lay, gpu, busy=1e9)  # the host side is the shorter
    monkeypatch.setattr(planner_time, "MOE_HOST_OP_SHARE", 1.0)
    plain = planner_time._readback_s(shape, train, lay, gpu, busy=1e9)
    assert abs(charged - plain - (MOE_HOST_OP_SHARE - 1) * 4 * fwd * gpu.host_op_s) < 1e-12


def test_stacked_experts_issue_the_same_ops_at_any_count_and_recorded_runs_one_per_expert():
    """The experts are stacked (models/moe.py Experts): a block of 4 or 12 experts issues the same ops,
    counted live (bench/calibrate/moe_host_ops.py's block), and so does the planner. Runs recorded while
    each expert held its own parameters (Training.expert_tensors) are planned as they ran: 3 tensors an
    expert (SwiGLU), each accumulated per micro-batch beyond OPS_MOE_EXPERTS and stepped once, all eager
    under compilation."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root / "bench"), str(root / "bench" / "calibrate")]
    from moe_host_ops import block_step

    from teratrain.planner.time import OPS_MOE_EXPERTS, expert_grad_ops, issued_ops

    live = {n: block_step([f"model.moe.num_experts={n}", "model.moe.top_k=2"])[1] for n in (4, 12)}
    assert live[12] == live[4]
    sets = ["model.preset=llama-1b", "model.n_layers=2", "model.moe.num_experts=12", "model.moe.top_k=2",
            "train.global_batch=6", "train.micro_batch=2"]
    shape, train = shape_of(load_config(None, sets)), training_of(load_config(None, sets))
    lay = Layout(micro_batch=2, num_microbatches=3)
    more = dataclasses.replace(shape, cfg=load_config(None, sets[:2] + ["model.moe.num_experts=20"] + sets[3:]).model)
    for compiled in (False, True):
        t = dataclasses.replace(train, compiled=compiled)
        assert issued_ops(more, t, lay) == issued_ops(shape, t, lay)
    assert expert_grad_ops(shape, train, lay) == 0
    recorded = dataclasses.replace(train, expert_tensors=True)
    assert expert_grad_ops(shape, recorded, lay) == 2 * 3 * (12 - OPS_MOE_EXPERTS) * 3  # 2 layers, 3 tensors, 3 mbs
    assert expert_grad_ops(shape, recorded, dataclasses.replace(lay, ep=6, dp=6)) == 2 * 3 * (2 - OPS_MOE_EXPERTS) * 3
    compiled = dataclasses.replace(recorded, compiled=True)
    # 8 experts more: 48 tensors, each accumulated in 3 micro-batches and stepped once, all eager
    assert issued_ops(more, compiled, lay) - issued_ops(shape, compiled, lay) == 2 * 3 * 8 * (3 + 1)


def test_only_experts_beyond_top_k_pay_for_their_stacks():
    """expert_stack_s: bf16 autocast over fp32 parameters, the weight stack's cast (4 + 2 bytes) once a
    step (each micro-batch in runs recorded before, Training.casts_per_micro_batch), the first
    micro-batch's gradient cast back (2 + 4), each later one cast and added to the accumulated one in one
    pass (2 + 4 + 4; recorded before, Training.grads_after_casts: cast back, then 3 x 4), for the local
    experts beyond top_k only: none at ep = num_experts / top_k."""
    from teratrain.planner.experts import expert_stack_s

    sets = ["model.preset=llama-1b", "model.n_layers=2", "model.moe.num_experts=8", "model.moe.top_k=2",
            "memory.precision=bf16", "train.global_batch=6", "train.micro_batch=2"]
    cfg = load_config(None, sets)
    shape, train, gpu = shape_of(cfg), training_of(cfg), GPUS["h200"]
    lay = Layout(micro_batch=2, num_microbatches=3)
    idle = (8 - 2) * 3 * cfg.model.d_model * cfg.model.expert_ffn_dim * 2  # experts, matrices, layers
    hbm = gpu.hbm_gbps * 1e9 * gpu.mem_efficiency
    assert abs(expert_stack_s(shape, train, lay, gpu) - idle * (6 + 6 + 2 * 10) / hbm) < 1e-12
    before = dataclasses.replace(train, grads_after_casts=True)
    assert abs(expert_stack_s(shape, before, lay, gpu) - idle * (6 + 3 * 6 + 2 * 12) / hbm) < 1e-12
    recorded = dataclasses.replace(train, casts_per_micro_batch=True, grads_after_casts=True)
    assert abs(expert_stack_s(shape, recorded, lay, gpu) - idle * (3 * (6 + 6) + 2 * 12) / hbm) < 1e-12
    dp = dataclasses.replace(lay, dp=2)  # the gradients views of the data-parallel engine's buckets: added apart
    assert abs(expert_stack_s(shape, train, dp, gpu) - idle * (6 + 3 * 6 + 2 * 12) / hbm) < 1e-12
    assert expert_stack_s(shape, train, dataclasses.replace(lay, dp=4, ep=4), gpu) == 0  # 2 local = top_k
