"""How fast one block's bf16 gradients are copied into an fp32 reduce input, by method; prints one JSON object.

    python bench/cast_copy.py [--out results/cast_copy_h200.json]     # one GPU, ~20 s
    python bench/cast_copy.py --smoke                                  # CPU, tiny shapes (checks the methods agree)

ZeRO-2/3 cast each group's bf16 gradients into the fp32 buffer they are reduce-scattered from
(parallel/flat.py). On a GPU, torch's copy between dtypes runs a kernel that casts each element
through a runtime dtype switch: 23.8 ms a step on the whole Llama-8B at dp=4, 5.7% of the compiled
step (bench/README.md, ZeRO-3 against FSDP2). The methods timed, each on the parameters of a
Llama-8B block (d 4096, d_ff 14336, 8 KV heads of 128) in their order:
- `copy`: one `copy_` per parameter into its view of the buffer;
- `foreach`: one `torch._foreach_copy_` over the views;
- `chunk_cat`: one `torch._chunk_cat` (FSDP2's copy-in kernel) into the buffer's front;
- `compiled`: the per-parameter copies under `torch.compile` (inductor writes one fused kernel).
Each reports its median time over 50 calls and the bytes moved per second (2 read + 4 written per
element), and its largest difference from `copy` (0: a cast from bf16 to fp32 is exact).

`wgrad` (GPU only: torch's `mm` with `out_dtype` has no CPU kernel): the block's weight-gradient GEMMs
at `--tokens` tokens, each dW = dY^T X, timed three ways: bf16 output alone (`bf16`), bf16 output then
one `_foreach_copy_` into the fp32 buffer (`bf16_then_cast`, what ZeRO-2/3 do now), and fp32 output
written straight into the buffer (`fp32_out`, cuBLAS accumulating in fp32 as always); with the
largest relative difference of `fp32_out` from the bf16-rounded result.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device, emit, env_info, smoke_compile, time_steps  # noqa: E402


def block_shapes(d: int, d_ff: int, kv: int) -> list[tuple[int, ...]]:
    return [(d,), (d, d), (kv, d), (kv, d), (d, d), (d,), (d_ff, d), (d_ff, d), (d, d_ff)]


def methods() -> dict:
    def copy(views, grads, flat, n):
        for v, g in zip(views, grads):
            v.copy_(g)

    def foreach(views, grads, flat, n):
        torch._foreach_copy_(views, grads)

    def chunk_cat(views, grads, flat, n):
        torch._chunk_cat(grads, 0, 1, out=flat[:n].view(1, n))

    return {"copy": copy, "foreach": foreach, "chunk_cat": chunk_cat, "compiled": torch.compile(copy)}


def timed(fn, dev, reps: int) -> float:
    """Median seconds of `reps` synchronized calls after 3 warm-up calls (common.time_steps; the
    session-11 files were timed with CUDA events around each call instead)."""
    return statistics.median(time_steps(fn, 3, reps, dev))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=4096, help="rows of X and dY for the wgrad timing (GPU)")
    args = ap.parse_args()
    if args.smoke:
        smoke_compile()
    dev = torch.device("cpu") if args.smoke else device()
    shapes = block_shapes(64, 224, 16) if args.smoke else block_shapes(4096, 14336, 1024)
    g = torch.Generator(device=dev).manual_seed(0)
    grads = [torch.randn(s, generator=g, device=dev).to(torch.bfloat16) for s in shapes]
    n = sum(t.numel() for t in grads)
    flat = torch.empty(n + 128, dtype=torch.float32, device=dev)  # padded, as a shard-divisible buffer
    offsets = [0]
    for t in grads:
        offsets.append(offsets[-1] + t.numel())
    views = [flat[o:o + t.numel()].view(t.shape) for o, t in zip(offsets, grads)]
    reference = torch.cat([t.float().flatten() for t in grads])
    rows = {}
    for name, fn in methods().items():
        flat.zero_()
        seconds = timed(lambda fn=fn: fn(views, grads, flat, n), dev, 3 if args.smoke else args.reps)
        rows[name] = {"ms": round(seconds * 1e3, 4), "gb_per_s": round(6 * n / seconds / 1e9, 1),
                      "max_abs_diff": float((flat[:n] - reference).abs().max())}
    out = {"bench": "cast_copy", **env_info(dev), "elements": n, "methods": rows}
    if dev.type == "cuda":
        out["wgrad"] = wgrad(grads, views, flat, args.tokens, dev, args.reps)
    emit(out, args.out)


def wgrad(grads, views, flat, tokens: int, dev, reps: int) -> dict:
    """The block's dW = dY^T X (weights only: 2-D gradients), three ways (module docstring)."""
    mats = [(v, g.shape) for v, g in zip(views, grads) if g.dim() == 2]
    gen = torch.Generator(device=dev).manual_seed(1)
    acts = [(torch.randn(tokens, o, generator=gen, device=dev, dtype=torch.bfloat16),
             torch.randn(tokens, i, generator=gen, device=dev, dtype=torch.bfloat16)) for _, (o, i) in mats]

    def bf16():
        return [torch.mm(dy.t(), x) for dy, x in acts]

    def bf16_then_cast():
        torch._foreach_copy_([v for v, _ in mats], bf16())

    def fp32_out():
        for (v, _), (dy, x) in zip(mats, acts):
            torch.mm(dy.t(), x, out_dtype=torch.float32, out=v)

    rows = {name: {"ms": round(timed(fn, dev, reps) * 1e3, 4)}
            for name, fn in (("bf16", bf16), ("bf16_then_cast", bf16_then_cast), ("fp32_out", fp32_out))}
    fp32_out()
    ref = bf16()
    rows["fp32_out"]["max_rel_diff_from_bf16"] = max(float((v - r.float()).abs().max() / r.float().abs().max())
                                                     for (v, _), r in zip(mats, ref))
    rows["flop_per_call"] = sum(2 * tokens * o * i for _, (o, i) in mats)
    return rows


if __name__ == "__main__":
    main()
