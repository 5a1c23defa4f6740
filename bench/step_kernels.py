"""Three bandwidth-bound pieces of the training step, each against its alternatives on one GPU.

`adamw`: one AdamW step over fp32 parameters shaped as llama-1b's (1.10 B, 147 tensors), as the
Qwen3-30B-A3B-shaped MoE's of bench/moe.py (5.14 B, 128-expert stacks) and as gpt2-350m's (355 M in 388 tensors,
most of them biases and norms: where launches a tensor would pace the step): torch's fused AdamW (with the
clip's gradient scale, as optim/engine.py runs it), torch.compile over torch's foreach AdamW (tensor lr,
capturable; `--no-compiled-adamw` leaves it out), and teratrain's kernel (optim/adamw_kernel.py), also at each
tile (BLOCK 1024-4096, CHUNK 1-64 BLOCKs, 4 or 8 warps; `chunks`: the 8 fastest, and the kernel's). `ideal_ms` =
28 bytes a parameter at the card's datasheet bandwidth (--hbm-gbps).

`moe_gather`: the compiled MoE layer's two row gathers summed over each token's k choices (models/
permute.py): dispatch's backward and the weighted combine, as a gather of all N x k rows reduced over k
and as k gathers added elementwise (`_by_choice`), each compiled on its own, at Qwen3-30B-A3B's routing
(N 8,192 tokens, 128 experts, top-8) and an 8-expert top-2 layer, d 2,048, bf16.

`swiglu`: the compiled MoE experts' SwiGLU over their joined gate and up GEMM output (rows, 2 f), forward and
backward, at both routings' rows (bf16): inductor's fusion of silu(y1) * y3 (its backward concatenates the
halves' gradients) against teratrain's Triton op (models/swiglu_kernel.py), each compiled on its own, as the
device time of one call (bench/pipeline_profile.py: the host's autograd call takes as long); and the op's two
kernels alone at tiles of 1-32 rows, 64-1024 columns and 2-8 warps (`tiles`: the 8 fastest, and the one `config`
picks).
`ideal_ms` = 3 + 5 passes over (rows, f) bf16 at --hbm-gbps.

    python bench/step_kernels.py --out FILE       # --smoke: tiny shapes on the CPU (the compiled foreach only)

Times are the mean of --iters calls after 3 warm-up calls, CUDA events (swiglu's forms: one profiled call).
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F
# common puts the checkout on sys.path
from common import emit, env_info
from pipeline_profile import profile_step

from teratrain.models import permute, swiglu_kernel  # noqa: E402
from teratrain.optim import adamw_kernel  # noqa: E402


def timed(fn, dev: torch.device, iters: int) -> float:
    for _ in range(3):
        fn()
    if dev.type != "cuda":
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def shapes(kind: str, smoke: bool) -> list[tuple[int, ...]]:
    if smoke:
        return [(64, 32)] * 6 + [(100,)] * 4
    out = []
    if kind == "qwen3-30b-a3b":  # 8 blocks: 3 expert stacks, attention, the router, 4 norms; embedding and head
        for _ in range(8):
            out += [(128, 768, 2048)] * 3 + [(4096, 2048), (512, 2048), (512, 2048), (2048, 4096), (128, 2048)]
            out += [(2048,), (2048,), (128,), (128,)]
        return out + [(151936 // 4, 2048), (151936 // 4, 2048), (2048,)]
    if kind == "gpt2-350m":  # the model's own tensors, as the planner lists them (norms and linears with biases)
        from teratrain.config import load_config
        from teratrain.planner.inputs import shape_of

        return [s for _, s in shape_of(load_config(None, ["model.preset=gpt2-350m"])).param_shapes()]
    for _ in range(16):  # llama-1b: 16 blocks, embedding and head untied
        out += [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)]
        out += [(2048,), (2048,)]
    return out + [(32000, 2048), (32000, 2048), (2048,)]


def adamw(dev: torch.device, smoke: bool, iters: int, hbm_gbps: float, compiled_too: bool = True) -> dict:
    out = {}
    for kind in ("llama-1b", "qwen3-30b-a3b", "gpt2-350m"):
        params = [torch.randn(s, device=dev) * 0.02 for s in shapes(kind, smoke)]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        count = sum(p.numel() for p in params)
        row = {"params": count, "tensors": len(params), "ideal_ms": round(count * 28 / hbm_gbps / 1e6, 3)}
        scale = torch.ones((), device=dev)
        impls = {"torch_fused": torch.optim.AdamW, "teratrain": adamw_kernel.AdamW} if dev.type == "cuda" else {}
        for name, cls in impls.items():
            if name == "teratrain" and not adamw_kernel.available():
                continue
            opt = cls(params, lr=1e-4, weight_decay=0.1, fused=True)

            def step(opt=opt, scale=scale):
                opt.grad_scale = scale
                opt.step()
            row[f"{name}_ms"] = round(timed(step, dev, iters), 3)
            if name == "teratrain":
                row["chunks"] = adamw_chunks(opt, scale, dev, iters)
            del opt, step  # the step's default holds the optimizer: its state freed before the next shape's
        if compiled_too:
            opt = torch.optim.AdamW(params, lr=torch.tensor(1e-4, device=dev) if dev.type == "cuda" else 1e-4,
                                    weight_decay=0.1, foreach=True, capturable=dev.type == "cuda")
            compiled = torch.compile(opt.step)
            t = time.perf_counter()
            compiled()
            row["compiled_foreach_first_call_s"] = round(time.perf_counter() - t, 1)
            row["compiled_foreach_ms"] = round(timed(compiled, dev, iters), 3)
            del opt, compiled
        del params
        if "teratrain_ms" in row:
            row["teratrain_speedup_over_torch_fused"] = round(row["torch_fused_ms"] / row["teratrain_ms"], 3)
            row["teratrain_bandwidth_share"] = round(row["ideal_ms"] / row["teratrain_ms"], 3)
        out[kind] = row
        print(kind, row, flush=True)
    return out


def adamw_chunks(opt, scale: torch.Tensor, dev: torch.device, iters: int) -> list[dict]:
    """teratrain's kernel at each tile (BLOCK, CHUNK, warps): the 8 fastest and the one the kernel takes."""
    rows = adamw_kernel._rows(opt, opt.param_groups[0])
    tiles, picked = [], [adamw_kernel.BLOCK, adamw_kernel.CHUNK, adamw_kernel.WARPS]
    for block, mult, warps in itertools.product((1024, 2048, 4096), (1, 2, 4, 8, 16, 64), (4, 8)):
        tables, tile = adamw_kernel._Tables(), (block, block * mult, warps)

        def step(tables=tables, tile=tile):
            adamw_kernel.launch(tables, rows, scale, 1e-4, 0.1, 0.9, 0.999, 1e-8, tile)
        tiles.append({"tile": list(tile), "ms": round(timed(step, dev, iters), 3)})
    tiles.sort(key=lambda t: t["ms"])
    return tiles[:8] + [t for t in tiles[8:] if t["tile"] == picked]


