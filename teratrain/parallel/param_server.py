"""Parameter server (Li et al. 2014, "Scaling Distributed Machine Learning with the Parameter
Server"), with bounded staleness (Ho et al. 2013, "More Effective Distributed ML via a Stale
Synchronous Parallel Parameter Server").

The job is `dp` workers (ranks 0..dp-1, the mesh) plus `parallel.num_servers` servers (the last
ranks). Each server owns whole parameters, balanced by size, and keeps them in fp32 with their
optimizer state; workers keep a replica, run forward and backward on their slice of the global
batch with no collective, then per server: push the flat fp32 gradient of its parameters, receive
the fresh parameters and the server's version. The server clips and steps with the lr the worker
sends. Messages are point-to-point on a gloo group of their own (gloo receives from any source):

    worker -> server  header [kind, worker, version, clock, lr, loss, grad_norm, overflow]  + gradient (PUSH)
    server -> worker  header [version, staleness, loss, grad_norm, skipped, lead, 0, 0]     + parameters
    kinds: PUSH (step), PULL (fetch before the first forward / after a resume), SAVE, DONE

A server's version counts the updates it applied; the staleness of a gradient is the server's
version when it is applied minus the version it was computed on. `parallel.staleness`:
- 0: synchronous. The server takes one message from each worker per round, in rank order (so the
  gradient sum is bitwise reproducible with a single accumulator), averages the pushes of its
  version, clips by the global norm (squared norms summed over servers), steps once and replies to
  all: bulk-synchronous SGD on the global batch, staleness 0.
- None: asynchronous (Downpour SGD, Dean et al. 2012). Each push is applied on arrival, clipped by the norm
  of that worker's whole gradient (sent in its header), and answered at once. Unbounded staleness.
- s > 0: stale synchronous parallel. Pushes are applied on arrival, but a worker's reply is held
  while its clock (pushes made) is more than s ahead of the slowest worker still running. Bound:
  between worker w's reply (clock c, every other clock >= c - s) and its next push, any other
  worker can push at most until its clock reaches c + s + 1 (its own replies need the minimum,
  <= c while w computes, within s), so at most 2s + 1 times: staleness <= (W - 1)(2s + 1).

Workers report, per step, the staleness of their gradient (max over servers), the largest seen,
and `clock_lead`: how many clocks ahead of the slowest worker they were when their reply came
(<= s under SSP, by construction; unbounded when asynchronous). The loss they report is the
mean over workers that server 0 saw (that version's pushes when synchronous, each worker's latest
push otherwise): workers run no collective among themselves, which would put them in lockstep.

Checkpoints are a synchronization point: each worker sends SAVE after its last push was applied;
once every worker has, the servers write their parameters, optimizer state, version and clocks,
and the workers their RNG, data position and loss scale. The servers' parameters are whole
tensors by global name, so readers (generate, export) find them like any other checkpoint's. On
resume workers pull the parameters before their first forward, so a synchronous run resumes
bitwise. Asynchronous runs are not bitwise reproducible at all (arrival order decides the update
order) but resume from a consistent state with every push applied.
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from teratrain.checkpoint.holdings import Holdings, Slot
from teratrain.config_base import ConfigError
from teratrain.memory.precision import has_inf_or_nan, make_scaler, param_dtype
from teratrain.mesh import new_group
from teratrain.optim.build import build_optimizer
from teratrain.optim.engine import EngineBase, StepStats, clip_, sum_sq, tensor_bytes
from teratrain.parallel.comm import all_reduce
from teratrain.parallel.flat import FlatGroup, deal
from teratrain.parallel.placement import init_local_, materialize, placement

# Both ends of the protocol live in this one file (past the ~300-line aim) so that every message's
# send and receive can be read side by side.
PUSH, PULL, SAVE, DONE = 1, 2, 3, 4
TAG_HEADER, TAG_GRAD, TAG_REPLY, TAG_PARAMS = 1, 2, 3, 4
HEADER = 8  # int64 words per header
CPU = torch.device("cpu")  # messages travel through host memory (gloo)


def f2i(x: float) -> int:
    """A float64 carried bit for bit in an int64 header word."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def i2f(n: int) -> float:
    return struct.unpack("<d", struct.pack("<q", n))[0]


