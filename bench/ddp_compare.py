"""Our data parallelism (parallel.dp=N, no ZeRO) against PyTorch DDP on the same model, shape, batch
and tokens, eager and compiled, under torchrun; rank 0 prints one JSON object (and writes it with --out).

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 bench/ddp_compare.py --compile --out r.json
    torchrun --nproc-per-node 2 bench/ddp_compare.py --smoke --compile    # gloo CPU processes, tiny shape

Both sides: our decoder (llama-1b width, 32k vocabulary, seq 2048), initialized alike (by name and
seed), fp32 parameters under bf16 autocast, fp32 gradient all-reduce in ~25 MB buckets launched from
backward, `--micro` micro-batches a step (DDP skips the reduction of all but the last under
`no_sync`), the gradient norm clipped at 1.0, fused AdamW. Compiled (`--compile`): ours with
train.compile (train.compile_scope=auto: each block apart at dp > 1) and once more with the whole model
as one graph (train.compile_scope=model); DDP with torch.compile on the wrapped model (dynamo's
DDPOptimizer splits the graph at DDP's buckets so that reductions overlap the backward, as torch
documents). Each run: 3 warm-up steps (the first compiles), `--steps` timed, the peak allocated, and
the mean loss of every step; `loss_rel_diff` is the largest relative difference of our losses from
DDP's over the same steps (bf16 compute: ~1e-3 is noise).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, env_info, fresh_compile, fresh_memory, graph_breaks, smoke_compile, summarize, sync

from teratrain.config import load_config
from teratrain.memory.precision import autocast
from teratrain.mesh import init_runtime, shutdown
from teratrain.models.transformer import Transformer, build_model, flops_per_token
from teratrain.optim.build import build_optimizer
from teratrain.optim.engine import train_step
from teratrain.parallel.parallelize import compile_scope, parallelize

SHAPE = ["model.preset=llama-1b", "model.vocab_size=32000", "model.seq_len=2048"]
SMOKE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.seq_len=32",
         "model.vocab_size=256", "train.device=cpu"]
RUN = ["memory.precision=bf16", "parallel.zero=0", "parallel.bucket_mb=25", "optim.lr=1e-4", "optim.warmup_steps=0",
       "train.grad_clip=1.0", "metrics.progress=false"]


def ours(cfg, rt):
    with torch.device("meta"):
        model = Transformer(cfg.model)
    engine = parallelize(model, rt, cfg)
    return lambda micro: train_step(model, engine, micro, "bf16", cfg.optim.lr)[1]


def ddp(cfg, rt):
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(cfg.model, rt.device, seed=cfg.train.seed)  # our init: by name and seed, as ours
    wrapped = DistributedDataParallel(model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
                                      bucket_cap_mb=cfg.parallel.bucket_mb, gradient_as_bucket_view=True)
    run = torch.compile(wrapped) if cfg.train.compile else wrapped
    opt = build_optimizer(model.named_parameters(), cfg.optim)  # ours: the same groups, fused AdamW on a GPU

    def step(micro) -> torch.Tensor:
        total = 0.0
        for i, (x, y) in enumerate(micro):
            with wrapped.no_sync() if i < len(micro) - 1 else contextlib.nullcontext(), autocast("bf16", x.device):
                loss = run(x, y)
            (loss / len(micro)).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total / len(micro)

    return step


def measure(build, sets: list[str], args, rt) -> dict:
    cfg = load_config(None, sets)
    cfg.parallel.dp = rt.dims.dp
    if cfg.train.compile:
        fresh_compile()
    fresh_memory(rt.device)
    step = build(cfg, rt)
    per_rank = args.micro * args.micro_batch
    g = torch.Generator().manual_seed(0)  # the same global batches for every run
    batches = [torch.randint(0, cfg.model.vocab_size, (per_rank * rt.world, cfg.model.seq_len + 1), generator=g)
               for _ in range(args.warmup + args.steps)]
    losses, times = [], []
    for i, batch in enumerate(batches):
        rows = batch[rt.rank * per_rank:(rt.rank + 1) * per_rank].to(rt.device)
        micro = [(rows[j:j + args.micro_batch, :-1], rows[j:j + args.micro_batch, 1:])
                 for j in range(0, per_rank, args.micro_batch)]
        sync(rt.device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(micro)  # this rank's mean over its micro-batches
        sync(rt.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(float(loss))
    out = summarize(times, per_rank * rt.world * cfg.model.seq_len, flops_per_token(cfg.model), rt.device)
    out["mfu"] = round(out["mfu"] / rt.world, 4) if out["mfu"] else None
    out["losses"] = [round(v, 5) for v in losses]
    if cfg.train.compile:
        out["graph_breaks"] = graph_breaks()
        if build is ours:
            out["compile_scope"] = compile_scope(cfg, rt.dims.dp)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per rank and step")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also both sides compiled")
    ap.add_argument("--compile-only", action="store_true", help="with --compile: only the compiled runs")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.smoke:
        args.micro_batch, args.steps, args.warmup = 2, 2, 1
        smoke_compile()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    base = (SMOKE if args.smoke else SHAPE + [f"model.n_layers={args.layers}"]) + RUN + [
        f"train.micro_batch={args.micro_batch}", f"train.global_batch={args.micro_batch * args.micro * world}"]
    runs = {} if args.compile_only else {"ours": (ours, base), "ddp": (ddp, base)}
    if args.compile:
        on = base + ["train.compile=true"]
        runs.update({"ours_compiled": (ours, on), "ours_compiled_whole": (ours, on + ["train.compile_scope=model"]),
                     "ddp_compiled": (ddp, on)})
    rt = init_runtime(load_config(None, base))
    rows = {name: measure(build, sets, args, rt) for name, (build, sets) in runs.items()}
    for mine, peer in (("ours", "ddp"), ("ours_compiled", "ddp_compiled"), ("ours_compiled_whole", "ddp_compiled")):
        if mine in rows and peer in rows:
            a, b = rows[mine], rows[peer]
            rows[f"{mine}_over_{peer}"] = {
                "tokens_per_s": round(a["tokens_per_s"] / b["tokens_per_s"], 4),
                "peak": round(a["peak_gib"] / b["peak_gib"], 4) if a["peak_gib"] and b["peak_gib"] else None,
                "loss_rel_diff": max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"]))}
    if rt.rank == 0:
        emit({"bench": "ddp_compare", "gpus": world, **env_info(rt.device), "shape": base, "micro": args.micro,
              **rows}, args.out)
    shutdown()


if __name__ == "__main__":
    main()
