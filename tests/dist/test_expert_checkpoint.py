"""The trainer with experts spread over 2 ranks (ep=2): checkpoints resume bit for bit at the same
layout (DP and ZeRO-1/3; dropout, expert dropout and router noise on, so every RNG stream matters; at
ZeRO-1 a sigmoid router balanced by its expert bias, which the checkpoint carries, the same on every rank),
the checkpoint consolidates to every expert of the model (what `teratrain generate` loads), and
metrics.jsonl / moe_load.png report each MoE layer; the planner predicts the ranks' model-state bytes."""

import json

import pytest
import torch

from harness import run_ranks
from teratrain.checkpoint import find_valid
from teratrain.checkpoint.consolidate import full_model
from teratrain.config import load_config
from teratrain.generate import generate
from teratrain.planner.inputs import layout_of, shape_of, training_of
from teratrain.planner.states import model_states
from teratrain.train import run
from workers import TINY, assert_bitwise_resume, train_many

MOE = TINY + ["model.moe.num_experts=4", "model.moe.router=noisy-topk", "model.moe.capacity_factor=1.0",
              "model.dropout=0.1", "model.moe.expert_dropout=0.2", "parallel.ep=2", "train.steps=8",
              "checkpoint.every=4", "optim.schedule=constant"]
BIAS = ["model.moe.router=softmax-topk", "model.moe.score=sigmoid", "model.moe.balance=bias", "model.moe.bias_rate=0.01"]


def straight_and_resumed(rank: int, world: int, zero: int, root: str) -> dict:
    extra = [f"parallel.zero={zero}"] + (BIAS if zero == 1 else [])
    engine = run(load_config(None, MOE + extra), f"{root}/straight")["engine"]
    params = engine.full_params()
    run(load_config(None, MOE + extra + ["train.steps=4"]), f"{root}/resumed")
    run(load_config(None, MOE + extra), f"{root}/resumed", resume=True)
    return params


@pytest.mark.parametrize("zero", [pytest.param(0, marks=pytest.mark.long), 1, 3])
def test_resume_consolidate_and_metrics(zero, dist_workdir):
    root = dist_workdir / f"moe-ep2-z{zero}"
    params = run_ranks(straight_and_resumed, 2, zero, str(root))[0]
    assert_bitwise_resume(root, 8, 2)
    if zero == 1:  # the expert bias: moved, the same on both ranks, carried over the resume
        saved = [[json.loads((root / run / "checkpoints" / f"step_{step:08d}" / f"rank{r:05d}.json").read_text())["moe_bias"]
                  for r in range(2)] for run in ("straight", "resumed") for step in (4, 8)]
        assert all(ranks[0] == ranks[1] for ranks in saved) and saved[1] == saved[3] and saved[0] != saved[1]
        assert all(any(b != 0 for b in bias) for bias in saved[1][0].values())

    path, _ = find_valid(root / "straight" / "checkpoints")
    weights = full_model(path)
    assert weights.keys() == params.keys()
    assert {k for k in params if ".experts." in k} == {f"layers.{i}.feed_forward.experts.{w}"
                                                       for i in range(2) for w in ("w1", "w2", "w3")}
    assert all(params[f"layers.0.feed_forward.experts.{w}"].shape[0] == 4 for w in ("w1", "w2", "w3"))
    for name, value in params.items():
        assert torch.equal(weights[name].view_as(value), value), name
    assert isinstance(generate(str(root / "straight"), "def ", 8, 0.0, 0, 0), str)

    rows = [json.loads(line) for line in (root / "straight" / "metrics.jsonl").read_text().splitlines()]
    cfg = load_config(None, MOE + (BIAS if zero == 1 else []))
    for row in rows:
        for layer in ("layers.0", "layers.1"):
            m = row["moe"][layer]
            routed = cfg.train.global_batch * cfg.model.seq_len * 2  # every token's 2 choices, whole batch
            assert sum(m["load"]) == pytest.approx(routed * (1 - m["dropped"]))
            assert m["aux_loss"] > 0 or cfg.model.moe.balance == "bias"  # bias: aux weight 0
    assert (root / "straight" / "moe_load.png").stat().st_size > 0


def test_planner_predicts_the_ep_model_states(dist_workdir):
    """`teratrain plan`'s per-rank bytes at ep=2 (dense parameters sharded over dp, experts over
    dp/ep) equal the engines' live bytes: params and grads exactly; optimizer state up to AdamW's
    4-byte step counter per tensor piece, which the planner estimates for sharded layouts."""
    sets = TINY + ["model.moe.num_experts=4", "parallel.ep=2", "train.steps=1"]
    runs = [(sets[len(TINY):] + [f"parallel.zero={z}"], str(dist_workdir / f"moe-bytes-{z}")) for z in range(4)]
    got = run_ranks(train_many, 2, runs)[0]
    for (extra, _), live in zip(runs, got):
        cfg = load_config(None, TINY + extra)
        planned = model_states(shape_of(cfg), training_of(cfg), layout_of(cfg, 2), device="cpu")
        bytes_ = live["bytes"]
        assert (bytes_["params"], bytes_["grads"]) == (planned["params"], planned["grads"]), extra
        assert abs(bytes_["optimizer"] - planned["optimizer"]) <= 4 * 32, extra
