"""The planner's view of a pipeline schedule, from the one simulator (parallel/pipeline/simulate.py).

The planner averages compute over stages (time.py divides the model's FLOPs by pp), so it simulates
even stages: each chunk's forward takes 1/v, its backward r/v, r = 2 (two matmuls per forward one)
or 3 under full, every-k or sqrt recomputation (one forward replayed). The weight-gradient half is
half of the backward. What it reads off the timeline:
- bubble: the idle share of the step (GPipe and 1F1B: (p-1)/(m+p-1); interleaved: (p-1)/(v*m+p-1);
  ZB-H1: (p-1)/(3m+p-1) at these ratios), which time.py adds on top of the busy time;
- in flight: the most micro-batches whose activations one rank holds, in whole-stage units
  (interleaved chunks count 1/v each: p + (p-1)/v, Korthikanti et al. 2022 sec. 4.2.3);
- held at each end (`end_held`): on the first and the last rank, the (chunks, end-chunk) pairs in
  flight and those waiting for W at each moment of the rank's own action list, so memory.py can weigh
  the end stage's extra tensors (the last stage's logits and loss) by how many of its micro-batches
  are alive: GPipe's last rank holds all m with their logits, 1F1B's one, ZB-H1's one in flight and
  p - 1 waiting for W (which hold only W's inputs and gradients: backward.py); and the share of the
  rank's chunks that have run a backward by then (their gradients exist: 1F1B's first rank at m = p
  reaches its fullest moment before any, at m > p again after one; an interleaved rank's chunks
  one by one; an asynchronous schedule's update frees them);
- weight versions: the most copies of a stage's weights an asynchronous schedule keeps;
- makespan: the step of real stages, which are not even: each holds its own block count (`stage_split`:
  `parallel.stage_layers`, else the split the planner balances, `balanced_split`), the first also runs
  the embedding and the last the LM head and the loss (at llama-1b's width and 32k vocabulary the
  head is as much work as one block, so the last of 4 stages of 8 layers does 3 blocks' work where the
  average is 2.25); the busiest stage sets the pace.
"""

from __future__ import annotations

from functools import lru_cache

from teratrain.config_schema import REPLAYING
from teratrain.parallel.pipeline.actions import B, I, STEP, W
from teratrain.parallel.pipeline.partition import split_layers
from teratrain.parallel.pipeline.schedules import build
from teratrain.parallel.pipeline.simulate import Costs, Timeline, held_split, simulate
from teratrain.planner.layout import Layout, ModelShape


def backward_ratio(lay: Layout) -> float:
    """Backward time over forward time of one micro-batch on one stage, for the simulated schedule's shape: 3 where
    backward reruns the forward, else 2. The per-op policies take 2 too, though the alternate one reruns about a
    third of the forward's products: without transfers the makespan of 1F1B and interleaved 1F1B does not depend on
    the ratio (forward and backward scale together; tests/unit/test_planner_stages.py), and ZB-H1, whose would,
    refuses them."""
    return 3.0 if lay.recompute in REPLAYING else 2.0


_build = lru_cache(maxsize=64)(build)  # the search asks for the same schedule at two backward ratios


@lru_cache(maxsize=1024)
def _summary(schedule: str, pp: int, m: int, v: int, ratio: float) -> tuple[float, float, int]:
    tl = simulate(_build(schedule, pp, m, v), Costs(forward_s=1 / v, backward_s=ratio / v))
    return tl.bubble_fraction, max(tl.peak_activations) / v, max(tl.peak_versions)


def summary(lay: Layout) -> tuple[float, float, int]:
    """(bubble fraction, micro-batches in flight on the fullest rank, weight versions held)."""
    if lay.pp == 1:  # accumulation without a pipeline: one micro-batch at a time, nothing idle
        return 0.0, 1.0, 1
    return _summary(lay.schedule, lay.pp, lay.num_microbatches, lay.virtual_stages, backward_ratio(lay))


@lru_cache(maxsize=1024)
def _end_held(schedule: str, pp: int, m: int, v: int, rank: int,
              blocks: tuple[int, ...]) -> tuple[tuple[float, int, float, int, float], ...]:
    """`end_held` of one rank whose chunks hold `blocks` (in flight and waiting for W counted in blocks)."""
    chunk = 0 if rank == 0 else v - 1 if rank == pp - 1 else -1  # the chunk of the model's first (last) stage
    acts = _build(schedule, pp, m, v).ranks[rank]
    out, made = set(), set()
    for a, (n, e, w, we) in zip(acts, held_split(acts, chunk, blocks)):
        if a.kind in (B, W):  # a chunk's weight gradients exist from its first B (or W)
            made.add(a.chunk)
        elif a.kind == STEP:  # the update frees gradients no buffer holds (asynchronous schedules)
            made.clear()
        out.add((n, e, w, we, len(made) / v))
    return tuple(sorted(out))


