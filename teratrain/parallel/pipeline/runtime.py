"""The pipeline executor: runs any schedule's action list (actions.py) on this rank, one trainer
step per call, and the step runner the trainer hands its micro-batches to.

Per call (m micro-batches, the same (x, y) on every rank of one pipeline; stage 0 reads x, the last
stage y):
- F runs the chunk's forward (stage 0 from the tokens; else from the received activation, a leaf
  that requires grad) and keeps what its backward needs; the last stage computes the micro-batch's
  loss. A stage that sends its output keeps only the output's place in the graph (a GradientEdge), not its
  values, which no backward reads: the message holds them until its send finishes (Megatron-LM frees its
  stages' outputs once sent the same way). B back-propagates from the received output gradient (the last
  stage: from the loss times loss-scale / micro-batches per update) and leaves the input gradient for SEND_B.
  I and W split B (backward.py). The engine is told about every backward: B or W runs inside
  `engine.accumulate(last=...)` (last: the final one before an update) and ends with
  `engine.end_backward()`, exactly as `train_step` does for pp=1.
- Messages are one shape, known ahead from the micro-batch: (B, T, d), or (B, T/tp, d) under sequence
  parallelism, in the parameters' dtype. Communication follows actions.py's rules (p2p.py). With tp > 1
  and no sequence parallelism each tp rank sends 1/tp of a message and the receiver all-gathers the
  pieces over tp once the receive is done (p2p.Scatter).
- Flush schedules step the engine once after the list; asynchronous ones step at their STEPs, with
  weight versions kept by versions.py. The engine's gradient norm and inf check already reduce over
  every worker, so an overflow on any stage skips the step on all of them.
- The step's loss (mean over micro-batches) is summed over the pipeline's ranks onto every rank: the
  last stage's cross-entropy plus every stage's MoE aux losses (in training, as the model's own
  forward adds them; each stage's aux losses also enter its backward, stage.py `with_aux`).
"""

from __future__ import annotations

import contextlib
from functools import lru_cache
from pathlib import Path

import torch
from torch.autograd.graph import get_gradient_edge
from torch.profiler import record_function

from teratrain.compat import reparametrize
from teratrain.memory.compression import compressed_saves
from teratrain.memory.precision import autocast
from teratrain.optim.engine import train_step
from teratrain.parallel.comm import SUM, all_gather_objects, all_reduce
from teratrain.parallel.pipeline.actions import (B, COMPUTE, F, I, RECV_F, RECVS, SEND_F, SENDS, STEP, W, Action,
                                                 add_communication)
from teratrain.parallel.pipeline.backward import backward_input, backward_weight
from teratrain.parallel.pipeline.p2p import Links, Scatter
from teratrain.parallel.pipeline.saved import SplitSaved
from teratrain.parallel.pipeline.schedules import build
from teratrain.parallel.pipeline.stage import Chunk, with_aux
from teratrain.parallel.pipeline.timing import Clock, plot
from teratrain.parallel.pipeline.versions import WeightVersions, checksum, is_async


class LocalSteps:
    """pp = 1: the step is `train_step`; evaluation calls the model."""

    def __init__(self, model, engine):
        self.model, self.engine = model, engine

    def __call__(self, micro_batches: list, precision: str, lr: float):
        return train_step(self.model, self.engine, micro_batches, precision, lr)

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(x, y)


def step_runner(model, engine, rt, cfg, run_dir: str | Path | None = None):
    """What the trainer calls with each step's micro-batches: `train_step` for pp = 1, else the
    executor (which also writes `pipeline.png` into `run_dir` when given)."""
    if rt.dims.pp == 1:
        return LocalSteps(model, engine)
    executor = PipelineExecutor(model, engine, rt, cfg, run_dir)
    rt.mesh.connect(rt.device)  # the pipeline group, before its first use at the end of a step
    return executor