def reduced(y, dest, sent, k, w):
    """The gather of all N x k rows reduced over k (permute's eager form)."""
    g = y.index_select(0, dest).masked_fill(~sent.unsqueeze(1), 0)
    if w is None:
        return g.view(-1, k, g.shape[1]).sum(1, dtype=torch.float32)
    return (g.view(w.shape[0], k, -1) * w.unsqueeze(-1)).sum(1)


def by_choice(y, dest, sent, k, w):
    return permute._by_choice(y, dest, sent, k, w, torch.float32 if w is None else y.dtype)


def moe_gather(dev: torch.device, smoke: bool, iters: int) -> dict:
    out = {}
    for name, n, k, e in (("qwen3-30b-a3b", 8192, 8, 128), ("8 experts top-2", 8192, 2, 8)):
        n, d = (256, 64) if smoke else (n, 2048)
        key = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(n)]).flatten()
        key[::7] = e  # some choices not sent (dropped for capacity): zero rows
        lay = permute.grouped_layout(key, e, 8)
        y = torch.randn(lay.rows, d, device=dev, dtype=torch.bfloat16)
        w = torch.rand(n, k, device=dev, dtype=torch.bfloat16)
        row = {"tokens": n, "k": k, "experts": e, "d": d}
        for part, weights in (("dispatch_backward", None), ("combine", w)):
            ref = reduced(y, lay.dest, lay.sent, k, weights).float()
            for form, fn in (("reduced", reduced), ("by_choice", by_choice)):
                c = torch.compile(fn)
                got = c(y, lay.dest, lay.sent, k, weights).float()
                row[f"{part}_{form}_rel_diff"] = float((got - ref).norm() / ref.norm())
                call = lambda c=c, y=y, lay=lay, k=k, weights=weights: c(y, lay.dest, lay.sent, k, weights)
                row[f"{part}_{form}_ms"] = round(timed(call, dev, iters), 4)
        out[name] = row
        print(name, row, flush=True)
    return out