@lru_cache(maxsize=256)
def _splits(schedule: str, pp: int, m: int, v: int) -> bool:
    return any(a.kind == I for a in _build(schedule, pp, m, v).ranks[0])


def splits_backward(lay: Layout) -> bool:
    """Does the schedule split each backward into I and W (ZB-H1)?"""
    return lay.pp > 1 and _splits(lay.schedule, lay.pp, lay.num_microbatches, lay.virtual_stages)


def end_held(lay: Layout, last: bool) -> tuple[tuple[float, int, float, int, float], ...]:
    """Every (stage-equivalents in flight, micro-batches of the end chunk in flight, stage-equivalents
    waiting for W, of the end chunk waiting for W, the share of the rank's chunks whose weight
    gradients exist: those that ran a B or W since the last update) the fullest pipeline rank before the
    last (`end_rank`; with `last`, the last rank) passes through (simulate.held_split); one (1, 1, 0, 0,
    1 if m > 1 else 0) without a pipeline (accumulation: the next micro-batch's forward runs beside the
    gradients). A stage-equivalent is the rank's blocks (`end_layers`) once: its chunks' in-flight
    micro-batches weighed by each chunk's blocks (1/v each on even stages); a rank with none holds 0."""
    if lay.pp == 1:
        return ((1.0, 1, 0.0, 0, 1.0 if lay.num_microbatches > 1 else 0.0),)
    rank = lay.pp - 1 if last else end_rank(lay)
    blocks = _rank_blocks(lay, rank)
    total = sum(blocks)
    return tuple((n / total if total else 0.0, e, w / total if total else 0.0, we, made)
                 for n, e, w, we, made in _end_held(lay.schedule, lay.pp, lay.num_microbatches,
                                                    lay.virtual_stages, rank, blocks))


def _rank_blocks(lay: Layout, rank: int) -> tuple[int, ...]:
    """Blocks of each chunk of a pipeline rank (`parallel.stage_layers`), or 1 each where the stages are even."""
    if not lay.stage_layers:
        return (1,) * lay.virtual_stages
    return tuple(lay.stage_layers[c * lay.pp + rank] for c in range(lay.virtual_stages))


def end_layers(lay: Layout, last: bool) -> int | None:
    """Blocks of the rank `end_held` follows (the last, or `end_rank`), or None where the stages are
    even (states.stage_params counts the first rank's)."""
    if lay.pp == 1 or not lay.stage_layers:
        return None
    return sum(_rank_blocks(lay, lay.pp - 1 if last else end_rank(lay)))


def end_rank(lay: Layout) -> int:
    """The pipeline rank before the last whose blocks' activations are the most at its fullest moment: the
    first on even stages (a later rank holds fewer micro-batches), a middle one where it has more blocks
    than the first (`stage_layers` 7, 8, ...: at 1F1B rank r holds p - r micro-batches of its own blocks;
    0, 8, ...: the first stage holds the embedding alone). memory.py counts that rank's blocks with the
    first rank's other tensors, so the worst rank's peak is reported."""
    if not lay.stage_layers or lay.pp < 3:
        return 0
    return _end_rank(lay.schedule, lay.pp, lay.num_microbatches, lay.virtual_stages, lay.stage_layers)


@lru_cache(maxsize=1024)
def _end_rank(schedule: str, pp: int, m: int, v: int, counts: tuple[int, ...]) -> int:
    def peak(r: int) -> float:
        acts = _build(schedule, pp, m, v).ranks[r]
        return max((n + w for n, _, w, _ in held_split(acts, -1, [counts[c * pp + r] for c in range(v)])), default=0)

    peaks = [peak(r) for r in range(pp - 1)]
    return peaks.index(max(peaks))


def makespan(lay: Layout, rank_s: float, last_extra_s: float, layers: tuple[int, ...] = ()) -> float:
    """Seconds of a step in which a rank holding the average block count does `rank_s` of work (all
    micro-batches, forward and backward), each global stage in proportion to its blocks (`layers`, one
    count per stage; empty: even), and the last stage `last_extra_s` more (the LM head and the loss,
    which the model's last stage alone runs): the simulated schedule over uneven stages, idle included.
    Without transfers the step scales with the costs, so it is rank_s x the step at rank_s = 1, which
    depends on last_extra_s / rank_s alone: simulated once per ratio to 3 significant digits (within
    0.05% of the head's time; the search asks for thousands of layouts)."""
    if rank_s <= 0:
        return last_extra_s
    ratio = float(f"{last_extra_s / rank_s:.3g}")
    return rank_s * _unit_makespan(lay.schedule, lay.pp, lay.num_microbatches, lay.virtual_stages,
                                   backward_ratio(lay), ratio, tuple(layers))


@lru_cache(maxsize=4096)
def _unit_makespan(schedule: str, pp: int, m: int, v: int, r: float, last_extra: float,
                   layers: tuple[int, ...]) -> float:
    return simulate(_build(schedule, pp, m, v), _stage_costs(pp, m, v, r, 1.0, last_extra, layers),
                    peaks=False).makespan_s


