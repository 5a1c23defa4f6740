"""Context parallelism (parallel/context.py, ring_attention.py) against one process.

Attention alone, fp64: ring attention (torch's fused kernel that returns the log-sum-exp, and the
math fallback) and the all-to-all form on cp=2 and cp=4 ranks, causal and with packed documents
(document-balanced chunks, single-token documents), equal SDPA over the whole samples (output and
the gradients of q, k, v) within 1e-12 relative; measured: about 6e-16.

Training, fp32, against one process on the same global batch (`train_random`: 3 AdamW steps of 2
micro-batches per data-parallel rank, clipping on): cp alone, ring and all-to-all (key/value heads
repeated where cp does not divide them); dp x cp with ZeRO 1 and 3 sharded over dp x cp; tp x cp with
sequence parallelism (and GPT-2's learned positions, tied embeddings and biases); pp x cp (and ZeRO-3); ep x cp (MoE); recomputation, full and selective; packed
documents; and train.compile (aot_eager). Tolerance: 1e-5 relative on every step's loss and every
final parameter tensor (gathered whole), as test_tensor_parallel.py; measured: losses about 1e-7,
parameters up to 4e-6 (AdamW with eps=1e-6 amplifies the splits' fp32 summation order). And the
bytes autograd keeps on a cp rank equal the planner's count."""

import pytest
from cp_workers import attention_vs_whole, compiled
from harness import run_ranks
from layout_workers import BASE, train_random
from test_tensor_parallel import GPT2_SGD, TOL, max_rel_diff

from teratrain.config import load_config
from teratrain.planner.inputs import layout_of, shape_of, training_of
from teratrain.planner.memory import forward_saved

STEPS = 3
CASES = [("ring", False, True), ("ring", False, False), ("ring", True, True), ("ring", True, False),
         ("all-to-all", False, True), ("all-to-all", True, True)]
DOCS = ["data.document_mask=true", "data.eot_id=0", "model.seq_len=32"]  # random ids: ~1 document end in 50
# MoE: deterministic top-2 routing without a capacity limit and no aux loss, which each cp rank computes
# over its own chunks (docs/context.md)
MOE = ["model.moe.num_experts=4", "model.moe.router=softmax-topk", "model.moe.aux_loss_weight=0.0",
       "optim.weight_decay=0.0"]


def _assert_attention(runs: list[list[dict]]) -> None:
    cp = len(runs)
    for i, case in enumerate(CASES):
        worst = max(max(r[i]["errors"].values()) for r in runs)
        assert worst < 1e-12, f"cp={cp} {case}: {worst:.1e}"
    if cp == 4:  # documents move the chunks off the causal pairs
        assert runs[0][0]["chunks"] == ((0, 7), (1, 6), (2, 5), (3, 4))
        assert runs[0][2]["chunks"] != runs[0][0]["chunks"]


def test_attention_equals_whole_sample_attention_on_two_ranks():
    _assert_attention(run_ranks(attention_vs_whole, 2, CASES))


def _compare(layouts: list[list[str]], runs: list[dict]) -> None:
    refs = {}
    for layout, got in zip(layouts, runs):
        same = tuple(o for o in layout if not o.startswith(("parallel.", "memory.recompute")))
        if same not in refs:
            refs[same] = train_random(0, 1, list(same), steps=len(got["losses"]))
        ref = refs[same]
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
        assert loss_err < TOL, f"{layout}: losses differ by {loss_err:.2e}"
        param_err = max_rel_diff(got["params"], ref["params"])
        assert param_err < TOL, f"{layout}: parameters differ by {param_err:.2e}"


def _many(rank: int, world: int, layouts: list[list[str]]) -> tuple[list[dict], list[dict]]:
    """Attention at cp=4 (the same processes: starting 4 is most of a small test's time), then training."""
    return attention_vs_whole(rank, world, CASES), [train_random(rank, world, layout, steps=STEPS,
                                                                 count_saved=_planned(layout)) for layout in layouts]


def _planned(layout: list[str]) -> bool:
    """Layouts whose forward the planner's `forward_saved` counts: no pipeline (measure.saved_bytes runs
    the whole model), experts, documents or ZeRO-3's gathers."""
    return not any(o.startswith(("parallel.pp", "parallel.ep", "data.", "parallel.zero=3")) for o in layout)


def _assert_saved_as_planned(layouts: list[list[str]], runs: list[dict]) -> None:
    """What autograd keeps for one micro-batch on rank 0 (measure.saved_bytes) is the planner's count
    (memory.forward_saved) for every layout `_planned` names: exactly, but for lm_loss's 4-byte scalar where the loss is not vocab-parallel (tp = 1), as in
    tests/unit/test_planner_activations.py."""
    for layout, got in zip(layouts, runs):
        if not _planned(layout):
            continue
        cfg = load_config(None, BASE + layout)
        planned = forward_saved(shape_of(cfg), training_of(cfg), layout_of(cfg, 4), "cpu")
        assert got["saved"] - planned == (4 if cfg.parallel.tp == 1 else 0), layout


def test_cp_composes_with_every_strategy_on_four_ranks():
    """Attention alone at cp=4 first, then every layout's training."""
    layouts = [["parallel.cp=4"], ["parallel.cp=4", "parallel.cp_form=all-to-all"],
               ["parallel.cp=2", "parallel.zero=1"], ["parallel.cp=2", "parallel.zero=3"],
               ["parallel.cp=2", "parallel.tp=2"], ["parallel.cp=2", "parallel.tp=2", "parallel.cp_form=all-to-all"],
               GPT2_SGD + ["parallel.cp=2", "parallel.tp=2"],  # learned positions of each rank's chunks, sp shards
               ["parallel.cp=2", "parallel.pp=2"], ["parallel.cp=2", "parallel.pp=2", "parallel.zero=3"],
               MOE + ["parallel.cp=2", "parallel.ep=2"],
               ["parallel.cp=2", "memory.recompute=full"], ["parallel.cp=2", "memory.recompute=selective"],
               DOCS + ["parallel.cp=2"], DOCS + ["parallel.cp=4", "parallel.cp_form=all-to-all"]]
    runs = run_ranks(_many, 4, layouts)
    _assert_attention([attention for attention, _ in runs])
    _compare(layouts, runs[0][1])
    _assert_saved_as_planned(layouts, runs[0][1])


@pytest.mark.long
def test_cp_compiled_matches_one_process():
    """train.compile: the all-to-all form traces whole (fullgraph: its exchange is a functional
    collective with an autograd formula); ring attention runs eager between the compiled pieces (one
    break where each block's ring starts)."""
    layouts = [["parallel.cp=2"], ["parallel.cp=2", "parallel.cp_form=all-to-all", "fullgraph=true"]]
    runs = run_ranks(compiled, 2, layouts, 2)[0]
    _compare([[o for o in lay if o != "fullgraph=true"] for lay in layouts], runs)
    assert runs[1]["graph_breaks"] == 0 and runs[0]["graph_breaks"] > 0
