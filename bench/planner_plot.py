"""Predicted against measured, one picture: each layout of a `planner_validate.py --gpus N` result,
re-predicted by today's planner with the hardware terms that run measured, as a point (peak memory
left, step time right) against the diagonal and the planner's aims (5% memory, 15% time). Held-out
rows are hollow; a point outside its band is labelled.

    python bench/planner_plot.py tests/fixtures/planner_runs/h200x4_2026-11-27_1.json --out docs/planner_validation.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from teratrain.planner.refit import _prepared, result_gpu  # noqa: E402
from teratrain.planner.search import evaluate  # noqa: E402

BANDS = {"peak": 0.05, "step": 0.15}


def points(result: dict) -> list[dict]:
    """Per measured row: name, held out, measured and predicted peak (GiB) and step (ms)."""
    gpu = result_gpu(result)
    out = []
    for shape, train, lay, row in _prepared(result):
        cand = evaluate(shape, train, lay, gpu)
        out.append({"name": row["name"], "held_out": bool(row.get("held_out")),
                    "peak": (row["measured_peak_gib"], cand.memory.peak_allocated / 2**30),
                    "step": (row["measured_step_s"] * 1e3, cand.time.step_time_s * 1e3)})
    return out


def plot(result: dict, out: Path) -> dict:
    """Write the picture; returns how many rows lie within each band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = points(result)
    if not rows:
        raise SystemExit("bench/planner_plot.py: the result has no measured rows; pass a planner_validate.py --gpus N "
                         "result whose layouts ran.")
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    within = {}
    for ax, (what, unit) in zip(axes, (("peak", "GiB"), ("step", "ms"))):
        band = BANDS[what]
        xs = [r[what][0] for r in rows]
        top = max(max(xs), max(r[what][1] for r in rows)) * 1.1
        line = [0, top]
        ax.plot(line, line, color="0.3", lw=1)
        ax.fill_between(line, [v * (1 - band) for v in line], [v * (1 + band) for v in line], color="0.9",
                        label=f"within {band:.0%}")
        within[what] = 0
        for r in rows:
            meas, pred = r[what]
            ok = abs(pred / meas - 1) <= band
            within[what] += ok
            ax.scatter([meas], [pred], s=30, facecolors="none" if r["held_out"] else "C0",
                       edgecolors="C0" if ok else "C3")
            if not ok:
                ax.annotate(f"{r['name']} ({pred / meas - 1:+.0%})", (meas, pred), fontsize=7,
                            xytext=(4, -10), textcoords="offset points", color="C3")
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.set_xlabel(f"measured {what} ({unit})")
        ax.set_ylabel(f"planned {what} ({unit})")
        ax.set_title(f"{what}: {within[what]} of {len(rows)} within {band:.0%}")
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"teratrain plan against {result.get('device', '?')} x {result.get('gpus', '?')} "
                 f"(torch {result.get('torch', '?')}); filled: fit rows, hollow: held out", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return {"rows": len(rows), **{f"{k}_within": v for k, v in within.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", help="a bench/planner_validate.py --gpus N result (JSON)")
    ap.add_argument("--out", default="planner_validation.png")
    args = ap.parse_args()
    try:
        result = json.loads(Path(args.result).read_text())
    except (OSError, ValueError) as e:
        sys.exit(f"bench/planner_plot.py: {args.result} cannot be read as JSON ({e}); pass a planner_validate result.")
    if "rows" not in result:
        sys.exit(f"bench/planner_plot.py: {args.result} has no measured rows; pass a planner_validate.py --gpus N result.")
    print(json.dumps({"out": args.out, **plot(result, Path(args.out))}))


if __name__ == "__main__":
    main()
