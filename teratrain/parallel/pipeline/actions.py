"""The pipeline schedule language: actions, per-rank lists, and the one function that adds communication.

A schedule is data: for each pipeline rank, the ordered list of `Action`s it performs in one call
(one trainer step of `num_microbatches` micro-batches). Stages are numbered globally: chunk c of rank r
is stage c * pp + r (Megatron's interleaved layout), so stage s runs on rank s % pp and hands its
activation to stage s + 1 on rank (s + 1) % pp.

    stage:   0    1    2    3  |  4    5    6    7        pp = 4, virtual_stages = 2
    rank:    0    1    2    3  |  0    1    2    3        (chunk 0 | chunk 1)

Kinds, and what an executor does for each (rank r, chunk c, stage s = c * pp + r, micro-batch mb):
  F       forward of stage s on mb. Input: mb's tokens (s = 0) or the tensor RECV_F delivered; the
          last stage also computes mb's loss. Keeps what backward needs.
  B       full backward of stage s on mb: gradient w.r.t. the input and the weights. Output gradient:
          from the loss (last stage) or from RECV_B. Frees mb's activations on this stage.
  I, W    the two halves of B (Qi et al. 2023 call them B and W): I computes only the input gradient
          (and is what SEND_B sends); W later adds the weight gradient and frees what I kept.
  STEP    optimizer update of every chunk of this rank with the gradients accumulated since the
          previous STEP, applied to the newest weights; creates weight version `version`.
  SEND_F  send F(mb, c)'s output to `peer`;      RECV_F  receive F(mb, c)'s input from `peer`.
  SEND_B  send the input gradient of B/I(mb, c) to `peer`;  RECV_B  receive the gradient of F(mb, c)'s
          output from `peer`.
Rules the lists guarantee (`check` verifies them) and an executor must keep:
  1. Sends never block: post the send and go on; all sends complete before the call returns.
  2. A receive completes before the next compute action of the list (posting it earlier is fine;
     the simulator waits at the RECV itself).
  3. Messages on one directed link (src -> dst) are received in the order they are sent: dst's
     RECVs from src appear in the same order as src's SENDs to dst, so positional (FIFO) matching
     needs no tags. A RECV may therefore sit a few actions before the compute that consumes it.
     NCCL runs the ops of one communicator in order on one stream, so give each directed link its
     own communicator (e.g. two 2-rank groups per neighbouring pair), or a send can wait behind a
     receive in the other direction.
  4. Weight versions (`version`): None in flush schedules (every action uses the current weights;
     the trainer steps once after the list). In the asynchronous schedules every F/B/I/W names the
     version it must use (the forward and backward of a micro-batch name the same one) and STEP names
     the version it creates; version 0 is the weights the call starts with. Keep a version while a
     later action of the list names it (weight stashing, Harlap et al. 2018).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

F, B, I, W, STEP = "F", "B", "I", "W", "STEP"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, I, W)
SENDS, RECVS = (SEND_F, SEND_B), (RECV_F, RECV_B)


@dataclass(frozen=True, slots=True)
class Action:
    kind: str  # F B I W STEP SEND_F RECV_F SEND_B RECV_B
    microbatch: int  # STEP: the last micro-batch whose gradient it applies
    chunk: int = 0  # model chunk on this rank (global stage = chunk * pp + rank)
    peer: int | None = None  # the other rank of a SEND/RECV
    version: int | None = None  # F/B/I/W: weight version to use; STEP: the version it creates

    def __str__(self) -> str:
        s = f"{self.kind}(mb={self.microbatch}, chunk={self.chunk}"
        s += f", peer={self.peer}" if self.peer is not None else ""
        return s + (f", v={self.version})" if self.version is not None else ")")


@dataclass(frozen=True)
class Schedule:
    """Every rank's ordered actions for one call of `num_microbatches` micro-batches."""

    name: str
    pp: int
    num_microbatches: int
    virtual_stages: int
    ranks: tuple[tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.pp + rank


def message(a: Action, rank: int, pp: int, num_stages: int, sending: bool) -> tuple | None:
    """The message, as ("F"|"B", micro-batch, consumer stage), that a compute action sends
    (sending=True: F's activation, B/I's input gradient) or needs (sending=False), or that a
    SEND (sending=True) or RECV (sending=False) names; None at the ends of the pipe and for W/STEP."""
    s = a.chunk * pp + rank
    if a.kind in (F, SEND_F, RECV_F):
        kind, producer, consumer = F, (s if sending else s - 1), (s + 1 if sending else s)
    elif a.kind in (B, I, SEND_B, RECV_B):
        kind, producer, consumer = B, (s if sending else s + 1), (s - 1 if sending else s)
    else:
        return None
    if not (0 <= producer < num_stages and 0 <= consumer < num_stages):
        return None
    return kind, a.microbatch, consumer


def producer_stage(msg: tuple) -> int:
    kind, _, consumer = msg
    return consumer - 1 if kind == F else consumer + 1


def add_communication(name: str, pp: int, num_microbatches: int, virtual_stages: int,
                      compute: list[list[Action]]) -> Schedule:
    """Insert SEND after each compute action whose result leaves the rank and RECV before each one
    that needs a remote input (rules 1-3 above). The same function serves every schedule.
    Receivers take a link's messages in the sender's order: to get message k, a rank first receives
    the messages sent before it on that link (they are already on their way, so nothing waits longer)."""
    S = pp * virtual_stages
    links: dict[tuple[int, int], deque] = {}
    sends = [[message(a, rank, pp, S, sending=True) for a in acts] for rank, acts in enumerate(compute)]
    for rank, msgs in enumerate(sends):
        for msg in msgs:
            if msg is not None and msg[2] % pp != rank:
                links.setdefault((rank, msg[2] % pp), deque()).append(msg)
    out = []
    for rank, acts in enumerate(compute):
        got: set = set()
        lst: list[Action] = []
        for a, sent in zip(acts, sends[rank]):
            need = message(a, rank, pp, S, sending=False)
            src = None if need is None else producer_stage(need) % pp
            if src is not None and src != rank and need not in got:
                queue = links.get((src, rank), deque())
                while need not in got:
                    if not queue:
                        raise ValueError(f"schedule '{name}': rank {rank} needs {need} from rank {src}, "
                                         "which never sends it")
                    kind, mb, consumer = msg = queue.popleft()
                    got.add(msg)
                    lst.append(Action(RECV_F if kind == F else RECV_B, mb, consumer // pp, peer=src))
            lst.append(a)
            if sent is not None and sent[2] % pp != rank:
                lst.append(Action(SEND_F if sent[0] == F else SEND_B, a.microbatch, a.chunk, peer=sent[2] % pp))
        out.append(tuple(lst))
    return Schedule(name, pp, num_microbatches, virtual_stages, tuple(out))


def check(sched: Schedule) -> None:
    """Raise ValueError naming the first broken rule: each (stage, micro-batch) has one F and one B
    (or one I then one W) after it, on the rank that holds the stage; inputs are received or made
    locally before use; sends follow what they send and go to the rank of the consuming stage;
    per-link orders match; versions exist before use and F and its backward use the same one."""
    counts: Counter = Counter()
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for rank in range(sched.pp):
        _check_rank(sched, rank, counts, sends, recvs)
    for s in range(sched.num_stages):
        for mb in range(sched.num_microbatches):
            once = counts[(F, s, mb)] == 1 and (counts[(B, s, mb)], counts[(I, s, mb)], counts[(W, s, mb)]) in \
                ((1, 0, 0), (0, 1, 1))
            if not once:
                raise ValueError(f"schedule '{sched.name}': stage {s} micro-batch {mb} is not forwarded and "
                                 "backwarded exactly once")
    for link in set(sends) | set(recvs):
        if sends.get(link, []) != recvs.get(link, []):
            raise ValueError(f"schedule '{sched.name}': rank {link[1]} receives from rank {link[0]} in another "
                             "order than it is sent")


def _check_rank(sched: Schedule, rank: int, counts: Counter, sends: dict, recvs: dict) -> None:
    pp, S = sched.pp, sched.num_stages
    done: set = set()
    have: set = set()  # messages available on this rank (received or made locally)
    steps, fwd_version = 0, {}
    for a in sched.ranks[rank]:
        where = f"schedule '{sched.name}' rank {rank}: {a}"
        if not (0 <= a.chunk < sched.virtual_stages and -1 <= a.microbatch < sched.num_microbatches):
            raise ValueError(f"{where} names a chunk or micro-batch out of range")
        s = sched.stage(rank, a.chunk)
        if a.kind in COMPUTE:
            counts[(a.kind, s, a.microbatch)] += 1
            need = message(a, rank, pp, S, sending=False)
            if need is not None and need not in have:
                raise ValueError(f"{where} runs before its input {need} is received")
            before = {B: F, I: F, W: I}.get(a.kind)
            if before and (before, s, a.microbatch) not in done:
                raise ValueError(f"{where} runs before {before} of that micro-batch on stage {s}")
            if fwd_version.setdefault((s, a.microbatch), a.version) != a.version:
                raise ValueError(f"{where} uses another weight version than its forward")
            if a.version is not None and a.version > steps:
                raise ValueError(f"{where} uses version {a.version} before this rank made it")
            done.add((a.kind, s, a.microbatch))
            made = message(a, rank, pp, S, sending=True)
            if made is not None and made[2] % pp == rank:
                have.add(made)
        elif a.kind == STEP:
            steps += 1
            if a.version != steps:
                raise ValueError(f"{where} should create version {steps}")
        elif a.kind in SENDS + RECVS:
            sending = a.kind in SENDS
            msg = message(a, rank, pp, S, sending)
            if msg is None or (msg[2] if sending else producer_stage(msg)) % pp != a.peer:
                raise ValueError(f"{where} names the wrong peer or leaves the pipe")
            if not sending:
                have.add(msg)
                recvs.setdefault((a.peer, rank), []).append(msg)
            elif any((k, s, a.microbatch) in done for k in ((F,) if a.kind == SEND_F else (B, I))):
                sends.setdefault((rank, a.peer), []).append(msg)
            else:
                raise ValueError(f"{where} sends before computing what it sends")
        else:
            raise ValueError(f"{where}: unknown action kind")
