"""Where a step's GPU time goes, from a torch.profiler trace: time in NCCL kernels and how much of it
no compute kernel hides, time in pure data movement (casts, copies, cat, memcpy/memset), idle gaps
(no kernel on any stream), and the top ops by their own device time. Without a GPU (the --smoke
runs) the kernel figures are zero and the top ops are ranked by CPU time, so the code path runs.

    summary = profile_steps(step, device, steps=2)
    python bench/trace_summary.py TRACE.json.gz [--steps 2]   # a saved trace (bench/moe.py --trace): host-late gaps

A gap the host causes: the device idles, and the kernel after the gap was launched only after the device had
run dry (its launch call ended after the last kernel did). `host_late_gaps` sums those gaps by the host ops that
were launching it (outermost and innermost CPU op around the launch), so an eager step paced by the host shows
which of its ops the device waited on.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import time

import torch
from torch.profiler import DeviceType, profile

from common import sync  # bench/ is on sys.path wherever this module is imported
from pipeline_profile import activities, length, minus, union

# Kernels that only move bytes. Casts and .contiguous() run as `direct_copy_kernel`, torch.cat as
# `CatArrayBatchedCopy`, cross-device/stream copies as Memcpy; Memset zeroes buffers; FSDP2 casts its
# gradients into its reduce-scatter input with `chunk_cat_cuda_kernel`.
COPY_MARKS = ("copy", "memcpy", "memset", "chunk_cat")
# Matrix kernels whose names hold a copy mark too: CUTLASS's mangled template names spell out their
# copy atoms (torch._grouped_mm's kernel: 31.6 of the 47 ms a step counted as copies in the MoE bench's
# ep=2 profile on 2 x H200), and inductor's template GEMMs (max-autotune) are named after the
# casts fused into them. cuBLAS's nvjet and sm90 xmma names hold no copy mark today.
GEMM_MARKS = ("gemm", "cutlass", "nvjet", "xmma", "triton_tem")
# Attention kernels: cuDNN's (`cudnn_generated_fort_native_sdpa_...`), flash (`pytorch_flash::flash_fwd_kernel`),
# memory-efficient (`fmha_cutlassF_...`). Inductor's fused kernels (`triton_poi_fused_...`) are named after the
# ops they fuse, attention's among them, so they are sorted before any name mark is read.
ATTENTION_MARKS = ("sdpa", "flash", "fmha", "attention")
# The fused AdamW and clipping's norms and scaling: multi-tensor kernels (their weight casts are copies).
OPTIMIZER_MARKS = ("adam", "multi_tensor_apply", "foreach")
KINDS = ("gemm", "attention", "elementwise", "copy", "optimizer", "nccl")


def is_copy(name: str) -> bool:
    """A kernel that only moves bytes, by its name (a fused kernel inductor names after a cast counts)."""
    low = name.lower()
    return "nccl" not in low and any(m in low for m in COPY_MARKS) and not any(m in low for m in GEMM_MARKS)


def kernel_kind(name: str) -> str:
    """One of KINDS for a kernel, by its name: inductor's fused kernels are elementwise (or copies when
    they only cast), its template GEMMs GEMMs."""
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if low.startswith("triton_") and not low.startswith("triton_tem"):
        return "copy" if is_copy(name) else "elementwise"
    for kind, marks in (("attention", ATTENTION_MARKS), ("gemm", GEMM_MARKS)):
        if any(m in low for m in marks):
            return kind
    if is_copy(name):
        return "copy"
    return "optimizer" if any(m in low for m in OPTIMIZER_MARKS) else "elementwise"


def kernel_kinds(kernels: list[tuple[str, float, float]], steps: int) -> dict:
    """Device time per step by kernel kind (KINDS): {kind: {"ms", "share" of the kernels' time, "kernels"
    per step, "top": its three longest kernels by name}}."""
    by: dict[str, list] = {k: [] for k in KINDS}
    for k in kernels:
        by[kernel_kind(k[0])].append(k)
    total = sum(b - a for _, a, b in kernels) or 1.0
    return {kind: {"ms": round(sum(b - a for _, a, b in ks) * 1e-3 / steps, 3),
                   "share": round(sum(b - a for _, a, b in ks) / total, 4), "kernels": len(ks) // steps,
                   "top": _top_names(ks, steps, top=3)} for kind, ks in by.items() if ks}


def traced_kernels(step, device: torch.device, steps: int = 2, trace: str | None = None) -> tuple:
    """Run step() `steps` times under the profiler (after one untraced call): the profile, every
    device kernel as (name, start_us, end_us), and the traced steps' wall seconds. `trace`: also write
    the Chrome trace there (gzipped when it ends in .gz; open it in Perfetto)."""
    step()
    sync(device)
    with profile(activities=activities(device)) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        wall = time.perf_counter() - t0
    if trace:
        prof.export_chrome_trace(trace)
    # a record_function range (the optimizer's "Optimizer.step#AdamW.step") also shows on the device as a
    # user annotation spanning its kernels: not a kernel, so not counted
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
               and not getattr(e, "is_user_annotation", False)]
    return prof, kernels, wall


def profile_steps(step, device: torch.device, steps: int = 2, top: int = 15, trace: str | None = None) -> dict:
    """Run step() `steps` times under the profiler (after one untraced call) and summarize per step
    (`trace`: also write the Chrome trace there)."""
    prof, kernels, _ = traced_kernels(step, device, steps, trace)
    out = kernel_account(kernels, steps)
    out["kinds"] = kernel_kinds(kernels, steps)
    out["top_ops"] = top_ops(prof, device, steps, top)
    out["host"] = host_account(prof, steps)
    return out


def kernel_account(kernels: list[tuple[str, float, float]], steps: int) -> dict:
    """(name, start_us, end_us) of every device kernel -> milliseconds per step by kind."""
    nccl = [(a, b) for n, a, b in kernels if "nccl" in n.lower()]
    named_copies = [k for k in kernels if is_copy(k[0])]
    copies = [(a, b) for _, a, b in named_copies]
    compute = [(a, b) for n, a, b in kernels if "nccl" not in n.lower()]  # copies occupy the GPU too
    busy = union([(a, b) for _, a, b in kernels])
    window = (max(b for _, b in busy) - min(a for a, _ in busy)) if busy else 0.0
    per = 1e-3 / steps  # us over all steps -> ms per step
    nccl_u = union(nccl)
    return {"window_ms": round(window * per, 3), "busy_ms": round(length(busy) * per, 3),
            "idle_ms": round((window - length(busy)) * per, 3),
            "nccl_ms": round(length(nccl_u) * per, 3),
            "nccl_exposed_ms": round(minus(nccl_u, union(compute)) * per, 3),
            "copy_ms": round(length(union(copies)) * per, 3), "copy_kernels_per_step": len(copies) // steps,
            "nccl_kernels_per_step": len(nccl) // steps, "kernels_per_step": len(kernels) // steps,
            "top_copy_kernels": _top_names(named_copies, steps), "longest_gaps": longest_gaps(kernels)}


def longest_gaps(kernels: list[tuple[str, float, float]], top: int = 6) -> list[dict]:
    """Where the device idles: the `top` longest gaps with no kernel running, each with the kernel that
    ended before it and the one that started after it (the host's work between them is the gap's cause)."""
    gaps, end, last = [], None, None
    for name, a, b in sorted(kernels, key=lambda k: k[1]):
        if end is not None and a > end:
            gaps.append((a - end, last, name))
        if end is None or b > end:
            end, last = b, name
    return [{"ms": round(us * 1e-3, 3), "after": before[:100], "before": after[:100]}
            for us, before, after in sorted(gaps, key=lambda g: -g[0])[:top]]


def _top_names(kernels: list[tuple[str, float, float]], steps: int, top: int = 8) -> list[dict]:
    """The kernels of one kind by name, the most device time first: ms per step and launches per step
    (a fused kernel inductor names after a cast counts as a copy: its name says what it fuses)."""
    by_name: dict[str, list[float]] = {}
    for name, a, b in kernels:
        by_name.setdefault(name, []).append(b - a)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"kernel": name[:160], "ms": round(sum(ts) * 1e-3 / steps, 3), "per_step": len(ts) / steps}
            for name, ts in ranked]


def top_ops(prof, device: torch.device, steps: int, top: int) -> list[dict]:
    """The ops with the most self device time (self CPU time without a GPU), per step."""
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, attr), reverse=True)[:top]
    return [{"op": e.key, "self_ms": round(getattr(e, attr) / 1e3 / steps, 3), "calls": e.count // steps}
            for e in rows]


def host_account(prof, steps: int, top: int = 10) -> dict:
    """Where the host's time goes, per step: the CUDA runtime and driver calls (cudaLaunchKernel, and any that
    block the host: cudaStreamSynchronize, cudaEventSynchronize, cudaMemcpy, cudaMalloc, cudaFree...)
    by total time, and the ops with the most self CPU time. A device that idles while the host is
    busy shows here as the call or op that took the time."""
    rows = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU and e.cpu_time_total > 0]
    runtime = sorted((e for e in rows if e.key.startswith("cu")), key=lambda e: e.cpu_time_total, reverse=True)
    ops = sorted((e for e in rows if not e.key.startswith("cu")), key=lambda e: e.self_cpu_time_total, reverse=True)
    per = 1e-3 / steps
    return {"runtime_calls": [{"call": e.key, "ms": round(e.cpu_time_total * per, 3), "calls": e.count // steps}
                              for e in runtime[:top]],
            "top_cpu_ops": [{"op": e.key, "self_cpu_ms": round(e.self_cpu_time_total * per, 3), "calls": e.count // steps}
                            for e in ops[:top]]}


def host_late_gaps(events: list[dict], steps: int = 1, top: int = 20, min_us: float = 5.0) -> dict:
    """A Chrome trace's events (torch.profiler's export_chrome_trace) -> ms per step of device idle gaps
    (no kernel, memcpy or memset running, `min_us` or longer), of those the host caused (the next kernel's
    launch ended after the device ran dry), and the host-late time by (outermost, innermost) CPU op around
    that launch on its thread, the most first: {"gaps_ms", "host_late_ms", "by_op": [{"ops", "ms", "gaps"}]}."""
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    late, gaps, end = [], 0.0, None
    for k in device:
        if end is not None and k["ts"] - end >= min_us:
            gaps += k["ts"] - end
            launch = launches.get(k.get("args", {}).get("correlation"))
            if launch is not None and launch["ts"] + launch["dur"] > end:
                late.append((launch["tid"], launch["ts"], k["ts"] - end))
        end = k["ts"] + k["dur"] if end is None else max(end, k["ts"] + k["dur"])
    around = _ops_around(events, [(tid, ts) for tid, ts, _ in late])
    by, count = collections.Counter(), collections.Counter()
    for (tid, ts, gap) in late:
        by[around[(tid, ts)]] += gap
        count[around[(tid, ts)]] += 1
    per = 1e-3 / steps
    return {"gaps_ms": round(gaps * per, 3), "host_late_ms": round(sum(g for *_, g in late) * per, 3),
            "by_op": [{"ops": list(ops), "ms": round(us * per, 3), "gaps": count[ops] / steps}
                      for ops, us in by.most_common(top)]}


def _ops_around(events: list[dict], queries: list[tuple]) -> dict:
    """{(tid, ts): (outermost, innermost) CPU op name running on thread tid at ts ("-" where none)}: one
    sweep per thread over its ops in start order, keeping the stack of those still open (ops nest)."""
    ops = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e:
            ops[e["tid"]].append(e)
    times_of = collections.defaultdict(list)
    for tid, ts in queries:
        times_of[tid].append(ts)
    out = {}
    for tid, times in times_of.items():
        run, stack, i = sorted(ops.get(tid, []), key=lambda e: (e["ts"], -e["dur"])), [], 0
        for ts in sorted(times):
            while i < len(run) and run[i]["ts"] <= ts:
                while stack and stack[-1]["ts"] + stack[-1]["dur"] < run[i]["ts"]:
                    stack.pop()
                stack.append(run[i])
                i += 1
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < ts:
                stack.pop()
            open_ = [e for e in stack if e["ts"] + e["dur"] >= ts]
            out[(tid, ts)] = (open_[0]["name"], open_[-1]["name"]) if open_ else ("-", "-")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="Host-late device gaps of a saved torch.profiler trace, by host op.")
    ap.add_argument("trace", help="a Chrome trace (.json or .json.gz), e.g. from bench/moe.py --trace")
    ap.add_argument("--steps", type=int, default=2, help="steps the trace holds (bench scripts trace 2)")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    out = host_late_gaps(events, args.steps, args.top)
    print(f"device idle {out['gaps_ms']:.1f} ms a step, {out['host_late_ms']:.1f} of it waiting on the host; by the "
          "host ops launching the kernel after each gap (outermost / innermost):")
    for row in out["by_op"]:
        print(f"{row['ms']:8.2f} ms {row['gaps']:7.1f} gaps  {' / '.join(row['ops'])}")


if __name__ == "__main__":
    main()
