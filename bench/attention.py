"""Which `scaled_dot_product_attention` kernel trains fastest at the shapes teratrain runs: forward +
backward of causal attention in bf16, each backend torch has forced in turn (flash, cuDNN, memory-
efficient), grouped-query heads passed as `enable_gqa=True` (what models/layers.py calls) and as key/value
heads repeated to the query heads; and the backend torch picks by itself.

    python bench/attention.py --out FILE             # the default shapes
    python bench/attention.py --shape 8,32,8,2048,64 # batch, heads, kv heads, sequence, head dim

TFLOP/s count causal attention's matmuls: forward 2·B·H·T²·D (QK^T and PV, half the square), backward
2.5x that (five matmuls of the two's size). A backend that refuses a shape (no kernel for it) is reported
with torch's reason. Median of `--iters` timed calls after 3 warm-up calls.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {  # name: (batch, heads, kv heads, sequence, head dim)
    "llama-1b mb8": (8, 32, 8, 2048, 64),
    "llama-8b width mb1": (1, 32, 8, 4096, 128),
    "qwen3-30b-a3b attention mb4": (4, 32, 4, 4096, 128),
}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _inputs(b: int, h: int, kv: int, t: int, d: int) -> tuple[torch.Tensor, ...]:
    q = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, kv, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    return q, k, v


def _call(q, k, v, repeat: bool) -> torch.Tensor:
    if repeat and k.shape[1] != q.shape[1]:  # key/value heads repeated to the query heads: plain attention
        r = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def time_ms(shape: tuple[int, ...], backend: str | None, repeat: bool, iters: int) -> dict:
    """Median forward + backward milliseconds of one configuration, or the reason it cannot run."""
    q, k, v = _inputs(*shape)
    grad = torch.randn_like(q)
    ctx = sdpa_kernel([BACKENDS[backend]]) if backend else contextlib.nullcontext()
    times = []
    try:
        with ctx, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(iters + 3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                _call(q, k, v, repeat).backward(grad)
                end.record()
                torch.cuda.synchronize()
                if i >= 3:
                    times.append(start.elapsed_time(end))
    except RuntimeError as e:
        return {"error": str(e).splitlines()[0][:200]}
    b, h, _, t, d = shape
    ms = statistics.median(times)
    return {"ms": round(ms, 4), "tflops": round(3.5 * 2 * b * h * t * t * d / ms / 1e9, 1)}


def picked(shape: tuple[int, ...], repeat: bool) -> str:
    """The backend torch picks for this call on its own."""
    q, k, v = _inputs(*shape)
    if repeat:
        r = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    choice = torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return next((name for name, b in SDPBackend.__members__.items() if int(b) == choice), str(choice))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", default=[], help="batch,heads,kv_heads,seq,head_dim (repeatable)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args()
    shapes = {s: tuple(int(x) for x in s.split(",")) for s in a.shape} or SHAPES
    rows = []
    for name, shape in shapes.items():
        for repeat in (False, True):
            row = {"shape": name, "b_h_kv_t_d": list(shape), "gqa": "repeated" if repeat else "enable_gqa",
                   "torch_picks": picked(shape, repeat), "default": time_ms(shape, None, repeat, a.iters)}
            row.update({b: time_ms(shape, b, repeat, a.iters) for b in BACKENDS})
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"bench": "attention", "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
