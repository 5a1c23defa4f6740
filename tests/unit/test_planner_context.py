"""The planner's context parallelism (planner/comm.py cp_s, activations.py, search.py): arithmetic
checked by hand. That the saved bytes are what autograd keeps on a cp rank is
tests/dist/test_context_parallel.py's (measure.saved_bytes against memory.forward_saved)."""

from dataclasses import replace

import pytest

from teratrain.planner.comm import cp_s, on_link
from teratrain.planner.hardware import GPUS
from teratrain.planner.inputs import layout_of, shape_of, training_of
from teratrain.planner.memory import forward_saved, plan_memory
from teratrain.planner.search import search
from tests.helpers import make_config

LONG = ["model.preset=llama-1b", "model.seq_len=32768", "train.global_batch=4", "train.micro_batch=1",
        "memory.precision=bf16"]


def _plan(*sets: str, gpus: int = 4):
    cfg = make_config(*LONG, *sets)
    return shape_of(cfg), training_of(cfg), layout_of(cfg, gpus)


@pytest.mark.parametrize("form", ["ring", "all-to-all"])
def test_a_rank_saves_a_cp_th_of_the_activations(form):
    """Every saved tensor is per token: cp=4 keeps a quarter of one rank's (ring; the all-to-all form
    adds its head-layout output per block and two position indices). bf16 parameters (fp32 masters):
    no autocast copies of the weights, and the norms run in bf16 with their bf16 weights: nothing kept is
    not per token."""
    one = forward_saved(*_plan("parallel.cp=1", "memory.master_weights=true"))
    four = forward_saved(*_plan("parallel.cp=4", f"parallel.cp_form={form}", "memory.master_weights=true"))
    shape = _plan()[0]
    c = shape.cfg
    extra = 0 if form == "ring" else c.n_layers * 32768 // 4 * c.d_model * 2 + 2 * 32768 * 8
    assert four == one // 4 + extra
    assert four <= 0.3 * one


def test_zero_shards_over_dp_times_cp():
    """ZeRO-3 at dp=1, cp=4 shards the states four ways, as dp=4 does."""
    shape, train, lay = _plan("parallel.cp=4", "parallel.zero=3")
    cp4 = plan_memory(shape, train, lay)
    dp4 = plan_memory(shape, train, replace(lay, dp=4, cp=1))
    assert (cp4.params, cp4.grads, cp4.optimizer) == (dp4.params, dp4.grads, dp4.optimizer)


def test_ring_transfers_hide_under_long_attention_and_show_under_short():
    """Per block and micro-batch: forward 3 (cp-1) key/value sends, backward 3 more and 4 (cp) passes of
    their fp32 gradient; under a long attention only the last gradient pass is exposed, under a short
    one every transfer beyond the attention of its step."""
    shape, train, lay = _plan("parallel.cp=4")
    c, gpu = shape.cfg, GPUS["h200"]
    n = 32768 // 4
    kv = on_link(gpu, "p2p", 2, 4, 2 * n * c.kv_heads * c.head_width * 2)
    grad = on_link(gpu, "p2p", 2, 4, 2 * n * c.kv_heads * c.head_width * 4)
    total, exposed = cp_s(shape, train, lay, gpu)
    blocks = c.n_layers * lay.num_microbatches  # 4 micro-batches of one sample (dp=1)
    assert total == pytest.approx(blocks * (6 * kv + 4 * grad))
    assert exposed == pytest.approx(blocks * grad)  # 32K tokens: a step's attention outlasts its transfer
    short = make_config(*LONG[:1], "model.seq_len=1024", "train.global_batch=4", "memory.precision=bf16",
                        "parallel.cp=4")
    s_shape, s_train, s_lay = shape_of(short), training_of(short), layout_of(short, 4)
    s_total, s_exposed = cp_s(s_shape, s_train, s_lay, replace(gpu, nvlink_gbps=1.0))  # a slow link
    assert s_exposed > 0.9 * s_total


def test_all_to_all_is_exposed_whole():
    shape, train, lay = _plan("parallel.cp=4", "parallel.cp_form=all-to-all")
    c, gpu = shape.cfg, GPUS["h200"]
    n, width = 32768 // 4, c.n_heads * c.head_width
    kv = c.kv_heads * c.head_width  # 8 key/value heads: 4 divides them, none repeated
    one = sum(on_link(gpu, "all_to_all", 4, 4, n * w * 2) for w in (width, kv, kv, width))
    total, exposed = cp_s(shape, train, lay, gpu)
    assert total == exposed == pytest.approx(c.n_layers * lay.num_microbatches * 2 * one)


def test_the_search_tries_cp_for_long_sequences_only():
    shape, train, _ = _plan()
    fixed = {"tp": 1, "pp": 1, "micro_batch": 1, "zero": 3, "offload": "none", "recompute": "none"}
    cands = search(shape, train, 4, GPUS["h200"], fixed, gpu_mem_gib=60)
    assert {(c.layout.cp, c.layout.cp_form) for c in cands} == {(1, "ring"), (2, "ring"), (2, "all-to-all"),
                                                                (4, "ring"), (4, "all-to-all")}
    assert not any(c.fits for c in cands if c.layout.cp == 1)  # one 32K sample's activations: over 60 GiB
    assert cands[0].fits and cands[0].layout.cp > 1
    short = make_config("model.preset=llama-1b", "model.seq_len=2048", "train.global_batch=4", "memory.precision=bf16")
    assert {c.layout.cp for c in search(shape_of(short), training_of(short), 4, GPUS["h200"], fixed)} == {1}


def test_the_search_never_offers_a_cp_layout_training_refuses():
    """Dropout (cp runs attention without it) and CUDA graphs rule cp out in the planner as in
    parallel/cp_plan.py check_cp: the same rule, cp_problem."""
    from teratrain.planner.hardware import GPUS

    for extra in (["model.dropout=0.1"], ["train.compile=true", "train.compile_mode=reduce-overhead"]):
        cfg = make_config(*LONG, *extra)
        found = search(shape_of(cfg), training_of(cfg), 8, GPUS["h200"], {})
        assert found and all(c.layout.cp == 1 for c in found), extra
