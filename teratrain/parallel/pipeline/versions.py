"""Weight versions of the asynchronous schedules (PipeDream's weight stashing, Harlap et al. 2018;
PipeDream-2BW's double buffering, Narayanan et al. 2021).

The engine owns the newest weights (the model's parameters) and updates them in place at every
STEP. A version a later action names is kept as an immutable snapshot: version 0 when the call
starts, version k right after the STEP that makes it; a snapshot is dropped after the last action
that names it. A forward runs with its version's snapshot in place of every parameter, through
`stashed(p, snapshot)`: the value is the snapshot, the gradient goes to p (so the engine's gradient
buffers and hooks see it as usual). Autograd saves the snapshot, never p, so a STEP that changes p
while the micro-batch is in flight cannot touch the weights its backward uses: the forward and the
backward of a micro-batch use the same version by construction, whichever STEPs run in between.
"""

from __future__ import annotations

import torch
from torch import nn

from teratrain.parallel.pipeline.actions import B, COMPUTE, F, STEP, Action


class _Stashed(torch.autograd.Function):
    """Forward: the snapshot's values (a view, no copy); backward: the gradient goes to the parameter."""

    @staticmethod
    def forward(ctx, param, snapshot):
        return snapshot.view_as(snapshot)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class WeightVersions:
    def __init__(self, model: nn.Module, acts: tuple[Action, ...]):
        self.named = list(model.named_parameters())
        self.last_use: dict[int, int] = {}
        for i, a in enumerate(acts):
            if a.kind in COMPUTE and a.version is not None:
                self.last_use[a.version] = i
        self.snaps: dict[int, list[torch.Tensor]] = {}
        self.newest = 0  # the version the parameters hold

    def made(self, version: int, position: int) -> None:
        """The parameters now hold `version` (the call's start, or right after a STEP): keep a
        snapshot if an action after `position` names it."""
        self.newest = version
        if self.last_use.get(version, -1) > position:
            self.snaps[version] = [p.detach().clone() for _, p in self.named]

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        """Every parameter as it was at `version` (by local name), differentiable into the parameter."""
        return {n: _Stashed.apply(p, s) if p.requires_grad else s
                for (n, p), s in zip(self.named, self.snaps[version])}

    def release(self, position: int) -> None:
        """Drop the snapshots no action after `position` names."""
        for v in [v for v in self.snaps if self.last_use[v] <= position]:
            del self.snaps[v]

    @property
    def alive(self) -> int:
        """Distinct weight versions held: the snapshots and the parameters' own."""
        return len(set(self.snaps) | {self.newest})


def checksum(tensors) -> float:
    """A number that changes with any weight: the fp64 sum of every element, each tensor weighted
    by its position (so swapping two tensors shows too)."""
    return float(sum((i + 1) * t.detach().double().sum() for i, t in enumerate(tensors)))


def is_async(acts: tuple[Action, ...]) -> bool:
    return any(a.kind == STEP for a in acts)


def audit(records: list[dict], simulated_peak: int) -> list[str]:
    """What breaks weight stashing in an executor's audit records (PipelineExecutor(audit=True)), for
    any asynchronous schedule: a forward or backward that did not use the very tensors of the version
    it names (the parameters right after the STEP that made it), a micro-batch whose backward used
    other weights than its forward, a forward never followed by its backward, or more versions held
    at once than the simulator predicts. Empty when all is well (first 10 problems otherwise)."""
    problems = []
    held = max((r["alive"] for r in records), default=simulated_peak)
    if held != simulated_peak:
        problems.append(f"held {held} weight versions at once, the simulator says {simulated_peak}")
    for call in sorted({r["call"] for r in records}):
        recs = [r for r in records if r["call"] == call]
        made = {r["version"]: r["sum"] for r in recs if r["kind"] in ("START", STEP)}
        forwards = {}
        for r in recs:
            if r["kind"] not in (F, B):
                continue
            where = f"call {call} rank {r['rank']} {r['kind']}(mb={r['mb']})"
            if r["sum"] != made.get(r["version"]):
                problems.append(f"{where} did not use version {r['version']}'s weights")
            if r["kind"] == F:
                forwards[r["mb"]] = r
            elif (f := forwards.pop(r["mb"], None)) is None or (f["version"], f["sum"]) != (r["version"], r["sum"]):
                problems.append(f"{where} used other weights than its forward")
        problems += [f"call {call}: forward of mb {mb} had no backward" for mb in sorted(forwards)]
    return problems[:10]
