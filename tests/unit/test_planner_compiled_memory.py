"""What a compiled step keeps (planner/compiled.py) against what autograd holds: `saved_tensors_hooks` around
one forward (+ loss) of a model that train.compile compiled on CPU, shared storages counted once, parameters
excluded, after a first call that compiles. Exact: every term is read off the partition, so a change of
torch's partitioner shows here as a difference of whole tensors. Then the compiled plan against the peaks
recorded on one H200 (torch 2.11), tolerances fixed before the comparison."""

import dataclasses
import json
from pathlib import Path

import pytest

from teratrain.config import load_config
from teratrain.measure import build_engine, random_batch, saved_bytes
from teratrain.planner.hardware import GPUS
from teratrain.planner.inputs import layout_of, shape_of, training_of
from teratrain.planner.memory import GIB, forward_saved, plan_memory
from teratrain.planner.report import memory_lines
from teratrain.planner.search import evaluate

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200"


def _cfg(arch: str, precision: str, scope: str, *extra: str):
    # 3 x 40 tokens: no activation shares a size with a weight, so a term counted as the wrong one shows
    sets = ["model.preset=tiny", f"model.arch={arch}", "model.seq_len=40", "model.n_layers=2",
            f"memory.precision={precision}", "train.compile=true", f"train.compile_scope={scope}", "train.micro_batch=3",
            "train.global_batch=3", *extra]
    if arch == "gpt2":
        sets.append("model.tie_embeddings=true")
    return load_config(None, sets)


def _measured(cfg) -> int:
    model, _ = build_engine(cfg)
    x, y = random_batch(cfg, cfg.train.micro_batch)
    saved_bytes(model, x, y, cfg.memory.precision, targets_in_model=True)  # compiles
    return saved_bytes(model, x, y, cfg.memory.precision, targets_in_model=True)


def _planned(cfg) -> int:
    return forward_saved(shape_of(cfg), training_of(cfg), layout_of(cfg, 1), "cpu")


CASES = [("llama", "bf16", "model"), ("llama", "bf16", "block")]
LONG = [("llama", "fp32", "model"), ("llama", "fp32", "block"), ("gpt2", "bf16", "model"), ("gpt2", "bf16", "block")]


@pytest.mark.slow
@pytest.mark.parametrize("arch, precision, scope", CASES + [pytest.param(*c, marks=pytest.mark.long) for c in LONG])
def test_compiled_model_keeps_what_the_planner_counts(arch, precision, scope):
    """bf16 autocast over fp32 weights (the GPU runs' setting) in both scopes by default; fp32 and GPT-2
    (LayerNorm, GELU, learned positions, a tied head) under -m long."""
    cfg = _cfg(arch, precision, scope)
    assert _planned(cfg) == _measured(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["model", pytest.param("block", marks=pytest.mark.long)])
def test_compiled_selective_recomputation_keeps_no_attention_output(scope):
    """`selective` checkpoints the attention core: compiled, its output and logsumexp are not kept (the core is rerun
    from q, k and v), and the checkpoint keeps the CPU generator's state. Exact, as the other terms."""
    cfg = _cfg("llama", "bf16", scope, "memory.recompute=selective")
    assert _planned(cfg) == _measured(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["selective-ops", pytest.param("full", marks=pytest.mark.long),
                                       pytest.param("selective-ops-alternate", marks=pytest.mark.long)])
def test_compiled_recomputation_keeps_no_more_than_its_blocks_and_the_compiled_loss(recompute):
    """A recomputed model in one graph: the blocks as eager's count (what a checkpoint keeps; inductor keeps a few
    tensors fewer), the loss as the compiled one. Tolerance fixed before the run: the plan within 5% above."""
    cfg = _cfg("llama", "bf16", "model", f"memory.recompute={recompute}")
    measured, planned = _measured(cfg), _planned(cfg)
    assert measured <= planned <= 1.05 * measured, (measured, planned)


@pytest.mark.long
@pytest.mark.parametrize("scope", ["model", "block"])
def test_bf16_weights_and_another_shape(scope):
    """bf16 parameters (fp32 masters in the optimizer: no autocast copies, a bf16 residual stream), at a
    wider shape without grouped heads and another MLP ratio."""
    cfg = _cfg("llama", "bf16", scope, "memory.master_weights=true", "model.d_model=192", "model.n_heads=6",
               "model.n_kv_heads=6", "model.d_ff=320")
    assert _planned(cfg) == _measured(cfg)


MOE = ["model.moe.num_experts=4", "model.moe.top_k=2"]


