"""Planner time model and layout search: the formulas' textbook values and the search's choices."""

import pytest

from teratrain.config import load_config
from teratrain.planner.hardware import GPUS
from teratrain.planner.inputs import shape_of, training_of
from teratrain.planner.layout import Layout, ModelShape, Training
from teratrain.planner.memory import GIB, in_flight, plan_memory
from teratrain.planner.search import batch_advice, evaluate, search
from teratrain.planner.comm import collective as _collective
from teratrain.planner.pipeline import summary
from teratrain.planner.time import model_flops, recompute_flops

H100 = GPUS["h100"]


def _shape(preset: str, *sets: str):
    cfg = load_config(None, [f"model.preset={preset}", "memory.precision=bf16", *sets])
    return shape_of(cfg), training_of(cfg)


def test_ring_collectives_move_the_textbook_fraction():
    gb = 1e9
    assert _collective("all_reduce", 8, gb, 100, 0.0) == pytest.approx(2 * 7 / 8 * gb / 100e9)
    assert _collective("reduce_scatter", 8, gb, 100, 0.0) == pytest.approx(7 / 8 * gb / 100e9)
    assert _collective("all_gather", 4, gb, 100, 1e-5) == pytest.approx(3 / 4 * gb / 100e9 + 3 * 1e-5)
    assert _collective("all_reduce", 1, gb, 100, 1e-5) == 0.0


def test_pipeline_bubble_and_in_flight_microbatches():
    assert summary(Layout(pp=4, num_microbatches=8))[0] == pytest.approx(3 / 11)  # GPipe: (p-1)/(m+p-1)
    assert summary(Layout(pp=4, num_microbatches=8, schedule="interleaved_1f1b", virtual_stages=2))[0] == \
        pytest.approx(3 / 19)
    assert in_flight(Layout(pp=4, num_microbatches=8, schedule="gpipe")) == 8
    assert in_flight(Layout(pp=4, num_microbatches=8)) == 4  # 1F1B holds at most p
    assert in_flight(Layout(pp=4, num_microbatches=8, schedule="interleaved_1f1b", virtual_stages=2)) == 4 + 3 / 2


def test_planner_reads_every_schedule_off_the_simulator():
    """ZB-H1 with backward = 2 forwards (I = W = F): (p-1)/(3m+p-1) (Qi et al. 2023); 2BW with m = 2p
    keeps two copies of the stage's weights; pp=1 accumulation holds one micro-batch."""
    assert summary(Layout(pp=4, num_microbatches=8, schedule="zb_h1"))[0] == pytest.approx(3 / 27)
    assert in_flight(Layout(pp=4, num_microbatches=8, schedule="zb_h1")) == 4
    assert in_flight(Layout(pp=1, num_microbatches=8, schedule="gpipe")) == 1
    shape, train = _shape("llama-1b")
    base = Layout(pp=4, num_microbatches=8, micro_batch=1)
    one = plan_memory(shape, train, base, H100)
    two = plan_memory(shape, train, base.with_(schedule="pipedream-2bw"), H100)
    assert two.params == 2 * one.params and two.terms["weight_versions"] == 2


def test_flops_follow_palm_and_recompute_adds_a_forward():
    shape, _ = _shape("llama-1b")
    c = shape.cfg
    n_matmul = shape.counts()["matmul"]
    per_token = 6 * n_matmul + 12 * c.n_layers * c.d_model * c.seq_len
    assert model_flops(shape, 1) == per_token
    blocks = n_matmul - c.vocab_size * c.d_model
    full = recompute_flops(shape, Layout(recompute="full"), 1)
    assert full == 2 * blocks + 4 * c.n_layers * c.d_model * c.seq_len
    assert recompute_flops(shape, Layout(recompute="selective"), 1) == 4 * c.n_layers * c.d_model * c.seq_len


def test_search_picks_the_fastest_layout_that_fits_and_rejects_the_rest():
    shape, train = _shape("gpt2-774m", "train.global_batch=16")
    cands = search(shape, train, 4, H100, {}, gpu_mem_gib=20)
    fitting = [c for c in cands if c.fits]
    assert fitting and any(not c.fits for c in cands)
    assert all(c.memory.total <= 20 * GIB for c in fitting)
    assert all(c.memory.total > 20 * GIB for c in cands if not c.fits)
    assert cands[0] is fitting[0]
    assert fitting[0].time.step_time_s <= min(c.time.step_time_s for c in fitting) * 1.001
    assert all(c.layout.gpus == 4 for c in cands)


def test_search_keeps_what_the_user_fixed():
    shape, train = _shape("llama-1b", "train.global_batch=16")
    cands = search(shape, train, 8, H100, {"tp": 2, "zero": 1, "recompute": "full"}, 80)
    assert {(c.layout.tp, c.layout.zero, c.layout.recompute) for c in cands} == {(2, 1, "full")}
    assert all(c.layout.dp * c.layout.pp == 4 for c in cands)  # pp is still searched


