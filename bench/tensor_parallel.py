"""Our Megatron tensor parallelism against PyTorch's DTensor tensor parallelism (`parallelize_module`
with colwise/rowwise plans, as torchtitan applies it) on the same model, shape and tokens, in the
same run: tokens/s, TFLOP/s per GPU, peak memory; with and without sequence parallelism; plus NCCL
loss parity of our tp against one GPU (bf16).

    torchrun --nproc-per-node 2 bench/tensor_parallel.py --out bench/results/tp_h200x2.json
    torchrun --nproc-per-node 2 bench/tensor_parallel.py --smoke     # gloo CPU, tiny shapes

Both run bf16 autocast over fp32 weights, fused AdamW, no clipping, the loss from vocab-parallel
logits (ours: our vocab-parallel cross-entropy; DTensor: `loss_parallel`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from teratrain.config import load_config  # noqa: E402
from teratrain.memory.precision import autocast  # noqa: E402
from teratrain.mesh import init_runtime  # noqa: E402
from teratrain.metrics import peak_flops  # noqa: E402
from teratrain.models.transformer import Transformer, flops_per_token, init_param_  # noqa: E402
from teratrain.optim.engine import train_step  # noqa: E402
from teratrain.parallel.parallelize import parallelize  # noqa: E402

SHAPE = ["model.preset=llama-8b", "model.vocab_size=32000", "model.seq_len=4096"]
SMOKE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
         "model.seq_len=32", "model.vocab_size=512"]


def ours(cfg, rt):
    with torch.device("meta"):
        model = Transformer(cfg.model)
    engine = parallelize(model, rt, cfg)
    return lambda x, y: train_step(model, engine, [(x, y)], "bf16", 1e-4)[1]


def dtensor(cfg, rt, sp: bool):
    """The torchtitan-style plan on the same Transformer class (its attention reads head counts from
    the projections' shapes, so local shards need no change)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, loss_parallel, parallelize_module)

    mesh = init_device_mesh(rt.device.type, (rt.world,))
    with torch.device("meta"):
        model = Transformer(cfg.model)
    seq = Shard(1) if sp else Replicate()
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in model.layers:
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=seq), "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
        if sp:
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                         "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                         desired_input_layouts=(Replicate(), None, None, None)),
                         "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
        parallelize_module(block, mesh, plan)
    model.to_empty(device=rt.device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            init_param_(local, name, cfg.model, 0)  # values differ from ours (sliced per rank): timing only
    model.init_buffers(rt.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=rt.device.type == "cuda")

    def step(x, y):
        with autocast("bf16", rt.device):
            logits = model(x)
        with loss_parallel():
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def measure(step, cfg, rt, mb: int, warmup: int, steps: int) -> dict:
    g = torch.Generator().manual_seed(0)  # every tp rank sees the same tokens
    x = torch.randint(0, cfg.model.vocab_size, (mb, cfg.model.seq_len + 1), generator=g).to(rt.device)
    times = []
    for i in range(warmup + steps):
        _sync(rt)
        t0 = time.perf_counter()
        step(x[:, :-1], x[:, 1:])
        _sync(rt)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    tps = mb * cfg.model.seq_len / statistics.median(times)  # one tp group: its tokens are the job's
    tflops = tps * flops_per_token(cfg.model) / rt.world / 1e12
    peak = peak_flops(rt.device, "bf16", None)
    mem = torch.cuda.max_memory_allocated(rt.device) / 2**30 if rt.device.type == "cuda" else None
    return {"tokens_per_s": round(tps, 1), "tflops_per_gpu": round(tflops, 2),
            "mfu": round(tflops * 1e12 / peak, 4) if peak else None, "step_ms": round(1e3 * statistics.median(times), 2),
            "peak_gib": round(mem, 2) if mem else None}


def _sync(rt) -> None:
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def parity(base: list[str], rt, steps: int) -> dict:
    """Losses of our tp run against the same model on one device (rank 0 alone, bf16)."""
    cfg = load_config(None, base + [f"parallel.tp={rt.world}"])
    step = ours(cfg, rt)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_len + 1), generator=g).to(rt.device)
               for _ in range(steps)]
    tp_losses = [float(step(b[:, :-1], b[:, 1:])) for b in batches]
    out = {"tp_losses": tp_losses}
    if rt.rank == 0:
        from teratrain.mesh import Runtime

        one = load_config(None, base)
        with torch.device("meta"):
            model = Transformer(one.model)
        engine = parallelize(model, Runtime.single(rt.device), one)
        ref = [float(train_step(model, engine, [(b[:, :-1], b[:, 1:])], "bf16", 1e-4)[1]) for b in batches]
        out.update(one_gpu_losses=ref, max_rel_diff=max(abs(a - b) / abs(b) for a, b in zip(tp_losses, ref)))
        del model, engine
    dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8, help="blocks of the llama-8b-width model (memory)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    base = (SMOKE if args.smoke else SHAPE + [f"model.n_layers={args.layers}"]) + ["memory.precision=bf16"]
    cfg0 = load_config(None, base + ["parallel.tp=2" if "WORLD_SIZE" not in os.environ else
                                     f"parallel.tp={os.environ['WORLD_SIZE']}"])
    rt = init_runtime(cfg0)
    steps, warmup = (2, 1) if args.smoke else (args.steps, 3)
    result = {"tp": rt.world, "shape": base, "micro_batch": args.micro_batch}
    for sp in (False, True):
        cfg = load_config(None, base + [f"parallel.tp={rt.world}", f"parallel.sequence_parallel={str(sp).lower()}"])
        tag = "sp" if sp else "no_sp"
        result[f"ours_{tag}"] = measure(ours(cfg, rt), cfg, rt, args.micro_batch, warmup, steps)
        _free(rt)
        result[f"dtensor_{tag}"] = measure(dtensor(cfg, rt, sp), cfg, rt, args.micro_batch, warmup, steps)
        _free(rt)
        result[f"ratio_{tag}"] = round(result[f"ours_{tag}"]["tokens_per_s"] / result[f"dtensor_{tag}"]["tokens_per_s"], 4)
    parity_base = (SMOKE if args.smoke else SHAPE + ["model.n_layers=2", "model.seq_len=1024"]) + ["memory.precision=bf16"]
    result["parity"] = parity(parity_base, rt, 3 if args.smoke else 10)
    if rt.rank == 0:
        text = json.dumps(result, indent=1)
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text)
    dist.destroy_process_group()


def _free(rt) -> None:
    import gc

    gc.collect()
    if rt.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(rt.device)


if __name__ == "__main__":
    main()