@pytest.mark.slow
@pytest.mark.parametrize("scope, extra", [
    ("model", MOE), pytest.param("block", MOE, marks=pytest.mark.long),
    pytest.param("model", ["model.moe.num_experts=8", "model.moe.top_k=3", "model.moe.expert_d_ff=96"],
                 marks=pytest.mark.long)])
def test_compiled_moe_keeps_what_the_planner_counts(scope, extra):
    """MoE layers in place of the MLPs (dropless softmax top-k, the experts as grouped GEMMs over their laid-out
    rows): in one graph all blocks but one keep their experts' outputs gathered back to the routed rows.
    Within 16 bytes: whether an 8-byte scalar's storage is shared with another varies from run to run."""
    cfg = _cfg("llama", "bf16", scope, *extra)
    assert abs(_planned(cfg) - _measured(cfg)) <= 16


@pytest.mark.slow
@pytest.mark.parametrize("scope, extra", [
    ("block", ["model.moe.score=sigmoid", "model.moe.balance=bias", "model.moe.shared_experts=1",  # DeepSeek-V3's
               "model.moe.num_experts=8", "model.moe.top_k=3", "model.moe.expert_d_ff=96"]),
    pytest.param("model", ["model.moe.shared_experts=1", "model.moe.shared_gate=true",  # Qwen2-MoE's
                           "model.moe.norm_topk=false", "model.moe.shared_d_ff=256"], marks=pytest.mark.long)])
def test_compiled_moe_routers_and_shared_experts_keep_what_the_planner_counts(scope, extra):
    """Sigmoid scores, bias balancing, unnormalised gates and shared experts, gated or not (within 16 bytes)."""
    cfg = _cfg("llama", "bf16", scope, *MOE, *extra)  # a setting given twice: the later one holds
    assert abs(_planned(cfg) - _measured(cfg)) <= 16


def test_moe_blocks_the_partition_was_not_read_for_are_planned_as_eager():
    """Where the compiled MoE count was not read off the partition (here: the router in bf16, fp32 compute,
    bf16 weights), the compiled step is planned with eager's tensors, more than it keeps."""
    for precision, extra in (("bf16", ["model.moe.router_dtype=compute"]), ("fp32", []),
                             ("bf16", ["memory.master_weights=true"])):
        cfg = _cfg("llama", precision, "model", *MOE, *extra)
        eager = dataclasses.replace(training_of(cfg), compiled=False)
        assert _planned(cfg) == forward_saved(shape_of(cfg), eager, layout_of(cfg, 1), "cpu")
    cfg = _cfg("llama", "bf16", "model", *MOE)  # the count read off the partition: less than eager's
    assert _planned(cfg) < forward_saved(shape_of(cfg), dataclasses.replace(training_of(cfg), compiled=False),
                                         layout_of(cfg, 1), "cpu")


def _handed_over(model, x, y, precision: str) -> list[int]:
    """Bytes of the parameters' gradients each compiled backward node hands over at once (its outputs, alive
    together before autograd accumulates any), one entry per node, from one forward and backward."""
    import torch

    from teratrain.memory.precision import autocast

    handed = []
    with autocast(precision, x.device):
        loss = model(x, y)
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunctionBackward" in node.name():  # the parameters' gradients: those AccumulateGrad takes
            into = [f is not None and "AccumulateGrad" in f.name() for f, _ in node.next_functions]
            node.register_hook(lambda grads, _, into=into: handed.append(
                sum(g.numel() * g.element_size() for g, p in zip(grads, into) if p and g is not None)))
        todo.extend(f for f, _ in node.next_functions)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return handed


@pytest.mark.slow
def test_the_whole_model_graph_hands_every_gradient_over_at_once():
    """The compiled whole model's backward is one autograd node: it hands every parameter's gradient over
    together, all alive at once before autograd adds them into those of the step's earlier micro-batches
    (planner/compiled.py gradients_at_once, added to the end of backward). Each block in its own graph
    hands over that block's alone (not counted)."""
    from teratrain.planner import compiled

    cfg = _cfg("llama", "bf16", "model")
    model, _ = build_engine(cfg)
    x, y = random_batch(cfg, cfg.train.micro_batch)
    _handed_over(model, x, y, cfg.memory.precision)  # compiles
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert _handed_over(model, x, y, cfg.memory.precision) == [params]
    lay = layout_of(load_config(None, ["model.preset=tiny", "train.compile=true", "train.micro_batch=3",
                                      "train.global_batch=6"]), 1)
    train = training_of(cfg)
    assert compiled.gradients_at_once(train, lay, params, buffered=False) == params  # the second micro-batch's
    assert compiled.gradients_at_once(train, layout_of(cfg, 1), params, buffered=False) == 0  # the only one
    cfg = _cfg("llama", "bf16", "block")
    model, _ = build_engine(cfg)
    _handed_over(model, x, y, cfg.memory.precision)
    blocks = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.layers]
    assert sorted(_handed_over(model, x, y, cfg.memory.precision), reverse=True)[:len(blocks)] == blocks
    assert compiled.gradients_at_once(training_of(cfg), lay, params, buffered=True) == 0