class PipelineExecutor:
    def __init__(self, model, engine, rt, cfg, run_dir=None, *, time_every_call: bool = False, audit: bool = False):
        p = cfg.parallel
        self.model, self.engine, self.rt, self.cfg = model, engine, rt, cfg
        self.layout = model.pipeline
        self.pp, self.rank = self.layout.pp, self.layout.rank
        S = self.layout.num_stages
        self.chunks = [Chunk(model, s, S, self.layout.bounds[s]) for s in self.layout.stages]
        self.schedule = lru_cache(maxsize=8)(
            lambda m: build(p.schedule, self.pp, m, p.virtual_stages, vertical_sync=p.vertical_sync,
                            weight_version_every=p.weight_version_every))
        self.sp = cfg.parallel.use_sp
        self.dtype = next(iter(model.parameters())).dtype  # this rank's blocks, or its embedding or head alone
        self.device = rt.device
        self.links = Links(rt.mesh, _links(self.pp, p.virtual_stages), rt.device)
        self.recv_ahead = p.pipeline_recv == "ahead"  # when receives are posted (p2p.py)
        tp = rt.dims.tp if not self.sp else 1  # under sequence parallelism the message is already a shard
        self.scatter = Scatter(rt.group("tp") if tp > 1 else None, tp, rt.mesh.coords["tp"] if tp > 1 else 0)
        self.pp_group = rt.group("pp")
        self.run_dir, self.time_every_call, self.audit = run_dir, time_every_call, audit
        self.calls = 0
        self.intervals: list = []  # the last timed call's measured timeline, all ranks of this pipeline
        self.host_intervals: list = []  # the same actions as the host issued them
        self.records: list[dict] = []  # asynchronous schedules: the weight version every action used

    # ------------------------------------------------------------------ the step
    def __call__(self, micro_batches: list, precision: str, lr: float):
        sched = self.schedule(len(micro_batches))
        timed = self.time_every_call or self.calls < 2
        clock = Clock(self.device, self.pp_group) if timed else None
        call = _Call(self, sched.ranks[self.rank], micro_batches, precision, lr, clock, train=True)
        with self.engine.pipeline_call(train=True):
            call.run()
            stats = call.stats if call.stats is not None else self.engine.step(lr)
        loss = self._step_loss(call, len(micro_batches))
        if timed:
            self._after_timed(sched, clock)
        self.calls += 1
        return stats, loss

    @torch.no_grad()
    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Evaluation: one micro-batch forward through every stage; the loss on every rank."""
        v = self.layout.virtual_stages
        sched = _forward_only(self.pp, v)
        call = _Call(self, sched.ranks[self.rank], [(x, y)], self.cfg.memory.precision, 0.0, None, train=False)
        with self.engine.pipeline_call(train=False):
            call.run()
        return self._step_loss(call, 1)

    def _step_loss(self, call: "_Call", m: int) -> torch.Tensor:
        """The mean loss over the m micro-batches, on every rank of the pipeline (collective over pp)."""
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.layout.holds_last:
            loss += torch.stack([call.losses[mb] for mb in range(m)]).float().mean()
        if call.aux:  # this rank's MoE layers
            loss += torch.stack([call.aux[mb] for mb in range(m)]).mean()
        all_reduce(loss, self.pp_group, op=SUM)
        return loss

    def _after_timed(self, sched, clock: Clock) -> None:
        got = all_gather_objects((clock.intervals(self.rank), clock.host_intervals(self.rank)), self.pp_group)
        self.intervals = [iv for dev, _ in got for iv in dev]
        self.host_intervals = [iv for _, host in got for iv in host]
        if self.run_dir is not None and self.rt.is_main:
            p = self.cfg.parallel
            chunks = f" x {p.virtual_stages} chunks" if p.virtual_stages > 1 else ""
            title = (f"{p.schedule}: pp={self.pp}{chunks}, {sched.num_microbatches} micro-batches; measured step "
                     "(below) and the simulator's prediction from the same per-stage action times (above)")
            plot(Path(self.run_dir) / "pipeline.png", sched, self.intervals, title, rendezvous=not self.recv_ahead)

    def message_shape(self, x: torch.Tensor) -> tuple[int, int, int]:
        B, T = x.shape
        return (B, T // (self.rt.dims.tp if self.sp else 1), self.model.cfg.d_model)


def _key(a: Action) -> tuple[str, int, int]:
    """The inbox/outbox key of a transfer: (F or B, micro-batch, chunk)."""
    return (F if a.kind in (RECV_F, SEND_F) else B, a.microbatch, a.chunk)


def _links(pp: int, v: int) -> set[tuple[int, int]]:
    """Directed links any schedule uses: neighbours both ways, and last -> first (both ways) when
    interleaved chunks wrap around."""
    out = {(r, r + 1) for r in range(pp - 1)} | {(r + 1, r) for r in range(pp - 1)}
    return out | ({(pp - 1, 0), (0, pp - 1)} if v > 1 else set())


@lru_cache(maxsize=8)
def _forward_only(pp: int, v: int):
    """One micro-batch's forward through every stage (evaluation), with its communication."""
    return add_communication("forward", pp, 1, v, [[Action(F, 0, c) for c in range(v)] for _ in range(pp)])


