"""The comparisons of bench/planner_validate.py --gpus N and --check-pick: every measured layout next
to the planner's prediction for the same config, the errors, the pick check, the markdown tables.

Predictions use the GPU found (its preset's constants, its memory) with what the job measured in
place of the assumptions: the fitted collective terms, PCIe, the CPU optimizer's and the host cast's
speed, and the host's cost per eager op and per tp collective from the host probe (`predicted_*`);
`predicted_step_s_assumed` is the same prediction with the preset's assumed terms, and
`predicted_step_s_row_host` the first with the host's costs scaled to its speed while the row ran.
Errors are (predicted - measured) / measured, in percent; a host-paced row measured twice
(planner_multi.py) is compared at its faster visit, and every row at its first visit in
`step_err_pct_first_visit` (the same as `step_err_pct` for a row visited once).
Peak = `max_memory_allocated` (fullest rank) against the planner's peak_allocated; total = reserved +
outside the allocator (the job's smallest: later rows' counts hold earlier rows' communicators)
against the planner's total (peak + allowance); saved = autograd's saved bytes of one micro-batch
against the planner's per-micro-batch activations and autocast weight copies.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import torch

from teratrain.planner.hardware import GPU, GPUS, gpu_for_device
from teratrain.planner.memory import forward_saved
from teratrain.planner.refit import fit_collectives, fit_host

GIB = 2**30
TARGETS = {"peak": 5.0, "step": 15.0}  # the planner's aims: within 5% (memory) and 15% (step time)


def device_gpu(smoke: bool) -> GPU:
    """The GPU preset of device 0 with its memory (no CUDA context is made); H100 arithmetic on CPU."""
    if smoke or not torch.cuda.is_available():
        return GPUS["h100"]
    props = torch.cuda.get_device_properties(0)
    return gpu_for_device(props.name, props.total_memory)


def measured_hw(machine: dict | None) -> tuple[dict, dict, dict]:
    """(hardware terms the job measured, the collective fits, the host probe's fit: its rows and the
    host's speed while it ran, refit.fit_host)."""
    if not machine:
        return {}, {}, {}
    fitted = fit_collectives(machine["collectives"])
    hw = dict(fitted["hw"])
    for key in ("pcie_gbps", "host_adam_params_per_s", "host_cast_params_per_s"):
        if key in machine:
            hw[key] = machine[key]
    host = {}
    if machine.get("host_probe"):
        fit = fit_host(machine["host_probe"], machine["world"])
        hw.update(fit["hw"])
        host = {"rows": fit["fit"], "host_loop_us": fit["host_loop_us"]}
    return hw, fitted["fit"], host


def _err(pred: float, meas: float) -> float | None:
    return round(100.0 * (pred - meas) / meas, 2) if meas else None


def _forward_saved(sets: list[str], lay, device: str) -> int:
    from teratrain.config import load_config
    from teratrain.planner.inputs import shape_of, training_of

    cfg = load_config(None, sets)
    return forward_saved(shape_of(cfg), training_of(cfg), lay, device)


def at_host_speed(gpu: GPU, row_loop_us: float | None, probe_loop_us: float | None) -> GPU | None:
    """`gpu` with its host costs scaled to the host's speed while a row ran (bench/machine.py
    `host_loop_us`) from its speed while the host probe ran; None where either was not measured."""
    if not row_loop_us or not probe_loop_us:
        return None
    k = row_loop_us / probe_loop_us
    launch = None if gpu.host_launch_s is None else gpu.host_launch_s * k
    return replace(gpu, host_op_s=gpu.host_op_s * k, host_collective_s=gpu.host_collective_s * k, host_launch_s=launch)


def compare(rows: list[dict], results: dict, gpus: int, gpu: GPU, hw: dict, smoke: bool,
            probe_loop_us: float | None = None) -> list[dict]:
    """Each row's measurement next to the planner's prediction (module docstring); with the host's
    speed while the probe ran, also the prediction at the host's speed while the row ran."""
    from planner_rows import predict

    measured_gpu = replace(gpu, **hw)
    device = "cpu" if smoke else "cuda"
    # memory outside the allocator grows row by row (each row's NCCL communicators stay in the
    # shared processes): what one job holds is the first row's, the smallest
    outside = min((r["outside_allocator_gib"] for r in results.values() if "outside_allocator_gib" in r),
                  default=0.0)
    out = []
    for row in rows:
        res = results.get(row["name"], {})
        cand = predict(row["sets"], gpus, measured_gpu, device)
        assumed = predict(row["sets"], gpus, gpu, device)
        r = {"name": row["name"], "held_out": row["held_out"], "sets": row["sets"], **res,
             "layout": {k: v for k, v in cand.layout.as_dict().items()},
             "predicted_peak_gib": cand.memory.peak_allocated / GIB, "predicted_total_gib": cand.memory.total / GIB,
             "predicted_phase": cand.memory.phase, "predicted_step_s": cand.time.step_time_s,
             "predicted_step_s_assumed": assumed.time.step_time_s,
             "predicted_time_terms": {k: round(v, 5) for k, v in cand.time.as_dict().items() if k.endswith("_s")},
             "predicted_comm_terms": {k: round(v, 5) for k, v in cand.time.terms.items() if k.startswith("comm_")}}
        if "measured_step_s" in res:
            r["step_err_pct"] = _err(r["predicted_step_s"], res["measured_step_s"])
            r["step_err_pct_assumed"] = _err(r["predicted_step_s_assumed"], res["measured_step_s"])
            if "first_visit_step_s" in res:
                r["step_err_pct_first_visit"] = _err(r["predicted_step_s"], res["first_visit_step_s"])
            then = at_host_speed(measured_gpu, res.get("host_loop_us"), probe_loop_us)
            if then is not None:
                r["predicted_step_s_row_host"] = predict(row["sets"], gpus, then, device).time.step_time_s
                r["step_err_pct_row_host"] = _err(r["predicted_step_s_row_host"], res["measured_step_s"])
        if "measured_peak_gib" in res:
            r["peak_err_pct"] = _err(r["predicted_peak_gib"], res["measured_peak_gib"])
            r["measured_total_gib"] = res["measured_reserved_gib"] + outside
            r["total_err_pct"] = _err(r["predicted_total_gib"], r["measured_total_gib"])
        if "measured_saved_bytes" in res:
            r["predicted_saved_bytes"] = _forward_saved(row["sets"], cand.layout, device)
            r["saved_err_pct"] = _err(r["predicted_saved_bytes"], res["measured_saved_bytes"])
        out.append(r)
    return out


def summary(rows: list[dict]) -> dict:
    """Worst and median |error| per quantity, for all rows, the fit rows and the held-out rows, and
    how many meet the planner's aims."""
    out = {}
    for key in ("peak_err_pct", "step_err_pct", "step_err_pct_first_visit", "step_err_pct_assumed",
                "step_err_pct_row_host", "total_err_pct", "saved_err_pct"):
        for group, keep in (("all", lambda r: True), ("fit", lambda r: not r["held_out"]),
                            ("held_out", lambda r: r["held_out"])):
            errs = [abs(r[key]) for r in rows if keep(r) and r.get(key) is not None]
            if errs:
                out[f"{key}_{group}"] = {"rows": len(errs), "max": max(errs),
                                         "median": round(statistics.median(errs), 2)}
    limits = {f"{what}_err_pct": limit for what, limit in TARGETS.items()}
    limits["step_err_pct_first_visit"] = TARGETS["step"]  # a twice-measured row at its first visit
    for key, limit in limits.items():
        errs = [abs(r[key]) for r in rows if r.get(key) is not None]
        out[key.replace("err_pct", f"within_{limit:g}pct")] = f"{sum(e <= limit for e in errs)} of {len(errs)}"
    out["not_measured"] = [r["name"] for r in rows if "measured_step_s" not in r]
    # a row whose model outlived it leaves its memory to the next rows, which then run out
    out["models_kept_alive"] = [r["name"] for r in rows if r.get("model_freed") is False]
    return out


def pick_check(model: str, rows: list[dict], results: dict) -> dict:
    """The planner's pick (the first row) against the fastest measured of the candidates."""
    timed = [(r["name"], results[r["name"]]["measured_step_s"]) for r in rows
             if "measured_step_s" in results.get(r["name"], {})]
    out = {"model": model, "candidates": [{**r, **results.get(r["name"], {})} for r in rows]}
    if timed and timed[0][0] == rows[0]["name"]:
        fastest = min(timed, key=lambda t: t[1])
        out.update(pick=rows[0]["name"], pick_step_s=timed[0][1], fastest=fastest[0], fastest_step_s=fastest[1],
                   pick_over_fastest=round(timed[0][1] / fastest[1], 4),
                   pick_rank=sorted(t for _, t in timed).index(timed[0][1]) + 1,
                   within_5pct=timed[0][1] <= 1.05 * fastest[1])
    else:
        out["error"] = "the pick itself was not measured"
    return out


def markdown(out: dict) -> str:
    """The comparison table (bench/README.md)."""
    hw = out.get("hw", {})
    head = (f"{out['device']} x {out['gpus']}, torch {out['torch']}; model {out['model']}; measured: "
            + ", ".join(f"{k} {v:.4g}" for k, v in sorted(hw.items())))
    columns = ("layout", "held out", "peak GiB meas / pred (err)", "step ms meas / pred (err; assumed terms)",
               "step err at the row's host speed (host loop us)", "saved err",
               "reserved+outside GiB meas / pred total (err)")
    lines = [head, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in out["rows"]:
        if "measured_step_s" not in r:
            why = r.get("error") or r.get("skipped")
            lines.append(f"| {r['name']} | {'yes' if r['held_out'] else ''} | {why} | | | | |")
            continue
        peak = (f"{r['measured_peak_gib']:.2f} / {r['predicted_peak_gib']:.2f} ({r['peak_err_pct']:+.1f}%)"
                if "measured_peak_gib" in r else f"- / {r['predicted_peak_gib']:.2f}")
        step = (f"{1e3 * r['measured_step_s']:.1f} / {1e3 * r['predicted_step_s']:.1f} ({r['step_err_pct']:+.1f}%; "
                f"{r['step_err_pct_assumed']:+.1f}%)")
        then = (f"{r['step_err_pct_row_host']:+.1f}% ({r['host_loop_us']:.4f})" if r.get("step_err_pct_row_host")
                is not None else "-")
        saved = f"{r['saved_err_pct']:+.2f}%" if r.get("saved_err_pct") is not None else "-"
        total = (f"{r['measured_total_gib']:.2f} / {r['predicted_total_gib']:.2f} ({r['total_err_pct']:+.1f}%)"
                 if "measured_total_gib" in r else "-")
        cells = (r["name"], "yes" if r["held_out"] else "", peak, step, then, saved, total)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
