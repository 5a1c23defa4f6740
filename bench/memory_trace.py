"""What is alive at one training step's memory peak, and what allocated it (bench/fsdp2_compare.py).

One step runs with allocation tracing on; the trace is replayed to find the moment the allocated
bytes peak and the blocks alive then, each named by the Python frames that allocated it:
- on a GPU, `torch.cuda.memory._record_memory_history` (allocation stacks) and the trace of
  `torch.cuda.memory._snapshot()`: `alloc` adds a block, `free_requested` removes it (the caching
  allocator's "allocated" bytes, as `torch.cuda.max_memory_allocated` counts them);
- on a CPU (`--smoke`), the profiler's memory events (`profile_memory=True`), whose allocations
  name the operators and Python frames around them.
Memory allocated before the step (the model states) is counted as `before_step`; the summary groups
what the step allocated and still holds at its peak by allocation site, largest first.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch

MIB = 2**20
# Frames worth naming a block by: our code, the benchmark, FSDP2, and what autograd/modules run
KEEP = ("teratrain" + os.sep, "bench" + os.sep, os.path.join("distributed", "fsdp"), os.path.join("torch", "nn"),
        os.path.join("torch", "autograd"), os.path.join("torch", "optim"))


def peak_of(events: list[tuple[str, int, int, str]], before: int = 0, top: int = 12,
            totals: list[int] | None = None) -> dict:
    """Replay `events` ((kind 'alloc' | 'free', address, bytes, site), in time order) from `before`
    bytes already allocated: the peak, and the step's blocks alive at it, grouped by site.
    `totals`: the allocator's own running total after each event, where frees can go unseen."""
    running, peak, at = before, before, -1
    for i, (kind, _, size, _) in enumerate(events):
        running = totals[i] if totals is not None else running + (size if kind == "alloc" else -size)
        if running > peak:
            peak, at = running, i
    live: dict[int, tuple[int, str]] = {}
    for kind, addr, size, site in events[:at + 1]:
        if kind == "alloc":
            live[addr] = (size, site)  # an unseen free left its address to this block
        else:
            live.pop(addr, None)  # a block allocated before the step is part of `before`
    by_site: dict[str, list[int]] = defaultdict(list)
    for size, site in live.values():
        by_site[site].append(size)
    held = sum(size for size, _ in live.values())
    sites = sorted(by_site.items(), key=lambda kv: -sum(kv[1]))
    return {"peak_mib": round(peak / MIB, 3), "before_step_mib": round((peak - held) / MIB, 3),
            "step_allocations_alive_at_peak_mib": round(held / MIB, 3), "events": len(events),
            "largest_sites_at_peak": [{"mib": round(sum(s) / MIB, 3), "blocks": len(s),
                                       "largest_mib": round(max(s) / MIB, 3), "site": site} for site, s in sites[:top]],
            # a compiled graph's blocks all come from one site: their sizes tell them apart
            "largest_blocks_mib": sorted((round(size / MIB, 3) for size, _ in live.values()), reverse=True)[:top],
            "peak_event": at, "events_after_peak": len(events) - 1 - at}


def site_of(frames: list[dict]) -> str:
    """`file:line(function)` of the innermost frames in code worth naming (up to 3, innermost
    first), else the innermost frame."""
    kept = [f for f in frames if any(k in f.get("filename", "") for k in KEEP)] or frames[:1]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}({f['name']})" for f in kept[:3]) or "?"


def traced_step(step, dev: torch.device, top: int = 12) -> dict:
    """Run step() once, tracing allocations, and summarize its peak (peak_of, its `top` sites)."""
    if dev.type == "cuda":
        return _cuda(step, dev, top)
    return _cpu(step, top)


def _cuda(step, dev: torch.device, top: int) -> dict:
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.memory._record_memory_history("all", context="all", stacks="python", max_entries=2_000_000)
    try:  # the history may still hold an earlier recording's events (no clear_history in every torch): skip them
        start = len(_trace(dev))
        step()
        torch.cuda.synchronize(dev)
        trace = _trace(dev)[start:]
    finally:
        torch.cuda.memory._record_memory_history(None)
    events = [("alloc" if e["action"] == "alloc" else "free", e["addr"], e["size"], site_of(e.get("frames", [])))
              for e in trace if e["action"] in ("alloc", "free_requested")]
    out = peak_of(events, before, top)
    out.update(max_allocated_mib=round(torch.cuda.max_memory_allocated(dev) / MIB, 3),
               max_reserved_mib=round(torch.cuda.max_memory_reserved(dev) / MIB, 3))
    return out


def _trace(dev: torch.device) -> list[dict]:
    return torch.cuda.memory._snapshot(dev)["device_traces"][dev.index or 0]


def _cpu(step, top: int) -> dict:
    """The profiler counts the allocations made while it runs (frees of older memory are not
    matched): `before` is 0 and the peak is what the step added. Frees on other threads (gloo's
    workers release the tensors of asynchronous collectives) are not events, but they lower the
    reporter's running total, which is used."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        step()
    found = []

    def walk(node):
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            frames, p = [], node.parent
            while p is not None:  # Python frames are named "file.py(line): function"
                name, _, rest = p.name.partition("(")
                line, _, func = rest.partition("): ")
                frames.append({"filename": name, "line": line, "name": func or p.name})
                p = p.parent
            found.append((node.start_time_ns, "alloc" if f.alloc_size > 0 else "free", f.ptr, abs(f.alloc_size),
                          site_of(frames), f.total_allocated))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    found.sort(key=lambda e: e[0])
    return peak_of([e[1:5] for e in found], top=top, totals=[e[5] for e in found])