class _Call:
    """One pass over this rank's action list."""

    def __init__(self, ex: PipelineExecutor, acts, micro, precision, lr, clock, train: bool):
        acts = _unsplit_first_stage(acts, {c for c, chunk in enumerate(ex.chunks) if chunk.is_first})
        self.ex, self.acts, self.precision, self.lr, self.clock, self.train = ex, acts, precision, lr, clock, train
        # each micro-batch as this rank computes it: its tokens, targets and positions (context parallelism
        # keeps this rank's chunks of the sequence; models/layers.py SequenceLayout)
        model = ex.model
        micro = [model.sequence(x, y, 0, model.rope) for x, y in micro]
        self.micro = micro
        self.shape = ex.message_shape(micro[0][0])
        self.states, self.inbox, self.outbox, self.losses = {}, {}, {}, {}
        self.split = train and any(a.kind == I for a in acts)  # forwards record for I and W (saved.py)
        self.saved: dict[tuple[int, int], SplitSaved] = {}
        self.casts: dict = {}  # weight casts shared by the step's micro-batches (SplitSaved)
        self.aux = {}  # micro-batch -> this rank's MoE aux losses (detached), summed over its chunks
        self.sends = []  # posted send batches: waited for when the list is done (or dropped once done)
        self.stats = None
        self.versions = WeightVersions(ex.model, acts) if train and is_async(acts) else None
        self.sync_at, self.seed_weight = _update_windows(acts, len(micro))

    def run(self) -> None:
        """Walk the list as `plan` orders its communication (p2p.py says when receives are posted)."""
        if self.versions is not None:
            self.versions.made(0, -1)
            self._record(Action("START", -1, version=0), None)
        posted: dict[Action, object] = {}  # a posted receive -> its batch
        for step in plan(self.acts, ahead=self.ex.recv_ahead):
            if step[0] == "post":
                posted.update(self._post(step[1]))
            elif step[0] == "wait":
                for batch in {posted.pop(r) for r in step[1]}:
                    batch.wait()
                for r in step[1]:  # in list order: every tp rank of the stage gathers the same messages
                    self.ex.scatter.gather(self.inbox[_key(r)])
            else:
                _, i, a = step
                with self.clock.span(a) if self.clock else contextlib.nullcontext(), \
                        record_function(f"pipeline.{a.kind}"):
                    self._compute(i, a)
                if self.versions is not None:
                    self.versions.release(i)
        for batch in self.sends:
            batch.wait()

    def _post(self, comm: list[Action]) -> dict[Action, object]:
        """Post sends (of tensors already computed) and receives (into new buffers), in list order;
        returns each receive's batch."""
        ops = []
        for a in comm:
            key = _key(a)
            if a.kind in SENDS:
                t = self.outbox.pop(key)
                if t.shape != self.shape or t.dtype != self.ex.dtype:
                    raise RuntimeError(f"pipeline message {key} is {tuple(t.shape)} {t.dtype}, expected "
                                       f"{self.shape} {self.ex.dtype}")
                ops.append((True, a.peer, self.ex.scatter.piece(t.contiguous())))
            else:
                buf = torch.empty(self.shape, dtype=self.ex.dtype, device=self.ex.device)
                self.inbox[key] = buf
                ops.append((False, a.peer, self.ex.scatter.piece(buf)))
        batches = self.ex.links.post(ops)
        sends = list(dict.fromkeys(b for (send, _, _), b in zip(ops, batches) if send))
        self.sends = [b for b in self.sends if not b.done()] + sends  # a finished send lets go of its tensor
        return {a: b for a, (send, _, _), b in zip(comm, ops, batches) if not send}

    def _compute(self, i: int, a: Action) -> None:
        if a.kind == F:
            self._forward(a)
        elif a.kind == STEP:
            self.stats = self.ex.engine.step(self.lr)
            self._record(a, None)
            self.versions.made(a.version, i)
        elif a.kind == I:  # no weight gradient yet: nothing for the engine
            self._input_grad(a)
        else:
            engine = self.ex.engine
            with engine.accumulate(last=i in self.sync_at):
                (self._backward if a.kind == B else self._weight_grad)(a)
                engine.end_backward()

    def _using(self, w: dict | None):
        """Run with a weight version's tensors in place of the parameters (asynchronous schedules)."""
        return reparametrize(self.ex.model, w) if w is not None else contextlib.nullcontext()

    def _forward(self, a: Action) -> None:
        chunk = self.ex.chunks[a.chunk]
        x_tokens, y, pos = self.micro[a.microbatch]
        w = self.versions.weights(a.version) if self.versions is not None else None
        saved = SplitSaved(self.casts) if self.split else None  # (compression is refused with a split backward)
        with self._using(w), autocast(self.precision, self.ex.device), compressed_saves(self.ex.model) as codec, \
                saved.recording() if saved is not None else contextlib.nullcontext():
            h0 = chunk.embed(x_tokens, pos) if chunk.is_first else None
            if chunk.embeds_only:  # the embedding's output is the message: its backward needs nothing of it
                x, h0 = h0, None
            else:
                x = (h0.detach() if chunk.is_first else self.inbox.pop((F, a.microbatch, a.chunk)))
                x.requires_grad_(self.train)
            if codec is not None:
                codec.starts_from(x)  # encoded as in one process, where it is the previous block's output
            out = chunk.forward(x, y, pos, segment=saved.segment if saved is not None else None)
            aux = chunk.aux_loss() if self.ex.model.training else None  # as Transformer.forward adds it
        if saved is not None:
            self.saved[(a.chunk, a.microbatch)] = saved
        if aux is not None:
            mb = a.microbatch
            self.aux[mb] = aux.detach() if mb not in self.aux else self.aux[mb] + aux.detach()
            if self.train:
                out = with_aux(out, aux, self._loss_weight)
        if chunk.is_last:
            self.losses[a.microbatch] = out.detach()
        else:
            self.outbox[(F, a.microbatch, a.chunk)] = out.detach()
            if self.train:  # the message alone holds the values now (see the module's docstring)
                out = get_gradient_edge(out)
        if self.train:
            self.states[(a.chunk, a.microbatch)] = [h0, x, out, w]
            self._record(a, w)

    def _loss_weight(self) -> float:
        """d(update's mean loss)/d(one micro-batch's loss), times the fp16 loss scale."""
        scaler = self.ex.engine.scaler
        return (scaler.scale if scaler else 1.0) * self.seed_weight

    def _output_grad(self, chunk: Chunk, a: Action, out: torch.Tensor) -> torch.Tensor:
        if chunk.is_last:
            return torch.full_like(out, self._loss_weight())
        return self.inbox.pop((B, a.microbatch, a.chunk))

    def _backward(self, a: Action) -> None:
        chunk = self.ex.chunks[a.chunk]
        h0, x, out, w = self.states.pop((a.chunk, a.microbatch))
        with self._using(w):  # a recomputed segment replays with the same version
            torch.autograd.backward(out, self._output_grad(chunk, a, out))
        self._record(a, w)
        self._input_done(chunk, a, h0, x)

    def _input_grad(self, a: Action) -> None:
        chunk = self.ex.chunks[a.chunk]
        state = self.states[(a.chunk, a.microbatch)]
        h0, x, out, _ = state
        saved = self.saved.pop((a.chunk, a.microbatch))
        early = chunk.early_weights(self.micro[a.microbatch][0].numel())
        state[2:] = [None, backward_input(out, self._output_grad(chunk, a, out), x, chunk.weights(), saved, early)]
        if not chunk.is_first:  # sent, and not needed by W: let it go once it is
            self.outbox[(B, a.microbatch, a.chunk)], x.grad = x.grad, None
            # The received activation is I-only too, but the retained graph holds the leaf (its
            # AccumulateGrad) until W: give the leaf an empty storage. A tensor W reads that shares
            # the storage (a saved alias) keeps it, so this frees it only where nothing else holds it.
            x.data = x.new_empty(0)

    def _weight_grad(self, a: Action) -> None:
        chunk = self.ex.chunks[a.chunk]
        h0, x, _, groups = self.states.pop((a.chunk, a.microbatch))
        backward_weight(groups)
        if chunk.is_first:
            h0.backward(x.grad)

    def _input_done(self, chunk: Chunk, a: Action, h0, x) -> None:
        """After a full backward: the embedding's gradient on stage 0 (an embedding alone has had it),
        else the input gradient to send."""
        if chunk.is_first:
            if h0 is not None:
                h0.backward(x.grad)
        else:
            self.outbox[(B, a.microbatch, a.chunk)] = x.grad

    def _record(self, a: Action, w) -> None:
        """Asynchronous schedules: which version each action used (and, when auditing, a checksum of
        the very tensors it used; STEP and START: of the parameters it leaves) and how many versions
        this rank holds."""
        v = self.versions
        if v is None:
            return
        rec = {"call": self.ex.calls, "rank": self.ex.rank, "kind": a.kind, "mb": a.microbatch,
               "version": a.version, "alive": v.alive}
        if self.ex.audit:
            rec["sum"] = checksum(w.values()) if w is not None else checksum(p for _, p in v.named)
        self.ex.records.append(rec)


