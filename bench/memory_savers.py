"""Memory savers on one GPU at the llama-1b shape: what each saves and what it costs.

1. Activations: peak memory, tokens/s and the bytes saved for backward (counted by the planner's
   saved-tensor hooks, next to the planner's prediction) for no saver, selective recomputation,
   activation compression (int8 and fp8: memory.compress_activations), and recomputation + int8.
2. Optimizers: AdamW vs Adafactor vs SM3 (with and without momentum): optimizer-state bytes (live,
   and as the planner predicts them), full training step time and the optimizer step alone.
4. Recomputation (`--part recompute`): none, selective (the attention core), selective-ops (every
   GEMM's and fused attention's output kept, norms/casts/activations replayed), selective-ops-alternate
   (every other linear product's output kept, the others run again) and full: peak memory,
   step time, and the bytes the forward leaves alive for backward (measure.live_bytes, which also sees
   selective-ops's own cache), each next to the planner's (forward_saved, peak, step time; the card's terms).
3. LoRA fine-tuning of llama-8b (rank 16 on the attention projections, frozen base in bf16, full
   recomputation): model-state bytes (live and planned), peak memory and tokens/s.

Every model is built as `teratrain train` builds it for one process (teratrain/measure.py), bf16
autocast over fp32 weights, and trained on random tokens.

    python bench/memory_savers.py                      # on the GPU machine (llama-1b, seq 2048)
    python bench/memory_savers.py --smoke              # a tiny model on CPU, to check the script itself
    python bench/memory_savers.py --part recompute     # the recomputation rows alone (--compile: compiled)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from common import config, device, emit, env_info, fresh_memory, peak_gib, planner_card, summarize, sync, time_steps

from teratrain.models.transformer import count_params, flops_per_token
from teratrain.optim.engine import train_step
from teratrain.planner.activations import forward_saved
from teratrain.planner.inputs import shape_of, training_of
from teratrain.planner.layout import Layout, ModelShape, widths
from teratrain.measure import build_engine, live_bytes, random_batch, saved_bytes
from teratrain.planner.states import model_states

SHAPE = ["model.preset=llama-1b", "model.seq_len=2048"]
SMOKE = ["model.preset=tiny", "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
         "model.d_ff=128", "model.vocab_size=512", "model.seq_len=64"]
LORA_SHAPE = ["model.preset=llama-8b", "model.seq_len=2048"]  # LoRA fine-tuning of an 8B model on one GPU
ACTIVATION_CASES = [("none", "none"), ("selective", "none"), ("none", "int8"), ("none", "fp8"), ("selective", "int8")]
RECOMPUTE = ["none", "selective", "selective-ops", "selective-ops-alternate", "full"]
OPTIMIZERS = [("adamw", []), ("adafactor", []), ("sm3", []), ("sm3", ["optim.momentum=0"])]


def activation_row(base: list[str], recompute: str, compress: str, mb: int, args, dev) -> dict:
    cfg = config(base + [f"memory.recompute={recompute}", f"memory.compress_activations={compress}"])
    fresh_memory(dev)
    model, engine = build_engine(cfg, dev)
    x, y = random_batch(cfg, mb, dev)
    T = cfg.model.seq_len
    predicted = forward_saved(ModelShape(cfg=cfg.model), widths(cfg.memory.precision, cfg.use_master_weights),
                              mb * T, T, recompute, cfg.memory.recompute_every, device=dev.type, compress=compress)
    measured = saved_bytes(model, x, y, cfg.memory.precision)
    fresh_memory(dev)  # the peak of training steps only
    times = time_steps(lambda: train_step(model, engine, [(x, y)], cfg.memory.precision, 1e-4)[1].item(),
                       args.warmup, args.steps, dev)
    row = {"recompute": recompute, "compress": compress, "saved_bytes": measured, "saved_bytes_planned": predicted,
           **summarize(times, mb * T, flops_per_token(cfg.model), dev)}
    del model, engine
    return row


def recompute_row(base: list[str], recompute: str, mb: int, args, dev) -> dict:
    """One recomputation policy: measured (live bytes, peak, step time) next to the planner's."""
    from teratrain.planner.hardware import gpu_with
    from teratrain.planner.inputs import layout_of
    from teratrain.planner.memory import forward_saved as planned_forward  # compiled: inductor's partition
    from teratrain.planner.search import evaluate

    cfg = config(base + [f"memory.recompute={recompute}", f"train.micro_batch={mb}", f"train.global_batch={mb}"])
    fresh_memory(dev)
    model, engine = build_engine(cfg, dev)
    x, y = random_batch(cfg, mb, dev)
    step = lambda: train_step(model, engine, [(x, y)], cfg.memory.precision, 1e-4)[1].item()  # noqa: E731
    if cfg.train.compile:  # a dispatch mode would run the compiled graph eagerly: the allocator counts instead
        step()  # compiled by the first step
        measured = _forward_allocated(model, engine, x, y, cfg.memory.precision, dev)
    else:
        measured = live_bytes(model, x, y, cfg.memory.precision)
    fresh_memory(dev)  # the peak of training steps only
    times = time_steps(step, args.warmup, args.steps, dev)
    shape, train, T = shape_of(cfg), training_of(cfg), cfg.model.seq_len
    w = widths(cfg.memory.precision, cfg.use_master_weights)
    card, lay = planner_card(dev), layout_of(cfg, 1)
    cand = evaluate(shape, train, lay, gpu_with(card))
    row = {"recompute": recompute, "compiled": cfg.train.compile, "live_bytes": measured, "planned_on": card,
           "saved_bytes_planned": (planned_forward(shape, train, lay, dev.type) if cfg.train.compile
                                   else forward_saved(shape, w, mb * T, T, recompute, cfg.memory.recompute_every,
                                                      device=dev.type)),
           "peak_gib_planned": round(cand.memory.peak_allocated / 2**30, 3),
           "step_s_planned": round(cand.time.step_time_s, 4),
           **summarize(times, mb * T, flops_per_token(cfg.model), dev)}  # the timed steps' peak
    if args.trace_peak:  # what is alive at one more step's peak, by allocation site (bench/memory_trace.py)
        from memory_trace import traced_step

        row["peak_trace"] = traced_step(step, dev)
    del model, engine
    return row