def inductor_form(y):
    y1, y3 = y.chunk(2, -1)
    return F.silu(y1) * y3


def swiglu(dev: torch.device, smoke: bool, iters: int, hbm_gbps: float) -> dict:
    out = {}
    for name, rows, f in (("qwen3-30b-a3b", 8192 * 8 + 128 * 16, 768), ("8 experts top-2", 8192 * 2 + 8 * 16, 2816)):
        rows, f = (64, 96) if smoke else (rows, f)
        y = torch.randn(rows, 2 * f, device=dev, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(rows, f, device=dev, dtype=torch.bfloat16)
        row = {"rows": rows, "f": f, "ideal_ms": round(rows * f * 2 * 8 / hbm_gbps / 1e6, 4)}
        ref = torch.autograd.grad(inductor_form(y.double()), y, g.double())[0]
        for form, fn in (("inductor", inductor_form), ("kernel", swiglu_kernel.swiglu_joined)):
            torch._dynamo.reset()
            c = torch.compile(fn)
            call = lambda c=c, y=y, g=g: torch.autograd.grad(c(y), y, g)  # noqa: E731
            row[f"{form}_rel_diff"] = float((call()[0].double() - ref).norm() / ref.norm())
            busy = profile_step(call, dev)["compute_s"] * 1e3 if dev.type == "cuda" else timed(call, dev, iters)
            row[f"{form}_ms"] = round(busy, 4)
        if swiglu_kernel.available(dev):
            h, dy, yd = torch.empty_like(g), torch.empty_like(y), y.detach()
            tiles = []
            for cfg in itertools.product((1, 2, 4, 8, 16, 32), (64, 128, 256, 512, 1024), (2, 4, 8)):
                if 256 <= cfg[0] * cfg[1] <= 16384:
                    def both(cfg=cfg):
                        swiglu_kernel.launch(swiglu_kernel._forward, rows, f, yd, h, cfg=cfg)
                        swiglu_kernel.launch(swiglu_kernel._backward, rows, f, yd, g, dy, cfg=cfg)
                    tiles.append({"tile": list(cfg), "ms": round(timed(both, dev, iters), 4)})
            tiles.sort(key=lambda t: t["ms"])
            picked = list(swiglu_kernel.config(f))
            row["tiles"] = tiles[:8] + [t for t in tiles[8:] if t["tile"] == picked]
            row["tile_picked"] = picked
        out[name] = row
        print(name, {k: v for k, v in row.items() if k != "tiles"}, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="adamw,moe_gather,swiglu")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--hbm-gbps", type=float, default=4800, help="datasheet bandwidth for ideal_ms (H200: 4800)")
    ap.add_argument("--no-compiled-adamw", action="store_true", help="adamw: leave torch.compile's form out")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    result = {"bench": "step_kernels", **env_info(dev)}
    only = args.only.split(",")
    if "adamw" in only:
        result["adamw"] = adamw(dev, args.smoke, args.iters, args.hbm_gbps, not args.no_compiled_adamw)
    if "moe_gather" in only:
        result["moe_gather"] = moe_gather(dev, args.smoke, args.iters)
    if "swiglu" in only:
        result["swiglu"] = swiglu(dev, args.smoke, args.iters, args.hbm_gbps)
    emit(result, args.out)


if __name__ == "__main__":
    main()
