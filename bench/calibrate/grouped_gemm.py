"""planner/hardware.py GPU.grouped_half_work: the experts' grouped GEMM rate by expert width, rows per
expert and expert count, against one dense GEMM of the same rows, and the constant fitted on it.

    python bench/calibrate/grouped_gemm.py --out FILE      # one GPU, under a minute
    python bench/calibrate/grouped_gemm.py --fit FILE [--card h200] [--write]   # the fit (CPU), into <card>.toml

One SwiGLU expert MLP per group, as models/grouped.py runs it uncompiled: h = silu(x W1_g^T) * (x W3_g^T),
y = h W2_g^T through torch's grouped GEMM in bf16, forward and backward (autograd), d_model 2048, G groups of R rows
each (G 8-128, at most 131,072 rows in all: a micro-batch of 16k tokens at top-8), for expert widths
256-4096 and R 128-4096. The dense row runs the same MLP on all G R rows with one weight (the rate the
planner prices a dense MLP at). Each call is captured in a CUDA graph and replayed: the GPU's time,
as a compiled step queues its kernels, not the host's launches (timed call by call, the small shapes
measure the host: 16 groups of 128 rows of width 768 at 90 TFLOP/s eager, against 519 TFLOP/s for 128
groups of the Qwen3-30B-A3B shape inside a compiled step). TFLOP/s count 6 FLOPs per weight and row
(forward 2, backward 4); the mean of 20 replays after 3 warm-up ones. `share`: grouped over dense
TFLOP/s.

The fit: the planner runs a compiled step's experts at its dense rate at this d_model (GPU.sustained_flops)
times w / (w + grouped_half_work), w = rows x width of one expert's GEMM; grouped_half_work is the value of
least squared log error over the rows of width >= 512 (narrower ones are not a width models use). Compiled, w1
and w3 run as one GEMM of twice the width (models/grouped.py fuses_gate_up): the planner prices it by this fit at
that width, not measured here.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, without installing

from teratrain import compat  # noqa: E402

D = 2048
GROUPS = (8, 16, 32, 64, 128)
WIDTHS = (256, 512, 768, 1024, 1408, 2048, 2816, 4096)
ROWS = (128, 256, 512, 1024, 2048, 4096)
MAX_ROWS = 131_072


def _mlp_ms(rows: int, width: int, groups: int, iters: int) -> float:
    """Mean GPU ms of one forward + backward of the expert MLP over `groups` groups of `rows` rows, from
    replays of its CUDA graph."""
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(groups * rows, D, device=dev, dtype=bf16, requires_grad=True)
    w1, w3 = (torch.randn(groups, width, D, device=dev, dtype=bf16, requires_grad=True) for _ in range(2))
    w2 = torch.randn(groups, D, width, device=dev, dtype=bf16, requires_grad=True)
    offs = torch.arange(1, groups + 1, device=dev, dtype=torch.int32) * rows
    grad = torch.randn(groups * rows, D, device=dev, dtype=bf16)

    def gmm(a, w):
        if groups == 1:
            return a @ w[0].t()
        return compat.grouped_mm(a, w.transpose(-2, -1), offs=offs)

    def call():
        gmm(F.silu(gmm(x, w1)) * gmm(x, w3), w2).backward(grad)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    for t in (x, w1, w3, w2):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    del graph
    return ms


def fit(result: dict, card: str) -> tuple[float, float]:
    """(grouped_half_work, rms log error) of a measurement against `card`'s dense rate at its d_model."""
    from teratrain.planner.hardware import GPUS

    dense = GPUS[card].sustained_flops("bf16", result["d_model"]) / 1e12
    rows = [(r["rows_per_group"] * r["width"], r["grouped_tflops"] / dense) for r in result["rows"] if r["width"] >= 512]

    def err(half: float) -> float:
        return statistics.fmean((math.log(share) - math.log(w / (w + half))) ** 2 for w, share in rows)

    half = min(range(10_000, 4_000_001, 10_000), key=err)
    return half, math.sqrt(err(half))


def write(card: str, half: float, rms: float, source: str) -> None:
    from teratrain.planner.refit import write_calibration

    write_calibration(card, {"grouped_half_work": {
        "value": half, "source": "bench/calibrate/grouped_gemm.py --write", "runs": [source],
        "fit_error": f"rate, the rows of width >= 512: {rms:.0%} rms (log)"}})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out")
    p.add_argument("--fit", metavar="RESULT", help="fit grouped_half_work on a result of this script instead")
    p.add_argument("--card", default="h200", help="the card the result was measured on")
    p.add_argument("--write", action="store_true", help="with --fit: write it into planner/calibration/<card>.toml")
    a = p.parse_args()
    if a.fit:
        half, rms = fit(json.loads(Path(a.fit).read_text()), a.card)
        print(json.dumps({"grouped_half_work": half, "rms_log_error": round(rms, 4)}))
        if a.write:
            write(a.card, half, rms, a.fit)
        return
    rows_out, dense_ms = [], {}
    for groups in GROUPS:
        for width in WIDTHS:
            for rows in (r for r in ROWS if groups * r <= MAX_ROWS):
                flops = 6 * 3 * groups * rows * D * width
                grouped = _mlp_ms(rows, width, groups, a.iters)
                if (rows * groups, width) not in dense_ms:
                    dense_ms[rows * groups, width] = _mlp_ms(rows * groups, width, 1, a.iters)
                dense = dense_ms[rows * groups, width]
                row = {"groups": groups, "width": width, "rows_per_group": rows,
                       "grouped_tflops": round(flops / grouped / 1e9, 1), "dense_tflops": round(flops / dense / 1e9, 1),
                       "share": round(dense / grouped, 3)}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    out = {"bench": "grouped_gemm", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "d_model": D, "timing": "CUDA graph replays", "rows": rows_out}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