def _forward_allocated(model, engine, x, y, precision: str, dev) -> int | None:
    """Bytes the allocator holds after one training forward (the loss included) beyond what it held before:
    what the forward leaves for its backward. None off CUDA."""
    if dev.type != "cuda":
        return None
    from teratrain.memory.precision import autocast

    model.train()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with autocast(precision, dev):
        loss = model(x, y)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    loss.backward()  # frees what the forward kept
    engine.zero_grad()  # the gradients as a step leaves them (freed, unless the engine keeps them)
    return held


def _timed(cfg, mb: int, args, dev):
    """A fresh engine for `cfg` and its step times on one random micro-batch of `mb` sequences."""
    fresh_memory(dev)
    model, engine = build_engine(cfg, dev)
    x, y = random_batch(cfg, mb, dev)
    times = time_steps(lambda: train_step(model, engine, [(x, y)], cfg.memory.precision, 1e-4)[1].item(),
                       args.warmup, args.steps, dev)
    return model, engine, times


def optimizer_row(base: list[str], name: str, extra: list[str], mb: int, args, dev) -> dict:
    cfg = config(base + [f"optim.name={name}", *extra])
    model, engine, times = _timed(cfg, mb, args, dev)
    T = cfg.model.seq_len
    live = engine.state_bytes()["optimizer"]  # after the steps: Adafactor creates its state lazily
    planned = model_states(shape_of(cfg), training_of(cfg), Layout(),
                           device=dev.type)["optimizer"]
    opt_s = _optimizer_step_s(engine, args.steps, dev)
    row = {"optimizer": name, "settings": extra, "state_bytes": live, "state_bytes_planned": planned,
           "state_bytes_per_param": round(live / count_params(cfg.model)["total"], 3),
           "optimizer_step_ms": round(opt_s * 1e3, 2), **summarize(times, mb * T, flops_per_token(cfg.model), dev)}
    del model, engine
    return row


