"""Refit the planner from measurements: collective terms from timed collectives, time constants from
a `bench/planner_validate.py --gpus N` result, and what each change does to the errors.

    python bench/planner_validate.py --refit RESULT.json           # the report
    python bench/planner_validate.py --refit RESULT.json --write   # and its fitted constants into calibration/

- Host costs (`fit_host`): the cost per eager op and per tensor-parallel collective from the host
  probe's steps (bench/planner_rows.py `probe_rows`), with the planner's own counts.
- Collectives (`fit_collectives`): per kind, t = steps(n) x alpha + fraction(n) x bytes / bandwidth
  (planner/comm.py's ring model) fitted to the timed sizes by least squares on the relative error
  (the sizes span four orders of magnitude: an absolute fit would ignore the small ones). The planner
  takes the result as `<kind>_gbps` and `<kind>_alpha_s` (`teratrain plan --hw-file RESULT.json`).
- Time constants (`refit`): the calibrated efficiencies and per-op cost of hardware.GPU, fitted by
  coordinate descent (each constant in turn on a shrinking multiplicative grid) to minimise the
  squared relative step-time error of the rows NOT marked held-out, with the measured hardware terms
  in place; the held-out rows' errors before and after show whether the change generalizes. Rows the
  planner has the host pace are not fitted: the report lists them with the host's measured spread.
- Memory has no fitted constant but the allowance: `context_gib` from the memory measured outside
  the allocator (CUDA context and NCCL's buffers): the median of a one-GPU result (a process per
  config), the smallest of a several-GPU one, whose rows run one after another in the same
  processes, each row's count holding the communicators of every earlier row (4.9 GiB at the first
  of 28 rows on 4 x H200, 38 GiB at the last); `fragmentation` from the median reserved/allocated - 1
  (the allocator's cache is emptied and its peaks reset between rows, so that ratio is per row).
Nothing is written by `refit`: the report says which constants the measurements would change, and to
what. A run is refitted only where tests/fixtures/planner_runs/manifest.toml marks it split = "fit" (a
held-out run is refused). `write_calibration` writes a fitted constant into planner/calibration/<card>.toml
with the runs it was fitted on and its error there (bench/calibrate/ scripts call it).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from teratrain.planner.comm import FRACTION, STEPS
from teratrain.planner.hardware import GPU, gpu_for_device, hw_keys

FITTED = ("flops_max", "flops_d_half", "op_overhead_s", "mem_efficiency", "host_op_s", "host_collective_s")
BOUNDS = {"flops_max": (0.05, 1.0), "mem_efficiency": (0.05, 1.0), "flops_d_half": (1.0, 1e5),
          "op_overhead_s": (0.0, 1e-3), "host_op_s": (0.0, 1e-3), "host_collective_s": (0.0, 1e-2)}


def fit_alpha_beta(kind: str, ranks: int, sizes: list[float], seconds: list[float]) -> dict:
    """(GB/s, alpha per ring step) of one collective from its timed sizes; max relative residual."""
    xs = [FRACTION[kind](ranks) * b for b in sizes]
    ws = [1.0 / t**2 for t in seconds]  # weights of a relative-error fit
    sw, sx, sxx = sum(ws), sum(w * x for w, x in zip(ws, xs)), sum(w * x * x for w, x in zip(ws, xs))
    st, sxt = sum(w * t for w, t in zip(ws, seconds)), sum(w * x * t for w, x, t in zip(ws, xs, seconds))
    det = sw * sxx - sx * sx
    a, c = (st * sxx - sx * sxt) / det, (sw * sxt - sx * st) / det
    if a < 0:  # no negative latency: the bandwidth alone
        a, c = 0.0, sxt / sxx
    if c <= 0:  # no bandwidth term resolvable at these sizes: the latency alone
        a, c = st / sw, 1e-15
    worst = max(abs(a + c * x - t) / t for x, t in zip(xs, seconds))
    return {"gbps": 1.0 / (c * 1e9), "alpha_s": a / STEPS[kind](ranks), "max_rel_err": worst, "ranks": ranks}


def fit_collectives(rows: list[dict]) -> dict:
    """The planner's terms from `bench/machine.py`'s collective rows: {"hw": {key: value}, "fit": {kind: ...}}."""
    fits = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        fits[kind] = fit_alpha_beta(kind, mine[0]["ranks"], [r["bytes"] for r in mine], [r["seconds"] for r in mine])
    hw = {}
    for kind, f in fits.items():
        hw[f"{kind}_gbps"], hw[f"{kind}_alpha_s"] = f["gbps"], f["alpha_s"]
    return {"hw": hw, "fit": fits}


def fit_host(probes: list[dict], gpus: int) -> dict:
    """The host's issue costs from the host probe (bench/planner_rows.py `probe_rows`: a model whose
    kernels take microseconds, so each step is the host's time): {"hw": {"host_op_s",
    "host_collective_s", "host_launch_s"}, "fit": per probe row, its counts, measured and fitted
    seconds}. The counts are the planner's own (time.eager_ops, time.issued_collectives and
    time.engine_launches), so the fitted costs mean what the planner means by them: least squares on
    the relative error over the probe rows, which the plain data-parallel probe (ops, and its engine's
    few launches), the tp probes (the same ops and their collectives) and the ZeRO-3 probe (the same
    ops and a launch per group, micro-batch and pass) tell apart. Without the ZeRO-3 probe (recorded runs
    that lack it) a launch costs time.DP_LAUNCH_SHARE of a collective, and only two costs are fitted.
    `host_loop_us`: the host's speed while the probe ran (bench/machine.py `host_loop_us`), the
    reference against which a row run at another moment can be compared."""
    from teratrain.config import load_config
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.time import DP_LAUNCH_SHARE, eager_ops, engine_launches, issued_collectives

    loops = [row["host_loop_us"] for row in probes if row.get("host_loop_us")]
    loop_us = statistics.median(loops) if loops else None
    counted, zeros = [], []  # per probe row: its counts; its ZeRO stage
    for row in probes:
        if not row.get("measured_step_s"):
            continue
        cfg = load_config(None, row["sets"])
        shape, train, lay = shape_of(cfg), training_of(cfg), layout_of(cfg, gpus)
        counted.append({"name": row["name"], "ops": eager_ops(shape, train, lay),
                        "collectives": issued_collectives(shape, train, lay),
                        "launches": engine_launches(shape, train, lay), "measured_s": row["measured_step_s"],
                        **({"passes_s": row["passes_s"]} if "passes_s" in row else {})})
        zeros.append(lay.zero)
    plain = [c for c, z in zip(counted, zeros) if not c["collectives"] and not z]
    if not plain:
        return {"hw": {}, "fit": counted, "host_loop_us": loop_us}
    per_op, per_coll, per_launch = statistics.median(c["measured_s"] / c["ops"] for c in plain), None, None
    has_tp, has_zero = any(c["collectives"] for c in counted), any(zeros)
    if has_tp and has_zero:
        per_op, per_coll, per_launch = _costs([(c["ops"], c["collectives"], c["launches"]) for c in counted],
                                              [c["measured_s"] for c in counted])
    elif has_tp:
        per_op, per_coll = _costs([(c["ops"], c["collectives"] + DP_LAUNCH_SHARE * c["launches"]) for c in counted],
                                  [c["measured_s"] for c in counted])
    elif has_zero:  # no tp probe: the launches' cost, none for a tp collective
        per_op, per_launch = _costs([(c["ops"], c["launches"]) for c in counted], [c["measured_s"] for c in counted])
    for c in counted:
        launch = per_launch if per_launch is not None else DP_LAUNCH_SHARE * (per_coll or 0.0)
        c["fitted_s"] = c["ops"] * per_op + c["collectives"] * (per_coll or 0.0) + c["launches"] * launch
    hw = {"host_op_s": per_op, **({"host_collective_s": per_coll} if per_coll is not None else {}),
          **({"host_launch_s": per_launch} if per_launch is not None else {})}
    return {"hw": hw, "fit": counted, "host_loop_us": loop_us}


def _costs(columns: list[tuple[float, ...]], seconds: list[float]) -> tuple[float, ...]:
    """Non-negative costs x of t = columns . x over the rows, least squares on the relative error
    (every row divided by its t), exactly: the best fit over every subset of the columns whose own
    least-squares costs are all non-negative, the other costs 0 (at most 3 columns: 7 subsets)."""
    import itertools

    import torch

    a = torch.tensor(columns, dtype=torch.float64) / torch.tensor(seconds, dtype=torch.float64)[:, None]
    ones = torch.ones(a.shape[0], 1, dtype=torch.float64)
    best = None
    for size in range(1, a.shape[1] + 1):
        for keep in itertools.combinations(range(a.shape[1]), size):
            x = torch.linalg.lstsq(a[:, keep], ones).solution
            if (x < 0).any():
                continue
            residual = float(((a[:, keep] @ x - ones) ** 2).sum())
            if best is None or residual < best[0]:
                best = (residual, keep, x.flatten().tolist())
    out = [0.0] * a.shape[1]
    for i, v in zip(best[1], best[2]):
        out[i] = v
    return tuple(out)


def result_gpu(result: dict) -> GPU:
    """The GPU a planner_validate result ran on, with what it measured (its "hw")."""
    gpu = gpu_for_device(result["device"], int(result["device_mem_gib"] * 2**30))
    known = set(hw_keys())
    return replace(gpu, **{k: v for k, v in result.get("hw", {}).items() if k in known})


def how_it_runs() -> dict:
    """The settings `as_ran` reads, as this checkout runs them: bench scripts write them into their results."""
    from teratrain.optim import adamw_kernel

    return {"norms": "residual dtype", "linear inputs": "cast once", "experts": "stacked",
            "weight casts": "once a step", "graphed weight casts": "once a step", "swiglu": "keeps its inputs",
            "expert gradients": "through the casts", "gate and up": "one GEMM",
            "moe layout": "running count", "carried gradients": "freed as summed",
            "adamw": "teratrain kernel, a launch a group" if adamw_kernel.available() else "torch fused"}


def as_ran(train, result: dict):
    """`train` as a recorded run ran it: the settings its result file names ("norms", "linear inputs",
    "experts", "weight casts", "graphed weight casts", "adamw", "expert gradients", "gate and up", "moe layout",
    "carried gradients", "swiglu"), and for each it does not name the code before that setting existed
    (planner/layout.py Training): the norms on fp32 copies, each projection casting its input, each expert its own
    parameters, the eager SwiGLU keeping silu's output, the
    casts every micro-batch (under CUDA graphs, every micro-batch until "graphed weight casts"), torch's fused
    AdamW (or teratrain's kernel launched a tensor at a time), the stacked experts' gradients cast back before
    autograd added them, w1 and w3 as two grouped GEMMs, the MoE layout by a sort, with masks, the carried
    gradients held to the step's end."""
    return replace(train, norms_fp32=result.get("norms") != "residual dtype",
                   linear_casts=result.get("linear inputs") != "cast once",
                   expert_tensors=result.get("experts") != "stacked",
                   silu_kept=result.get("swiglu") != "keeps its inputs",
                   casts_per_micro_batch=train.casts_per_micro_batch or result.get("weight casts") != "once a step"
                   or (train.graphed and result.get("graphed weight casts") != "once a step"),
                   torch_adamw=train.torch_adamw or not str(result.get("adamw")).startswith("teratrain kernel"),
                   adamw_per_tensor=result.get("adamw") == "teratrain kernel",
                   grads_after_casts=result.get("expert gradients") != "through the casts",
                   gate_up_apart=result.get("gate and up") != "one GEMM",
                   moe_sorted_layout=result.get("moe layout") != "running count",
                   carried_grads_held=result.get("carried gradients") != "freed as summed")


def _prepared(result: dict) -> list[tuple]:
    """(shape, train, layout, row) of every measured row, built once (the search caches by shape)."""
    from teratrain.config import load_config
    from teratrain.planner.inputs import layout_of, shape_of, training_of

    out = []
    for row in result["rows"]:
        if row.get("measured_step_s"):
            cfg = load_config(None, row["sets"])
            out.append((shape_of(cfg), as_ran(training_of(cfg), result), layout_of(cfg, result["gpus"]), row))
    return out


def step_errors(gpu: GPU, prepared: list[tuple]) -> list[float]:
    """Relative step-time errors (predicted - measured) / measured, one per row."""
    from teratrain.planner.search import evaluate

    return [evaluate(s, t, lay, gpu).time.step_time_s / row["measured_step_s"] - 1 for s, t, lay, row in prepared]


def _loss(gpu: GPU, prepared: list[tuple]) -> float:
    return sum(e * e for e in step_errors(gpu, prepared))


def _fit(gpu: GPU, prepared: list[tuple], max_passes: int = 40) -> GPU:
    """Coordinate descent: each constant in turn moves by the factors s^-2..s^2 (within its bounds)
    to the least squared relative error; s halves (in log) after a pass that improved nothing, down to
    0.1%. The width at which the efficiency reaches half its maximum is fitted only when the rows
    span several widths (one width cannot tell it from the maximum)."""
    widths = {p[0].cfg.d_model for p in prepared}
    keys = [k for k in FITTED if k != "flops_d_half" or len(widths) > 1]
    step, best = 2.0, _loss(gpu, prepared)
    for _ in range(max_passes):
        improved = False
        for key in keys:
            lo, hi = BOUNDS[key]
            now = getattr(gpu, key)
            trials = [min(hi, max(lo, now * step**k)) for k in (-2, -1, 1, 2)] if now else [1e-6, 3e-6, 1e-5]
            for value in trials:
                trial = replace(gpu, **{key: value})
                loss = _loss(trial, prepared)
                if loss < best * (1 - 1e-9):
                    gpu, best, improved = trial, loss, True
        if not improved:
            step = step**0.5
            if step < 1.001:
                break
    return gpu


def _stats(errs: list[float]) -> dict:
    a = [abs(e) for e in errs]
    return {"rows": len(a), "max_abs_pct": round(100 * max(a), 1) if a else None,
            "median_abs_pct": round(100 * statistics.median(a), 1) if a else None}


def refit(result: dict, split: str = "fit") -> dict:
    """What the measurements of `result` would change (module docstring), and the errors before and after.
    `split`: the run's split in tests/fixtures/planner_runs/manifest.toml; a held-out run is refused."""
    if split != "fit":
        raise ValueError(f"this run is split = \"{split}\" in tests/fixtures/planner_runs/manifest.toml: refit only "
                         "fits on runs marked split = \"fit\"; mark it so there (and say so in docs/planner.md) or "
                         "refit another run.")
    preset = gpu_for_device(result["device"], int(result["device_mem_gib"] * 2**30))
    measured = result_gpu(result)
    prepared = _prepared(result)
    paced = host_paced(measured, prepared)
    fit_rows = [p for p in prepared if not p[3].get("held_out") and p[3]["name"] not in paced]
    held = [p for p in prepared if p[3].get("held_out")]
    fitted = _fit(measured, fit_rows) if fit_rows else measured
    changes = {k: [getattr(preset, k), v] for k, v in result.get("hw", {}).items() if getattr(preset, k, None) != v}
    changes.update({k: [getattr(measured, k), getattr(fitted, k)] for k in FITTED
                    if getattr(fitted, k) != getattr(measured, k)})
    outside = [r["outside_allocator_gib"] for r in result["rows"] if r.get("outside_allocator_gib") is not None]
    frag = [r["measured_reserved_gib"] / r["measured_peak_gib"] - 1 for r in result["rows"]
            if r.get("measured_reserved_gib") and r.get("measured_peak_gib")]
    if outside:
        own = min(outside) if result.get("gpus", 1) > 1 else statistics.median(outside)
        changes["context_gib"] = [preset.context_gib, round(own, 3)]
    if frag:
        changes["fragmentation"] = [preset.fragmentation, round(statistics.median(frag), 3)]
    launch = optimizer_tensor_s(measured, fit_rows)
    if launch is not None:
        changes["host_optimizer_tensor_s"] = [preset.host_optimizer_tensor_s, launch]
    errors = {}
    for name, gpu in (("assumed", preset), ("measured terms", measured), ("refit", fitted)):
        errors[name] = {"fit rows": _stats(step_errors(gpu, fit_rows)), "held-out rows": _stats(step_errors(gpu, held))}
    flags = " ".join(f"--hw {k}={v[1]:.6g}" for k, v in changes.items())
    return {"changes": changes, "step_time_errors": errors, "hw_flags": flags, "host_paced": paced}


def optimizer_tensor_s(gpu: GPU, prepared: list[tuple]) -> float | None:
    """The host's time a stepped tensor cost teratrain's AdamW kernel launched a tensor at a time (the runs recorded
    so): the median, over the rows whose optimizer phase (bench/planner_validate.py "phases") took over twice its
    planned HBM sweep, of that phase over the tensors the row steps; None where no row ran the kernel so."""
    from teratrain.planner.search import evaluate
    from teratrain.planner.time import optimizer_s

    each = []
    for shape, train, lay, row in prepared:
        took = (row.get("phases") or {}).get("step_s")
        if not took or lay.offload != "none" or train.optimizer != "adamw" or not train.adamw_per_tensor:
            continue
        cand = evaluate(shape, train, lay, gpu)
        sweep = optimizer_s(train, train.widths(lay.zero, lay.offload), cand.memory.terms["shard_params"], gpu)
        if took > 2 * sweep:
            each.append(took / cand.time.terms["optimizer_tensors"])
    return float(f"{statistics.median(each):.3g}") if each else None


def host_paced(gpu: GPU, prepared: list[tuple]) -> dict[str, dict]:
    """The fit rows the planner has the host pace (an eager step the host takes longer to issue than the GPU
    to run): not fitted, reported with their error and the host's measured spread over the row's visits
    (bench/planner_multi.py `visits_s`: slowest / fastest - 1; None where the row was measured once)."""
    from teratrain.planner.search import evaluate

    out = {}
    for s, t, lay, row in prepared:
        cand = evaluate(s, t, lay, gpu)
        if cand.time.host_paced and not row.get("held_out"):
            visits = row.get("visits_s") or []
            out[row["name"]] = {"error_pct": round(100 * (cand.time.step_time_s / row["measured_step_s"] - 1), 1),
                                "spread_pct": round(100 * (max(visits) / min(visits) - 1), 1) if len(visits) > 1 else None}
    return out


def _num(v) -> str:
    return "unset (NVLink's)" if v is None else f"{v:.6g}"


def render(report: dict) -> str:
    lines = ["Constants the measurements would change (old -> new):"]
    lines += [f"  {k:24} {_num(old)} -> {_num(new)}" for k, (old, new) in report["changes"].items()]
    lines.append("Step-time error |predicted/measured - 1| (max, median), by constants used:")
    for name, groups in report["step_time_errors"].items():
        parts = [f"{g}: {s['rows']} rows, max {s['max_abs_pct']}%, median {s['median_abs_pct']}%"
                 for g, s in groups.items() if s["rows"]]
        lines.append(f"  {name:16} " + "; ".join(parts))
    for name, r in report.get("host_paced", {}).items():
        spread = "measured once" if r["spread_pct"] is None else f"the host's spread over its visits {r['spread_pct']}%"
        lines.append(f"  host-paced, not fitted: {name} {r['error_pct']:+}% ({spread})")
    lines.append(f"As flags: teratrain plan ... {report['hw_flags']}")
    return "\n".join(lines)


def calibration_updates(report: dict, run: str) -> dict[str, dict]:
    """`write_calibration`'s entries for the fitted constants a `refit` report changes, fitted on `run`."""
    errs = report["step_time_errors"]["refit"]
    err = "; ".join(f"{g}: {s['rows']} rows, max {s['max_abs_pct']}%, median {s['median_abs_pct']}%"
                    for g, s in errs.items() if s["rows"])
    measured = {"context_gib": "the memory measured outside the allocator (module docstring)",
                "fragmentation": "the median of reserved / allocated - 1 over the rows",
                "host_optimizer_tensor_s": "measured: the optimizer phase over the tensors stepped, the median "
                                           "over the fit rows it paces (refit.optimizer_tensor_s)"}
    return {k: {"value": new, "source": "bench/planner_validate.py --refit", "runs": [run],
                "fit_error": measured.get(k, err)}
            for k, (_, new) in report["changes"].items() if k in FITTED or k in measured}


def write_calibration(card: str, updates: dict[str, dict], path=None) -> None:
    """Rewrite entries of planner/calibration/<card>.toml (or `path`): per constant its "value", "source",
    "runs" and "fit_error" (its "term" stays); the file's header comment and the other entries are kept."""
    import tomllib

    from teratrain.config_toml import toml_value
    from teratrain.planner.hardware import CALIBRATION

    path = path or CALIBRATION / f"{card}.toml"
    text = path.read_text()
    entries = tomllib.loads(text)
    header = text[: text.index("\n[") + 1] if "\n[" in text else ""
    for key, new in updates.items():
        if key not in entries and "term" not in new:
            raise ValueError(f"{path.name} has no [{key}] entry; give its \"term\" (the sentence it scales) to add it.")
        entries[key] = {**entries.get(key, {}), **new}
    order = ("value", "term", "source", "runs", "fit_error")
    blocks = ["\n".join([f"[{key}]"] + [f"{k} = {toml_value(entry[k])}" for k in order if k in entry])
              for key, entry in entries.items()]
    path.write_text(header + "\n\n".join(blocks) + "\n")
