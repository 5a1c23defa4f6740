"""Our training step against HF transformers' LlamaForCausalLM (attn sdpa) at the same shape, or with
`--model gpt2-350m` (any GPT-2 preset) against its GPT2LMHeadModel.

Implementations: `ours` (the head and loss fused and chunked, memory.loss_chunks=0: auto pieces),
`ours_plain` (whole logits, memory.loss_chunks=1, the default), `ours_liger` (our model, the loss by Liger-Kernel's
fused linear cross-entropy, where liger_kernel imports), `hf`, and `hf_liger` (transformers with
Liger-Kernel's Llama kernels, where it imports). Every ratio divides two rows of the same mode.

Shape: d_model 2048, 16 layers, 32 heads, 8 KV heads, d_ff 8192, vocab 32000,
seq 2048, micro-batch 8, bf16 autocast over fp32 weights, fused AdamW, grad clipping at 1.0 on both
sides, eager and torch.compile, in one run. Both report model FLOPs by the same PaLM formula, so
TFLOP/s and MFU compare like for like. Each step ends with `loss.item()` as a training loop's logging does.

    python bench/train_step.py                 # on the GPU machine
    python bench/train_step.py --smoke         # tiny shapes on CPU, to check the script itself
    python bench/train_step.py --modes compile --impls ours_plain,hf --profile   # + device time by kernel kind
    python bench/train_step.py --model gpt2-350m --impls ours_plain,hf           # GPT-2: its preset, both modes

`--profile`: 2 more steps of each row under torch.profiler (bench/trace_summary.py): device time by kernel kind
(GEMMs, attention, elementwise, copies, optimizer), idle time, and the rate the GEMMs reach (6 x the matmul
parameters x tokens over the GEMM kernels' time: the bf16 GEMM ceiling is what `bench/fp8.py` measures
for torch.mm) and the attention kernels' (a causal kernel's 6LHQT per token). `--compile-mode`: the mode of
torch.compile on both sides (`max-autotune-no-cudagraphs` lets inductor time its own GEMM templates). `--weights bf16`:
bf16 weights with fp32 master copies in the optimizer on both sides (`memory.master_weights=true`, as Megatron-LM and
torchtitan's FSDP2 keep them), through teratrain's engine for both models.
`--clocks`: the SM clock and board power while each row's steps are timed (a step held at the card's power limit runs
below its top clock). Our rows also carry the planner's step and peak for their layout with the preset of the card
they ran on (`planned_step_ms`, `planned_error_pct`, `planned_peak_gib`).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from common import (GpuClocks, add_weights_arg, config, device, emit, env_info, error_text, fresh_compile, fresh_memory,
                    hf_gpt2, hf_llama, hf_step, planned_step, planner_card, smoke_compile, summarize, time_steps,
                    weights_set)
from trace_summary import profile_steps

from teratrain.models.transformer import build_model, count_params, flops_per_token
from teratrain.optim.engine import LocalEngine, train_step

SHAPE = ["model.arch=llama", "model.d_model=2048", "model.n_layers=16", "model.n_heads=32", "model.n_kv_heads=8",
         "model.d_ff=8192", "model.vocab_size=32000", "model.seq_len=2048", "model.tie_embeddings=false"]
SMOKE = ["model.arch=llama", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.d_ff=128", "model.vocab_size=512", "model.seq_len=64", "model.tie_embeddings=false"]
SMOKE_GPT2 = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.vocab_size=509", "model.seq_len=64"]


def ours(cfg, dev, compiled: str | None, loss_chunks: int = 0, liger: bool = False):
    model = build_model(cfg.model, dev, seed=0)
    model.chunked_loss.chunks = loss_chunks
    if liger:
        model.chunked_loss = LigerLoss()
    if compiled:
        model.compile(mode=None if compiled == "default" else compiled)
    engine = LocalEngine(model, cfg.optim, cfg.memory, cfg.train.grad_clip,
                         master_weights=bool(cfg.memory.master_weights))

    def step(x, y):
        return train_step(model, engine, [(x, y)], "bf16", cfg.optim.lr)[1].item()

    return step, (model, engine)


class LigerLoss(torch.nn.Module):
    """Liger-Kernel's fused linear cross-entropy (Triton) in place of our chunked loss."""

    def __init__(self):
        super().__init__()
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        # its Triton kernels run eager inside a compiled model (dynamo cannot trace its addmm(out_dtype=))
        self.chunks, self.fn = 0, torch.compiler.disable(LigerFusedLinearCrossEntropyLoss())

    def forward(self, h, weight, targets):
        return self.fn(weight, h.flatten(0, 1), targets.flatten())