def _stage_costs(pp: int, m: int, v: int, r: float, rank_s: float, last_extra_s: float, layers: tuple[int, ...],
                 send_s: float = 0.0) -> Costs:
    """Each global stage's forward and backward of one micro-batch: `rank_s` (a rank of the average block count,
    every micro-batch, forward and backward) spread over the stages by their blocks (`layers`; empty: even),
    the model's last stage (chunk v-1 of the last rank) `last_extra_s` more."""
    S = pp * v
    shares = [n * S / sum(layers) for n in layers] if layers else [1.0] * S  # blocks over the average
    per = [k * rank_s / m / v for k in shares]
    per[-1] += last_extra_s / m
    return Costs(forward_s=[t / (1 + r) for t in per], backward_s=[t * r / (1 + r) for t in per], send_s=send_s)


def timeline(lay: Layout, busy_s: float, send_s: float, last_extra_s: float = 0.0, layers: tuple[int, ...] = (),
             **options) -> Timeline:
    """The simulated step of `lay` in seconds: `busy_s` is a rank's compute for the whole step at the average
    block count (all micro-batches, forward and backward), spread over the stages by `layers` (empty: even), the
    last stage `last_extra_s` more (the head and the loss), `send_s` one activation's transfer between stages;
    `options` go to the schedule (vertical_sync, weight_version_every)."""
    m, v = lay.num_microbatches, lay.virtual_stages
    costs = _stage_costs(lay.pp, m, v, backward_ratio(lay), busy_s, last_extra_s, tuple(layers), send_s)
    return simulate(build(lay.schedule, lay.pp, m, v, **options), costs)


def head_blocks(shape: ModelShape) -> float:
    """The LM head's work in blocks: its FLOPs per token (6*d*V) over one block's (6 per matmul weight
    plus the attention core's 12*H*Q*T, PaLM appendix B); the embedding is a lookup (none)."""
    c = shape.cfg
    block = 6 * (shape.counts()["per_block"]) + 12 * c.n_heads * c.head_width * c.seq_len
    return 6 * c.d_model * c.vocab_size / block


@lru_cache(maxsize=4096)
def balanced_split(n_layers: int, stages: int, first: float = 0.0, last: float = 0.0) -> tuple[int, ...]:
    """Blocks per stage that minimise the slowest stage, the first stage costing `first` blocks more
    (the embedding) and the last `last` more (the head and the loss): the least bound T at which
    floor(T - extra) blocks per stage hold them all, then the surplus taken one block at a time from the
    busiest stage, the earliest among equals (the first stages hold the most micro-batches in flight).
    Llama 3 405B's 126 blocks on 16 stages with its head (0.6 of a block) give 7, 8 x 14, 7, as its
    authors ran (Dubey et al. 2024, sec. 3.3.2). One or two stages more than blocks: a block a stage, the
    head alone on the last, and with two the embedding alone on the first (its 126 blocks on 16 x 8)."""
    if 2 <= stages and n_layers < stages <= n_layers + 2:
        return ((0,) if stages == n_layers + 2 else ()) + (1,) * n_layers + (0,)
    if not 1 <= stages <= n_layers:
        split_layers(n_layers, stages)  # the executor's one-sentence refusal
    extra = [0.0] * stages
    extra[0] += first
    extra[-1] += last

    def room(bound: float) -> list[int]:
        return [max(1, int(bound - e + 1e-9)) for e in extra]

    bounds = sorted({k + e for e in extra for k in range(1, n_layers + 1)})
    bound = next(b for b in bounds if sum(room(b)) >= n_layers)
    counts = room(bound)
    for _ in range(sum(counts) - n_layers):
        busiest = min((i for i in range(stages) if counts[i] > 1), key=lambda i: (-(counts[i] + extra[i]), i))
        counts[busiest] -= 1
    return tuple(counts)


def stage_split(shape: ModelShape, lay: Layout) -> tuple[int, ...]:
    """Blocks of each of the pp x virtual_stages global stages: the layout's own (`parallel.stage_layers`),
    else the executor's count split (parallel.partition=layers: equal where they divide)."""
    if lay.stage_layers:
        return lay.stage_layers
    S = lay.pp * lay.virtual_stages
    if shape.is_bare or S == 1:
        return ()
    return tuple(len(r) for r in split_layers(shape.cfg.n_layers, S))


def planned_split(shape: ModelShape, lay: Layout) -> tuple[int, ...]:
    """The split the search gives a layout with no `stage_layers`: `balanced_split` over its global
    stages, the head on the last (the embedding costs no FLOPs)."""
    S = lay.pp * lay.virtual_stages
    if shape.is_bare or S == 1:
        return ()
    return balanced_split(shape.cfg.n_layers, S, 0.0, head_blocks(shape))
