"""Which transformer blocks each pipeline stage holds: by count, or by measured cost (PipeDream).

- `split_layers`: contiguous, as even as counts allow; the n_layers % num_stages extra blocks go one
  each to the first stages (never to the last, which also holds the head and the loss).
- `partition`: the contiguous split of measured per-block times that minimizes the slowest stage
  under a per-stage memory cap, by dynamic programming (Narayanan et al. 2019, PipeDream sec. 3.1:
  A(j, k) = min_i max(A(i, k-1), 2 C_i, T(i+1..j)), C_i the activation transfer after block i).
  The embedding (`first`) and head + loss (`last`) are counted on the first and last stage.
- `profile_layers`: forward + backward time and memory of each module of a list, on any device.
Stages are global (chunk c of rank r is stage c * pp + r), so interleaved schedules split into
pp * virtual_stages stages; every stage holds at least one block, except that a split given as counts
(`parallel.stage_layers`) may leave the model's first stage with the embedding alone and its last with
the head and the loss alone (Dubey et al. 2024, sec. 3.3.2: Llama 3 405B's 126 blocks over 16 x 8 stages).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn


def split_layers(n_layers: int, num_stages: int) -> list[range]:
    """Blocks of each stage by count: stage s gets n // S blocks, plus one if s < n % S."""
    if not 1 <= num_stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} blocks into {num_stages} pipeline stages: each stage needs a "
                         "block; lower parallel.pp x parallel.virtual_stages or add layers.")
    base, extra = divmod(n_layers, num_stages)
    sizes = [base + (s < extra) for s in range(num_stages)]
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def counts_problem(counts: Sequence[int], num_stages: int, n_layers: int) -> str | None:
    """What makes `counts` (blocks of each global stage, `parallel.stage_layers`) no split of n_layers blocks
    into num_stages stages, as a clause, or None: one count a stage, n_layers in all, at least one block on
    every stage but the model's first (the embedding alone) and last (the head and the loss alone)."""
    if len(counts) != num_stages:
        return f"it has {len(counts)} counts for the {num_stages} pipeline stages (parallel.pp x parallel.virtual_stages)"
    if sum(counts) != n_layers:
        return f"its counts add up to {sum(counts)}, not model.n_layers={n_layers}"
    empty = [s for s, n in enumerate(counts) if n < 1]
    if any(n < 0 for n in counts) or any(0 < s < num_stages - 1 for s in empty):
        return ("every stage but the first and the last needs at least one block (the first may hold the embedding "
                "alone, the last the head and the loss alone)")
    return None


@dataclass(frozen=True)
class LayerCost:
    """What one module costs: forward + backward seconds, its parameter bytes and the bytes it
    saves for backward per micro-batch (saved_tensors_hooks, each storage counted once)."""

    time_s: float
    param_bytes: int
    activation_bytes: int


def stage_totals(bounds: Sequence[range], values: Sequence[float], first: float = 0.0,
                 last: float = 0.0) -> list[float]:
    """Sum of `values` over each stage's blocks, plus `first` on stage 0 and `last` on the final stage."""
    out = [sum(values[i] for i in r) for r in bounds]
    out[0] += first
    out[-1] += last
    return out


def partition(time_s: Sequence[float], num_stages: int, *, memory_bytes: Sequence[float] | None = None,
              memory_cap_bytes: float = math.inf, first: tuple[float, float] = (0.0, 0.0),
              last: tuple[float, float] = (0.0, 0.0), boundary_s: Sequence[float] | None = None) -> list[range]:
    """Contiguous split of blocks into `num_stages` minimizing the slowest stage's time (with the
    transfer after block i costing 2 * boundary_s[i]: activation forward, gradient back), every
    stage's memory at most `memory_cap_bytes`. first/last = (seconds, bytes) of the embedding and
    head. Exact: dynamic program over (blocks placed, stages used), O(S * L^2)."""
    n, S = len(time_s), num_stages
    split_layers(n, S)  # the same one-sentence refusal when there are fewer blocks than stages
    mem = list(memory_bytes) if memory_bytes is not None else [0.0] * n
    cross = list(boundary_s) if boundary_s is not None else [0.0] * n
    t_pre = [0.0] + list(_cumsum(time_s))
    m_pre = [0.0] + list(_cumsum(mem))
    INF = math.inf
    # best[k][j]: least max-stage time placing blocks [0, j) on stages [0, k); cut[k][j]: where stage k-1 starts
    best = [[INF] * (n + 1) for _ in range(S + 1)]
    cut = [[-1] * (n + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for k in range(1, S + 1):
        for j in range(k, n - (S - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == INF:
                    continue
                t = t_pre[j] - t_pre[i] + (first[0] if k == 1 else 0.0) + (last[0] if k == S else 0.0)
                m = m_pre[j] - m_pre[i] + (first[1] if k == 1 else 0.0) + (last[1] if k == S else 0.0)
                if m > memory_cap_bytes:
                    continue
                cost = max(best[k - 1][i], t, 2 * cross[i - 1] if i > 0 else 0.0)
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    if best[S][n] == INF:
        raise ValueError(f"no split of {n} blocks into {num_stages} stages fits {memory_cap_bytes / 2**30:.2f} GiB per "
                         "stage; add pipeline stages or lower the memory per block (recompute, smaller micro-batch).")
    bounds, j = [], n
    for k in range(S, 0, -1):
        i = cut[k][j]
        bounds.append(range(i, j))
        j = i
    return bounds[::-1]


def _cumsum(xs: Sequence[float]):
    total = 0.0
    for x in xs:
        total += x
        yield total


def profile_layers(layers: Sequence[nn.Module], example: torch.Tensor, *, repeats: int = 3, warmup: int = 1,
                   clock=time.perf_counter) -> list[LayerCost]:
    """Time forward + backward of each module on the output of the previous one (the input `example`
    for the first): the least of `repeats` runs after `warmup` (other work on the device only adds
    time), on whatever device the modules and `example` live (synchronized on CUDA). Backward starts
    from a gradient of ones. `clock`: wall time by default; time.process_time measures a one-thread
    CPU run without the time other processes take from it."""
    out, x = [], example.detach()
    for layer in layers:
        y, saved = _saved_bytes(layer, x)
        times = [_fwd_bwd_s(layer, x, clock) for _ in range(warmup + repeats)][warmup:]
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        out.append(LayerCost(min(times), params, saved))
        x = y.detach()
    return out


def _fwd_bwd_s(layer: nn.Module, x: torch.Tensor, clock) -> float:
    x = x.detach().requires_grad_(x.is_floating_point())
    _sync(x)
    t0 = clock()
    y = layer(x)
    y.backward(torch.ones_like(y))
    _sync(x)
    elapsed = clock() - t0
    layer.zero_grad(set_to_none=True)
    return elapsed


def _saved_bytes(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    x = x.detach().requires_grad_(x.is_floating_point())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    return y, sum(b for ptr, b in seen.items() if ptr not in params)


def _sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)
