"""Planner vs reality: predicted peak memory and step time against measured ones, on one GPU or N.

For each config: build the model as `teratrain train` does for one process (meta device ->
parallelize(): recompute, then LocalEngine or ZeroEngine; teratrain.measure.build_engine), run
warm-up steps, time steps with synchronize (the garbage collector frozen as the trainer freezes it,
teratrain/collector.py), read torch.cuda.max_memory_allocated over the steady-state steps, count the
bytes autograd saves (saved_tensors_hooks), and compare each with the planner's prediction for the
same layout. Prints one JSON object (rows with predicted / measured / error %). `--profile` also
profiles two steps a row: the GPU's busy time against the work the planner gives it, and its idle
share (a GPU idle more than HOST_PACED_IDLE of the step is paced by the host).

    python bench/planner_validate.py            # on a GPU (H200: ~3-4 minutes, < 60 GiB)
    python bench/planner_validate.py --smoke    # tiny shapes on CPU: proves the script runs

Each row is planned with the preset of the GPU it runs on (planner/hardware.py gpu_for_device) and the host terms
measured here. The result records each row's settings, so `--refit RESULT [--write]` fits that card's constants
(teratrain/planner/calibration/<card>.toml) on the rows not named "held-out"; tabulated in docs/planner.md.

Several GPUs of one host (bench/planner_modes.py; one torchrun job, rows in the same processes):

    python bench/planner_validate.py --gpus 2 --out r.json --table   # >= 20 layouts (planner_rows.py), ~5-6 min
    python bench/planner_validate.py --gpus 2 --check-pick --hw-file r.json --out pick.json --table
    python bench/planner_validate.py --refit r.json                  # the constants r.json would change
    python bench/planner_validate.py --gpus 2 --smoke [--check-pick] # 2 gloo CPU processes, tiny shapes

--gpus N first measures the machine's collectives (all-reduce, reduce-scatter, all-gather, all-to-all,
point-to-point at 5 sizes), PCIe and CPU AdamW, writes them under "hw" (which `teratrain plan
--hw-file r.json` reads), then each layout next to the planner's prediction with those terms.
--check-pick measures the planner's pick and its next 5 candidates for llama-1b and for the largest
Llama the N GPUs fit: the pick must be the fastest measured or within 5% of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from teratrain.collector import Collector  # noqa: E402
from teratrain.config import load_config  # noqa: E402
from teratrain.planner.activations import forward_saved  # noqa: E402
from teratrain.planner.hardware import gpu_for_device, gpu_with  # noqa: E402
from teratrain.planner.inputs import layout_of, shape_of, training_of  # noqa: E402
from teratrain.optim.engine import train_step  # noqa: E402
from teratrain.measure import build_engine, random_batch, saved_bytes  # noqa: E402
from teratrain.planner.refit import how_it_runs  # noqa: E402
from teratrain.planner.search import evaluate  # noqa: E402
from machine import HOST_NUMEL, host_adam, host_cast, pcie_gbps  # noqa: E402

GIB = 2**30
# (name, --set overrides). bf16 unless stated; sizes chosen to span GPU-bound and host-bound steps.
GPU_CONFIGS = [
    ("llama-1b mb2", ["model.preset=llama-1b", "train.micro_batch=2"]),
    ("llama-1b mb4 full", ["model.preset=llama-1b", "train.micro_batch=4", "memory.recompute=full"]),
    ("llama-1b mb4 selective", ["model.preset=llama-1b", "train.micro_batch=4", "memory.recompute=selective"]),
    ("llama-1b mb2 sqrt", ["model.preset=llama-1b", "train.micro_batch=2", "memory.recompute=sqrt"]),
    ("llama-1b mb2 zero1", ["model.preset=llama-1b", "train.micro_batch=2", "parallel.zero=1"]),
    ("llama-8b 4 layers T4096", ["model.preset=llama-8b", "model.n_layers=4", "model.seq_len=4096",
                                 "train.micro_batch=1"]),
    ("gpt2-774m mb8", ["model.preset=gpt2-774m", "train.micro_batch=8"]),
    ("gpt2-350m mb8 full", ["model.preset=gpt2-350m", "train.micro_batch=8", "memory.recompute=full"]),
    ("gpt2-350m mb2", ["model.preset=gpt2-350m", "train.micro_batch=2"]),
    ("gpt2-350m mb4 fp32", ["model.preset=gpt2-350m", "train.micro_batch=4", "memory.precision=fp32"]),
    ("gpt2-350m mb4 zero2 offload", ["model.preset=gpt2-350m", "train.micro_batch=4", "parallel.zero=2",
                                     "parallel.offload=optimizer"]),
    # held out: not used to calibrate hardware.GPU's calibrated defaults
    ("held-out llama-1b mb1", ["model.preset=llama-1b", "train.micro_batch=1"]),
    ("held-out llama-8b 8 layers T2048 mb2 selective", ["model.preset=llama-8b", "model.n_layers=8",
                                                        "model.seq_len=2048", "train.micro_batch=2",
                                                        "memory.recompute=selective"]),
    ("held-out gpt2-1.5b mb4 every-3", ["model.preset=gpt2-1.5b", "train.micro_batch=4", "memory.recompute=every-k",
                                        "memory.recompute_every=3"]),
    ("held-out gpt2-124m mb16", ["model.preset=gpt2-124m", "train.micro_batch=16"]),
]
SMOKE_CONFIGS = [
    ("tiny", ["model.preset=tiny", "train.micro_batch=2"]),
    ("tiny full", ["model.preset=tiny", "train.micro_batch=2", "memory.recompute=full"]),
    ("tiny gpt2 zero1", ["model.preset=tiny", "model.arch=gpt2", "train.micro_batch=2", "parallel.zero=1"]),
]
COMMON = ["memory.precision=bf16", "train.compile=false"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def phases(model, engine, batch, precision: str, device: torch.device, repeats: int = 3) -> dict[str, float]:
    """Peak allocated GiB and median seconds of forward, backward and the optimizer step, each
    measured on its own (synchronized, peak counter reset) over `repeats` further steps."""
    from teratrain.memory.precision import autocast
    from teratrain.models.transformer import lm_loss

    x, y = batch
    peaks: dict[str, list[float]] = {}
    times: dict[str, list[float]] = {}

    def timed(name, fn):
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.setdefault(name, []).append(time.perf_counter() - t0)
        peaks.setdefault(name, []).append(torch.cuda.max_memory_allocated(device) / GIB)
        return out

    for _ in range(repeats):
        def forward():
            with autocast(precision, device):
                return lm_loss(model(x), y)
        loss = timed("forward", forward)
        timed("backward", lambda: engine.backward(loss))
        loss = None  # free the graph before the step
        timed("step", lambda: engine.step(1e-4))
    return {**{f"{k}_peak_gib": max(v) for k, v in peaks.items()},
            **{f"{k}_s": statistics.median(v) for k, v in times.items()}}


def full_sets(sets: list[str]) -> list[str]:
    """The --set overrides a row runs with (recorded in the result, so that planner/refit.py plans it again)."""
    return COMMON + sets + [f"train.global_batch={_mb(sets)}"]


def preset_of(device: torch.device, hw: dict):
    """The planner's preset for this device (the H200's on CPU), with the host terms measured here."""
    if device.type != "cuda":
        return gpu_with("h200", hw)
    props = torch.cuda.get_device_properties(device)
    return replace(gpu_for_device(props.name, props.total_memory), **hw)


def measure(name: str, sets: list[str], device: torch.device, steps: int, warmup: int, hw: dict,
            profile: bool = False) -> dict:
    cfg = load_config(None, full_sets(sets))
    model, engine = build_engine(cfg, device)
    batch = random_batch(cfg, cfg.train.micro_batch, device)
    times = []
    collector = Collector()  # the garbage collector as `teratrain train` runs it (teratrain/collector.py)
    with collector:
        for i in range(warmup + steps):
            if i == warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)  # steady state: optimizer state already exists
            sync(device)
            t0 = time.perf_counter()
            train_step(model, engine, [batch], cfg.memory.precision, 1e-4)
            sync(device)
            times.append(time.perf_counter() - t0)
            collector.step()
        row = {"name": name, "held_out": name.startswith("held-out"), "sets": full_sets(sets),
               "measured_step_s": statistics.median(times[warmup:]),
               "step_times_s": [round(t, 5) for t in times[warmup:]]}
        if device.type == "cuda":
            row["measured_peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            row["measured_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
            free, total = torch.cuda.mem_get_info(device)
            row["outside_allocator_gib"] = (total - free - torch.cuda.memory_reserved(device)) / GIB
            row["phases"] = phases(model, engine, batch, cfg.memory.precision, device)
        if profile:  # the GPU's busy time a step (what the planner's gpu_s predicts) and its idle time
            from trace_summary import profile_steps

            prof = profile_steps(lambda: train_step(model, engine, [batch], cfg.memory.precision, 1e-4), device)
            row["profile"] = {**{k: prof[k] for k in ("window_ms", "busy_ms", "idle_ms", "kernels_per_step")},
                              "kinds_ms": {k: v["ms"] for k, v in prof.get("kinds", {}).items()}}
    row["measured_saved_bytes"] = saved_bytes(model, *batch, cfg.memory.precision)
    row["measured_states"] = engine.last_state_bytes
    del model, engine, batch
    _predict(row, cfg, device, hw)
    return row


def _mb(sets: list[str]) -> int:
    return next(int(s.split("=")[1]) for s in sets if s.startswith("train.micro_batch="))


def _predict(row: dict, cfg, device: torch.device, hw: dict) -> None:
    shape, train = shape_of(cfg), training_of(cfg)
    lay = layout_of(cfg, 1)
    gpu = preset_of(device, hw)
    cand = evaluate(shape, train, lay, gpu)
    w = train.widths(lay.zero, lay.offload)
    n = lay.micro_batch * cfg.model.seq_len
    row["layout"] = {k: v for k, v in lay.as_dict().items() if k in ("zero", "micro_batch", "recompute", "offload")}
    row["predicted_saved_bytes"] = forward_saved(shape, w, n, cfg.model.seq_len, lay.recompute, lay.recompute_every,
                                                 device=device.type)
    row["saved_err_pct"] = _err(row["predicted_saved_bytes"], row["measured_saved_bytes"])
    row["predicted_states"] = {k: getattr(cand.memory, k) for k in ("params", "grads", "optimizer")}
    row["predicted_peak_gib"] = cand.memory.peak_allocated / GIB
    row["predicted_phase"] = cand.memory.phase
    row["predicted_phases_gib"] = {k: round(v / GIB, 3) for k, v in cand.memory.phases.items()}
    row["predicted_step_s"] = cand.time.step_time_s
    row["predicted_gpu_s"], row["predicted_host_s"] = cand.time.terms["gpu_s"], cand.time.terms["host_s"]
    row["predicted_time_terms"] = {k: round(v, 5) for k, v in cand.time.as_dict().items() if k.endswith("_s")}
    row["time_err_pct"] = _err(row["predicted_step_s"], row["measured_step_s"])
    if "measured_peak_gib" in row:
        row["peak_err_pct"] = _err(row["predicted_peak_gib"], row["measured_peak_gib"])
        # what must fit: the allocator's reserved peak plus what lives outside it, vs peak + allowance
        row["predicted_total_gib"] = cand.memory.total / GIB
        row["measured_total_gib"] = row["measured_reserved_gib"] + row["outside_allocator_gib"]
        row["total_err_pct"] = _err(row["predicted_total_gib"], row["measured_total_gib"])
        peak = gpu.peak_flops(cfg.memory.precision)
        row["mfu_measured"] = round(cand.time.model_flops_per_step / row["measured_step_s"] / peak, 4)
        row["mfu_predicted"] = round(cand.time.mfu, 4)


HOST_PACED_IDLE = 0.10  # a profiled step whose GPU idles more than this share of it is paced by the host


def _err(pred: float, meas: float) -> float:
    return round(100.0 * (pred - meas) / meas, 2) if meas else float("nan")


def markdown(out: dict) -> str:
    """The validation table for docs/planner.md and bench/README.md."""
    host = out["hw"]
    cast = f", cast {host['host_cast_params_per_s'] / 1e9:.2f}" if "host_cast_params_per_s" in host else ""
    lines = [f"{out['device']}, torch {out['torch']}; host: PCIe {host.get('pcie_gbps', 0):.0f} GB/s, "
             f"CPU AdamW {host['host_adam_params_per_s'] / 1e9:.2f}{cast} G params/s", "",
             "| config | peak GiB meas / pred (err) | step ms meas / pred (err) | saved err | "
             "reserved+context GiB meas / pred total (err) |", "|---|---|---|---|---|"]
    for r in out["rows"]:
        if "error" in r:
            lines.append(f"| {r['name']} | error: {r['error']} | | | |")
            continue
        lines.append(f"| {r['name']} | {r.get('measured_peak_gib', 0):.2f} / {r['predicted_peak_gib']:.2f} "
                     f"({r.get('peak_err_pct', 0):+.1f}%) | {1e3 * r['measured_step_s']:.1f} / "
                     f"{1e3 * r['predicted_step_s']:.1f} ({r['time_err_pct']:+.1f}%) | {r['saved_err_pct']:+.2f}% | "
                     f"{r.get('measured_total_gib', 0):.2f} / {r.get('predicted_total_gib', 0):.2f} "
                     f"({r.get('total_err_pct', 0):+.1f}%) |")
    profiled = [r for r in out["rows"] if "profile" in r]
    if profiled:  # where the step's time goes: the GPU's busy time against the planner's, the host's share
        lines += ["", "| config | GPU busy ms a step meas / pred (err) | GPU idle | host ms pred | paced by, "
                  "measured / planned |", "|---|---|---|---|---|"]
        for r in profiled:
            p = r["profile"]
            busy, idle = p["busy_ms"], p["idle_ms"] / max(p["window_ms"], 1e-9)
            gpu_ms = 1e3 * (r["predicted_gpu_s"] + r["predicted_time_terms"]["optimizer_s"])  # the GPU's work
            paced = "-" if not p["window_ms"] else "host" if idle > HOST_PACED_IDLE else "GPU"  # "-": no kernels
            planned = "host" if r["predicted_host_s"] > r["predicted_gpu_s"] else "GPU"
            lines.append(f"| {r['name']} | {busy:.1f} / {gpu_ms:.1f} ({_err(gpu_ms, busy):+.1f}%) | {100 * idle:.0f}% "
                         f"| {1e3 * r['predicted_host_s']:.1f} | {paced} / {planned} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny CPU configs: check the script, not the planner")
    ap.add_argument("--only", help="run configs whose name contains this")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one config in this process
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--table", action="store_true", help="also print the markdown table (after the JSON)")
    ap.add_argument("--profile", action="store_true", help="also profile two steps a row: the GPU's busy and idle "
                    "time, against the planner's GPU and host terms (a second table)")
    ap.add_argument("--hw", default="{}", help=argparse.SUPPRESS)  # internal: measured host numbers
    ap.add_argument("--host", action="store_true", help=argparse.SUPPRESS)  # internal: measure them
    ap.add_argument("--gpus", type=int, help="validate layouts on this many GPUs of this host (2 or 4)")
    ap.add_argument("--check-pick", action="store_true", help="with --gpus: measure the planner's pick and the "
                    "next 5 candidates")
    ap.add_argument("--hw-file", help="with --check-pick: plan with the terms a --gpus run measured")
    ap.add_argument("--budget-s", type=float, default=400.0, help="with --gpus: wall-time budget in seconds (the "
                    "rows' first visits get 65%% of it, 50%% with relaunches)")
    ap.add_argument("--relaunches", type=int, default=2, help="with --gpus: jobs after the main one that run the host "
                    "probe and the host-paced rows again in fresh processes, while the budget leaves time")
    ap.add_argument("--refit", metavar="RESULT", help="print what a result of this script would change in the planner")
    ap.add_argument("--write", action="store_true", help="with --refit: write the refitted constants into "
                    "teratrain/planner/calibration/<card>.toml")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    if args.refit:
        import tomllib

        from teratrain.planner.refit import refit, render

        manifest = tomllib.loads((ROOT / "tests" / "fixtures" / "planner_runs" / "manifest.toml").read_text())["runs"]
        path = Path(args.refit).resolve()
        split = next((e["split"] for e in manifest.values() if (ROOT / e["file"]).resolve() == path), "fit")
        result = json.loads(path.read_text())
        report = refit(result, split)
        print(render(report))
        if args.write:  # the fitted constants into the card's teratrain/planner/calibration/<card>.toml
            from teratrain.planner.hardware import gpu_for_device
            from teratrain.planner.refit import calibration_updates, write_calibration

            card = gpu_for_device(result["device"], 0).name
            run = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
            write_calibration(card, calibration_updates(report, run))
        return 0
    if args.gpus:
        return _several(args)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    configs = dict(SMOKE_CONFIGS if device.type == "cpu" else GPU_CONFIGS)
    if args.one:
        hw = json.loads(args.hw)
        print(json.dumps(measure(args.one, configs[args.one], device, args.steps, 1 if args.smoke else 2, hw,
                                 args.profile)))
        return 0
    if args.host:
        numel = 5_000_000 if args.smoke else HOST_NUMEL
        hw = {"host_adam_params_per_s": host_adam(numel), "host_cast_params_per_s": host_cast(numel)}
        if device.type == "cuda":
            hw["pcie_gbps"] = pcie_gbps()
        print(json.dumps(hw))
        return 0
    # the host link and CPU optimizer are this machine's, not the preset's: measure them (in a
    # process of their own, so no CUDA context stays behind), then plan with them
    cmd = [sys.executable, __file__, "--host"] + (["--smoke"] if args.smoke else [])
    hw = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    rows = []
    for name in configs:
        if args.only and args.only not in name:
            continue
        # one process per config: a fresh allocator (clean peaks, no memory kept by the previous
        # engine, whose gradient hooks keep it alive) and a CUDA context measured on its own
        cmd = [sys.executable, __file__, "--one", name, "--steps", str(args.steps), "--hw", json.dumps(hw)]
        cmd += (["--smoke"] if args.smoke else []) + (["--profile"] if args.profile else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            rows.append({"name": name, "error": done.stderr.strip().splitlines()[-1:]})
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{name}: done", file=sys.stderr)
    gpu = preset_of(device, hw)
    # planner/refit.py reads the device, its memory, the host terms ("hw") and each row's sets: `--refit` fits
    # the card's constants (calibration/<card>.toml) on the rows not held out
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "gpus": 1,
           "device_mem_gib": gpu.memory_gib, "gpu_preset": gpu.name, "torch": torch.__version__,
           "hw": hw, **how_it_runs(), "garbage collector": "frozen as teratrain train freezes it", "rows": rows}
    for key in ("peak_err_pct", "time_err_pct", "saved_err_pct", "total_err_pct"):
        errs = [abs(r[key]) for r in rows if key in r]
        if errs:
            out[f"worst_{key}"] = max(errs)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.table:
        print(markdown(out))
    return 0


def _several(args) -> int:
    """--gpus N [--check-pick]: one JSON object (and the table), written to --out too."""
    import planner_modes
    from teratrain.planner.hardware import read_hw_file

    if args.check_pick:
        hw = read_hw_file(args.hw_file)[0] if args.hw_file else {}
        out = planner_modes.check_pick(args, hw)
        table = planner_modes.pick_markdown(out)
    else:
        out = planner_modes.validate_gpus(args)
        table = planner_modes.markdown(out)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.table:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
