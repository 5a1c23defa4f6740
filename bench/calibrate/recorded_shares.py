"""planner/calibration/h200.toml `op_overhead_s` and common.toml `dp_launch_share`, fitted on the fit rows
of the recorded runs (tests/fixtures/planner_runs/manifest.toml, split = "fit"), never on held-out rows.

    python bench/calibrate/recorded_shares.py                       # the grid and its errors (~10 min, CPU)
    python bench/calibrate/recorded_shares.py --write               # and the best point into the files

- op_overhead_s (the H200's GPU cost per eager op): least squared relative step error over the H200 runs'
  fit rows that the GPU paces (a host-paced row's step does not see the GPU's per-op cost).
- dp_launch_share (a data-parallel engine launch's host cost, as a share of a tensor-parallel
  collective's, where the run's host probe did not measure it): least squared relative step error over
  every run's fit rows (the host's terms show in the host-paced rows).
The held-out rows are scored at each grid point (rows within 15%) and never enter the choice.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from teratrain.planner import time as planner_time  # noqa: E402
from teratrain.planner.refit import _prepared, result_gpu  # noqa: E402
from teratrain.planner.search import evaluate  # noqa: E402

MANIFEST = ROOT / "tests" / "fixtures" / "planner_runs" / "manifest.toml"


def rows_at(runs: dict, op_s: float, share: float) -> list[dict]:
    """Every measured row of the fit runs, planned with the H200's per-op cost `op_s` and launch share `share`."""
    planner_time.DP_LAUNCH_SHARE = share
    out = []
    for stem, entry in runs.items():
        result = json.loads((ROOT / entry["file"]).read_text())
        gpu = result_gpu(result)
        h200 = "H200" in result["device"]
        gpu = replace(gpu, op_overhead_s=op_s) if h200 and "op_overhead_s" not in result.get("hw", {}) else gpu
        for shape, train, lay, row in _prepared(result):
            if row["name"] in entry.get("skip_step", []):
                continue
            cand = evaluate(shape, train, lay, gpu)
            out.append({"key": (stem, row["name"]), "held_out": bool(row.get("held_out")), "h200": h200,
                        "host_paced": cand.time.host_paced, "err": cand.time.step_time_s / row["measured_step_s"] - 1})
    return out


def score(rows: list[dict], gpu_paced: set) -> dict:
    """op_loss over the H200 fit rows in `gpu_paced` (the GPU paces them at every grid point: a fixed set),
    share_loss over every fit row, and the rows within 15% ([within, of]) fit and held out apart."""
    fit = [r for r in rows if not r["held_out"]]
    within = lambda group: sum(abs(r["err"]) <= 0.15 for r in group)  # noqa: E731
    held = [r for r in rows if r["held_out"]]
    return {"op_loss": sum(r["err"] ** 2 for r in fit if r["h200"] and r["key"] in gpu_paced),
            "share_loss": sum(r["err"] ** 2 for r in fit),
            "fit_within": [within(fit), len(fit)], "held_within": [within(held), len(held)]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op-us", type=float, nargs="+", default=[4.725, 5.0625, 5.4, 5.7375, 6.075, 6.75],
                    help="H200 us per op")
    ap.add_argument("--shares", type=float, nargs="+", default=[0.5, 0.7], help="dp_launch_share values")
    ap.add_argument("--write", action="store_true", help="write the best point into planner/calibration/")
    args = ap.parse_args(argv)
    runs = {k: e for k, e in tomllib.loads(MANIFEST.read_text())["runs"].items() if e["split"] == "fit"}
    planned = {(o, sh): rows_at(runs, o * 1e-6, sh) for o, sh in itertools.product(args.op_us, args.shares)}
    gpu_paced = set.intersection(*({r["key"] for r in rows if not r["host_paced"]} for rows in planned.values()))
    grid = {point: score(rows, gpu_paced) for point, rows in planned.items()}
    for (op_us, share), s in grid.items():
        print(f"op {op_us:6.4f} us, launch share {share:.2f}: H200 GPU-paced fit loss {s['op_loss']:.3f}, fit loss "
              f"{s['share_loss']:.3f}; within 15%: fit {s['fit_within']}, held out {s['held_within']}")
    best_share = min(args.shares, key=lambda sh: min(grid[(o, sh)]["share_loss"] for o in args.op_us))
    best_op = min(args.op_us, key=lambda o: grid[(o, best_share)]["op_loss"])
    best = grid[(best_op, best_share)]
    print(f"best: op_overhead_s {best_op} us, dp_launch_share {best_share}: {best}")
    if args.write:
        _write(best_op, best_share, best, len(runs))
    return {"op_us": best_op, "share": best_share, **best}


def _write(op_us: float, share: float, best: dict, n: int) -> None:
    from teratrain.planner.refit import write_calibration

    err = (f"rows within 15%: fit {best['fit_within'][0]} of {best['fit_within'][1]}, held out {best['held_within'][0]} "
           f"of {best['held_within'][1]} (manifest.toml per run)")
    runs = [f"tests/fixtures/planner_runs/manifest.toml: the {n} fit runs, fit rows only"]
    source = "bench/calibrate/recorded_shares.py"
    h200_runs = [f"tests/fixtures/planner_runs/manifest.toml: the H200 runs among the {n} fit runs, the fit rows the "
                 "GPU paces at every grid point"]
    write_calibration("h200", {"op_overhead_s": {"value": float(f"{op_us}e-6"), "source": source, "runs": h200_runs,
                                                 "fit_error": err}})
    write_calibration("common", {"dp_launch_share": {"value": share, "source": source, "runs": runs, "fit_error": err}})


if __name__ == "__main__":
    main()