def plan(acts, ahead: bool) -> list[tuple]:
    """The executor's walk of one action list: ("post", communication), ("wait", receives) and
    ("run", position, compute action or STEP), in order. Everything is posted in list order, so each
    directed link's messages are posted in the same order at both ends (actions.py rule 3); sends go
    right after the action that made them; each receive is waited for just before the compute action
    it is listed before, and posted after the action before that one (`ahead`: before it, so that its
    transfer overlaps it)."""
    steps = _comm_groups(acts)
    recvs = lambda comm: [c for c in comm if c.kind in RECVS]  # noqa: E731
    out: list[tuple] = [("post", recvs(steps[0][1]))] if ahead else []
    for k, (i, comm, a) in enumerate(steps):
        now = [c for c in comm if c.kind in SENDS] if ahead else list(comm)
        if ahead and k + 1 < len(steps):
            now += recvs(steps[k + 1][1])
        out += [("post", now), ("wait", recvs(comm))] + ([("run", i, a)] if a is not None else [])
    return [step for step in out if step[0] == "run" or step[1]]  # no empty posts or waits


def _comm_groups(acts) -> list[tuple[int, list[Action], Action | None]]:
    """The list as (position, communication listed before it, compute action), the last entry
    holding what follows the final compute action (compute None)."""
    out, comm = [], []
    for i, a in enumerate(acts):
        if a.kind in COMPUTE or a.kind == STEP:
            out.append((i, comm, a))
            comm = []
        else:
            comm.append(a)
    return out + [(len(acts), comm, None)]