def hf(cfg, dev, compiled: str | None, liger: bool = False):
    model = (hf_gpt2 if cfg.model.arch == "gpt2" else hf_llama)(cfg.model, dev)
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)  # rope, RMSNorm, SwiGLU and the fused linear cross-entropy
    if compiled:
        model.compile(mode=None if compiled == "default" else compiled)
    return hf_step(model, cfg, dev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", help="llama: the shape above; or a GPT-2 preset (gpt2-350m, ...): "
                    "its shape, dropout 0, against transformers' GPT-2 (no Liger rows)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--impls", default="ours,ours_plain,ours_liger,hf,hf_liger",
                    help="the *_liger rows are skipped where liger_kernel does not import")
    ap.add_argument("--loss-chunks", type=int, default=0, help="memory.loss_chunks of the `ours` row (0: auto)")
    ap.add_argument("--compile-mode", default="default", choices=["default", "max-autotune-no-cudagraphs"])
    ap.add_argument("--profile", action="store_true", help="device time by kernel kind, 2 profiled steps a row")
    ap.add_argument("--clocks", action="store_true", help="the SM clock and power while each row's steps are timed "
                    "(nvidia-smi every 100 ms): a step held at the card's power limit runs below its top clock")
    add_weights_arg(ap)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = device()
    if args.smoke:
        smoke_compile()
    shape = (SMOKE if args.smoke else SHAPE) if args.model == "llama" else [f"model.preset={args.model}"] + (
        SMOKE_GPT2 if args.smoke else [])
    args.sets = shape + ["memory.precision=bf16", "train.grad_clip=1.0", "optim.lr=1e-4", weights_set(args.weights)]
    cfg = config(args.sets + [f"memory.loss_chunks={args.loss_chunks}"])
    B, T = args.micro_batch, cfg.model.seq_len
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=g).to(dev)
    inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    impls = [i for i in args.impls.split(",") if not i.endswith("_liger") or has_liger() and args.model == "llama"]
    rows = []
    # Liger patches transformers' Llama classes for the whole process (apply_liger_kernel_to_llama): its rows
    # run after every other row, so no `hf` row is built from patched classes
    order = [(m, i) for m in args.modes.split(",") for i in impls if i != "hf_liger"]
    order += [(m, i) for m in args.modes.split(",") for i in impls if i == "hf_liger"]
    for mode, impl in order:
        rows.append(measure(impl, mode, cfg, dev, inputs, targets, args))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    emit({"bench": "train_step", **env_info(dev), "model": args.model, "micro_batch": B, "seq_len": T,
          "liger": has_liger(), "compile_mode": args.compile_mode, "weights": args.weights,
          "params": count_params(cfg.model)["total"], "results": rows, "ratios_tokens_per_s": ratios(rows)}, args.out)


def measure(impl, mode, cfg, dev, inputs, targets, args) -> dict:
    """One row: the median step of `impl` in `mode`, or the error that stopped it (the row then fails)."""
    fresh_memory(dev)
    fresh_compile()
    B, T = inputs.shape
    try:
        step, keep = BUILD[impl](cfg, dev, args.compile_mode if mode == "compile" else None)
        warmup = args.warmup + (2 if mode == "compile" else 0)
        for _ in range(warmup):
            step(inputs, targets)
        with GpuClocks(dev.index or 0, enabled=args.clocks and dev.type == "cuda") as clocks:
            times = time_steps(lambda: step(inputs, targets), 0, args.steps, dev)
        loss = step(inputs, targets)
        prof = profile_steps(lambda: step(inputs, targets), dev, steps=2, top=8) if args.profile else None
    except Exception as e:  # noqa: BLE001 - a peer's failure is a row, not the end of the job
        return {"impl": impl, "mode": mode, "error": error_text(e)}
    row = {"impl": impl, "mode": mode, **summarize(times, B * T, flops_per_token(cfg.model), dev),
           "loss": round(loss, 4), **({"gpu_clocks": clocks.summary()} if clocks.enabled else {})}
    if impl in ("ours", "ours_plain"):  # the planner's step and peak for this row, with its card's preset
        chunks = args.loss_chunks if impl == "ours" else 1
        sets = [f"memory.loss_chunks={chunks}", f"train.micro_batch={B}", f"train.global_batch={B}"]
        step_s, peak = planned_step(args.sets + sets + (["train.compile=true"] if mode == "compile" else []),
                                    planner_card(dev))
        row.update(planned_step_ms=round(step_s * 1e3, 2), planned_error_pct=round(100 * (step_s * 1e3 /
                   row["step_ms"] - 1), 1), planned_peak_gib=round(peak, 2))
    if prof is not None:
        row.update(profile=prof, **kernel_rates(prof["kinds"], cfg.model, B * T))
    return row


def kernel_rates(kinds: dict, m, tokens: int) -> dict:
    """TFLOP/s the GEMM kernels and the attention kernels reach over their own device time in a step."""
    work = {"gemm": 6 * count_params(m)["matmul"], "attention": 6 * m.n_layers * m.n_heads * m.head_width * m.seq_len}
    return {f"{kind}_tflops": round(per_token * tokens / (kinds[kind]["ms"] * 1e-3) / 1e12, 1)
            for kind, per_token in work.items() if kinds.get(kind, {}).get("ms")}


BUILD = {"ours": lambda c, d, m: ours(c, d, m, loss_chunks=c.memory.loss_chunks),
         "ours_plain": lambda c, d, m: ours(c, d, m, loss_chunks=1),
         "ours_liger": lambda c, d, m: ours(c, d, m, liger=True), "hf": hf,
         "hf_liger": lambda c, d, m: hf(c, d, m, liger=True)}
PAIRS = [("ours", "hf"), ("ours", "hf_liger"), ("ours", "ours_plain"), ("ours_liger", "ours"),
         ("ours_plain", "hf")]


def has_liger() -> bool:
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def ratios(rows: list[dict]) -> dict:
    """`a/b` tokens/s ratios of the PAIRS, each within one mode: {mode: {"ours/hf": 1.2, ...}}."""
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        by = {r["impl"]: r for r in rows if r["mode"] == mode and "error" not in r}
        out[mode] = {f"{a}/{b}": round(by[a]["tokens_per_s"] / by[b]["tokens_per_s"], 3)
                     for a, b in PAIRS if a in by and b in by}
    return out


if __name__ == "__main__":
    main()
