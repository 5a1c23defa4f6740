"""FP8 training (memory.fp8) against bf16 and against transformers + torchao's float8, on one GPU.

Speed: the same Llama shape (default: the llama-8b width, 8 layers, seq 4096, micro-batch 1, untied
head), bf16 autocast over fp32 weights, fused AdamW, grad clipping 1.0, in one process: ours in bf16 and
in fp8, transformers' LlamaForCausalLM (sdpa) in bf16 and with torchao's float8 on its decoder layers
(`convert_to_float8_training`, the head left in bf16 as ours), each eager and compiled (each block
compiled apart on both sides: `train.compile_scope=block` for ours, each decoder layer for transformers;
`--scope model`: the whole model on both sides, teratrain's default on one GPU; `--compile-mode`: torch.compile's
mode on both sides). Ratios compare one mode on
both sides only. `--weights bf16`: bf16 weights with fp32 masters in the optimizer on both sides
(`memory.master_weights=true`; transformers' model stepped by teratrain's engine). `--width 1b`: bench/train_step.py's
llama-1b width instead (d 2048, d_ff 8192, vocab 32000; give --layers 16 --seq 2048 --micro-batch 8 for its step).

    python bench/fp8.py --modes compile --accum 4 --out fp8.json   # speed, on the GPU machine (~4 min)
    python bench/fp8.py --converge 600 --out conv.json --plot docs/fp8_loss.png   # bf16 vs fp8 on real text
    python bench/fp8.py --smoke                              # CPU, tiny shapes, float8 emulated
    python bench/fp8.py --experts-only --out FILE            # the routed experts' grouped GEMMs (GPU)
    python bench/fp8.py --saved --width 1b --seq 2048 --micro-batch 8 --scope model --out FILE   # kept for backward

Convergence (`--converge STEPS`): `teratrain train` twice on the stdlib corpus, bf16 and fp8, compiled,
the same seed and batches (llama-1b width, 8 layers, seq 1024, 16 sequences a step, vocabulary 8192,
lr 6e-4 with 50 warmup steps and a cosine decay); the loss curves, and
the mean loss of the last 50 steps of each side (`within_1pct`: their difference over bf16's <= 1%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from common import (GpuClocks, add_weights_arg, config, count_ops, device, emit, env_info, fresh_compile,
                    fresh_memory, hf_llama, hf_step, smoke_compile, summarize, time_steps, weights_set)
from trace_summary import profile_steps

from teratrain.mesh import Runtime
from teratrain.models.transformer import Transformer, count_params, flops_per_token
from teratrain.optim.engine import train_step
from teratrain.parallel.parallelize import parallelize

WIDTH_8B = ["model.arch=llama", "model.d_model=4096", "model.n_heads=32", "model.n_kv_heads=8", "model.d_ff=14336",
            "model.vocab_size=128256", "model.tie_embeddings=false", "model.rope_theta=500000"]
# bench/train_step.py's llama-1b width (untied, 1.10B at 16 layers): where float8's GEMMs are narrow
WIDTH_1B = ["model.arch=llama", "model.d_model=2048", "model.n_heads=32", "model.n_kv_heads=8", "model.d_ff=8192",
            "model.vocab_size=32000", "model.tie_embeddings=false"]
WIDTHS = {"8b": WIDTH_8B, "1b": WIDTH_1B}
SMOKE = ["model.arch=llama", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
         "model.vocab_size=512", "model.seq_len=64", "model.n_layers=2", "model.tie_embeddings=false"]
CONVERGE = ["model.preset=llama-1b", "model.n_layers=8", "model.vocab_size=8192", "model.seq_len=1024",
            "model.tie_embeddings=false", "train.global_batch=16", "train.micro_batch=16", "optim.lr=6e-4",
            "optim.warmup_steps=50", "optim.schedule=cosine", "train.compile=true", "train.eval_every=100",
            "checkpoint.every=0", "memory.precision=bf16", "metrics.progress=false"]


def ours(cfg, dev, accum: int):
    with torch.device("meta"):
        model = Transformer(cfg.model)
    engine = parallelize(model, Runtime.single(dev), cfg)

    def step(x, y):
        return train_step(model, engine, [(x, y)] * accum, "bf16", cfg.optim.lr)[1].item()

    return step, (model, engine)


def hf(cfg, dev, fp8: str, emulate: bool, accum: int):
    model = hf_llama(cfg.model, dev)
    if fp8 != "none":
        from teratrain import compat

        ao = compat.torchao_float8()
        ao_cfg = ao.Float8LinearConfig.from_recipe_name(fp8)
        if emulate:
            import dataclasses

            ao_cfg = dataclasses.replace(ao_cfg, emulate=True)
        ao.convert_to_float8_training(model.model.layers, config=ao_cfg)
    mode = None if cfg.train.compile_mode == "default" else cfg.train.compile_mode
    if cfg.train.compile and cfg.train.compile_scope == "model":
        model.compile(mode=mode)
    elif cfg.train.compile:
        for layer in model.model.layers:
            layer.compile(mode=mode)
    return hf_step(model, cfg, dev, accum)


def speed(args, dev) -> dict:
    shape = SMOKE if args.smoke else WIDTHS[args.width] + [f"model.n_layers={args.layers}", f"model.seq_len={args.seq}"]
    emulate = args.smoke or dev.type != "cuda"
    gemm = gemms(dev) if dev.type == "cuda" else []
    print({"gemm_tflops": gemm}, flush=True)
    rows = []
    for mode in args.modes.split(","):
        for impl in args.impls.split(","):
            for fp8 in ("none", args.recipe):
                sets = shape + ["memory.precision=bf16", "train.grad_clip=1.0", "optim.lr=1e-4",
                                weights_set(args.weights),
                                f"memory.fp8={fp8}", f"train.device={dev.type}"]
                sets += ["memory.fp8_emulate=true"] if emulate and fp8 != "none" else []
                sets += ["train.compile=true", f"train.compile_scope={args.scope}",
                         f"train.compile_mode={args.compile_mode}"] if mode == "compile" else []
                cfg = config(sets)
                fresh_memory(dev)
                fresh_compile()
                step, keep = ours(cfg, dev, args.accum) if impl == "ours" else hf(cfg, dev, fp8, emulate, args.accum)
                B, T = args.micro_batch, cfg.model.seq_len
                g = torch.Generator().manual_seed(0)
                x = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=g).to(dev)
                inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()
                warmup = args.warmup + (2 if mode == "compile" else 0)
                for _ in range(warmup):
                    step(inputs, targets)
                with GpuClocks(dev.index or 0, enabled=args.clocks and dev.type == "cuda") as clocks:
                    times = time_steps(lambda: step(inputs, targets), 0, args.steps, dev)
                row = {"impl": impl, "mode": mode, "fp8": fp8,
                       **summarize(times, B * T * args.accum, flops_per_token(cfg.model), dev),
                       **({"gpu_clocks": clocks.summary()} if clocks.enabled else {})}
                if args.profile:  # device time by kernel kind: what the casts cost against the GEMMs they speed
                    row["profile"] = profile_steps(lambda: step(inputs, targets), dev, steps=2, top=8)
                if impl == "ours" and mode == "eager":  # what the planner's host terms count (planner/time.py)
                    row["aten_ops_per_step"] = count_ops(lambda: step(inputs, targets))
                rows.append(row)
                print(row, flush=True)
                step = keep = None  # free this model before the next one is built
    return {"bench": "fp8", **env_info(dev), "gemm_tflops": gemm, "width": args.width, "n_layers": args.layers,
            "seq_len": args.seq, "micro_batch": args.micro_batch, "accumulation": args.accum, "recipe": args.recipe,
            "scope": args.scope, "compile_mode": args.compile_mode,
            "weights": args.weights, "weight casts": "once a step",  # memory/step_casts.py (planner/refit.py)
            "float8 gradients": "through the casts",  # the gradient so far carried (memory/fp8.py _CarriedGrad)
            "results": rows,
            "ratios": ratios(rows, args.recipe)}


def gemms(dev) -> dict:
    """TFLOP/s of one GEMM, bf16 (torch.mm) against float8 (torch._scaled_mm, tensorwise and rowwise
    scales, e4m3 operands, bf16 output), at the llama-8b width's shapes (M tokens x K in -> N out) and
    at 8192 cubed: the rates the planner's compute terms assume (planner/hardware.py)."""
    import time

    from teratrain import compat

    ao = compat.torchao_float8()
    out = []
    for m, k, n in ((4096, 4096, 4096), (4096, 4096, 14336), (4096, 14336, 4096), (8192, 8192, 8192)):
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        fa, fb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        runs = {"bf16": lambda: a @ b.t(),
                "fp8_tensorwise": lambda: torch._scaled_mm(fa, fb.t(), one, one, out_dtype=torch.bfloat16,
                                                           use_fast_accum=True),
                "fp8_rowwise": lambda: torch._scaled_mm(fa, fb.t(), torch.ones(m, 1, device=dev),
                                                        torch.ones(1, n, device=dev), out_dtype=torch.bfloat16)}
        row = {"m": m, "k": k, "n": n}
        for name, fn in runs.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            torch.cuda.synchronize(dev)
            row[name] = round(2 * m * k * n * 20 / (time.perf_counter() - t0) / 1e12, 1)
        out.append(row)
    del ao
    return out


