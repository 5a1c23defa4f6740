"""Measured pipeline timelines: every compute action of a step as the simulator's `Interval`, on one
time axis for all ranks, and the simulator's prediction from the same per-stage action times.

Alignment: the ranks of one pipeline pass a barrier (then, on a GPU, wait for their device to be
idle) and each takes that moment as its time zero, so ranks differ by the barrier's exit skew
(microseconds), far below an action's length. On a GPU the start and end of each action are CUDA
events on the compute stream (they measure when the device ran it, with no synchronization inside
the step); on a CPU, `time.perf_counter`.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist

from teratrain.parallel.pipeline.actions import B, F, I, STEP, W, Schedule
from teratrain.parallel.pipeline.simulate import Costs, Interval, bubble_fraction, simulate


class Clock:
    def __init__(self, device: torch.device, group):
        self.cuda = device.type == "cuda"
        if group is not None:
            dist.barrier(group=group)
        if self.cuda:
            torch.cuda.synchronize(device)
            self.zero = torch.cuda.Event(enable_timing=True)
            self.zero.record()
        else:
            self.zero = time.perf_counter()
        self.spans: list[tuple] = []  # (start, end, action)

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    @contextmanager
    def span(self, action):
        start = self._now()
        yield
        self.spans.append((start, self._now(), action))

    def intervals(self, rank: int) -> list[Interval]:
        """This rank's actions in seconds from time zero (on a GPU, waits for the device first)."""
        if self.cuda:
            torch.cuda.synchronize()
            sec = lambda ev: self.zero.elapsed_time(ev) / 1e3  # noqa: E731
        else:
            sec = lambda t: t - self.zero  # noqa: E731
        return [Interval(rank, sec(s), sec(e), a.kind, a.microbatch, a.chunk, a.version) for s, e, a in self.spans]


def measured_costs(intervals: list[Interval], pp: int, num_stages: int) -> Costs:
    """Per-stage median seconds of F, B (or I + W) and STEP, as the simulator takes them."""
    by = defaultdict(list)
    for iv in intervals:
        by[(iv.kind, iv.chunk * pp + iv.rank)].append(iv.end - iv.start)
    med = lambda k, s: statistics.median(by[(k, s)]) if by[(k, s)] else 0.0  # noqa: E731
    fwd = [med(F, s) for s in range(num_stages)]
    split = any(iv.kind == W for iv in intervals)
    bwd = [med(I, s) + med(W, s) if split else med(B, s) for s in range(num_stages)]
    wgrad = [med(W, s) for s in range(num_stages)] if split else None
    steps = [iv.end - iv.start for iv in intervals if iv.kind == STEP]
    return Costs(forward_s=fwd, backward_s=bwd, weight_grad_s=wgrad, step_s=statistics.median(steps) if steps else 0.0)


def predicted(sched: Schedule, measured: list[Interval]) -> list[Interval]:
    """The simulator's timeline of `sched` with the measured per-stage action times."""
    return simulate(sched, measured_costs(measured, sched.pp, sched.num_stages)).intervals


def plot(path, sched: Schedule, measured: list[Interval], title: str) -> float:
    """Write the measured timeline under the simulator's prediction; returns the measured bubble."""
    from teratrain.parallel.pipeline.plot import plot_timeline

    plot_timeline(str(path), predicted(sched, measured), measured, num_ranks=sched.pp, title=title,
                  unit="ms", scale=1e3)
    return bubble_fraction(measured, sched.pp)
