"""Pipeline schedules as data: pure functions from (pp, num_microbatches, ...) to every rank's actions.

Each builder, called as builder(pp, m, v) (only interleaved uses v), orders the compute actions of
each rank (F, B or I + W, STEP); `add_communication` (actions.py) then inserts the sends and receives
the same way for all of them. Rank r runs stage r (and, interleaved, stages r + pp, r + 2 pp, ...).
Config names (`parallel.schedule`) in brackets; `build(name, ...)` takes either spelling.

- naive [naive]: model parallelism without pipelining; one micro-batch goes all the way through the
  pipe and back before the next enters. Bubble (pp-1)/pp.
- gpipe [gpipe] (Huang et al. 2019): every forward, then every backward. Bubble (pp-1)/(m+pp-1);
  the first stage holds the activations of all m micro-batches.
- one_f_one_b [1f1b] (PipeDream-flush, Narayanan et al. 2021): rank r runs pp-r-1 warm-up forwards,
  then alternates one forward and one backward. Same bubble, at most pp micro-batches in flight.
- interleaved_1f1b [interleaved-1f1b] (Narayanan et al. 2021, PTD-P sec. 2.2.2): v chunks per rank,
  micro-batches taken in groups of pp through chunk 0, then chunk 1, ... (Megatron-LM's order and
  warm-up (pp-r-1)*2 + (v-1)*pp). Bubble (pp-1)/(v*m+pp-1). Rule: m >= pp and m % pp == 0 (Megatron).
- zb_h1 [zb-h1] (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 2.1, ZB-H1): 1F1B with B
  split into I and W; rank r defers its first r weight-gradient passes, so every rank holds at most
  pp micro-batches (1F1B's peak, on the first stage) and the deferred W fill the drain.
  Bubble (pp-1)(T_F + T_I - T_W), against 1F1B's (pp-1)(T_F + T_I + T_W).
- pipedream [pipedream] (Harlap et al. 2018; Narayanan et al. 2019): asynchronous 1F1B; every stage
  updates its weights after each backward (STEP), and a micro-batch's backward uses the version its
  forward used (weight stashing). vertical_sync=True: every stage uses the version the micro-batch
  entered stage 0 with (sec. 3.3, "vertical sync").
- pipedream_2bw [pipedream-2bw] (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
  Training", sec. 3.1): a new weight version every k >= pp micro-batches (gradients of those k
  accumulated); micro-batch i uses version max(i // k - 1, 0) on every stage, forward and backward,
  so with k >= pp at most two versions are alive: W(t+1) = W(t) - lr * grad f(W(t-1)).
Asynchronous schedules describe one trainer step of m micro-batches: the pipe fills at its start and
drains at its end (PipeDream's steady state holds within a step), version 0 is the weights the step
starts with, and the STEPs inside are the optimizer updates (pipedream: m per step, 2BW: m / k).
"""

from __future__ import annotations

from collections import deque

from teratrain.parallel.pipeline.actions import B, F, I, STEP, W, Action, Schedule, add_communication

CONFIG_NAMES = {"naive": "naive", "gpipe": "gpipe", "1f1b": "one_f_one_b", "interleaved-1f1b": "interleaved_1f1b",
                "zb-h1": "zb_h1", "pipedream": "pipedream", "pipedream-2bw": "pipedream_2bw"}

ASYNC_SCHEDULES = ("pipedream", "pipedream-2bw")  # update the weights inside a step (weight versions)


def config_name(name: str) -> str:
    """The `parallel.schedule` spelling of a schedule given by function or config name."""
    return {fn: cfg for cfg, fn in CONFIG_NAMES.items()}.get(name, name)


def problem(name: str, pp: int, num_microbatches: int | None, virtual_stages: int = 1,
            weight_version_every: int | None = None, vertical_sync: bool = False) -> str | None:
    """One sentence naming the config key that makes this schedule impossible, or None.
    num_microbatches=None skips the checks that need it (the config may leave it to the launcher)."""
    fn = CONFIG_NAMES.get(name, name)
    m, v = num_microbatches, virtual_stages
    if fn not in BUILDERS:
        return f"parallel.schedule={name} is unknown; use one of {', '.join(CONFIG_NAMES)}."
    if pp < 1 or v < 1 or (m is not None and m < 1):
        return "parallel.pp, parallel.num_microbatches and parallel.virtual_stages must be at least 1."
    if fn == "interleaved_1f1b":
        if v < 2:
            return ("parallel.schedule=interleaved-1f1b needs parallel.virtual_stages >= 2 model chunks per rank "
                    "(with 1 it is 1f1b); set parallel.virtual_stages=2.")
        if m is not None and m % pp:  # Megatron's rule; other counts run slower or deadlock (tested)
            return (f"interleaved-1f1b needs a multiple of parallel.pp={pp} micro-batches per step, got {m}; make "
                    f"train.global_batch / (dp x train.micro_batch) a multiple of {pp}.")
    elif v != 1:
        return (f"parallel.virtual_stages={v} needs parallel.schedule=interleaved-1f1b; set it or "
                "parallel.virtual_stages=1.")
    if weight_version_every is not None and fn != "pipedream_2bw":
        return "parallel.weight_version_every only applies to parallel.schedule=pipedream-2bw; leave it unset."
    if vertical_sync and fn != "pipedream":
        return "parallel.vertical_sync only applies to parallel.schedule=pipedream; set it to false."
    if fn == "pipedream_2bw":
        k = weight_version_every or pp
        if k < pp:
            return (f"parallel.weight_version_every={k} is below parallel.pp={pp}, so 2BW would need more than two "
                    f"weight versions; set it to at least {pp}.")
        if m is not None and m % k:
            return (f"pipedream-2bw makes a weight version every {k} micro-batches, which must divide the {m} "
                    f"micro-batches of a step; make them a multiple of {k}.")
    return None