def assign(numels: list[int], num_servers: int) -> list[list[int]]:
    """Parameter indices per server: largest first onto the least-loaded server (LPT scheduling,
    within 4/3 of the best balance; flat.deal), ties by index, so every rank derives the same split."""
    if num_servers > len(numels):
        raise ConfigError(f"parallel.num_servers={num_servers} exceeds the model's {len(numels)} parameter tensors "
                          f"(servers own whole tensors); set parallel.num_servers <= {len(numels)}.")
    return deal(numels, num_servers)


def build(model, rt, cfg, init):
    """The engine of this rank: a server, or a worker (materialized here). Collective on all ranks."""
    timeout_s, ranks = cfg.parallel.timeout_s, list(range(rt.world))
    channel = new_group(ranks, "ps_channel", timeout_s, local=False, backend="gloo")
    servers = new_group(ranks[rt.dims.workers:], "ps_servers", timeout_s, local=False, backend="gloo")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    owned = assign([p.numel() for _, p in named], rt.dims.num_servers)
    groups = [FlatGroup([named[i][0] for i in o], [named[i][1] for i in o], 1, 0) for o in owned]
    if rt.is_server:
        return ParamServer(groups[rt.rank - rt.dims.workers], cfg, rt, channel, servers, init)
    materialize(model, rt.device, init)
    return ParamServerWorker(model, groups, cfg, rt, channel)


