"""Training on fixed random tokens, by the engines alone (no corpus, no trainer): the same global
batch for every layout, so any layout can be compared with one process step by step.

Every function is module-level so spawned ranks can import it; `train_random(0, 1, ...)` in the
test's own process is the single-process reference."""

from __future__ import annotations

import torch

from teratrain import moe_metrics
from teratrain.config import load_config
from teratrain.mesh import init_runtime
from teratrain.models.moe import expert_biases, moe_layers, seed_routing
from teratrain.models.transformer import Transformer
from teratrain.parallel.comm import AVG, all_gather_objects, all_reduce
from teratrain.parallel.parallelize import parallelize
from teratrain.parallel.pipeline.runtime import step_runner
from teratrain.measure import saved_bytes
from teratrain.train import seed_everything

# Small enough for 4 ranks on 2 cores; GQA (4 query / 2 key-value heads) and a vocabulary that
# 4 does not divide (padded under tp=4).
BASE = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
        "model.vocab_size=50", "model.seq_len=16", "train.global_batch=8", "train.micro_batch=2",
        "optim.lr=0.01", "optim.eps=1e-6", "optim.warmup_steps=0", "train.device=cpu"]
GPT2 = ["model.arch=gpt2", "model.n_kv_heads=4", "model.tie_embeddings=true", "model.bias=true"]


def build(overrides: list[str], freeze: tuple[str, ...] = ()):
    """Config, runtime, model and engine of this rank; parameters named in `freeze` are frozen
    (requires_grad=False) before any strategy sees them."""
    cfg = load_config(None, BASE + overrides)
    rt = init_runtime(cfg)
    cfg.parallel.dp = rt.dims.dp
    seed_everything(cfg.train.seed + rt.dp_rank)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    for name in freeze:
        model.get_parameter(name).requires_grad_(False)
    return cfg, rt, model, parallelize(model, rt, cfg)


def batches(cfg, steps: int, seed: int = 0):
    """Each step's global batch (B, T+1) of random token ids, the same for every layout."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.model.seq_len + 1), generator=g)
            for _ in range(steps)]


def train_steps(cfg, rt, model, engine, steps: int, start: int = 0) -> list[float]:
    """Steps start..steps-1 of `batches` (train_step, or the pipeline executor at pp > 1), each rank
    on its share of the global batch; the mean loss over data-parallel ranks of each step."""
    run_step, losses = step_runner(model, engine, rt, cfg), []
    for batch in batches(cfg, steps)[start:]:
        _, loss = run_step(micro_batches(cfg, rt, batch), cfg.memory.precision, cfg.optim.lr)
        loss = loss.clone()
        all_reduce(loss, rt.dp_group, op=AVG)
        losses.append(float(loss))
    return losses


def micro_batches(cfg, rt, batch: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of a global batch (B, T+1), as (inputs, targets) micro-batches."""
    tc = cfg.train
    per_rank = tc.global_batch // rt.dims.dp
    rows = batch[rt.dp_rank * per_rank:(rt.dp_rank + 1) * per_rank]
    return [(rows[i:i + tc.micro_batch, :-1], rows[i:i + tc.micro_batch, 1:]) for i in range(0, per_rank, tc.micro_batch)]


def count_launches(rank: int, world: int, cases: list[list[str]]) -> list[dict]:
    """Per case (overrides of BASE): the collectives one optimizer step launches after a first step,
    by kind (every one goes through parallel/inflight.py `launch`)."""
    from collections import Counter
    from unittest import mock

    from teratrain.parallel import inflight

    out = []
    for overrides in cases:
        cfg, rt, model, engine = build(overrides)
        run_step = step_runner(model, engine, rt, cfg)
        micro = micro_batches(cfg, rt, batches(cfg, 1)[0])
        run_step(micro, cfg.memory.precision, cfg.optim.lr)
        seen, real = Counter(), inflight.launch

        def counting(what, group, start):
            seen[what] += 1
            return real(what, group, start)

        with mock.patch.object(inflight, "launch", counting):
            run_step(micro, cfg.memory.precision, cfg.optim.lr)
        out.append(dict(seen))
    return out