def lora_row(sets: list[str], mb: int, args, dev) -> dict:
    """LoRA fine-tuning (memory/lora.py): model-state bytes (live and planned), peak and tokens/s."""
    cfg = config(sets)
    model, engine, times = _timed(cfg, mb, args, dev)
    T = cfg.model.seq_len
    planned = model_states(shape_of(cfg), training_of(cfg), Layout(), device=dev.type)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    row = {"settings": sets[-6:], "trainable_params": trainable, "params": count_params(cfg.model)["total"],
           "model_state_bytes": engine.last_state_bytes,
           "model_state_bytes_planned": {k: planned[k] for k in ("params", "grads", "optimizer")},
           **summarize(times, mb * T, flops_per_token(cfg.model), dev)}
    del model, engine
    return row


def _optimizer_step_s(engine, steps: int, dev) -> float:
    """Median time of optimizer.step() alone, on random gradients of the parameters' shapes."""
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    times = []
    for _ in range(max(steps, 3)):
        sync(dev)
        t0 = time.perf_counter()
        engine.optimizer.step()
        sync(dev)
        times.append(time.perf_counter() - t0)
    engine.zero_grad()
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--part", choices=["all", "activations", "optimizers", "lora", "recompute"], default="all",
                    help="all: each part in a fresh process (no part's allocations can outlive it)")
    ap.add_argument("--compile", action="store_true", help="train.compile=true (the recompute part: compile_scope "
                    "auto, the whole model for the per-op policies)")
    ap.add_argument("--policies", default=",".join(RECOMPUTE), help="the recompute part's policies, comma-separated")
    ap.add_argument("--trace-peak", action="store_true", help="the recompute part: what is alive at a step's peak")
    ap.add_argument("--out")
    args = ap.parse_args()
    if (args.compile or args.trace_peak) and args.part != "recompute":
        ap.error("--compile and --trace-peak measure the recomputation rows: add --part recompute")
    if args.smoke:
        args.steps, args.warmup, args.micro_batch = 2, 1, 2
    dev = device()
    base = (SMOKE if args.smoke else SHAPE) + ["memory.precision=bf16", "train.grad_clip=1.0"]
    base += ["train.compile=true"] if args.compile else []
    if args.part == "all":
        parts = {part: _run_part(part, sys.argv[1:]) for part in ("activations", "optimizers", "lora", "recompute")}
        cfg = config(base)
        emit({"bench": "memory_savers", **env_info(dev), "shape": base, "micro_batch": args.micro_batch,
              "seq_len": cfg.model.seq_len, "params": count_params(cfg.model)["total"], **parts}, args.out)
        return
    if args.part == "activations":
        rows = [activation_row(base, r, c, args.micro_batch, args, dev) for r, c in ACTIVATION_CASES]
    elif args.part == "recompute":
        rows = [recompute_row(base, r, args.micro_batch, args, dev) for r in args.policies.split(",")]
    elif args.part == "optimizers":
        rows = [optimizer_row(base, n, e, args.micro_batch, args, dev) for n, e in OPTIMIZERS]
    else:
        lora_base = (SMOKE if args.smoke else LORA_SHAPE) + ["memory.precision=bf16", "memory.recompute=full"]
        rows = [lora_row(lora_base + ["lora.rank=16", "lora.base_dtype=bf16"], 1, args, dev)]
    emit({"bench": "memory_savers", **env_info(dev), "part": args.part, "rows": rows}, args.out)


def _run_part(part: str, argv: list[str]) -> list[dict]:
    """Run one part of the bench in a child process; its rows (or its error) come back as JSON."""
    argv = [a for i, a in enumerate(argv) if a != "--out" and (i == 0 or argv[i - 1] != "--out")]
    proc = subprocess.run([sys.executable, __file__, *argv, "--part", part], capture_output=True, text=True)
    if proc.returncode:
        return [{"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}]
    return json.loads(proc.stdout)["rows"]


if __name__ == "__main__":
    main()
