"""Pipelining in the trainer and the engines: exact resume, fp16 overflow on one stage, and the
planner's per-stage bytes against what each stage holds."""

import pytest
import torch

from harness import run_ranks
from layout_workers import BASE, build, train_random, train_steps
from teratrain.config import load_config
from teratrain.parallel.pipeline.runtime import step_runner
from teratrain.planner.inputs import layout_of, shape_of, training_of
from teratrain.planner.states import model_states, stage_params
from teratrain.train import run
from workers import TINY, assert_bitwise_resume

# pp=2 x dp=2, ZeRO-1 sharding a tied embedding held at both ends, dropout on (each rank's RNG is
# checkpointed); constant lr: a cosine schedule depends on train.steps, which the first half changes
RESUME = TINY + ["parallel.pp=2", "parallel.zero=1", "model.tie_embeddings=true", "model.dropout=0.1",
                 "train.steps=6", "checkpoint.every=3", "optim.schedule=constant"]


def straight_and_resumed(rank: int, world: int, root: str) -> None:
    run(load_config(None, RESUME), f"{root}/straight")
    run(load_config(None, RESUME + ["train.steps=3"]), f"{root}/resumed")
    run(load_config(None, RESUME), f"{root}/resumed", resume=True)


@pytest.mark.long
def test_resume_at_pp2_dp2_is_bitwise(dist_workdir):
    root = dist_workdir / "pp-resume"
    run_ranks(straight_and_resumed, 4, str(root))
    assert_bitwise_resume(root, 6, 4)
    assert (root / "straight" / "pipeline.png").stat().st_size > 10_000


POISON_STEP = 1


def poisoned(rank: int, world: int) -> dict:
    """fp16 at pp=2: one gradient element of the last stage becomes inf at step 1 (only there)."""
    cfg, rt, model, engine = build(["parallel.pp=2", "memory.precision=fp16", "memory.loss_scale_init=1024"])
    runner = step_runner(model, engine, rt, cfg)
    box = {"step": -1}
    if rank == 1:
        def poison(grad):
            if box["step"] != POISON_STEP:
                return grad
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad
        model.norm.weight.register_hook(poison)
    g = torch.Generator().manual_seed(0)
    history = []
    for step in range(3):
        box["step"] = step
        x = torch.randint(0, cfg.model.vocab_size, (8, cfg.model.seq_len + 1), generator=g)
        stats, _ = runner([(x[i:i + 2, :-1], x[i:i + 2, 1:]) for i in range(0, 8, 2)], "fp16", 1e-3)
        history.append({"skipped": stats.skipped, "scale": stats.loss_scale, "params": engine.full_params()})
    return {"history": history, "skipped_total": engine.skipped_steps}


def test_overflow_on_one_stage_skips_the_step_on_every_stage():
    for rank, r in enumerate(run_ranks(poisoned, 2)):
        h = r["history"]
        assert [s["skipped"] for s in h] == [False, True, False], f"rank {rank}: {[s['skipped'] for s in h]}"
        assert r["skipped_total"] == 1 and h[1]["scale"] == h[0]["scale"] / 2
        same = all(torch.equal(h[1]["params"][n], t) for n, t in h[0]["params"].items())
        assert same, f"rank {rank}: a skipped step changed weights"
        assert any(not torch.equal(h[2]["params"][n], t) for n, t in h[1]["params"].items())


PLANNED = [["parallel.pp=2"], ["parallel.pp=2", "model.arch=gpt2", "model.n_kv_heads=4", "model.tie_embeddings=true"],
           ["parallel.pp=2", "memory.precision=bf16", "parallel.zero=1", "model.n_layers=4"],
           # a tied embedding at ZeRO-2 keeps a full fp32 accumulator: it is reduced across stages at the step
           ["parallel.pp=2", "model.arch=gpt2", "model.n_kv_heads=4", "model.tie_embeddings=true", "parallel.zero=2",
            "memory.precision=bf16"],
           # ZeRO-3: full fp32 accumulators on every stage (reduced once per step), shards at rest; the tied
           # embedding sharded over both ends; bf16 keeps no parameter shard beside the fp32 master
           ["parallel.pp=2", "parallel.zero=3"],
           ["parallel.pp=2", "model.arch=gpt2", "model.n_kv_heads=4", "model.tie_embeddings=true", "parallel.zero=3",
            "memory.precision=bf16", "parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2",
            "model.n_layers=4"]]


def _bytes(rank: int, world: int) -> list[dict]:
    return [train_random(rank, world, layout, steps=1)["bytes"] for layout in PLANNED]


def test_planner_bytes_per_stage_equal_live_bytes():
    """Each stage's live parameter bytes are the planner's count for that end of the pipeline (whole
    parameters below ZeRO-3), and the planner's model states (the fuller stage) equal that stage's
    live params, grads and optimizer state, byte for byte (AdamW step counters and the flat groups
    included; ZeRO-3: shards and full fp32 accumulators)."""
    live = run_ranks(_bytes, 2)
    for i, layout in enumerate(PLANNED):
        cfg = load_config(None, BASE + layout)
        shape, lay, train = shape_of(cfg), layout_of(cfg, 2), training_of(cfg)
        per_param = train.widths(lay.zero, lay.offload).param
        sp = stage_params(shape, lay)
        if lay.zero < 3:
            assert [live[r][i]["params"] for r in (0, 1)] == [sp["first"] * per_param, sp["last"] * per_param], layout
        planned = model_states(shape, train, lay, device="cpu")
        worst = live[1 if sp["last"] >= sp["first"] else 0][i]  # the planner's rule (states.py `_tensors`)
        assert {k: worst[k] for k in ("params", "grads", "optimizer")} == \
            {k: planned[k] for k in ("params", "grads", "optimizer")}, layout


def outputs_held(rank: int, world: int, sets: list[str]) -> list[bool]:
    """One step at pp=2; after each forward whose output is sent, the message is swapped for a copy (sent
    in its place): is the original's storage then gone, i.e. held by nothing else (the stage, the graph)?"""
    from torch.multiprocessing.reductions import StorageWeakRef

    from teratrain.parallel.pipeline import runtime

    cfg, rt, model, engine = build(["parallel.pp=2"] + sets)
    freed, forward = [], runtime._Call._forward

    def swapped(call, a):
        forward(call, a)
        key = (runtime.F, a.microbatch, a.chunk)
        if key in call.outbox:
            message = call.outbox.pop(key)
            ref = StorageWeakRef(message.untyped_storage())
            call.outbox[key] = message.clone()
            del message
            freed.append(ref.expired())

    runtime._Call._forward = swapped
    train_steps(cfg, rt, model, engine, 1)
    return freed


@pytest.mark.parametrize("sets", [["parallel.schedule=zb-h1"],
                                  ["parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2",
                                   "model.n_layers=4"]], ids=["zb-h1", "interleaved"])
def test_a_sent_stage_output_is_held_only_by_its_message(sets):
    """Megatron-LM frees a stage's output once sent: only its place in the graph is needed for backward."""
    freed = run_ranks(outputs_held, 2, sets)
    assert len(freed[0]) >= 4 and all(freed[0]), freed  # every forward of rank 0 sends (interleaved: rank 1's too)
    assert all(freed[1])