def build(name: str, pp: int, num_microbatches: int, virtual_stages: int = 1, *, vertical_sync: bool = False,
          weight_version_every: int | None = None) -> Schedule:
    """The named schedule (config or function name) with its communication added."""
    why = problem(name, pp, num_microbatches, virtual_stages, weight_version_every, vertical_sync)
    if why:
        raise ValueError(why)
    fn = CONFIG_NAMES.get(name, name)
    kw = {"vertical_sync": vertical_sync} if fn == "pipedream" else \
        {"every": weight_version_every} if fn == "pipedream_2bw" else {}
    return BUILDERS[fn](pp, num_microbatches, virtual_stages, **kw)


def naive(pp: int, m: int, v: int = 1) -> Schedule:
    compute = [[a for mb in range(m) for a in (Action(F, mb), Action(B, mb))] for _ in range(pp)]
    return add_communication("naive", pp, m, 1, compute)


def gpipe(pp: int, m: int, v: int = 1) -> Schedule:
    compute = [[Action(F, mb) for mb in range(m)] + [Action(B, mb) for mb in range(m)] for _ in range(pp)]
    return add_communication("gpipe", pp, m, 1, compute)


def _one_f_one_b_order(pp: int, rank: int, m: int) -> list[tuple[str, int]]:
    """PipeDream-flush's order on one rank: pp-rank-1 warm-up forwards, 1F1B, cool-down backwards."""
    warm = min(pp - rank - 1, m)
    order = [(F, mb) for mb in range(warm)]
    for k in range(m - warm):
        order += [(F, warm + k), (B, k)]
    return order + [(B, mb) for mb in range(m - warm, m)]


def one_f_one_b(pp: int, m: int, v: int = 1) -> Schedule:
    compute = [[Action(kind, mb) for kind, mb in _one_f_one_b_order(pp, r, m)] for r in range(pp)]
    return add_communication("1f1b", pp, m, 1, compute)


def interleaved_1f1b(pp: int, m: int, v: int = 2) -> Schedule:
    """Megatron-LM's interleaved order (schedules.py, forward_backward_pipelining_with_interleaving):
    the k-th forward of every rank is table[k], its k-th backward the same micro-batch on chunk v-1-c."""
    table = [(mb, c) for g in range(0, m, pp) for c in range(v) for mb in range(g, min(g + pp, m))]
    total = len(table)
    compute = []
    for r in range(pp):
        warm = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        fwd = [Action(F, mb, c) for mb, c in table]
        bwd = [Action(B, mb, v - 1 - c) for mb, c in table]
        order = fwd[:warm]
        for k in range(total - warm):
            order += [fwd[warm + k], bwd[k]]
        compute.append(order + bwd[total - warm:])
    return add_communication("interleaved-1f1b", pp, m, v, compute)


def zb_h1(pp: int, m: int, v: int = 1) -> Schedule:
    """1F1B's forwards and input gradients; rank r keeps up to r weight-gradient passes pending."""
    compute = []
    for r in range(pp):
        order: list[Action] = []
        pending: deque = deque()
        for kind, mb in _one_f_one_b_order(pp, r, m):
            if kind == F:
                order.append(Action(F, mb))
                continue
            order.append(Action(I, mb))
            pending.append(mb)
            if len(pending) > r:
                order.append(Action(W, pending.popleft()))
        compute.append(order + [Action(W, mb) for mb in pending])
    return add_communication("zb-h1", pp, m, 1, compute)


def _versioned(name: str, pp: int, m: int, version_of, step_after) -> Schedule:
    """1F1B order with weight versions: F and B of micro-batch mb on rank r use version_of(r, mb, steps
    made so far); a STEP follows B whenever step_after(mb) says so."""
    compute = []
    for r in range(pp):
        order, steps, used = [], 0, {}
        for kind, mb in _one_f_one_b_order(pp, r, m):
            if kind == F:
                used[mb] = version_of(r, mb, steps)
            order.append(Action(kind, mb, version=used[mb]))
            if kind == B and step_after(mb):
                steps += 1
                order.append(Action(STEP, mb, version=steps))
        compute.append(order)
    return add_communication(name, pp, m, 1, compute)


def pipedream(pp: int, m: int, v: int = 1, vertical_sync: bool = False) -> Schedule:
    """Weight stashing: a forward takes the newest version on its stage. With vertical sync it takes
    the version stage 0 used, i.e. the updates rank 0 made before F(mb) (later stages have made more)."""
    entered, steps = {}, 0
    for kind, mb in _one_f_one_b_order(pp, 0, m):
        entered.setdefault(mb, steps)
        steps += kind == B

    def version_of(r, mb, steps):
        return entered[mb] if vertical_sync else steps

    return _versioned("pipedream", pp, m, version_of, lambda mb: True)


def pipedream_2bw(pp: int, m: int, v: int = 1, every: int | None = None) -> Schedule:
    k = every or pp
    return _versioned("pipedream-2bw", pp, m, lambda r, mb, steps: max(mb // k - 1, 0), lambda mb: (mb + 1) % k == 0)


BUILDERS = {"naive": naive, "gpipe": gpipe, "one_f_one_b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b,
            "zb_h1": zb_h1, "pipedream": pipedream, "pipedream_2bw": pipedream_2bw}
