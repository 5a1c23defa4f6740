"""What ZB-H1's split backward (I, then W) costs beyond 1F1B's whole backward B, counted on CPU for
one middle pipeline stage of Llama blocks (issue 22 item 3: W no more than B's weight half).

    python bench/pipeline_split.py            # d 256, 4 blocks, bf16 autocast over fp32; ~1 min
    python bench/pipeline_split.py --smoke    # tiny: checks the script (seconds)

One JSON object:
- `account`: per pass (B; I; W; I + W) on the stage, over the aten ops it dispatches: FLOPs (torch's
  formulas, flop_counter), ops (every aten op), kernels (ops that launch one on a GPU: all but
  views, detach and other aliases), bytes made by copies (copy_, _to_copy, clone, cat, contiguous),
  autograd engine calls (W's start at weight-side edges: each walks a transpose, a cast and an
  AccumulateGrad, not the activations' graph); `kernels_by_op` where I + W and B differ;
- `host_ms`: the stage at a width where compute is negligible (d 32, 8 tokens), so the CPU time of a
  pass is what the host spends issuing it: per m in 4, 8, 16 the median ms of B, I and W over m
  micro-batches run as ZB-H1's last stage holds them at worst (m forwards, m I's, then m W's: every W
  pending while the I's run), and the first and last W's (does a W cost more with more pending?).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import emit  # noqa: E402
from teratrain.parallel.pipeline import backward as split  # noqa: E402
from teratrain.parallel.pipeline.saved import SplitSaved  # noqa: E402
from teratrain.parallel.pipeline.stage import Chunk  # noqa: E402

COPIES = {"copy_", "_to_copy", "clone", "cat", "contiguous"}
CPU_SDPA = {"_scaled_dot_product_flash_attention_for_cpu": sdpa_flop_count,
            "_scaled_dot_product_flash_attention_for_cpu_backward": sdpa_backward_flop_count}


class Account(TorchDispatchMode):
    """Per aten op run under it: count by name, FLOPs, and the bytes copies make; `engine_calls`,
    the autograd engine runs (set by `engine_calls`)."""

    def __init__(self):
        super().__init__()
        self.ops, self.kernels = collections.Counter(), collections.Counter()
        self.flops = self.copy_bytes = self.engine_calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        self.ops[name] += 1
        if not func.is_view and name not in ("detach", "alias", "lift_fresh"):
            self.kernels[name] += 1
        if name in CPU_SDPA:
            self.flops += CPU_SDPA[name](*(a.shape for a in args[:4 if "backward" in name else 3]))
        elif func._overloadpacket in flop_registry:
            self.flops += flop_registry[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
        if name in COPIES:
            outs = out if isinstance(out, (list, tuple)) else [out]
            self.copy_bytes += sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
        return out

    def summary(self) -> dict:
        return {"flops": self.flops, "ops": sum(self.ops.values()), "kernels": sum(self.kernels.values()),
                "copy_bytes": self.copy_bytes, "engine_calls": self.engine_calls}


def counted(fn) -> Account:
    """fn() under an Account, counting the autograd engine's runs too."""
    acc, run = Account(), torch.autograd.graph._engine_run_backward

    def counting(*args, **kwargs):
        acc.engine_calls += 1
        return run(*args, **kwargs)

    torch.autograd._engine_run_backward = torch.autograd.graph._engine_run_backward = counting
    try:
        with acc:
            fn()
    finally:
        torch.autograd._engine_run_backward = torch.autograd.graph._engine_run_backward = run
    return acc


