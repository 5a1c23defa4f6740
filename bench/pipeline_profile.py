"""One profiled pipeline step (torch.profiler): where one rank's device time goes, and what the host
spends issuing each kind of action. bench/pipeline.py --profile puts it in its JSON.

`account(kernels)`, from the device kernels of one step on one rank as (start_s, end_s, name):
- compute_s: time some kernel other than NCCL's runs;
- comm_s: time some NCCL kernel runs; exposed_comm_s: the part of it no compute kernel overlaps.
  A receive's kernel spins until its peer's send arrives, so this is the transfer plus the wait for
  the peer (the bubble seen from this rank), for as long as the receive was posted;
- idle_s: time no kernel runs (the host has not issued the next one yet, or a wait outside NCCL);
- span_s: first kernel start to last kernel end = compute_s + exposed_comm_s + idle_s.
`host_ms`: per action kind (the "pipeline.F" ... ranges the executor marks), the mean host time to
issue one action; on a GPU the host runs ahead of the device unless this exceeds the device time.
The span arithmetic (union, length, minus) and the profiler's activities serve bench/trace_summary.py too.
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterable

import torch


def activities(device: torch.device) -> list:
    """What torch.profiler records: the host, and the device kernels where there is a GPU."""
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted cover of the spans."""
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(spans: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in spans)


def minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of union `a` not covered by union `b` (both disjoint and sorted)."""
    total, j = 0.0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        total += max(0.0, e - cur)
    return total


def account(kernels: list[tuple[float, float, str]]) -> dict:
    if not kernels:
        return {"span_s": 0.0, "compute_s": 0.0, "comm_s": 0.0, "exposed_comm_s": 0.0, "idle_s": 0.0, "kernels": 0}
    comm = union((s, e) for s, e, name in kernels if "nccl" in name.lower())
    compute = union((s, e) for s, e, name in kernels if "nccl" not in name.lower())
    span = max(e for _, e, _ in kernels) - min(s for s, _, _ in kernels)
    busy = length(union([*comm, *compute]))
    return {"span_s": span, "compute_s": length(compute), "comm_s": length(comm),
            "exposed_comm_s": minus(comm, compute), "idle_s": span - busy, "kernels": len(kernels)}


def profile_step(step: Callable[[], None], device: torch.device, top: int = 8) -> dict:
    """Profile the second of two calls of step() (the first warms the profiler up)."""
    from torch.autograd import DeviceType
    from torch.profiler import profile, schedule

    got = []  # the active step's events, taken before the profiler clears them at the cycle's end
    with warnings.catch_warnings(), profile(
            activities=activities(device), schedule=schedule(wait=0, warmup=1, active=1),
            on_trace_ready=lambda p: got.append((p.events(), p.key_averages()))) as prof:
        warnings.simplefilter("ignore")  # "the profiler clears events at the end of each cycle": taken above
        for _ in range(2):
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            prof.step()
    events, averages = got[0]
    kernels = [(e.time_range.start / 1e6, e.time_range.end / 1e6, e.name) for e in events
               if e.device_type == DeviceType.CUDA]
    host = {}
    for e in averages:
        if e.key.startswith("pipeline.") and e.count:
            host[e.key.split(".", 1)[1]] = {"count": e.count, "ms": round(e.cpu_time_total / 1e3 / e.count, 3)}
    by_kernel: dict[str, list[float]] = {}
    for s, e, name in kernels:
        by_kernel.setdefault(name, []).append(e - s)
    heavy = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
    out = {k: round(v, 6) if isinstance(v, float) else v for k, v in account(kernels).items()}
    return {**out, "host_ms": host,
            "top_kernels": [{"name": n[:90], "count": len(t), "ms": round(sum(t) * 1e3, 3)} for n, t in heavy]}
