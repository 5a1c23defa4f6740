"""Train a model too large for plain AdamW on one GPU, by offloading the optimizer to CPU memory.

Plain mixed-precision AdamW needs 16 bytes/param of model state (Rajbhandari et al. 2019): at
~9.4B parameters that is ~140 GiB, more than an H200's 139 GiB before a single activation. The
script first shows the plain engine failing to even build its state, then trains the same model
with ZeRO-2 + `parallel.offload=optimizer` at dp=1 (bf16 weights and fp32 gradient shard on the GPU;
fp32 masters and AdamW moments, 12 bytes/param, in host memory, stepped there) and reports GPU bytes,
host bytes and tokens/s.

    python bench/offload.py              # GPU machine (needs ~110 GiB of host memory)
    python bench/offload.py --smoke      # CPU, tiny
"""

from __future__ import annotations

import argparse
import resource

import torch
from common import config, device, emit, env_info, fresh_memory, summarize, time_steps

from teratrain.mesh import Runtime
from teratrain.models.transformer import Transformer, count_params, flops_per_token, materialize
from teratrain.optim.engine import LocalEngine, train_step
from teratrain.parallel.parallelize import parallelize

# Llama-8B's block (d 4096, 32 heads, 8 KV heads, d_ff 14336) stacked 42 deep, 32k vocabulary: 9.42B params.
SHAPE = ["model.arch=llama", "model.d_model=4096", "model.n_layers=42", "model.n_heads=32", "model.n_kv_heads=8",
         "model.d_ff=14336", "model.vocab_size=32000", "model.seq_len=2048"]
SMOKE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=64", "model.vocab_size=512"]


def host_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def try_plain(cfg, dev) -> dict:
    """Plain AdamW (bf16 autocast over fp32 weights): expected to run out of GPU memory."""
    fresh_memory(dev)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    try:
        materialize(model, dev, 0)
        engine = LocalEngine(model, cfg.optim, cfg.memory, cfg.train.grad_clip, master_weights=False)
        x = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_len + 1), device=dev)
        train_step(model, engine, [(x[:, :-1], x[:, 1:])], "bf16", 1e-4)
        return {"plain_adamw": "fits", "model_state_bytes": engine.last_state_bytes}
    except torch.OutOfMemoryError as e:
        return {"plain_adamw": "out of memory", "error": str(e).split("\n")[0][:200]}
    finally:
        model = engine = None  # noqa: F841 - drop every reference before the offloaded run
        fresh_memory(dev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--skip-plain", action="store_true")
    ap.add_argument("--params", action="store_true", help="ZeRO-3 with offload=params instead of ZeRO-2 + optimizer")
    ap.add_argument("--layers", type=int, help="fewer blocks than the 9.4B shape (ZeRO-3 offload=params is slower)")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = device()
    shape = (SMOKE if args.smoke else SHAPE) + ([f"model.n_layers={args.layers}"] if args.layers else [])
    mode = ["parallel.zero=3", "parallel.offload=params"] if args.params else ["parallel.zero=2", "parallel.offload=optimizer"]
    cfg = config(shape + ["memory.precision=bf16", *mode, "memory.recompute=full", "parallel.bucket_mb=256"])
    n_params = count_params(cfg.model)["total"]
    plain = {} if args.skip_plain else try_plain(config(shape + ["memory.precision=bf16"]), dev)
    fresh_memory(dev)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    engine = parallelize(model, Runtime.single(dev), cfg)  # recompute=full, ZeRO-2/3, offload
    x = torch.randint(0, cfg.model.vocab_size, (args.micro_batch, cfg.model.seq_len + 1), device=dev)

    def step():
        return train_step(model, engine, [(x[:, :-1], x[:, 1:])] * args.accum, "bf16", 1e-4)[1].item()

    times = time_steps(step, 1, args.steps, dev)
    tokens = args.micro_batch * args.accum * cfg.model.seq_len
    res = summarize(times, tokens, flops_per_token(cfg.model), dev)
    emit({"bench": "offload", **env_info(dev), "mode": mode, "params": n_params, "plain_16_bytes_per_param_gib": round(16 * n_params / 2**30, 1),
          **plain, "offload": {**res, "model_state_bytes": engine.last_state_bytes, "host_peak_rss_gib": round(host_peak_gib(), 1),
                               "tokens_per_step": tokens}}, args.out)


if __name__ == "__main__":
    main()