def train_random(rank: int, world: int, overrides: list[str], steps: int = 10, freeze: tuple[str, ...] = (),
                 skip_branch: bool = False, routing_seed: bool = False, count_saved: bool = False) -> dict:
    """`steps` optimizer steps; returns every step's mean loss and (rank 0) the final whole params.
    skip_branch: data-parallel rank 1 of 2 takes no gradient through layers.1's MLP (its output is
    replaced by zeros); one process zeroes it for the same samples, which is the same math.
    routing_seed: MoE routers draw their randomness from a seed per (step, global micro-batch), the
    same on every layout. MoE runs also return `moe`: routed choices dropped for capacity and expert
    runs on zero rows, summed over data-parallel ranks (and pipeline stages), and `moe_metrics`: the
    trainer's MoE statistics of the whole run (every layer, whatever stage holds it; balance=bias: of
    the last step, as the trainer moves the bias after every step), and `expert_bias`: every rank's
    expert biases (balance=bias), gathered. count_saved:
    also `saved`, the bytes autograd keeps for one micro-batch's forward on this rank
    (measure.saved_bytes)."""
    cfg, rt, model, engine = build(overrides, freeze)
    tc = cfg.train
    per_rank = tc.global_batch // rt.dims.dp
    lo = rt.dp_rank * per_rank
    counter = _skip_branch(model, rt, tc) if skip_branch else None
    run_step = step_runner(model, engine, rt, cfg)  # train_step, or the pipeline executor (pp > 1)
    seeds = _seed_routing(model, rt.dp_rank * per_rank // tc.micro_batch) if routing_seed else None
    probe = _probe_moe(model)
    losses = []
    for step, batch in enumerate(batches(cfg, steps)):
        rows = batch[lo:lo + per_rank]
        micro = [(rows[i:i + tc.micro_batch, :-1], rows[i:i + tc.micro_batch, 1:])
                 for i in range(0, per_rank, tc.micro_batch)]
        if counter is not None:
            counter[0] = 0
        if seeds is not None:
            seeds[:] = [step, 0]
        _, loss = run_step(micro, cfg.memory.precision, cfg.optim.lr)
        if cfg.model.moe.balance == "bias":  # as the trainer's step: the bias moved by the global load
            moe_metrics.step_metrics(model, rt)
        loss = loss.clone()
        all_reduce(loss, rt.dp_group, op=AVG)
        losses.append(float(loss))
    params = engine.full_params()
    probe[0] = _dropped(model)
    stats = moe_metrics.step_metrics(model, rt) if cfg.model.moe.enabled else {}  # the whole run's, as logged
    all_reduce(probe, rt.dp_group)  # tensor-parallel peers route the same tokens: count them once
    all_reduce(probe, rt.group("pp"))  # every pipeline stage's layers
    saved = saved_bytes(model, *micro[0], cfg.memory.precision, targets_in_model=True) if count_saved else None
    return {"losses": losses, "params": params if rank == 0 else None, "bytes": engine.last_state_bytes,
            "skipped": engine.skipped_steps, "moe": dict(zip(("dropped", "idle_experts"), probe.tolist())),
            "moe_metrics": stats, "saved": saved,
            "expert_bias": all_gather_objects(expert_biases(model), rt.world_group) if rt.world > 1 else [expert_biases(model)]}


def _seed_routing(model, first_micro: int) -> list[int]:
    """Before each forward: seed the routers with (step, this micro-batch's index in the global batch)."""
    state = [0, 0]  # step, micro-batches run this step

    def hook(module, args):
        seed_routing(module, state[0] * 1000 + first_micro + state[1])
        state[1] += 1

    model.register_forward_pre_hook(hook)
    return state


def _probe_moe(model) -> torch.Tensor:
    """(2,) counts filled during training: capacity drops (read by `_dropped` at the end) and experts
    run on zero rows (this rank; per chunk under parallel.ep_overlap_chunks)."""
    probe = torch.zeros(2, dtype=torch.float64)
    for _, layer in moe_layers(model):
        run, local = layer.run_local, len(layer.experts)

        def counting(x, key, k=1, stacks=None, every=False, run=run, local=local):
            if torch.compiler.is_compiling():  # a read-back would break the graph: compiled runs count nothing
                return run(x, key, k, stacks, every)
            probe[1] += int((torch.bincount(key, minlength=local + 1)[:local] == 0).sum())
            return run(x, key, k, stacks, every)

        layer.run_local = counting
    return probe


def _dropped(model) -> float:
    """Routed choices this rank's MoE layers dropped for capacity since the start (their statistics)."""
    return sum(float(layer.stats.get("dropped", 0.0)) for _, layer in moe_layers(model))


def _skip_branch(model, rt, tc) -> list[int]:
    """Zero layers.1.feed_forward's output on the second half of the global batch: detached on
    data-parallel rank 1 of 2 (its parameters get no gradient there at all), masked in one process."""
    counter = [0]  # micro-batches seen this step (one process)

    def hook(module, args, out):
        if rt.dims.dp > 1:
            return torch.zeros_like(out).detach() if rt.dp_rank == 1 else None
        start = counter[0] * tc.micro_batch
        counter[0] += 1
        keep = (torch.arange(start, start + out.shape[0]) < tc.global_batch // 2).to(out.dtype)
        return out * keep.view(-1, *[1] * (out.dim() - 1))

    model.layers[1].feed_forward.register_forward_hook(hook)
    return counter
