"""The several-GPU modes of bench/planner_validate.py (its docstring says how to call them).

--gpus N: the layouts of planner_rows.py for N GPUs, on a model sized to the GPU found, measured in
one torchrun job (planner_multi.py) after the machine's collectives, PCIe and CPU optimizer; each
next to the planner's prediction (planner_report.py). --check-pick: the planner's pick for llama-1b
and for the largest Llama the N GPUs fit, and the next 5 candidates, measured the same way.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from planner_multi import run_rows
from planner_report import compare, device_gpu, markdown, measured_hw, pick_check, summary
from planner_rows import BUILD_S, COMMON, full_sets, probe_rows, rows_for, size_layers

from teratrain.planner.refit import how_it_runs

WARMUP, STEPS = 2, 4
# The share of --budget-s the rows' first visits may take (planner_rows.size_layers sizes the model to
# it); with relaunches half: on 2 x H200 at 32 layers the first visits took ~230 s of a 315 s job
# that ran two relaunches
ROWS_SHARE, ROWS_SHARE_RELAUNCHED = 0.65, 0.5


def _checked(rows: list[dict]) -> dict[str, dict]:
    """Rows the engines would refuse, found before launching anything: name -> {"error"}."""
    from teratrain.config import ConfigError, load_config
    from teratrain.mesh import ParallelDims
    from teratrain.parallel.support import check_supported

    bad = {}
    for row in rows:
        try:
            cfg = load_config(None, row["sets"])
            check_supported(cfg)
            cfg.microbatches(ParallelDims.from_config(cfg.parallel, row["gpus"]).dp)
        except ConfigError as e:
            bad[row["name"]] = {"error": str(e)}
    return bad


def validate_gpus(args) -> dict:
    n, smoke = args.gpus, args.smoke
    deadline = time.time() + args.budget_s
    gpu = device_gpu(smoke)
    rows = [r for r in rows_for(n, smoke) if not args.only or args.only in r.name]
    steps = 1 if smoke else STEPS
    if smoke:  # pp x virtual stages divide the layers; every tiny row is host-paced: each is visited twice
        layers, est = 2 * n, [{"est_s": 5.0, "revisit": True}] * len(rows)
    else:  # the rows' first visits' share of the budget; the rest goes to start-up, NCCL, the machine's
        # terms, the revisits and the relaunches (planner_multi.py)
        share = ROWS_SHARE if args.relaunches == 0 else ROWS_SHARE_RELAUNCHED
        layers, est = size_layers(rows, n, gpu, share * args.budget_s, WARMUP + steps)
    payload = [{"name": r.name, "held_out": r.held_out, "sets": full_sets(r, layers, smoke), "est_s": e["est_s"],
                "revisit": e["revisit"], "gpus": n} for r, e in zip(rows, est)]
    refused = _checked(payload)
    machine, results = run_rows([p for p in payload if p["name"] not in refused], n, smoke=smoke, steps=steps,
                                warmup=1 if smoke else WARMUP, deadline=deadline, measure_machine=True,
                                probes=probe_rows(n, smoke), relaunches=args.relaunches)
    results.update(refused)
    hw, fits, host = measured_hw(machine)
    if machine and "device" in machine:
        gpu = replace(gpu, memory_gib=machine["total_bytes"] / 2**30)
    cmp = compare(payload, results, n, gpu, hw, smoke, host.get("host_loop_us"))
    return {"bench": "planner_validate", "gpus": n, "device": machine.get("device", "cpu") if machine else "cpu",
            "device_mem_gib": gpu.memory_gib, "gpu_preset": gpu.name, "torch": torch.__version__,
            "model": f"llama-1b width, {layers} layers (MoE rows: 4 experts, {max(4, layers // 2)} layers)",
            "steps": steps, "warmup": WARMUP, "hw": hw, "host_threads": (machine or {}).get("host_threads"),
            "collectives": {"rows": (machine or {}).get("collectives", []), "fit": fits},
            "host_probe": host, "rows": cmp, "summary": summary(cmp),
            **how_it_runs()}  # planner/refit.py as_ran plans earlier runs as they ran


def _models(n: int, gpu, host_mem: float | None, smoke: bool) -> list[tuple[str, list[str]]]:
    """llama-1b, and the largest Llama preset with a layout that fits the n GPUs (2048-token sequences)."""
    from planner_rows import dense

    if smoke:
        tiny = COMMON + dense(2 * n, True)
        return [("tiny a", tiny + [f"train.global_batch={4 * n}"]), ("tiny b", tiny + [f"train.global_batch={2 * n}"])]
    out = [("llama-1b", COMMON + ["model.preset=llama-1b", "memory.precision=bf16", f"train.global_batch={8 * n}"])]
    for preset in ("llama-70b", "llama-8b"):
        sets = COMMON + [f"model.preset={preset}", "model.seq_len=2048", "memory.precision=bf16",
                         f"train.global_batch={2 * n}"]
        if _candidates(sets, n, gpu, host_mem, 1):
            return out + [(preset, sets)]
    return out


def _candidates(sets: list[str], n: int, gpu, host_mem: float | None, count: int) -> list:
    """The planner's `count` fastest fitting layouts that the engines run, fastest first (the first is
    what parallel.auto picks)."""
    from teratrain.config import load_config
    from teratrain.planner.auto import _runnable
    from teratrain.planner.inputs import fixed_of, shape_of, training_of
    from teratrain.planner.search import search

    cfg = load_config(None, sets)
    cands = search(shape_of(cfg), training_of(cfg), n, gpu, fixed_of(cfg), gpu.memory_gib, host_mem)
    return [c for c in cands if c.fits and _runnable(cfg, c.layout)][:count]


def check_pick(args, hw: dict) -> dict:
    from teratrain.planner.auto import layout_sets
    from teratrain.planner.hardware import host_memory_gib

    n, smoke = args.gpus, args.smoke
    deadline = time.time() + args.budget_s
    gpu = replace(device_gpu(smoke), **hw)
    host = host_memory_gib()
    plan, rows = [], []
    for model, sets in _models(n, gpu, host, smoke):
        if args.only and args.only not in model:
            continue
        mine = []
        for i, c in enumerate(_candidates(sets, n, gpu, host, 6)):
            words = " ".join(f"{k.split('.')[1]}" for k in layout_sets(c.layout))
            mine.append({"name": f"{model} #{i + 1} {words}", "sets": sets + layout_sets(c.layout), "gpus": n,
                         "est_s": (WARMUP + STEPS) * c.time.step_time_s + BUILD_S
                         + 2e-9 * c.memory.terms["local_params"],  # ~2 s more per billion parameters
                         "predicted_step_s": c.time.step_time_s, "predicted_total_gib": c.memory.total / 2**30})
        plan.append((model, mine))
        rows += mine
    _, results = run_rows(rows, n, smoke=smoke, steps=1 if smoke else STEPS, warmup=1 if smoke else WARMUP,
                          deadline=deadline, measure_machine=False)
    return {"bench": "planner_check_pick", "gpus": n, "gpu_preset": gpu.name, "torch": torch.__version__, "hw": hw,
            "host_mem_gib": host, "models": [pick_check(model, mine, results) for model, mine in plan]}


def pick_markdown(out: dict) -> str:
    lines = ["| model | candidate (planner order) | predicted s | measured s |", "|---|---|---|---|"]
    for m in out["models"]:
        for c in m["candidates"]:
            meas = f"{c['measured_step_s']:.3f}" if "measured_step_s" in c else (c.get("error") or c.get("skipped"))
            lines.append(f"| {m['model']} | {c['name']} | {c['predicted_step_s']:.3f} | {meas} |")
        if "pick_over_fastest" in m:
            lines.append(f"| {m['model']} | pick / fastest measured = {m['pick_over_fastest']:.3f} (rank "
                         f"{m['pick_rank']}; within 5%: {m['within_5pct']}) | | |")
    return "\n".join(lines)


__all__ = ["check_pick", "markdown", "pick_markdown", "validate_gpus"]
