"""planner/calibration/published.toml `<card>_flops_max`, `<card>_flops_d_half`: the bf16/fp16 GEMM
efficiency by width that the software of a card's published runs reached, fitted on the runs of
bench/published_runs.toml marked split = "fit". bench/published.py plans the published runs with it.

    python bench/calibrate/published_fit.py --card a100            # the fit and its errors, to stdout
    python bench/calibrate/published_fit.py --card a100 --write    # and into planner/calibration/published.toml

A card without teratrain runs of its own (the A100) takes the fit as its preset too: --write then also
rewrites calibration/<card>.toml's flops_max and flops_d_half, whose source names this script.

The planner's prediction of a run depends on the two constants only through the efficiency at the run's
width, eff = flops_max * d / (d + flops_d_half) (planner/hardware.py). So each fit run is planned at a few
efficiencies (flops_d_half = 0, flops_max = eff) and its step time interpolated in 1/eff between them
(compute, bubble and recomputation scale with 1/eff; the rest does not); the two constants are then the
grid point of least squared relative step error over the fit runs. The fitted preset then plans every
run of the card again, and the report gives the fit and the held-out runs' errors apart. Runs the planner
refuses (e.g. layers that do not split evenly over the stages) are listed and left out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from published import card, load_runs, plan, published_step_s, software_efficiency  # noqa: E402

from teratrain.planner.hardware import GPUS  # noqa: E402
from teratrain.planner.states import PlanError  # noqa: E402

SOURCE = "bench/calibrate/published_fit.py"
EFFS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def curve(run: dict) -> list[tuple[float, float]]:
    """(1/eff, predicted step s) of `run` at each of EFFS."""
    return [(1 / e, plan(run, replace(card(run), flops_max=e, flops_d_half=0.0)).time.step_time_s) for e in EFFS]


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    pts = sorted(points)
    if not pts[0][0] <= x <= pts[-1][0]:
        return float("inf")  # outside the planned efficiencies
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def fit(curves: dict[str, tuple[int, float, list]]) -> tuple[float, float, float]:
    """(flops_max, flops_d_half, loss) of least squared relative step error; curves: name -> (width,
    published s, curve)."""
    best = (0.0, 0.0, float("inf"))
    for i in range(141):  # flops_max 0.30 .. 1.00
        fm = 0.30 + 0.005 * i
        for dh in range(0, 8001, 25):
            loss = sum((interpolate(c, (d + dh) / (fm * d)) / pub - 1) ** 2 for d, pub, c in curves.values())
            if loss < best[2]:
                best = (fm, float(dh), loss)
    return best


def errors(runs: list[dict], **constants: float) -> dict[str, float | str]:
    """name -> predicted / published - 1 on each run's card with `constants` (flops_max, flops_d_half), or the
    planner's refusal."""
    out = {}
    for run in runs:
        try:
            out[run["name"]] = plan(run, replace(card(run), **constants)).time.step_time_s / published_step_s(run) - 1
        except PlanError as e:
            out[run["name"]] = f"not planned: {e}"
    return out


def summary(errs: dict) -> str:
    a = [abs(e) for e in errs.values() if isinstance(e, float)]
    if not a:
        return "no run planned"
    return f"{len(a)} runs, max {100 * max(a):.1f}%, median {100 * statistics.median(a):.1f}%"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--card", default="a100", choices=sorted(GPUS))
    ap.add_argument("--write", action="store_true",
                    help="write the fit into calibration/published.toml (and <card>.toml, a card without own runs)")
    args = ap.parse_args(argv)
    runs = [r for r in load_runs() if r["gpu"] == args.card]
    fit_runs, held = [r for r in runs if r["split"] == "fit"], [r for r in runs if r["split"] != "fit"]
    curves, refused = {}, {}
    for run in fit_runs:
        try:
            curves[run["name"]] = (run["d_model"], published_step_s(run), curve(run))
        except PlanError as e:
            refused[run["name"]] = str(e)
    if len(curves) < 2:
        raise SystemExit(f"{args.card}: {len(curves)} plannable fit runs in bench/published_runs.toml; mark at least "
                         f"two of different widths split = \"fit\" (refused: {refused or 'none'}).")
    fm, dh, _ = fit(curves)
    before = {"fit": errors(fit_runs), "held_out": errors(held)}
    after = {split: errors(runs, flops_max=fm, flops_d_half=dh)
             for split, runs in (("fit", fit_runs), ("held_out", held))}
    report = {"card": args.card, "flops_max": fm, "flops_d_half": dh, "before": before, "after": after}
    was = {**{k: getattr(GPUS[args.card], k) for k in ("flops_max", "flops_d_half")}, **software_efficiency(args.card)}
    print(f"{args.card}: flops_max {was['flops_max']:g} -> {fm:.3f}, flops_d_half {was['flops_d_half']:g} -> {dh:g}")
    for split in ("fit", "held_out"):
        print(f"  {split:8} before: {summary(before[split])}; after: {summary(after[split])}")
        for name, e in after[split].items():
            print(f"    {name:34} {e if isinstance(e, str) else f'{100 * e:+.1f}%'}")
    if args.write:
        _write(args.card, fm, dh, list(curves), after)
    return report


TERMS = {"flops_max": "bf16/fp16 share of the datasheet peak at infinite width that the software of the card's "
                      "published runs reached: eff = flops_max * d / (d + flops_d_half), d the model width",
         "flops_d_half": "the width at which that efficiency reaches half of flops_max"}


def _write(card_name: str, fm: float, dh: float, names: list[str], after: dict) -> None:
    from teratrain.planner.hardware import calibration
    from teratrain.planner.refit import write_calibration

    runs = [f"bench/published_runs.toml: {n}" for n in names]
    err = f"step time, fit runs: {summary(after['fit'])}; held-out runs: {summary(after['held_out'])}"
    entry = {"source": SOURCE, "runs": runs, "fit_error": err}
    values = {"flops_max": round(fm, 3), "flops_d_half": dh}
    write_calibration("published", {f"{card_name}_{k}": {"value": v, "term": TERMS[k], **entry}
                                    for k, v in values.items()})
    if calibration(card_name)["flops_max"]["source"] == SOURCE:  # no teratrain run on the card: its preset too
        write_calibration(card_name, {k: {"value": v, **entry} for k, v in values.items()})


if __name__ == "__main__":
    main()