def test_tensor_parallel_degree_must_divide_the_heads():
    shape, train = _shape("gpt2-1.5b")  # 25 heads
    assert {c.layout.tp for c in search(shape, train, 8, H100, {}, 80)} <= {1, 5}


def test_tensor_parallel_beyond_the_key_value_heads_replicates_them_as_the_runtime_does():
    """tp a multiple of n_kv_heads runs (parallel/tp_plan.py check_tp, the megatron form: one whole key/value
    head a rank) and is searched; the per-layer forms split the heads and may not exceed them."""
    shape, train = _shape("llama-1b", "model.n_kv_heads=4", "train.global_batch=16")
    assert 8 in {c.layout.tp for c in search(shape, train, 8, H100, {}, 80)}
    assert {c.layout.tp for c in search(shape, train, 8, H100, {"tp_form": "all-gather"}, 80)} <= {1, 2, 4}
    with pytest.raises(Exception, match=r"divide model.n_kv_heads \(4\) or be a multiple of it"):
        search(shape, train, 8, H100, {"tp": 3}, 80)


def test_more_gpus_take_less_time_per_step():
    shape, train = _shape("llama-1b", "train.global_batch=32")
    one = evaluate(shape, train, Layout(dp=1, micro_batch=2, num_microbatches=16, recompute="full"), H100)
    eight = evaluate(shape, train, Layout(dp=8, micro_batch=2, num_microbatches=2, recompute="full"), H100)
    assert eight.time.step_time_s < one.time.step_time_s / 4
    assert 0 < eight.time.mfu < one.time.mfu <= 1


def test_memory_falls_as_each_saving_is_added():
    shape, train = _shape("llama-8b", "train.global_batch=64")
    base = Layout(dp=8, micro_batch=1, num_microbatches=8)
    totals = [plan_memory(shape, train, lay, H100).total for lay in
              (base, base.with_(zero=1), base.with_(zero=2), base.with_(zero=3),
               base.with_(zero=3, recompute="full"), base.with_(zero=3, recompute="full", offload="params"))]
    assert totals == sorted(totals, reverse=True)
    assert plan_memory(shape, train, base.with_(zero=3, offload="params"), H100).host > 0


def test_bare_parameter_count_has_no_activations():
    shape = ModelShape(cfg=None, bare_params=1_500_000_000)
    c = evaluate(shape, Training(precision="bf16"), Layout(), H100)
    assert c.memory.activations == 0
    assert c.memory.params + c.memory.grads + c.memory.optimizer == 24 * 10**9


def test_batch_advice_scales_lr_and_warmup():
    adv = batch_advice(3e-4, "sqrt", 256, 1024, 100)
    assert adv["lr"] == pytest.approx(6e-4) and adv["lr_linear"] == pytest.approx(1.2e-3)
    assert adv["warmup_steps"] == 200
    assert batch_advice(3e-4, "sqrt", None, 1024, 100) is None


def test_pipeline_ends_say_when_their_gradients_exist():
    """pipeline.end_held gives each moment of a rank's action list the share of its chunks that have
    run a backward (B, or W when split) since the last update: gradients nothing buffers exist for
    those (memory.py weighs them into the fullest moment). 1F1B's first rank at m = p holds its p
    micro-batches before any backward, at m > p again after one; GPipe runs every forward first; the
    last rank runs a backward after its first forward; ZB-H1's first rank has run an I, not yet a W,
    with 3 in flight; an interleaved rank's chunks start their backwards one after the other;
    PipeDream's updates free what the backwards made."""
    from teratrain.planner.pipeline import end_held

    def fullest(lay, last=False):
        states = end_held(lay, last)
        most = max(s[0] for s in states)
        return {s[4] for s in states if s[0] == most}

    assert fullest(Layout(pp=4, num_microbatches=4)) == {0.0}
    assert fullest(Layout(pp=4, num_microbatches=8)) == {0.0, 1.0}
    assert fullest(Layout(pp=4, num_microbatches=8, schedule="gpipe")) == {0.0}
    assert fullest(Layout(pp=4, num_microbatches=8), last=True) == {0.0, 1.0}
    assert (3.0, 3, 1.0, 1, 0.0) in end_held(Layout(pp=4, num_microbatches=8, schedule="zb_h1"), False)
    interleaved = end_held(Layout(pp=4, num_microbatches=4, schedule="interleaved_1f1b", virtual_stages=2), False)
    assert (2.0, 4, 0.0, 0, 0.5) in interleaved and fullest(Layout(pp=4, num_microbatches=4,
                                                                   schedule="interleaved_1f1b", virtual_stages=2)) == {0.0}
    assert fullest(Layout(pp=4, num_microbatches=8, schedule="pipedream")) == {0.0}
    assert end_held(Layout(num_microbatches=4), False) == ((1.0, 1, 0.0, 0, 1.0),)