def gemm_speedups(dev) -> dict:
    """`gemms` and float8's speed over bf16 per recipe: the mean over the llama-8b width's shapes at 4096 tokens
    (the planner's fp8_speedup_tensorwise / _rowwise)."""
    rows = gemms(dev)
    mine = [r for r in rows if r["m"] == 4096]
    return {"bench": "fp8_gemms", **env_info(dev), "gemm_tflops": rows,
            "speedup": {recipe: round(statistics.fmean(r[f"fp8_{recipe}"] / r["bf16"] for r in mine), 3)
                        for recipe in ("tensorwise", "rowwise")}}


# (name, tokens, top-k, experts, d_model, expert d_ff): bench/moe.py's two shapes at 8 sequences of 2,048, and
# Mixtral-8x7B's expert shape at 4 sequences of 2,048
EXPERT_SHAPES = (("8x2816-top2", 16384, 2, 8, 2048, 2816), ("qwen3-30b-a3b", 16384, 8, 128, 2048, 768),
                 ("mixtral-8x7b", 8192, 2, 8, 4096, 14336))


def expert_gemms(dev, iters: int = 20) -> dict:
    """The routed experts of one MoE layer (rows laid out by expert, each group a multiple of 16 rows; w1 and w3
    as one stack, SwiGLU, w2), forward and backward, with bf16 grouped GEMMs (torch._grouped_mm, what
    models/grouped.py runs) against torchao's rowwise float8 grouped GEMM (torchao.prototype.moe_training: each
    operand cast with power-of-2 row scales, all three GEMMs torch._scaled_grouped_mm), eager and compiled
    (the layer whole, static shapes); the median of `iters` calls. `rel_diff`: the float8 output's and w13
    gradient's distance from bf16's."""
    import importlib

    import torch.nn.functional as F

    prototype = importlib.import_module("torchao.prototype.moe_training.fp8_grouped_mm")
    fp8_mm = prototype._to_fp8_rowwise_then_scaled_grouped_mm

    def layer(kind, a, w13, w2, offs):
        def mm(x, w):
            if kind == "bf16":
                return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
            return fp8_mm(x, w.transpose(-2, -1), offs, torch.bfloat16, torch.float8_e4m3fn, False)

        h1, h3 = mm(a, w13).chunk(2, -1)
        return mm(F.silu(h1) * h3, w2)

    g = torch.Generator().manual_seed(0)
    rows = []
    for name, tokens, k, experts, d, f in EXPERT_SHAPES:
        m = tokens * k
        share = torch.rand(experts, generator=g) + 0.5  # uneven groups, as routing makes them
        sizes = (share / share.sum() * m).long() // 16 * 16
        sizes[-1] += m - sizes.sum()  # every row in a group (m is a multiple of 16): no row left uncomputed
        offs = sizes.cumsum(0).to(torch.int32).to(dev)
        a = torch.randn(m, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w13 = (torch.randn(experts, 2 * f, d, device=dev) * d ** -0.5).bfloat16().requires_grad_()
        w2 = (torch.randn(experts, d, f, device=dev) * f ** -0.5).bfloat16().requires_grad_()
        dy = torch.randn(m, d, device=dev, dtype=torch.bfloat16)
        row = {"shape": name, "rows": m, "experts": experts, "d": d, "d_ff": f,
               "flops": 6 * int(offs[-1]) * 3 * d * f}
        ref = None
        for kind in ("bf16", "fp8_rowwise"):
            for mode in ("eager", "compiled"):
                torch._dynamo.reset()
                fn = layer if mode == "eager" else torch.compile(layer, dynamic=False)

                def call(fn=fn, kind=kind):
                    a.grad = w13.grad = w2.grad = None
                    y = fn(kind, a, w13, w2, offs)
                    y.backward(dy)
                    return y

                ms = statistics.median(time_steps(call, 3, iters, dev)) * 1e3
                y = call()
                if ref is None:  # the first form timed, bf16 eager: what the float8 rows are compared with
                    ref = (y.float(), w13.grad.float())
                row[f"{kind}_{mode}_ms"] = round(ms, 3)
                row[f"{kind}_{mode}_tflops"] = round(row["flops"] / ms / 1e9, 1)
                if kind != "bf16":
                    row[f"{kind}_{mode}_rel_diff"] = [round(float((t.float() - r).norm() / r.norm()), 4)
                                                      for t, r in zip((y, w13.grad), ref)]
        for mode in ("eager", "compiled"):
            row[f"fp8_over_bf16_{mode}"] = round(row[f"bf16_{mode}_ms"] / row[f"fp8_rowwise_{mode}_ms"], 3)
        rows.append(row)
        print(name, {key: v for key, v in row.items() if "over" in key or key.endswith("_ms")}, flush=True)
        del a, w13, w2, dy
        torch.cuda.empty_cache()
    return {"bench": "fp8_expert_gemms", **env_info(dev), "experts": rows}


def ratios(rows: list[dict], recipe: str) -> dict:
    """Tokens/s ratios, each within one mode: fp8 over bf16 (ours, transformers), ours over transformers
    (bf16, fp8)."""
    by = {(r["impl"], r["mode"], r["fp8"]): r["tokens_per_s"] for r in rows}
    out = {}
    for mode in sorted({r["mode"] for r in rows}):
        pairs = {"ours_fp8_over_ours_bf16": (("ours", recipe), ("ours", "none")),
                 "hf_fp8_over_hf_bf16": (("hf", recipe), ("hf", "none")),
                 "ours_fp8_over_hf_fp8": (("ours", recipe), ("hf", recipe)),
                 "ours_bf16_over_hf_bf16": (("ours", "none"), ("hf", "none"))}
        for name, ((ia, fa), (ib, fb)) in pairs.items():
            a, b = by.get((ia, mode, fa)), by.get((ib, mode, fb))
            if a and b:
                out.setdefault(mode, {})[name] = round(a / b, 3)
    return out


def saved(args, dev) -> dict:
    """What the compiled model keeps for backward (`saved_tensors_hooks` around one forward and its loss, each
    storage once, parameters apart) in bf16 and under each float8 recipe, at 1 and 2 blocks, by shape and dtype,
    against the planner's count (planner/memory.py forward_saved). On CPU, float8 is emulated."""
    from teratrain.measure import build_engine, random_batch, saved_bytes
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.memory import forward_saved

    shape = SMOKE if args.smoke else WIDTHS[args.width] + [f"model.seq_len={args.seq}"]
    B = 2 if args.smoke else args.micro_batch
    rows = []
    for fp8 in ("none", "tensorwise", "rowwise"):
        for layers in (1, 2):
            cfg = config([s for s in shape if not s.startswith("model.n_layers")] + [
                f"model.n_layers={layers}", "memory.precision=bf16", "train.compile=true",
                f"train.compile_scope={args.scope}", f"train.micro_batch={B}", f"train.global_batch={B}",
                f"memory.fp8={fp8}", f"train.device={dev.type}",
                *(["memory.fp8_emulate=true"] if fp8 != "none" and dev.type != "cuda" else [])])
            fresh_compile()
            model, _ = build_engine(cfg, dev)
            x, y = random_batch(cfg, B, dev)
            saved_bytes(model, x, y, "bf16", targets_in_model=True)  # compiles
            kept = []
            total = saved_bytes(model, x, y, "bf16", targets_in_model=True, kept=kept)
            kinds = {}
            for k in kept:
                kinds.setdefault(json.dumps(k), [k, 0])[1] += 1
            row = {"fp8": fp8, "layers": layers, "saved_bytes": total,
                   "planned_bytes": forward_saved(shape_of(cfg), training_of(cfg), layout_of(cfg, 1), dev.type),
                   "tensors": sorted(([*k, n] for k, n in kinds.values()), key=lambda r: -r[2] * r[3])}
            print({k: v for k, v in row.items() if k != "tensors"}, flush=True)
            rows.append(row)
            model = None
    return {"bench": "fp8_saved", **env_info(dev), "width": args.width, "seq_len": args.seq, "micro_batch": B,
            "scope": args.scope, "results": rows}


def converge(args, dev) -> dict:
    """Two `teratrain train` runs, bf16 and fp8, on the stdlib corpus: their losses step by step."""
    from teratrain.config import load_config
    from teratrain.metrics import read_metrics
    from teratrain.train import run

    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        sets = CONVERGE
        if args.smoke:  # a small text of its own: the stdlib corpus would train a tokenizer for a minute
            Path(f"{tmp}/text.txt").write_text("def f(x):\n    return x + 1\n" * 2000)
            sets = SMOKE + ["train.global_batch=4", "train.micro_batch=2", "memory.precision=bf16",
                            "metrics.progress=false", "checkpoint.every=0", f"data.path={tmp}/text.txt",
                            f"data.cache_dir={tmp}/cache"]
        for fp8 in ("none", args.recipe):
            extra = [f"memory.fp8={fp8}", f"train.steps={args.converge}", f"train.device={dev.type}"]
            extra += ["memory.fp8_emulate=true"] if fp8 != "none" and dev.type != "cuda" else []
            fresh_memory(dev)
            fresh_compile()
            run(load_config(None, sets + extra), f"{tmp}/{fp8}")
            records = read_metrics(Path(tmp) / fp8 / "metrics.jsonl")
            curves[fp8] = {"loss": [r["loss"] for r in records], "tokens_per_s": [r["tokens_per_s"] for r in records],
                           "eval_loss": [(r["step"], r["eval_loss"]) for r in records
                                         if r.get("eval_loss") is not None]}
    tail = min(50, args.converge)
    last = {k: statistics.mean(c["loss"][-tail:]) for k, c in curves.items()}
    diff = (last[args.recipe] - last["none"]) / last["none"]
    out = {"bench": "fp8_converge", **env_info(dev), "steps": args.converge, "sets": sets, "recipe": args.recipe,
           f"mean_loss_last_{tail}": last, "relative_difference": round(diff, 5), "within_1pct": abs(diff) <= 0.01,
           "curves": curves}
    if args.plot:
        plot(curves, args.recipe, args.plot)
    return out


def plot(curves: dict, recipe: str, path: str) -> None:
    """Training loss (a 20-step mean) and held-out loss of both runs, one picture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, color in (("none", "bf16", "tab:blue"), (recipe, f"fp8 ({recipe})", "tab:orange")):
        loss = np.asarray(curves[key]["loss"])
        mean = np.convolve(loss, np.ones(20) / 20, mode="valid")
        ax.plot(np.arange(20, len(loss) + 1), mean, color=color, lw=1.2, label=f"{label}, training (20-step mean)")
        steps, evals = zip(*curves[key]["eval_loss"])
        ax.plot(steps, evals, "o--", color=color, ms=4, lw=0.8, label=f"{label}, held out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("llama-1b width, 8 layers, stdlib corpus: bf16 against fp8")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", default="8b", choices=sorted(WIDTHS),
                    help="8b: llama-8b's width (the default); 1b: bench/train_step.py's llama-1b width")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--impls", default="ours,hf")
    ap.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    ap.add_argument("--scope", default="block", choices=["block", "model"],
                    help="compiled: each block apart (default) or the whole model, on both sides")
    ap.add_argument("--compile-mode", default="default", choices=["default", "max-autotune-no-cudagraphs"],
                    help="torch.compile's mode on both sides (max-autotune-no-cudagraphs: inductor times its GEMMs)")
    ap.add_argument("--converge", type=int, default=0, help="train this many steps in bf16 and in fp8 instead")
    ap.add_argument("--plot", help="with --converge: write the two loss curves here (PNG)")
    ap.add_argument("--replot", metavar="JSON", help="draw --plot from a --converge result instead of training")
    ap.add_argument("--profile", action="store_true", help="device time by kernel kind, 2 profiled steps a row")
    ap.add_argument("--clocks", action="store_true", help="the SM clock and power while each row's steps are timed")
    ap.add_argument("--gemms-only", action="store_true", help="only the GEMM rates and float8's speed-ups over bf16 "
                    "(planner/calibration/<card>.toml fp8_speedup_*)")
    ap.add_argument("--saved", action="store_true", help="what the compiled model keeps for backward, bf16 and "
                    "float8, at 1 and 2 blocks, against the planner's count")
    ap.add_argument("--experts-only", action="store_true", help="only an MoE layer's experts: bf16 grouped GEMMs "
                    "against torchao's rowwise float8 grouped GEMM, eager and compiled (a GPU with float8)")
    add_weights_arg(ap)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.replot:
        result = json.loads(Path(args.replot).read_text())
        plot(result["curves"], result["recipe"], args.plot)
        return
    dev = device()
    if args.smoke:
        smoke_compile()
        args.steps, args.warmup = 2, 1
    if args.gemms_only:
        emit(gemm_speedups(dev), args.out)
        return
    if args.experts_only:
        emit(expert_gemms(dev), args.out)
        return
    if args.saved:
        emit(saved(args, dev), args.out)
        return
    emit(converge(args, dev) if args.converge else speed(args, dev), args.out)


if __name__ == "__main__":
    main()
