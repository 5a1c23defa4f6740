"""One simulator for every schedule: per-rank timeline, bubble, activations in flight, weight versions.

Execution model (the one an executor must honour, actions.py rules 1-3):
- each rank runs its list in order, one action at a time;
- a compute action (F, B, I, W, STEP) starts when the rank reaches it and takes its stage's time;
- a SEND takes no rank time and never blocks: the message leaves when the rank reaches the SEND;
- a RECV waits until its matching SEND was issued plus the transfer time of that boundary, then
  takes no further time (so the rank is idle while it waits). With `Costs.rendezvous` (the executor's
  default, parallel.pipeline_recv=at_use, p2p.py) the transfer starts only once the receiving rank has
  reached the RECV too: a RECV reached after its message was sent then costs the transfer time.
A list that cannot complete (every unfinished rank waits on a RECV whose SEND is never reached)
raises `Deadlock`, naming the ranks, the actions they wait at, and the cycle they form.

Costs are per global stage (chunk c of rank r is stage c * pp + r), so uneven stages work; with
virtual stages, give each chunk's own time (1/v of a whole-rank stage for an even split).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

from teratrain.parallel.pipeline.actions import B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, STEP, W, Action, Schedule

Number = float | Sequence[float]


@dataclass(frozen=True)
class Costs:
    """Seconds (or any unit) per action on each global stage; a scalar applies to every stage."""

    forward_s: Number = 1.0
    backward_s: Number = 2.0  # the full backward B = input gradient + weight gradient
    weight_grad_s: Number | None = None  # W; unset = half of B. I takes B - W
    send_s: Number = 0.0  # transfer of the activation (or its gradient) across boundary s | s+1
    step_s: float = 0.0  # one optimizer STEP on a rank
    rendezvous: bool = False  # a transfer starts when both its SEND and its RECV are reached

    def per_stage(self, num_stages: int) -> dict[str, list[float]]:
        def vec(x: Number, what: str, n: int) -> list[float]:
            out = [float(x)] * n if isinstance(x, (int, float)) else [float(t) for t in x]
            if len(out) < n or any(t < 0 for t in out):
                raise ValueError(f"Costs.{what} needs {n} non-negative values (one per stage), got {x!r}")
            return out

        f, b = vec(self.forward_s, "forward_s", num_stages), vec(self.backward_s, "backward_s", num_stages)
        w = [x / 2 for x in b] if self.weight_grad_s is None else vec(self.weight_grad_s, "weight_grad_s", num_stages)
        if any(y > x for x, y in zip(b, w)):
            raise ValueError("Costs.weight_grad_s is part of backward_s and cannot exceed it")
        send = vec(self.send_s, "send_s", num_stages - 1) + [0.0]  # boundaries 0|1 .. S-2|S-1
        return {F: f, B: b, W: w, I: [x - y for x, y in zip(b, w)], "send": send}


@dataclass(frozen=True)
class Interval:
    """One action on one rank's timeline; measured timelines use the same record."""

    rank: int
    start: float
    end: float
    kind: str  # F B I W STEP
    microbatch: int
    chunk: int = 0
    version: int | None = None  # the weight version the action used (asynchronous schedules)


@dataclass
class Timeline:
    runs: list[list[tuple]]  # per rank: (start, end, Action) of every compute action, in order
    num_ranks: int
    makespan_s: float
    bubble_fraction: float  # idle share of num_ranks x makespan
    peak_activations: list[int]  # per rank: most (micro-batch, chunk) pairs between F and B (or W)
    peak_versions: list[int]  # per rank: most weight versions alive at once (1 for flush schedules)
    busy_s: list[float] = field(default_factory=list)

    @property
    def intervals(self) -> list[Interval]:
        """Every compute action as an Interval (the record measured timelines use too)."""
        return [Interval(r, s, e, a.kind, a.microbatch, a.chunk, a.version)
                for r, run in enumerate(self.runs) for s, e, a in run]


class Deadlock(ValueError):
    """A schedule that cannot complete; `waits` maps each stuck rank to the RECV it waits at."""

    def __init__(self, msg: str, waits: dict[int, Action], cycle: list[int]):
        super().__init__(msg)
        self.waits, self.cycle = waits, cycle


def bubble_fraction(intervals: Sequence[Interval], num_ranks: int) -> float:
    """Idle share of the ranks' time from the first start to the last end (measured or simulated)."""
    if not intervals:
        return 0.0
    span = max(iv.end for iv in intervals) - min(iv.start for iv in intervals)
    busy = sum(iv.end - iv.start for iv in intervals)
    return 1.0 - busy / (num_ranks * span) if span > 0 else 0.0


