"""The verdicts of bench/layouts.py's rows and their markdown table: every tolerance fixed before any run, a
failing row failing with its reason."""

from __future__ import annotations

import math
import statistics

FP32_TOL, BF16_TOL = 1e-4, 2e-2  # fixed before any run
# one block's bytes kept for backward (tensor-parallel rows, `_block_bytes`) against the planner's count: within
# 1% (fixed before any GPU run; on gloo's CPU kernels they are equal, tests/dist/test_tensor_parallel.py)
BLOCK_BYTES_TOL = 1e-2
# MoE rows in bf16 (fixed before any run; the argument: bench/layouts.py's docstring): the mean loss over the last
# half of the bf16 steps (10 of 20) within 1% of one GPU's, both sides under train.deterministic
MOE_BF16_TOL = 1e-2


def max_rel(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two runs' losses, step by step."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b)) if a else math.nan


def tail(losses: list[float]) -> list[float]:
    """The last half of a run's steps (10 of 20): what an MoE row's bf16 check averages."""
    return losses[len(losses) // 2:] if len(losses) > 1 else losses


def tail_rel(a: list[float], b: list[float]) -> float:
    """Relative difference of the mean loss over the last half of the steps."""
    mb = statistics.mean(tail(b))
    return abs(statistics.mean(tail(a)) - mb) / abs(mb) if a else math.nan


def _bf16(row: dict) -> tuple[float, float, float | None, str]:
    """(the bf16 error a row is judged on, its tolerance, one GPU's own floor of it, its words): the mean of
    the last half of the steps for MoE rows, the worst step for the others."""
    if row.get("bf16_check") == "tail-mean":
        return row["bf16_tail_rel_err"], MOE_BF16_TOL, row.get("bf16_tail_noise_floor"), "bf16 mean of the last half"
    return row["bf16_rel_err"], BF16_TOL, row.get("bf16_noise_floor"), "bf16"


def parity_ok(row: dict) -> bool:
    """A parity row passes: fp32 within FP32_TOL (where it ran: FP8 rows have none) and bf16 within its
    tolerance of one GPU (`_bf16`)."""
    err, tol, _, _ = _bf16(row)
    return row.get("fp32_rel_err", 0.0) < FP32_TOL and err < tol


def parity_reason(row: dict) -> str | None:
    """Why a parity row fails (None where it passes): each check it misses, and one GPU's own bf16 floor."""
    why = []
    if row.get("fp32_rel_err", 0.0) >= FP32_TOL:
        why.append(f"fp32 {row['fp32_rel_err']:.1e} over {FP32_TOL:.0e}")
    err, tol, floor, words = _bf16(row)
    if err >= tol:
        why.append(f"{words} {err:.1e} over {tol:.0e}" + (f" (one GPU against itself: {floor:.1e})" if floor is not None
                                                          else ""))
    return "; ".join(why) or None


def table(rows: list[dict]) -> str:
    """The markdown table of bench/README.md."""
    out = ["| layout | GPUs | fp32 max rel. err | bf16 max rel. err (one GPU's floor) | tokens/s | x one GPU, eager | "
           "MFU | peak GiB | block KiB (planned) | ok |", "| " + " | ".join(["---"] * 10) + " |"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['name']} | {r['gpus']} | {r['error'][:80]} | | | | | | | no |")
            continue
        f32 = (f"{r['fp32_rel_err']:.1e}" if "fp32_rel_err" in r
               else "- (fp8: bf16 only)" if r.get("check") == "parity-bf16" else "own semantics")
        b16 = _bf16_cell(r) if "bf16_rel_err" in r else ("audit ok, loss fell" if r["ok"] else str(r["audit"]))
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        ok = parity_ok(r) if "bf16_rel_err" in r else r["ok"]
        verdict = "yes" if ok else "no" + (f": {parity_reason(r)}" if "bf16_rel_err" in r else "")
        speedup = f"{r['speedup_vs_one_gpu']:.2f}" if "speedup_vs_one_gpu" in r else "- (compiled)"
        block = (f"{r['block_bytes'] / 1024:,.0f} ({r['block_bytes_planned'] / 1024:,.0f})"
                 + ("" if r["block_bytes_ok"] else ": off by more than 1%")) if "block_bytes" in r else \
            f"not counted: {r['block_bytes_error'][:60]}" if "block_bytes_error" in r else "-"
        verdict += "" if r.get("block_bytes_ok", True) else "; block bytes: no"
        out.append(f"| {r['name']} | {r['gpus']} | {f32} | {b16} | {r['tokens_per_s']:,.0f} | "
                   f"{speedup} | {mfu} | {r['peak_gib']} | {block} | {verdict} |")
    return "\n".join(out)


def _bf16_cell(r: dict) -> str:
    """The bf16 column: the error the row is judged on, one GPU's own floor of it in brackets; for an MoE row
    the mean of the last half of the steps, then its worst step."""
    err, _, floor, _ = _bf16(r)
    cell = f"{err:.1e}" + (f" ({floor:.1e})" if floor is not None else " (not measured)")
    tail = r.get("bf16_check") == "tail-mean"
    return cell + (f" mean of last half; worst step {r['bf16_rel_err']:.1e}" if tail else "")