def test_compiled_blocks_keep_less_than_eager():
    """Per token, a compiled bf16 Llama block over fp32 weights keeps 14d + 4kv + 6f bytes (+ 2d more as the whole
    model's one graph) where eager keeps 16d + 4kv + 6f (8f while its SwiGLU kept silu's output), statistics and
    RoPE casts aside (planner/compiled.py)."""
    from teratrain.planner import activations as act
    from teratrain.planner import compiled

    cfg = _cfg("llama", "bf16", "block", "model.d_model=256", "model.n_heads=8", "model.n_kv_heads=2", "model.d_ff=768")
    shape, train, lay = shape_of(cfg), training_of(cfg), layout_of(cfg, 1)
    w, c, n = train.widths(0), cfg.model, 120
    d, kv, f = c.d_model, c.kv_heads * c.head_width, c.ffn_dim
    small = 4 * c.n_heads * n + 2 * 4 * n  # logsumexp, rstd x 2
    block = compiled.block_saved(shape, w, n, 40, "block")
    assert sum(block.values()) - block["rope_casts"] - small == n * (14 * d + 4 * kv + 6 * f)
    model = compiled.block_saved(shape, w, n, 40, "model")
    assert sum(model.values()) - small == n * (16 * d + 4 * kv + 6 * f)
    for silu_kept, kept in ((False, 6 * f), (True, 8 * f)):
        eager = act.block_saved(shape, dataclasses.replace(w, silu_kept=silu_kept), n, 40, device="cuda")
        assert sum(eager.values()) - eager["rope_casts"] - small == n * (16 * d + 4 * kv) + n * kept
    assert compiled.scope(shape, train, lay) == "block"
    assert compiled.scope(shape, training_of(_cfg("llama", "bf16", "block", "model.dropout=0.1")), lay) is None


TRAIN_STEP = ["model.arch=llama", "model.d_model=2048", "model.n_layers=16", "model.n_heads=32", "model.n_kv_heads=8",
              "model.d_ff=8192", "model.vocab_size=32000", "model.seq_len=2048", "model.tie_embeddings=false",
              "memory.precision=bf16", "train.micro_batch=8", "train.compile=true"]
FP8_WIDTH = ["model.arch=llama", "model.d_model=4096", "model.n_layers=8", "model.n_heads=32", "model.n_kv_heads=8",
             "model.d_ff=14336", "model.vocab_size=128256", "model.seq_len=4096", "model.tie_embeddings=false",
             "memory.precision=bf16", "train.micro_batch=1", "train.compile=true", "train.compile_scope=block"]


@pytest.mark.parametrize("sets, file, impl, batch", [
    (TRAIN_STEP, "2026-12-02_train_step.json", "ours_plain", 8),
    (FP8_WIDTH, "2026-12-02_fp8_modes.json", "ours", 1),
    (FP8_WIDTH, "2026-12-02_fp8.json", "ours", 4),  # 4 micro-batches a step
    # held out (measured after the rule was written): planned 25.4 GiB against 26.7 measured, -4.8%
    pytest.param([*TRAIN_STEP, "train.micro_batch=4", "memory.loss_chunks=0"], "2026-12-02_train_step_mb4.json",
                 "ours", 4, marks=pytest.mark.xfail(strict=True, reason="planned 4.8% under the measured peak")),
], ids=["llama-1b-model-scope", "llama-8b-width-block-scope", "llama-8b-width-4-micro-batches",
        "llama-1b-micro-batch-4-held-out"])