def _unsplit_first_stage(acts, first: set[int]) -> tuple[Action, ...]:
    """Stage 0's input gradient goes to no other rank (only to its own embedding), so splitting its
    backward buys nothing: where W(mb) directly follows I(mb) on a chunk of `first`, with nothing
    between them, run one full backward B(mb) in their place (the same gradients, without the split's
    host time and kept gradients)."""
    out: list[Action] = []
    for a in acts:
        prev = out[-1] if out else None
        if a.kind == W and a.chunk in first and prev is not None and prev.kind == I and \
                (prev.microbatch, prev.chunk, prev.version) == (a.microbatch, a.chunk, a.version):
            out[-1] = Action(B, a.microbatch, a.chunk, version=a.version)
        else:
            out.append(a)
    return tuple(out)


def _update_windows(acts, m: int) -> tuple[set[int], float]:
    """Positions of the backward (B or W) that ends each update's accumulation (the last before a
    STEP, and the list's last), and the weight of one micro-batch's loss: 1 / micro-batches per update."""
    backs = [i for i, a in enumerate(acts) if a.kind in (B, W)]
    steps = [i for i, a in enumerate(acts) if a.kind == STEP]
    ends = {max((b for b in backs if b < s), default=-1) for s in steps} | ({backs[-1]} if backs else set())
    per_update = m // len(steps) if steps else m
    return ends - {-1}, 1.0 / per_update
