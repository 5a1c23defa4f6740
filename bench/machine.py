"""What the planner needs to know of this machine, measured: collective bandwidth and latency among
its GPUs, the host link (PCIe) and the CPU optimizer's speed.

Collectives: every rank of a process group calls `measure`: all-reduce, reduce-scatter, all-gather and all-to-all
over the whole group, and point-to-point sends (rank 2i to rank 2i+1, all pairs at once, as pipeline
stages send), each through teratrain.parallel.comm (the wrappers the engines use) at a few sizes.
A size is the whole tensor, as the planner counts it (planner/comm.py: an all-reduce's tensor, an
all-gather's output, a reduce-scatter's input, an all-to-all's input, one message). Each time is
the mean of `iters` back-to-back calls after 3 warm-up calls, the slowest rank's. nccl-tests'
quantities come with each row: algorithm bandwidth bytes/t and bus bandwidth fraction x bytes/t
(Thakur et al.'s ring fraction). `teratrain.planner.refit.fit_collectives` turns the rows into the
alpha-beta terms the planner takes (`<kind>_gbps`, `<kind>_alpha_s`).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from teratrain.parallel import comm
from teratrain.planner.comm import FRACTION

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p")
SIZES = (2**16, 2**20, 2**23, 2**26, 2**28)  # 64 KiB .. 256 MiB
SMOKE_SIZES = (2**10, 2**14, 2**18)


def _op(kind: str, nbytes: int, device: torch.device, group=None, dtype: torch.dtype | None = None):
    """A closure running one collective of `kind` on a `nbytes` tensor (`dtype`; default bf16 on GPUs,
    fp32 on CPU) over `group` (default every rank)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    elems = max(n, nbytes // dtype.itemsize) // n * n  # a multiple of the group size
    whole = torch.ones(elems, dtype=dtype, device=device)
    piece = torch.ones(elems // n, dtype=dtype, device=device)
    group = group or dist.group.WORLD
    if kind == "all_reduce":
        return lambda: comm.all_reduce(whole, group)
    if kind == "reduce_scatter":
        return lambda: comm.reduce_scatter(piece, whole, group)
    if kind == "all_gather":
        return lambda: comm.all_gather(whole, piece, group)
    if kind == "all_to_all":
        out, splits = torch.empty_like(whole), [elems // n] * n
        return lambda: comm.all_to_all(out, whole, splits, splits, group)
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    if peer >= n:  # an odd rank out: it waits at the barrier only
        return lambda: None
    send = rank % 2 == 0
    return lambda: (dist.send if send else dist.recv)(whole, peer)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_one(kind: str, nbytes: int, device: torch.device, iters: int, group=None,
             dtype: torch.dtype | None = None) -> float:
    """Seconds per call of one collective (`_op`'s), the slowest rank's."""
    return time_calls(_op(kind, nbytes, device, group, dtype), device, iters)


def time_calls(op, device: torch.device, iters: int) -> float:
    """Seconds per call of `op()` (a collective every rank calls): the mean of `iters` back-to-back
    calls after 3 warm-up calls, the slowest rank's."""
    for _ in range(3):
        op()
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    _sync(device)
    took = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def measure(device: torch.device, sizes=SIZES, iters: int = 20) -> list[dict]:
    """One row per (kind, size): bytes, seconds, algorithm and bus bandwidth in GB/s."""
    n = dist.get_world_size()
    rows = []
    for kind in KINDS:
        for nbytes in sizes:
            t = time_one(kind, nbytes, device, iters if nbytes < 2**26 else max(3, iters // 4))
            group = 2 if kind == "p2p" else n
            rows.append({"kind": kind, "ranks": group, "bytes": nbytes, "seconds": t,
                         "algbw_gbps": round(nbytes / t / 1e9, 3),
                         "busbw_gbps": round(FRACTION[kind](group) * nbytes / t / 1e9, 3)})
    return rows


# Parameters the host-step rates are measured on: a shard's size, not a cache's. On 4 x H100 (16 threads
# a rank, every rank at once) 50M gave 2.9 G params/s of AdamW and 12.9 G/s of cast, 200M 1.5-1.7 and
# 4.9-5.0, and the engine's own host step ran at the 200M rates
HOST_NUMEL = 200_000_000


def host_adam(numel: int = HOST_NUMEL, steps: int = 3) -> float:
    """Parameters per second of fused AdamW on this host's CPU (the offload step's speed)."""
    p = torch.zeros(numel, requires_grad=True)
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return numel * steps / (time.perf_counter() - t0)


def host_cast(numel: int = HOST_NUMEL, steps: int = 3, dtype: torch.dtype = torch.bfloat16) -> float:
    """Parameters per second of the host's fp32 -> `dtype` cast into a pinned buffer (the offload
    step's copy of each stepped master shard, memory/offload.py)."""
    from teratrain.compat import pinned_empty

    src = torch.randn(numel)
    dst = pinned_empty(numel, dtype) if torch.cuda.is_available() else torch.empty(numel, dtype=dtype)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(steps):
        dst.copy_(src)
    return numel * steps / (time.perf_counter() - t0)


def host_loop_us(n: int = 100_000, repeats: int = 3) -> float:
    """The host CPU's speed at this moment: microseconds per iteration of a pure Python loop (the best
    of `repeats`). A cloud machine's host ran this 2x slower at some moments than at others within
    one job, and an eager step that the host paces follows it."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = 0
        for i in range(n):
            x += i
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def pcie_gbps(nbytes: int = 2**30, device: torch.device | str = "cuda") -> float:
    """GB/s of pinned host<->device copies (the mean of both directions)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for dst, src in ((dev, host), (host, dev)) * 2:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.mean(rates[2:])