def test_compiled_peak_against_recorded_runs(sets, file, impl, batch):
    """Planned peak allocated (before the allowance) within 3% of torch.cuda.max_memory_allocated of compiled
    bf16 steps on one H200 (eager plans these within 0.2%: test_eager_peak_against_the_recorded_run; 47.85
    against 47.91 at the llama-8b width, when each projection cast its own input): 36.9 GiB planned against 36.1,
    43.1 against 42.1 and 52.5 against 52.6."""
    cfg = load_config(None, [*sets, f"train.global_batch={batch}", "parallel.dp=1"])
    shape, train, lay = shape_of(cfg), training_of(cfg), layout_of(cfg, 1)
    planned = plan_memory(shape, train, lay, GPUS["h200"]).peak_allocated / GIB
    rows = json.loads((RESULTS / file).read_text())["results"]
    row = next(r for r in rows if r["impl"] == impl and r["mode"] == "compile" and r.get("fp8", "none") == "none")
    assert planned == pytest.approx(row["peak_gib"], rel=0.03)


# Held out: planned before the run (bench/fp8.py --accum 2 --scope model --layers 4 --seq 2048, one H200), the
# llama-8b width at 2 micro-batches of one sequence, eager and the whole model compiled, bf16 and float8 linears
ACCUM_2 = ["model.arch=llama", "model.d_model=4096", "model.n_layers=4", "model.n_heads=32", "model.n_kv_heads=8",
           "model.d_ff=14336", "model.vocab_size=128256", "model.seq_len=2048", "model.tie_embeddings=false",
           "memory.precision=bf16"]


@pytest.mark.parametrize("mode, fp8, planned_gib", [("eager", "none", 35.66), ("eager", "tensorwise", 34.85),
                                                    ("compile", "none", 36.74), ("compile", "tensorwise", 37.06)])
def test_peaks_at_two_micro_batches_planned_before_the_run(mode, fp8, planned_gib):
    """The whole model compiled peaks at the end of the second micro-batch's backward, its fp32 gradients
    handed over at once beside the first's (7.2 GiB: compiled.gradients_at_once), above eager's peak though it
    keeps fewer activations: measured 36.0 / 36.76 GiB compiled (bf16 / float8 linears) where eager peaks at
    35.72 / 34.91. Without the term the compiled rows planned 33.46 / 34.85, 7% / 5% under. Each planned
    figure was written down before the run; 3% as the other rows. The float8 row's was 37.22, its blocks counted
    as eager's; 37.06 since the compiled float8 partition is counted (test_planner_fp8.py)."""
    sets = [*ACCUM_2, f"memory.fp8={fp8}", *(["memory.fp8_emulate=true"] if fp8 != "none" else []),
            *(["train.compile=true", "train.compile_scope=model"] if mode == "compile" else [])]
    cfg = load_config(None, sets)
    lay = layout_of(load_config(None, [*sets, "train.micro_batch=1", "train.global_batch=2"]), 1)
    train = dataclasses.replace(training_of(cfg), silu_kept=True)  # the SwiGLU kept silu's output then
    planned = plan_memory(shape_of(cfg), train, lay, GPUS["h200"]).peak_allocated / GIB
    assert planned == pytest.approx(planned_gib, abs=0.005)  # the prediction, as written before the run
    cand = evaluate(shape_of(cfg), train, lay, GPUS["h200"])
    grads = next(line for line in memory_lines(shape_of(cfg), train, GPUS["h200"], cand) if line[0] == "gradients")
    assert ("a second copy" in grads[3]) == (mode == "compile")  # `teratrain plan` says why
    rows = json.loads((RESULTS / "2026-12-03_compiled_gradients_at_once.json").read_text())["results"]
    row = next(r for r in rows if r["mode"] == mode and r["fp8"] == fp8)
    assert planned == pytest.approx(row["peak_gib"], rel=0.03)


def test_eager_peak_against_the_recorded_run():
    """The eager step of llama-1b (bench/train_step.py, one H200, bf16 autocast over fp32 weights), measured after
    the attention and the MLP cast their input once for their projections: planned 44.87 GiB against 44.94
    (3 GiB under the 47.9 of a cast per projection), within the compiled rows' 3%."""
    cfg = load_config(None, [*TRAIN_STEP, "train.compile=false", "train.global_batch=8", "parallel.dp=1"])
    train = dataclasses.replace(training_of(cfg), silu_kept=True)  # the SwiGLU kept silu's output then
    planned = plan_memory(shape_of(cfg), train, layout_of(cfg, 1), GPUS["h200"]).peak_allocated / GIB
    rows = json.loads((RESULTS / "2026-12-03_train_step_cast_once.json").read_text())["results"]
    row = next(r for r in rows if r["impl"] == "ours_plain" and r["mode"] == "eager")
    assert planned == pytest.approx(row["peak_gib"], rel=0.03)
