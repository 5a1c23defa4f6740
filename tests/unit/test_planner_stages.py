"""The planner's pipeline stages: uneven splits (any layer count on any stage count, the head counted on
the last stage), interleaving in the search, and the published layouts of bench/published_runs.toml."""

import sys
from pathlib import Path

import pytest

from teratrain.config import load_config
from teratrain.planner.hardware import GPUS
from teratrain.planner.inputs import fixed_of, layout_of, shape_of, training_of
from teratrain.planner.layout import Layout
from teratrain.planner.pipeline import (_unit_makespan, balanced_split, end_held, end_layers, end_rank, head_blocks,
                                        planned_split, stage_split)
from teratrain.planner.search import evaluate, search

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import published  # noqa: E402  (bench/published.py)

RUNS = {r["name"]: r for r in published.load_runs()}


def _run(name: str, *drop: str):
    """A published run's shape, training and layout (config keys in `drop` left unset)."""
    run = RUNS[name]
    kv = [] if "n_kv_heads" in run else [f"model.n_kv_heads={run['n_heads']}"]  # GPT: a key/value head per head
    cfg = load_config(None, [s for s in published.sets_of(run) if s.split("=")[0] not in drop] + kv)
    return run, cfg, shape_of(cfg), training_of(cfg)


def test_balanced_split_minimises_the_slowest_stage_counting_the_ends():
    assert balanced_split(8, 4) == (2, 2, 2, 2)
    assert balanced_split(5, 2) == (2, 3)  # the earlier stage holds more micro-batches: it gets fewer
    assert balanced_split(5, 2, last=1.0) == (3, 2)
    assert balanced_split(6, 2, last=1.5) == (4, 2)  # 4 | 2 + 1.5 beats 3 | 3 + 1.5
    assert balanced_split(70, 12, last=2.0) == (6,) * 11 + (4,)
    for n, s, head in ((126, 16, 0.6), (70, 12, 0.9), (7, 3, 0.0), (96, 8, 3.0)):
        got = balanced_split(n, s, last=head)
        assert sum(got) == n and len(got) == s and min(got) >= 1
        slowest = max(k + (head if i == s - 1 else 0.0) for i, k in enumerate(got))
        assert slowest <= -(-(n + head) // s) + 1  # within a block of the continuous optimum


def test_llama3_405b_plans_126_layers_on_16_stages_as_published():
    """Dubey et al. 2024 sec. 3.3.2 ran Llama 3 405B's 126 blocks on 16 stages with one block fewer on the
    first and the last; the planner's balanced split (the head is 0.6 of a block) is that split. Against the
    count split (8 x 14, 7, 7: the head on a 7) its busiest stage holds as many blocks (8), so the bubble is
    the same within 1%, and its fullest rank holds the embedding's parameters fewer (7 blocks and the
    embedding, or 8 blocks, against 8 and the embedding): at ZeRO-0, less to reduce over dp and to step."""
    run, cfg, shape, train = _run("dubey24-405b-8k", "parallel.stage_layers", "parallel.virtual_stages",
                                  "parallel.schedule", "parallel.zero")  # 1F1B, ZeRO-0: the ends' split alone
    assert head_blocks(shape) == pytest.approx(0.6, abs=0.05)
    lay = layout_of(cfg, run["gpus"])
    assert stage_split(shape, lay) == (8,) * 14 + (7, 7)
    balanced = lay.with_(stage_layers=planned_split(shape, lay))
    assert balanced.stage_layers == (7,) + (8,) * 14 + (7,)
    plain, even = evaluate(shape, train, lay, GPUS["h100"]), evaluate(shape, train, balanced, GPUS["h100"])
    assert even.time.bubble_s == pytest.approx(plain.time.bubble_s, rel=0.01)
    assert even.time.terms["comm_dp_s"] < plain.time.terms["comm_dp_s"]
    assert even.time.optimizer_s < plain.time.optimizer_s
    assert even.time.step_time_s < plain.time.step_time_s
    # rank 1 holds 15 micro-batches of 8 blocks at 1F1B, rank 0 16 of 7: the worst one is reported
    assert end_rank(balanced) == 1 and end_layers(balanced, False) == 8
    assert max(held[0] for held in end_held(balanced, False)) == 15


def test_bloom_70_layers_on_12_stages_plans_with_the_head_on_a_shorter_stage():
    run, cfg, shape, train = _run("lescao22-bloom-176b")
    lay = layout_of(cfg, run["gpus"])
    balanced = lay.with_(stage_layers=planned_split(shape, lay))
    assert sum(balanced.stage_layers) == 70 and len(balanced.stage_layers) == 12
    assert balanced.stage_layers[-1] < max(balanced.stage_layers)  # its 250k-word head weighs on the last
    plain, even = evaluate(shape, train, lay, GPUS["a100"]), evaluate(shape, train, balanced, GPUS["a100"])
    assert even.time.step_time_s < plain.time.step_time_s


def test_search_fills_in_the_split_and_honours_a_given_one():
    cfg = load_config(None, ["model.preset=tiny", "model.n_layers=7", "parallel.pp=2", "parallel.dp=1",
                             "parallel.schedule=1f1b", "parallel.zero=0", "train.global_batch=4"])
    shape, train = shape_of(cfg), training_of(cfg)
    fixed = {**fixed_of(cfg), "offload": "none", "recompute": "none"}
    cands = search(shape, train, 2, GPUS["h100"], fixed)
    assert {c.layout.stage_layers for c in cands} == {balanced_split(7, 2, last=head_blocks(shape))}
    cands = search(shape, train, 2, GPUS["h100"], {**fixed, "stage_layers": (2, 5)})
    assert {c.layout.stage_layers for c in cands} == {(2, 5)}


def test_a_middle_stage_with_more_blocks_sets_the_activation_peak():
    """At 1F1B rank r holds p - r micro-batches: 5 blocks on rank 1 (3 in flight) hold less than 5 on
    rank 0 (4 in flight) and more than 2 on every rank."""
    cfg = load_config(None, ["model.preset=tiny", "model.n_layers=8", "parallel.pp=4", "train.global_batch=8"])
    shape, train = shape_of(cfg), training_of(cfg)
    lay = layout_of(cfg, 4)
    blocks = {split: evaluate(shape, train, lay.with_(stage_layers=split), GPUS["h100"]).memory.activations
              for split in ((2, 2, 2, 2), (1, 5, 1, 1), (5, 1, 1, 1))}
    assert blocks[(2, 2, 2, 2)] < blocks[(1, 5, 1, 1)] < blocks[(5, 1, 1, 1)]


def test_stages_beyond_the_blocks_leave_the_ends_alone_and_memory_follows_each_ranks_blocks():
    """One or two stages more than blocks: the head alone on the last, and the embedding alone on the first
    (Llama 3 405B's 126 blocks over 16 x 8 stages); three more cannot be split. With the first stage empty
    at 1F1B, rank 1 (3 blocks, 3 micro-batches in flight) is the fullest before the last, and the empty
    last stage holds no block's activations."""
    assert balanced_split(126, 128, 0.0, 0.6) == (0,) + (1,) * 126 + (0,)
    assert balanced_split(4, 5) == (1, 1, 1, 1, 0)
    with pytest.raises(ValueError, match="each stage needs a block"):
        balanced_split(4, 7)
    lay = Layout(pp=4, num_microbatches=8, stage_layers=(0, 3, 3, 2))
    assert end_rank(lay) == 1 and end_layers(lay, False) == 3
    assert max(held[0] for held in end_held(lay, False)) == 3
    last_empty = Layout(pp=2, num_microbatches=4, stage_layers=(4, 0))
    assert end_layers(last_empty, True) == 0 and {held[0] for held in end_held(last_empty, True)} == {0.0}
    cfg = load_config(None, ["model.preset=tiny", "parallel.pp=2", "train.global_batch=8", "parallel.zero=0",
                             "parallel.offload=none", "memory.recompute=none", "train.micro_batch=2"])
    shape, train = shape_of(cfg), training_of(cfg)
    fixed = {**fixed_of(cfg), "schedule": "interleaved_1f1b", "virtual_stages": 3}  # 6 stages, 4 blocks
    assert {c.layout.stage_layers for c in search(shape, train, 2, GPUS["h100"], fixed)} == {(0, 1, 1, 1, 1, 0)}


@pytest.mark.long  # ten layouts of a 96-block model, each built on the meta device: 6-25 s on 2 cores
def test_free_pick_for_gpt3_175b_is_no_slower_than_the_published_layout():
    """Korthikanti et al. 2022 ran GPT-3 175B on 64 A100s as t8 p8 (1F1B, 64 micro-batches); left to
    choose the pipeline degree, the schedule and its virtual stages at that tp, the planner predicts
    its pick no slower than that layout, which it also plans."""
    run, cfg, shape, train = _run("korthikanti22-175b-full", "parallel.pp", "parallel.dp", "parallel.virtual_stages")
    published_lay = layout_of(load_config(None, published.sets_of(run)), run["gpus"])
    ref = evaluate(shape, train, published_lay, GPUS["a100"])
    fixed = {**fixed_of(cfg), "zero": 1, "offload": "none", "micro_batch": 1}
    best = search(shape, train, run["gpus"], GPUS["a100"], fixed, 80)[0]
    assert best.fits and best.time.step_time_s <= ref.time.step_time_s
    assert (best.layout.pp, best.layout.schedule) != (8, "one_f_one_b")  # it found something else


def test_auto_hands_the_planned_split_and_schedule_to_the_executor():
    from teratrain.planner.auto import Target, resolve

    cfg = load_config(None, ["model.preset=tiny", "model.n_layers=5", "parallel.auto=true", "parallel.pp=2",
                             "train.global_batch=8", "parallel.zero=0", "parallel.offload=none",
                             "memory.recompute=none", "train.micro_batch=2"])
    got = resolve(cfg, 2, Target(GPUS["h100"], 79.2, None, 2)).chosen
    assert sum(got["parallel.stage_layers"]) == 5 and cfg.parallel.stage_layers == got["parallel.stage_layers"]
    assert len(cfg.parallel.stage_layers) == 2 * cfg.parallel.virtual_stages
    assert cfg.parallel.schedule == got["parallel.schedule"] in ("1f1b", "interleaved-1f1b")


def test_uneven_stages_time_the_average_rank_and_the_busiest_paces():
    """A rank's per-block time terms (ops, tensor-parallel exchanges) are the average rank's, as its compute
    is (n_layers / pp blocks); the simulated schedule then weighs each stage by its own blocks. Counting the
    first rank's 1 block of (1, 3, 3, 1) instead halved them against (2, 2, 2, 2)."""
    cfg = load_config(None, ["model.preset=llama-1b", "model.n_layers=8", "model.vocab_size=1024", "parallel.pp=4",
                             "parallel.tp=2", "parallel.schedule=1f1b", "train.global_batch=8", "train.micro_batch=1"])
    shape, train = shape_of(cfg), training_of(cfg)
    lay = layout_of(cfg, 8)
    even, uneven = (evaluate(shape, train, lay.with_(stage_layers=split), GPUS["h100"]).time
                    for split in ((2, 2, 2, 2), (1, 3, 3, 1)))
    assert even.terms["comm_tp_s"] > 0 and uneven.terms["comm_tp_s"] == pytest.approx(even.terms["comm_tp_s"])
    assert uneven.ops_s == pytest.approx(even.ops_s) and uneven.compute_s == pytest.approx(even.compute_s)
    assert uneven.step_time_s > even.step_time_s  # a stage of 3 blocks paces it


@pytest.mark.parametrize("schedule, v", [("one_f_one_b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)])
@pytest.mark.parametrize("m", [4, 8, 12])
def test_backward_ratio_does_not_move_these_schedules_makespan(schedule, v, m):
    """Why the per-op policies keep the ratio 2 (pipeline.backward_ratio): 1F1B's and interleaved 1F1B's simulated
    step, the last stage's head and uneven stages included, is the same whatever share of a chunk's time its
    backward takes (selective-ops-alternate's replayed products would put it near 2.3 at llama-1b's width)."""
    layers = (3,) + (4,) * (4 * v - 2) + (5,)  # uneven: one block fewer first, one more last
    steps = [_unit_makespan(schedule, 4, m, v, r, 0.3, layers) for r in (2.0, 2.32, 3.0)]
    assert steps == pytest.approx([steps[0]] * 3, rel=1e-12)