def simulate(sched: Schedule, costs: Costs = Costs(), peaks: bool = True) -> Timeline:
    """Run every rank's list under the execution model above. `peaks=False` leaves the activation and
    weight-version counts empty (they depend on the lists alone, not the costs): for callers that read
    the times only, at a third of the work."""
    pp = sched.pp
    ops = _compile(sched, costs)
    pos, clock = [0] * pp, [0.0] * pp
    reached = [0.0] * pp  # when each rank ended its last compute action: where it posts the RECVs after it
    issued: dict[tuple, float] = {}
    runs: list[list[tuple]] = [[] for _ in range(pp)]  # (start, end, action) per rank
    while True:
        progress = False
        for r in range(pp):
            seq, i, c, run = ops[r], pos[r], clock[r], runs[r]
            while i < len(seq):
                op, x, y = seq[i]
                if op == "recv":
                    sent = issued.get(x)
                    if sent is None:
                        break
                    c = max(c, max(sent, reached[r]) + y if costs.rendezvous else sent + y)
                elif op == "send":
                    issued[x] = c
                else:
                    run.append((c, c + y, x))
                    c += y
                    reached[r] = c
                i += 1
            progress |= i > pos[r]
            pos[r], clock[r] = i, c
        if all(pos[r] == len(ops[r]) for r in range(pp)):
            break
        if not progress:
            raise _deadlock(sched, pos)
    busy = [sum(e - s for s, e, _ in run) for run in runs]
    makespan = max(clock) if clock else 0.0
    frac = 1.0 - sum(busy) / (pp * makespan) if makespan > 0 else 0.0
    acts = sched.ranks if peaks else ()
    return Timeline(runs, pp, makespan, frac, [peak_activations(a) for a in acts], [peak_versions(a) for a in acts],
                    busy)


def _compile(sched: Schedule, costs: Costs) -> list[list[tuple]]:
    """Each action as (op, x, y): ("recv", message, transfer s), ("send", message, 0) or
    ("run", action, duration s), so the event loop does no lookups. Messages are keyed as in
    actions.message: (F or B, micro-batch, consumer stage)."""
    pp, S = sched.pp, sched.num_stages
    t = costs.per_stage(S)
    send, out = t["send"], []
    for r, acts in enumerate(sched.ranks):
        seq = []
        for a in acts:
            s, k = a.chunk * pp + r, a.kind
            if k == RECV_F:  # crossed boundary s-1 | s
                seq.append(("recv", (F, a.microbatch, s), send[s - 1]))
            elif k == RECV_B:  # crossed boundary s | s+1
                seq.append(("recv", (B, a.microbatch, s), send[s]))
            elif k == SEND_F:
                seq.append(("send", (F, a.microbatch, s + 1), 0.0))
            elif k == SEND_B:
                seq.append(("send", (B, a.microbatch, s - 1), 0.0))
            else:
                seq.append(("run", a, costs.step_s if k == STEP else t[k][s]))
        out.append(seq)
    return out


def held(acts: Sequence[Action], chunk: int = 0) -> Iterator[tuple[int, int]]:
    """After each action of a rank's list: how many (micro-batch, chunk) pairs have run their forward
    and not yet their backward (B, or W when split), and how many of them are of `chunk`. A rank
    runs one action at a time, so list order gives the exact counts."""
    for n, of_chunk, pending, pending_of_chunk in held_split(acts, chunk):
        yield n + pending, of_chunk + pending_of_chunk


def held_split(acts: Sequence[Action], chunk: int = 0,
               weights: Sequence[float] | None = None) -> Iterator[tuple[float, int, float, int]]:
    """`held`, split where the backward is: after each action, the pairs in flight (forward run, no
    B or I yet) and of them of `chunk`, then the pairs waiting for W (I run, W not) and of `chunk`.
    A pair waiting for W holds less than one in flight (backward.py: W's inputs and gradients).
    `weights`: each chunk's weight in the first and third counts (its blocks; default 1 each)."""
    n = of_chunk = pending = pending_of_chunk = 0
    for a in acts:
        mine = a.chunk == chunk
        weight = 1 if weights is None else weights[a.chunk]
        into, out_of = a.kind == F, a.kind in (B, I)
        n += (into - out_of) * weight
        of_chunk += (into - out_of) * mine
        waits = (a.kind == I) - (a.kind == W)
        pending += waits * weight
        pending_of_chunk += waits * mine
        yield n, of_chunk, pending, pending_of_chunk


def peak_activations(acts: Sequence[Action]) -> int:
    """Most (micro-batch, chunk) pairs a rank holds at once (`held`)."""
    return max((n for n, _ in held(acts)), default=0)


def peak_versions(acts: Sequence[Action]) -> int:
    """Most weight versions alive at once: version v lives from the STEP that makes it until it is
    superseded or until the last action that names it, whichever is later."""
    if not any(a.kind == STEP for a in acts):
        return 1
    last_use: dict[int, int] = {}
    for i, a in enumerate(acts):
        if a.version is not None and a.kind != STEP:
            last_use[a.version] = i
    newest = peak = 0
    for i, a in enumerate(acts):
        if a.kind == STEP:
            newest = a.version
        alive = sum(1 for v in range(newest) if last_use.get(v, -1) >= i) + 1
        peak = max(peak, alive)
    return max(peak, 1)


def _deadlock(sched: Schedule, pos: list[int]) -> Deadlock:
    waits = {r: acts[pos[r]] for r, acts in enumerate(sched.ranks) if pos[r] < len(acts)}
    lines, nxt = [], {}
    for r, a in waits.items():
        peer = a.peer
        state = f"waits at {a}" if peer in waits else f"waits at {a}, but rank {peer} finished without sending it"
        lines.append(f"rank {r} {state}")
        nxt[r] = peer
    cycle, r = [], min(waits)
    while r in nxt and r not in cycle:
        cycle.append(r)
        r = nxt[r]
    cycle = cycle[cycle.index(r):] + [r] if r in cycle else []
    ring = f" (cycle {' -> '.join(map(str, cycle))})" if cycle else ""
    return Deadlock(f"schedule '{sched.name}' deadlocks: " + "; ".join(lines) + ring, waits, cycle)
