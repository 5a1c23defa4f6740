"""Our ZeRO-3 against PyTorch FSDP2 (`fully_shard`) on the same model, shape and batch. Run under
torchrun (bench/multi_gpu.py does); rank 0 writes one JSON object to --result.

Both shard every block and the root over all ranks, compute in bf16 with fp32 master weights and an
fp32 gradient reduction, use fused AdamW and clip at 1.0, and see the same random tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from teratrain.config import load_config  # noqa: E402
from teratrain.mesh import init_runtime  # noqa: E402
from teratrain.models.transformer import Transformer, flops_per_token  # noqa: E402
from teratrain.optim.engine import train_step  # noqa: E402
from teratrain.parallel.parallelize import parallelize  # noqa: E402

SHAPES = {"llama-8b": ["model.preset=llama-8b", "model.vocab_size=32000", "model.seq_len=4096"],
          "llama-1b": ["model.preset=llama-1b", "model.vocab_size=32000", "model.seq_len=2048"]}
SMOKE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=32", "model.vocab_size=512"]


def ours(cfg, rt):
    with torch.device("meta"):
        model = Transformer(cfg.model)
    engine = parallelize(model, rt, cfg)

    def step(x, y):
        train_step(model, engine, [(x, y)], "bf16", 1e-4)

    return step


def fsdp2(cfg, rt):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh(rt.device.type, (rt.world,))
    with torch.device("meta"):
        model = Transformer(cfg.model)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=rt.device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, cfg.model.init_std)
    model.init_buffers(rt.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=rt.device.type == "cuda")

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def measure(build, cfg, rt, mb: int, warmup: int, steps: int) -> dict:
    if rt.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(rt.device)
    step = build(cfg, rt)
    g = torch.Generator().manual_seed(rt.rank)
    x = torch.randint(0, cfg.model.vocab_size, (mb, cfg.model.seq_len + 1), generator=g).to(rt.device)
    times = []
    for i in range(warmup + steps):
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        step(x[:, :-1], x[:, 1:])
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.tensor([torch.cuda.max_memory_allocated(rt.device) if rt.device.type == "cuda" else 0.0], device=rt.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tps = mb * cfg.model.seq_len * rt.world / statistics.median(times)
    return {"tokens_per_s": tps, "tflops_per_gpu": tps * flops_per_token(cfg.model) / rt.world / 1e12,
            "step_ms": 1e3 * statistics.median(times), "peak_gib_max_over_ranks": float(peak) / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--result", required=True)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--model", choices=sorted(SHAPES), default="llama-8b")
    ap.add_argument("--layers", type=int, help="fewer blocks (to fit fewer GPUs)")
    args = ap.parse_args()
    shape = SMOKE if args.smoke else SHAPES[args.model] + ([f"model.n_layers={args.layers}"] if args.layers else [])
    cfg = load_config(None, shape + ["memory.precision=bf16", "parallel.zero=3"])
    if not dist.is_initialized():  # FSDP2 needs a process group even on one GPU (ours needs none then)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rt = init_runtime(cfg)
    rows = {name: measure(build, cfg, rt, args.micro_batch, 3, args.steps) for name, build in (("ours_zero3", ours), ("fsdp2", fsdp2))}
    rows["tokens_per_s_ratio_ours_over_fsdp2"] = rows["ours_zero3"]["tokens_per_s"] / rows["fsdp2"]["tokens_per_s"]
    if rt.rank == 0:
        Path(args.result).write_text(json.dumps({"gpus": rt.world, "shape": shape, "micro_batch": args.micro_batch, **rows},
                                                indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
