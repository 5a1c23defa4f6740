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

from teratrain.parallel import inflight
from teratrain.parallel.pipeline.actions import B, F, I, STEP, W, Schedule
from teratrain.parallel.pipeline.simulate import Costs, Interval, bubble_fraction, simulate


class Clock:
    def __init__(self, device: torch.device, group):
        self.cuda = device.type == "cuda"
        if group is not None:
            inflight.blocking("barrier", group, lambda: dist.barrier(group=group))
        if self.cuda:
            torch.cuda.synchronize(device)
            self.zero = torch.cuda.Event(enable_timing=True)
            self.zero.record()
        else:
            self.zero = time.perf_counter()
        self.host_zero = time.perf_counter()
        self.spans: list[tuple] = []  # (start, end, action)
        self.host: list[tuple[float, float]] = []  # per span: when the host issued it (perf_counter)

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    @contextmanager
    def span(self, action):
        t0, start = time.perf_counter(), self._now()
        yield
        self.spans.append((start, self._now(), action))
        self.host.append((t0, time.perf_counter()))

    def intervals(self, rank: int) -> list[Interval]:
        """This rank's actions in seconds from time zero (on a GPU, waits for the device first)."""
        if self.cuda:
            torch.cuda.synchronize()
            sec = lambda ev: self.zero.elapsed_time(ev) / 1e3  # noqa: E731
        else:
            sec = lambda t: t - self.zero  # noqa: E731
        return [Interval(rank, sec(s), sec(e), a.kind, a.microbatch, a.chunk, a.version) for s, e, a in self.spans]

    def host_intervals(self, rank: int) -> list[Interval]:
        """This rank's actions as the host issued them (seconds from the clock's creation)."""
        z = self.host_zero
        return [Interval(rank, s - z, e - z, a.kind, a.microbatch, a.chunk, a.version)
                for (s, e), (_, _, a) in zip(self.host, self.spans)]


def measured_costs(intervals: list[Interval], pp: int, num_stages: int, transfers: bool = True,
                   rendezvous: bool = False) -> Costs:
    """Per-stage median seconds of F, B (or I + W) and STEP, as the simulator takes them, and (with
    `transfers`) each boundary's transfer time from `transfer_s`; `rendezvous`: the executor posted
    receives where they are used (simulate.py)."""
    by = defaultdict(list)
    for iv in intervals:
        by[(iv.kind, iv.chunk * pp + iv.rank)].append(iv.end - iv.start)
    med = lambda k, s: statistics.median(by[(k, s)]) if by[(k, s)] else 0.0  # noqa: E731
    fwd = [med(F, s) for s in range(num_stages)]
    bwd = [med(B, s) if by[(B, s)] else med(I, s) + med(W, s) for s in range(num_stages)]
    # a stage that ran whole backwards (the executor joins I and W on stage 0) says nothing about
    # the split; there W follows I directly, so any share gives that rank the same timeline
    split = any(iv.kind == W for iv in intervals)
    wgrad = [med(W, s) if by[(W, s)] else bwd[s] / 2 for s in range(num_stages)] if split else None
    steps = [iv.end - iv.start for iv in intervals if iv.kind == STEP]
    send = transfer_s(intervals, pp, num_stages) if transfers else 0.0
    return Costs(forward_s=fwd, backward_s=bwd, weight_grad_s=wgrad, step_s=statistics.median(steps) if steps else 0.0,
                 send_s=send, rendezvous=rendezvous)


def transfer_s(intervals: list[Interval], pp: int, num_stages: int) -> list[float]:
    """Per boundary s | s+1: the least time from the end of an action whose result crossed it (F of
    stage s, or B / I of stage s + 1) to the start of the action that consumed it, over the messages
    the consumer's rank sat idle for (its previous action had ended before the message was made), so
    slack is not mistaken for transfer; 0 where no rank ever waited."""
    at = {(iv.kind, iv.chunk * pp + iv.rank, iv.microbatch): iv for iv in intervals}
    prev_end: dict[tuple, float] = {}  # an action -> the end of the action before it on its rank
    for rank in {iv.rank for iv in intervals}:
        mine = sorted((iv for iv in intervals if iv.rank == rank), key=lambda iv: iv.start)
        for a, b in zip(mine, mine[1:]):
            prev_end[(b.kind, b.chunk * pp + b.rank, b.microbatch)] = a.end
    best = [float("inf")] * (num_stages - 1)
    for (kind, s, mb), iv in at.items():
        if kind == F and s > 0:
            made, boundary = at.get((F, s - 1, mb)), s - 1
        elif kind in (B, I) and s < num_stages - 1:
            made, boundary = at.get((B, s + 1, mb)) or at.get((I, s + 1, mb)), s
        else:
            continue
        if made is None or made.rank == iv.rank or prev_end.get((kind, s, mb), -1.0) > made.end:
            continue
        best[boundary] = min(best[boundary], max(0.0, iv.start - made.end))
    return [0.0 if b == float("inf") else b for b in best]


def predicted(sched: Schedule, measured: list[Interval], rendezvous: bool = False) -> list[Interval]:
    """The simulator's timeline of `sched` with the measured per-stage action times."""
    return simulate(sched, measured_costs(measured, sched.pp, sched.num_stages, rendezvous=rendezvous)).intervals


def plot(path, sched: Schedule, measured: list[Interval], title: str, rendezvous: bool = False) -> float:
    """Write the measured timeline under the simulator's prediction; returns the measured bubble."""
    from teratrain.parallel.pipeline.plot import plot_timeline

    plot_timeline(str(path), predicted(sched, measured, rendezvous), measured, num_ranks=sched.pp, title=title,
                  unit="ms", scale=1e3)
    return bubble_fraction(measured, sched.pp)
