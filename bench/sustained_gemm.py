"""The bf16 GEMM rate a card sustains, against the rate of a short burst: each shape multiplied back to back
for `--seconds`, after a pause that lets the card cool, its TFLOP/s over the first window and over each window
of the second half, with the SM clock and board power sampled meanwhile (bench/common.py GpuClocks). A card held
at its power limit lowers its clock: a kernel timed alone in a burst runs faster than the same kernel does
inside a long training step.

    python bench/sustained_gemm.py --out FILE            # the block GEMMs of llama-1b's and llama-8b's widths
    python bench/sustained_gemm.py --smoke               # tiny shapes on CPU: checks the script
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import GpuClocks, device, emit, env_info, sync

# (name, tokens, in, out): x (tokens, in) @ w (in, out), as the block's forward multiplies
SHAPES = [("llama-1b w1", 16384, 2048, 8192), ("llama-1b w2", 16384, 8192, 2048), ("llama-1b wq", 16384, 2048, 2048),
          ("llama-8b w1", 8192, 4096, 14336)]
SMOKE = [("tiny", 64, 32, 48)]


def calls_per_window(a: torch.Tensor, b: torch.Tensor, window_s: float, dev) -> int:
    """How many back-to-back a @ b take about `window_s` (timed over 3)."""
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(3):
        a @ b
    sync(dev)
    return max(1, int(window_s / max((time.perf_counter() - t0) / 3, 1e-9)))


def windows(a: torch.Tensor, b: torch.Tensor, seconds: float, calls: int, dev) -> list[float]:
    """TFLOP/s of each window of `calls` back-to-back a @ b, for about `seconds` in all (one window at least)."""
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    rates, start = [], time.perf_counter()
    while not rates or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        for _ in range(calls):
            a @ b
        sync(dev)
        rates.append(calls * flops / (time.perf_counter() - t0) / 1e12)
    return rates


def measure(name: str, m: int, k: int, n: int, seconds: float, pause: float, dev) -> dict:
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a, b = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype)
    calls = calls_per_window(a, b, 0.1, dev)  # and cuBLAS's choice and its workspace, before the pause
    time.sleep(pause)
    burst = windows(a, b, 0.0, calls, dev)[0]  # the first window after the pause
    first = windows(a, b, seconds / 2, calls, dev)
    with GpuClocks(dev.index or 0, enabled=dev.type == "cuda") as clocks:
        last = windows(a, b, seconds / 2, calls, dev)
    sustained = statistics.median(last)
    return {"shape": name, "m": m, "k": k, "n": n, "burst_tflops": _sig(burst),
            "first_half_median_tflops": _sig(statistics.median(first)),
            "sustained_tflops": _sig(sustained), "sustained_over_burst": round(sustained / burst, 3),
            "second_half_clocks": clocks.summary()}


def _sig(x: float) -> float:
    """Four significant digits: a GPU's hundreds of TFLOP/s to a tenth, a tiny CPU shape's rate still above 0."""
    return float(f"{x:.4g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=12.0, help="back-to-back multiplies per shape")
    ap.add_argument("--pause", type=float, default=5.0, help="idle seconds before each shape's burst")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = device()
    seconds, pause = (0.4, 0.0) if args.smoke else (args.seconds, args.pause)
    rows = [measure(*shape, seconds, pause, dev) for shape in (SMOKE if args.smoke else SHAPES)]
    emit({"bench": "sustained_gemm", **env_info(dev), "seconds": seconds, "pause_s": pause, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
