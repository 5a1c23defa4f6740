"""What the data-parallel and ZeRO wrappers cost at dp=1 against the plain single-replica step.

At dp=1 every collective is a local copy, so the difference is pure wrapper cost: gradient hooks,
flat-buffer copies, shard bookkeeping (and for ZeRO-3 the gather/free of every block). Each row is
compared with the plain engine of the same precision policy:
  - DataParallelEngine vs LocalEngine: bf16 autocast over fp32 weights (the zero=0 default);
  - ZeRO-1/2/3 vs LocalEngine with master weights: bf16 weights + fp32 masters (ZeRO's policy).

    python bench/zero_overhead.py            # GPU machine
    python bench/zero_overhead.py --smoke    # CPU, tiny
"""

from __future__ import annotations

import argparse

import torch
from common import config, device, emit, env_info, fresh_memory, summarize, time_steps

from teratrain.mesh import Runtime
from teratrain.models.transformer import Transformer, flops_per_token
from teratrain.optim.engine import train_step
from teratrain.parallel.data import DataParallelEngine
from teratrain.parallel.parallelize import init_fn, parallelize
from teratrain.parallel.placement import assign_defaults, materialize

SHAPE = ["model.preset=llama-1b", "model.vocab_size=32000", "model.seq_len=2048"]
SMOKE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=64", "model.vocab_size=512"]


def build(kind: str, cfg, dev):
    """The engine parallelize() builds for one process, or the data-parallel engine at dp=1 (what a
    multi-GPU run adds to the plain update, measured without other ranks)."""
    rt = Runtime.single(dev)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    if kind != "dp":
        return model, parallelize(model, rt, cfg)
    assign_defaults(model)
    materialize(model, dev, init_fn(cfg))
    return model, DataParallelEngine(model, cfg, rt)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = device()
    base = (SMOKE if args.smoke else SHAPE) + ["memory.precision=bf16"]
    variants = {  # name: (engine kind, extra overrides, baseline name)
        "plain": ("plain", [], None),
        "dp": ("dp", [], "plain"),
        "plain-masters": ("plain", ["memory.master_weights=true"], None),
        "zero1": ("zero", ["parallel.zero=1"], "plain-masters"),
        "zero2": ("zero", ["parallel.zero=2"], "plain-masters"),
        "zero3": ("zero", ["parallel.zero=3"], "plain-masters"),
    }
    rows = {}
    for name, (kind, extra, _) in variants.items():
        cfg = config(base + extra)
        fresh_memory(dev)
        model, engine = build(kind, cfg, dev)
        x = torch.randint(0, cfg.model.vocab_size, (args.micro_batch, cfg.model.seq_len + 1), device=dev)

        def step():
            return train_step(model, engine, [(x[:, :-1], x[:, 1:])], "bf16", 1e-4)[1].item()

        times = time_steps(step, 3, args.steps, dev)
        rows[name] = {"engine": name, **summarize(times, args.micro_batch * cfg.model.seq_len, flops_per_token(cfg.model), dev),
                      "model_state_bytes": engine.last_state_bytes}
        model = engine = None  # free this model before the next one is built
    for name, (_, _, baseline) in variants.items():
        if baseline:
            rows[name]["overhead_vs_" + baseline] = round(rows[name]["step_ms"] / rows[baseline]["step_ms"] - 1, 4)
    emit({"bench": "zero_overhead", **env_info(dev), "micro_batch": args.micro_batch, "rows": list(rows.values())}, args.out)


if __name__ == "__main__":
    main()