class Stage:
    """A middle stage of `blocks` Llama blocks (llama-1b's ratios: d_ff 4 d, 4 query heads per KV
    head), micro-batch 2, bf16 autocast over fp32 weights, as bench/pipeline.py runs them."""

    def __init__(self, d: int, blocks: int, tokens: int):
        from tests.helpers import small_model

        model = small_model(dtype=torch.float32, n_layers=blocks, d_model=d, n_heads=8, n_kv_heads=2, d_ff=4 * d,
                            seq_len=max(tokens, 16), vocab_size=64)
        self.chunk, self.d, self.tokens = Chunk(model, stage=1, num_stages=3, blocks=range(blocks)), d, tokens
        self.weights = self.chunk.weights()
        self.g = torch.Generator().manual_seed(0)

    def forward(self, saved: SplitSaved | None):
        """A micro-batch's forward (recorded for the split with `saved`)."""
        for w in self.weights:  # gradients already there, as for every micro-batch after a step's first
            w.grad = torch.zeros_like(w)
        x = torch.randn(2, self.tokens, self.d, generator=self.g).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16), saved.recording() if saved else contextlib.nullcontext():
            out = self.chunk.forward(x, None, self.tokens, segment=saved.segment if saved else None)
        return x, out, torch.randn(out.shape, generator=self.g, dtype=out.dtype)


def account(stage: Stage) -> dict:
    x, out, g = stage.forward(None)
    b = counted(lambda: torch.autograd.backward(out, g))
    saved = SplitSaved({})
    x, out, g = stage.forward(saved)
    plan = []
    i = counted(lambda: plan.append(split.backward_input(out, g, x, stage.weights, saved)))
    w = counted(lambda: split.backward_weight(plan[0]))
    both = {k: i.summary()[k] + w.summary()[k] for k in i.summary()}
    names = set(b.kernels) | set(i.kernels) | set(w.kernels)
    diff = {n: {"B": b.kernels[n], "I": i.kernels[n], "W": w.kernels[n]} for n in sorted(names)
            if b.kernels[n] != i.kernels[n] + w.kernels[n]}
    return {"B": b.summary(), "I": i.summary(), "W": w.summary(), "I+W": both,
            "I+W_over_B": {k: round(both[k] / b.summary()[k], 3) if b.summary()[k] else None for k in both},
            "kernels_by_op": diff}


def host_ms(stage: Stage, m: int, repeats: int) -> dict:
    """Median ms per B, I and W over m micro-batches (`repeats` times), ZB-H1's worst order for W."""
    times = collections.defaultdict(list)
    for _ in range(repeats):
        pending = [stage.forward(None) for _ in range(m)]
        for x, out, g in pending:
            t = time.perf_counter()
            torch.autograd.backward(out, g)
            times["B"].append(time.perf_counter() - t)
        saves = [SplitSaved({}) for _ in range(m)]
        casts: dict = {}
        for s in saves:
            s.casts = casts  # one step's weight casts, shared as the executor shares them
        pending = [(s, *stage.forward(s)) for s in saves]
        plans = []
        for s, x, out, g in pending:
            t = time.perf_counter()
            plans.append(split.backward_input(out, g, x, stage.weights, s))
            times["I"].append(time.perf_counter() - t)
        for k, plan in enumerate(plans):
            t = time.perf_counter()
            split.backward_weight(plan)
            times["W" if 0 < k < m - 1 else ("W_first" if k == 0 else "W_last")].append(time.perf_counter() - t)
    return {k: round(statistics.median(v) * 1e3, 3) for k, v in sorted(times.items())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    width, tokens = (32, 8) if args.smoke else (256, 128)
    result = {"bench": "pipeline_split", "torch": torch.__version__, "blocks": args.blocks,
              "account": {"d": width, "tokens": 2 * tokens, **account(Stage(width, args.blocks, tokens))}}
    host = Stage(32, args.blocks, 8)
    for _ in range(2):  # warm up
        host_ms(host, 2, 1)
    ms, repeats = ([4], 1) if args.smoke else ([4, 8, 16], 5)
    result["host_ms"] = {f"m={m}": host_ms(host, m, repeats) for m in ms}
    for row in result["host_ms"].values():
        row["I+W_over_B"] = round((row["I"] + row.get("W", row["W_last"])) / row["B"], 3)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(result, args.out)


if __name__ == "__main__":
    main()