class ParamServerWorker(EngineBase):
    """A worker's engine. Forward: local, except the first forward after start or resume, which
    first pulls every server's parameters. Backward: local, no communication (gradients accumulate
    over micro-steps). step(): per server at once, push the flat fp32 gradient of its parameters
    (unscaled; the header carries lr, local loss, whole-gradient norm, fp16 overflow), then wait
    for every reply and copy the fresh parameters into the replica."""

    is_server = False

    def __init__(self, model, groups: list[FlatGroup], cfg, rt, channel):
        self.model, self.device, self.rank, self.channel = model, rt.device, rt.rank, channel
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        by_name = dict(self.named)
        if cfg.use_master_weights:  # the servers hold the fp32 copy; the replica can stay low precision
            for _, p in self.named:
                p.data = p.data.to(param_dtype(cfg.memory.precision, True))
        self.groups = [FlatGroup(g.names, [by_name[n] for n in g.names], 1, 0) for g in groups]
        self.servers = [rt.dims.workers + s for s in range(len(groups))]
        self.inbox = [torch.empty(g.numel, dtype=torch.float32, device=CPU) for g in self.groups]
        self.versions = [0] * len(groups)
        mem = cfg.memory
        self.scaler = make_scaler(mem)
        self.clock, self.staleness_max, self.stale = 0, 0, True  # stale: pull before the next forward
        self._loss = torch.zeros((), dtype=torch.float32, device=rt.device)
        self.last_state_bytes: dict[str, int] | None = None
        model.register_forward_pre_hook(lambda m, args: self._pull() if self.stale else None)

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients stay local until step() (accumulate() needs no mode switch here)."""
        self._loss += loss.detach().float()  # the loop passes loss / micro-steps: this sums to the local mean
        super().backward(loss)

    def step(self, lr: float) -> StepStats:
        if self.last_state_bytes is None:
            self.last_state_bytes = self.state_bytes()
        flats = [g.flatten([p.grad for p in g.params], torch.float32, self.device) for g in self.groups]
        overflow = False
        if self.scaler is not None:
            torch._foreach_mul_(flats, 1.0 / self.scaler.scale)
            overflow = bool(has_inf_or_nan(flats))
        norm = float(sum_sq(flats).sqrt())
        loss, self._loss = float(self._loss), torch.zeros_like(self._loss)
        for _, p in self.named:
            p.grad = None
        replies = self._exchange(PUSH, [f.to(CPU) for f in flats], lr, loss, norm, overflow)
        self.clock += 1
        staleness = max(r[1] for r in replies)
        self.staleness_max = max(self.staleness_max, staleness)
        skipped = bool(replies[0][4])
        if self.scaler is not None:
            self.scaler.update(skipped)
        metrics = {"loss": i2f(replies[0][2]), "staleness": staleness, "staleness_max": self.staleness_max,
                   "clock_lead": max(r[5] for r in replies)}
        return StepStats(i2f(replies[0][3]), skipped, self.scaler.scale if self.scaler else None, metrics)

    def _pull(self) -> None:
        self._exchange(PULL)
        self.stale = False

    def _exchange(self, kind: int, grads=None, lr=0.0, loss=0.0, norm=0.0, overflow=False) -> list[list[int]]:
        """One message to every server at once; for PUSH/PULL wait for every reply and load it."""
        works, replies = [], []
        for s, dst in enumerate(self.servers):
            head = torch.tensor([kind, self.rank, self.versions[s], self.clock, f2i(lr), f2i(loss), f2i(norm),
                                 int(overflow)], dtype=torch.int64)
            works.append(dist.isend(head, dst=dst, group=self.channel, tag=TAG_HEADER))
            if grads is not None:
                works.append(dist.isend(grads[s], dst=dst, group=self.channel, tag=TAG_GRAD))
            if kind in (PUSH, PULL):
                replies.append(torch.empty(HEADER, dtype=torch.int64))
                works.append(dist.irecv(replies[-1], src=dst, group=self.channel, tag=TAG_REPLY))
                works.append(dist.irecv(self.inbox[s], src=dst, group=self.channel, tag=TAG_PARAMS))
        for w in works:
            w.wait()
        with torch.no_grad():
            for s, (g, r) in enumerate(zip(self.groups, replies)):
                for p, v in zip(g.params, g.views(self.inbox[s])):
                    p.copy_(v)  # casts to the replica's dtype and device
                self.versions[s] = int(r[0])
        return [r.tolist() for r in replies]

    def close(self) -> None:
        """Tell the servers this worker is done (they stop once every worker is)."""
        self._exchange(DONE)

    # ---- accounting and checkpoints
    def state_bytes(self) -> dict[str, int]:
        return {"params": tensor_bytes(p for _, p in self.named), "grads": tensor_bytes(p.grad for _, p in self.named),
                "optimizer": 0}  # optimizer state and fp32 masters live on the servers

    def holdings(self) -> Holdings:
        return Holdings([])  # the servers hold the parameters and the optimizer state

    def state_meta(self) -> dict:
        """Collective with the servers: SAVE tells them to write their shards with this checkpoint."""
        self._exchange(SAVE)
        return {"param_server": {"clock": self.clock, "staleness_max": self.staleness_max},
                "scaler": self.scaler.state_dict() if self.scaler else None}

    def loaded(self, meta: dict) -> None:
        ps = meta["param_server"]
        self.clock, self.staleness_max, self.stale = ps["clock"], ps["staleness_max"], True
        if self.scaler is not None and meta.get("scaler"):
            self.scaler.load_state_dict(meta["scaler"])

    @torch.no_grad()
    def full_params(self) -> dict[str, torch.Tensor]:
        """This worker's replica: the parameters of its last reply (the servers' latest when synchronous)."""
        return {n: p.detach().float().cpu().clone() for n, p in self.named}


class ParamServer:
    """A server's engine: its parameters in one fp32 flat buffer (views of it are what the
    optimizer steps, views of a second buffer their gradients), and the serve loop. It runs no
    forward or backward; it holds no replica of the other servers' parameters."""

    is_server = True

    def __init__(self, group: FlatGroup, cfg, rt, channel, servers, init):
        self.group, self.channel, self.servers, self.device = group, channel, servers, rt.device
        self.staleness, self.grad_clip = cfg.parallel.staleness, cfg.train.grad_clip
        self.flat = torch.zeros(group.numel, dtype=torch.float32, device=rt.device)
        self.grad = torch.zeros_like(self.flat)
        self.views = group.views(self.flat)
        for p, view, grad in zip(group.params, self.views, group.views(self.grad)):
            init_local_(view, placement(p), init)  # by global name and seed: the workers' values
            view.grad = grad
        self.optimizer = build_optimizer(zip(group.names, self.views), cfg.optim)
        self.num_workers = rt.dims.workers
        self.version, self.clock = 0, [0] * self.num_workers
        self.active, self.held = set(range(self.num_workers)), {}  # held: SSP replies waiting for the slowest
        self.last_loss: dict[int, float] = {}
        self.inbox = torch.empty(group.numel, dtype=torch.float32, device=CPU)  # one push's gradient
        self.saves, self.skipped_steps = 0, 0
        self.last_state_bytes = self.state_bytes()

    def serve(self, save) -> None:
        """Answer workers until every one has sent DONE. `save(step)` writes a checkpoint (collective)."""
        if self.staleness == 0:
            self._serve_rounds(save)
        else:
            self._serve_on_arrival(save)

    def _recv_header(self, src: int | None) -> list[int]:
        head = torch.empty(HEADER, dtype=torch.int64)
        dist.recv(head, src=src, group=self.channel, tag=TAG_HEADER)  # src None: from any worker
        return head.tolist()

    def _recv_grad(self, worker: int) -> torch.Tensor:
        dist.recv(self.inbox, src=worker, group=self.channel, tag=TAG_GRAD)
        self.clock[worker] += 1
        return self.inbox

    def _serve_rounds(self, save) -> None:
        """Synchronous: every worker sends the same message each round; taken in rank order, so the
        gradient sum has the same bits on every run with one accumulator (not one buffer per worker)."""
        total = torch.zeros_like(self.inbox)
        while self.active:
            heads = {}
            for i, w in enumerate(sorted(self.active)):
                heads[w] = h = self._recv_header(w)
                if h[0] != PUSH:
                    continue
                if h[2] != self.version:
                    raise RuntimeError(f"worker {w} pushed for version {h[2]}; the server is at {self.version}")
                if i == 0:
                    total.copy_(self._recv_grad(w))
                else:
                    total.add_(self._recv_grad(w))
            kinds = {h[0] for h in heads.values()}
            if len(kinds) != 1:
                raise RuntimeError(f"synchronous workers sent different messages in one round: {heads}")
            kind, first = kinds.pop(), heads[min(heads)]
            if kind == PUSH:  # one update with the mean gradient; the mean loss goes back to everyone
                overflow = any(h[7] for h in heads.values())
                norm, skipped = self._update(total.div_(len(heads)), i2f(first[4]), None, overflow)
                loss = sum(i2f(heads[w][5]) for w in sorted(heads)) / len(heads)
                for w in sorted(heads):
                    self._reply(w, 0, loss, norm, skipped, 0)
            else:
                self._control(kind, first, list(heads), save)

    def _serve_on_arrival(self, save) -> None:
        """Asynchronous / SSP: each message as it comes, from any worker."""
        while self.active:
            h = self._recv_header(None)
            kind, worker = h[0], h[1]
            if kind != PUSH:
                self._control(kind, h, [worker], save)
                continue
            stale = self.version - h[2]
            norm, skipped = self._update(self._recv_grad(worker), i2f(h[4]), i2f(h[6]), bool(h[7]))
            self.last_loss[worker] = i2f(h[5])
            self.held[worker] = (stale, norm, skipped)
            self._release()

    def _control(self, kind: int, h: list[int], workers: list[int], save) -> None:
        """PULL, SAVE and DONE from `workers` (all of them at once when synchronous)."""
        if kind == PULL:
            for w in workers:
                self._reply(w, 0, float("nan"), float("nan"), False, self._lead(w))
        elif kind == SAVE:
            self.saves += len(workers)
            if self.saves == len(self.active):  # every push before it was applied and answered
                self.saves = 0
                save(h[3])
        elif kind == DONE:
            self.active.difference_update(workers)
            self._release()
        else:
            raise RuntimeError(f"parameter server got unknown message kind {kind} from ranks {workers}")

    def _update(self, grad: torch.Tensor, lr: float, norm: float | None, overflow: bool) -> tuple[float, bool]:
        """Clip and step on one gradient. norm=None: the global norm of this gradient over all
        servers (synchronous mode, where every server updates once per version)."""
        self.version += 1
        if overflow:  # fp16: a worker's gradient overflowed; skip it as the data-parallel engines do
            self.skipped_steps += 1
            return float("nan"), True
        self.grad.copy_(grad)
        if norm is None:  # per-tensor norms first, as the single-process engine sums them
            sq = sum_sq(self.group.views(self.grad)).to(CPU)
            all_reduce(sq, self.servers)  # squared norms of the shards add up to the global one
            norm_t = sq.sqrt()
        else:
            norm_t = torch.tensor(norm, dtype=torch.float32)
        clip_([self.grad], norm_t, self.grad_clip)
        for pg in self.optimizer.param_groups:
            pg["lr"] = lr
        self.optimizer.step()
        return float(norm_t), False

    def _release(self) -> None:
        """Answer held workers that are no more than `staleness` clocks ahead of the slowest running one."""
        if not self.held:
            return
        for w in sorted(self.held):
            lead = self._lead(w)
            if self.staleness is None or lead <= self.staleness:
                stale, norm, skipped = self.held.pop(w)
                loss = sum(self.last_loss.values()) / len(self.last_loss)
                self._reply(w, stale, loss, norm, skipped, lead)

    def _lead(self, worker: int) -> int:
        """Clocks this worker is ahead of the slowest one still running."""
        return self.clock[worker] - min((self.clock[w] for w in self.active), default=self.clock[worker])

    def _reply(self, worker: int, staleness: int, loss: float, norm: float, skipped: bool, lead: int) -> None:
        head = torch.tensor([self.version, staleness, f2i(loss), f2i(norm), int(skipped), lead, 0, 0],
                            dtype=torch.int64)
        dist.send(head, dst=worker, group=self.channel, tag=TAG_REPLY)
        dist.send(self.flat.to(CPU), dst=worker, group=self.channel, tag=TAG_PARAMS)

    # ---- the engine interface, as far as a server has it
    def state_bytes(self) -> dict[str, int]:
        opt = [t for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
        return {"params": tensor_bytes([self.flat]), "grads": tensor_bytes([self.grad, self.inbox]),
                "optimizer": tensor_bytes(opt)}

    def holdings(self) -> Holdings:
        """The whole parameters this server owns (fp32) and its optimizer over them."""
        slots = [Slot(placement(p), v) for p, v in zip(self.group.params, self.views)]
        return Holdings(slots, [(self.optimizer, slots)])

    def state_meta(self) -> dict:
        return {"param_server": {"version": self.version, "clock": self.clock, "skipped_steps": self.skipped_steps}}

    def loaded(self, meta: dict) -> None:
        ps = meta["param_server"]
        self.version, self.clock, self.skipped_steps = ps["version"], ps["clock"], ps["skipped_steps"]

    @torch.no_grad()
    def full_params(self) -> dict[str, torch.Tensor]:
        """The parameters this server owns (fp32, CPU)."""
        return {n: v.detach().cpu().clone() for n, v in zip(self.group.names, self.views)}
