"""The planner on mixture-of-experts models: total vs active parameters, FLOPs (and so MFU) of the
active weights only, bytes per rank under expert parallelism, the all-to-all term, and layouts in
which ep borrows data-parallel ranks."""

import json

import pytest

from teratrain.config import load_config
from teratrain.models.transformer import count_params
from teratrain.planner.comm import all_to_all_s, collective
from teratrain.planner.experts import moe_extra_flops, moe_flops
from teratrain.planner.hardware import GPUS
from teratrain.planner.inputs import load, shape_of, training_of
from teratrain.planner.layout import Layout
from teratrain.planner.memory import plan_memory
from teratrain.planner.refit import as_ran
from teratrain.planner.search import evaluate, search
from teratrain.planner.states import model_states
from teratrain.planner.time import model_flops

H200 = GPUS["h200"]


def _shape(*sets: str):
    cfg = load_config(None, ["model.preset=mixtral-8x7b", "memory.precision=bf16", "model.seq_len=4096", *sets])
    return shape_of(cfg), training_of(cfg)


def test_counts_total_active_and_flops_of_active_weights():
    shape, _ = _shape()
    c = shape.counts()
    assert (round(c["total"] / 1e9, 1), round(c["active"] / 1e9, 1)) == (46.7, 12.9)  # Jiang et al. 2024
    L, d, T = 32, 4096, 4096
    per_token = 6 * c["matmul"] + 12 * L * d * T  # PaLM appendix B on the active weights
    assert model_flops(shape, 1000) == pytest.approx(1000 * per_token)
    assert c["matmul"] < c["active"] < c["total"]


def test_bytes_per_rank_under_ep():
    """zero=0, bf16 autocast (fp32 params): a rank holds the dense weights and n/ep of each layer's
    experts; ZeRO shards dense parameters over dp and experts over the dp/ep ranks that hold them."""
    shape, train = _shape()
    c = shape.counts()
    dense = c["total"] - c["expert"]
    for ep in (1, 2, 8):
        st = model_states(shape, train, Layout(dp=8, ep=ep))
        assert st["params"] == (dense + c["expert"] // ep) * 4
    z3 = model_states(shape, train, Layout(dp=8, ep=2, zero=3))["shard"]  # elements of this rank's shards
    assert z3 == pytest.approx(dense / 8 + c["expert"] / 2 / 4, rel=1e-3)


def test_moe_overhead_is_not_split_by_tensor_parallelism():
    """The experts' cost beyond their FLOPs (routing, permutation, small grouped GEMMs) is replicated on
    every tp rank in the megatron form (only the experts' weights are split), and the per-layer forms
    (parallel.tp_form=all-gather / all-reduce) keep MoE layers whole: the planner takes back rank_flops' division by tp. Pipeline stages split both.
    Eager with a capacity: the experts at moe_efficiency (expert_efficiency)."""
    shape, _ = _shape("model.moe.capacity_factor=1.25")
    moe = moe_flops(shape, 4096)
    over = moe * (1 / H200.moe_efficiency - 1)
    assert moe_extra_flops(Layout(tp=1), moe, H200) == pytest.approx(over)
    assert moe_extra_flops(Layout(tp=2), moe, H200) == pytest.approx(over)
    assert moe_extra_flops(Layout(tp=2, pp=2), moe, H200) == pytest.approx(over / 2)
    whole = moe_extra_flops(Layout(tp=4, tp_form="all-gather"), moe, H200)
    assert whole == pytest.approx(over + moe * 3 / 4)  # rank_flops counted a quarter of the experts' FLOPs
    assert moe_extra_flops(Layout(tp=2), 0.0, H200) == 0.0
    # in the step: tp=2 (megatron form) halves the FLOPs but not the overhead, so the compute term is
    # half of tp=1's plus half of the overhead's time
    train = _shape("model.moe.capacity_factor=1.25")[1]
    one, two = (evaluate(shape, train, Layout(dp=1, tp=tp, micro_batch=1, num_microbatches=1), H200).time
                for tp in (1, 2))
    tokens = shape.cfg.seq_len  # one micro-batch of one sequence
    rate = H200.sustained_flops("bf16", shape.cfg.d_model)
    overhead_s = moe_flops(shape, tokens) * (1 / H200.moe_efficiency - 1) / rate
    assert two.compute_s - one.compute_s / 2 == pytest.approx(overhead_s / 2, rel=1e-9)


def test_all_to_all_term():
    """4 all-to-alls per MoE layer and micro-batch (dispatch, combine; forward, backward), each moving
    (ep-1)/ep of micro_batch x T x top_k rows of d in bf16 (parallel.ep_dedup=false; deduplicated:
    test_deduplicated_all_to_all_rows); none at ep=1; half with every=2."""
    shape, train = _shape("parallel.ep_dedup=false")
    lay = Layout(dp=8, ep=4, micro_batch=2, num_microbatches=3)
    bw, alpha = H200.link("all_to_all", 4)
    one = collective("all_to_all", 4, 2 * 4096 * 2 * 4096 * 2, bw, alpha)
    assert all_to_all_s(shape, train, lay, H200) == pytest.approx(one)
    mem = evaluate(shape, train, lay, H200).memory
    t = evaluate(shape, train, lay, H200).time
    assert t.terms["comm_ep_s"] == pytest.approx(3 * 32 * 4 * one)
    assert evaluate(shape, train, lay.with_(ep=1), H200).time.terms["comm_ep_s"] == 0
    half, _ = _shape("model.moe.every=2")
    assert evaluate(half, train, lay, H200).time.terms["comm_ep_s"] == pytest.approx(3 * 16 * 4 * one)
    assert mem.total > 0


def test_expected_ranks_per_token():
    """ep (1 - C(n - n/ep, k) / C(n, k)): against counting every k-subset of experts by the ranks it
    touches (exact), and the limits: top-1 one rank, ep=1 one rank, k > n - n/ep every rank."""
    from itertools import combinations

    from teratrain.parallel.ep_plan import expected_ranks

    for n, ep, k in [(8, 2, 4), (8, 4, 4), (8, 4, 2), (12, 3, 5), (16, 4, 8)]:
        subsets = list(combinations(range(n), k))
        exact = sum(len({e // (n // ep) for e in s}) for s in subsets) / len(subsets)
        assert expected_ranks(n, ep, k) == pytest.approx(exact, rel=1e-12), (n, ep, k)
    assert expected_ranks(64, 8, 1) == pytest.approx(1.0) and expected_ranks(64, 1, 6) == pytest.approx(1.0)
    assert expected_ranks(8, 4, 7) == pytest.approx(4.0)
    assert expected_ranks(128, 4, 8) == pytest.approx(3.629, abs=1e-3)


def test_deduplicated_all_to_all_rows():
    """parallel.ep_dedup (the default): expected_ranks rows per token instead of top_k, each d + 2 min(k,
    n/ep) wide (gates and expert ids): Mixtral's top-2 of 8 at ep=4, 13/7 ranks a token."""
    from teratrain.parallel.ep_plan import expected_ranks

    shape, train = _shape()
    lay = Layout(dp=8, ep=4, micro_batch=2, num_microbatches=3)
    bw, alpha = H200.link("all_to_all", 4)
    ranks = expected_ranks(8, 4, 2)
    assert ranks == pytest.approx(13 / 7)
    one = collective("all_to_all", 4, 2 * 4096 * ranks * (4096 + 2 * 2) * 2, bw, alpha)
    assert all_to_all_s(shape, train, lay, H200) == pytest.approx(one)


def test_search_borrows_ep_from_dp():
    shape, train = _shape("train.global_batch=64")
    cands = search(shape, train, 8, H200, {"ep": 4})
    assert cands and all(c.layout.gpus == 8 and c.layout.dp % 4 == 0 and c.layout.ep == 4 for c in cands)
    assert {c.layout.ep for c in search(shape, train, 8, H200, {"tp": 1, "pp": 1})} == {1, 2, 4, 8}


def test_hf_mixtral_config_becomes_model_moe(tmp_path):
    hf = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
          "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "rope_theta": 1e6,
          "max_position_embeddings": 32768, "num_local_experts": 8, "num_experts_per_tok": 2}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    cfg, _ = load(str(path), None, [])
    assert (cfg.model.moe.num_experts, cfg.model.moe.k, cfg.model.moe.router) == (8, 2, "softmax-topk")
    preset = load_config(None, ["model.preset=mixtral-8x7b"]).model
    assert count_params(cfg.model)["total"] == count_params(preset)["total"]


def test_fine_grained_and_shared_experts_in_counts_shapes_and_flops():
    """Qwen2-MoE-like layers (fine-grained routed experts, one gated shared expert, a first dense
    layer): the planner's parameter count and tensor shapes are the built model's, and its expert FLOPs
    are top_k x the expert width (the shared expert runs at the dense rate, counted in the matmuls)."""
    import torch

    from teratrain.models.transformer import Transformer

    sets = ["model.preset=tiny", "model.n_layers=3", "model.moe.num_experts=8", "model.moe.top_k=4",
            "model.moe.expert_d_ff=48", "model.moe.shared_experts=1", "model.moe.shared_d_ff=96",
            "model.moe.shared_gate=true", "model.moe.first_dense_layers=1"]
    cfg = load_config(None, sets)
    shape = shape_of(cfg)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    assert shape.counts()["total"] == sum(p.numel() for p in model.parameters())
    assert shape.param_shapes() == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    d = cfg.model.d_model
    assert moe_flops(shape, 10) == pytest.approx(6 * 10 * 2 * 4 * 3 * d * 48)  # 2 MoE layers, top-4, SwiGLU
    assert shape.moe_hidden == 4 * 48 + 96


SETS = ["model.preset=llama-1b", "model.moe.num_experts=16", "model.moe.top_k=4", "model.moe.expert_d_ff=512",
        "model.seq_len=1024", "train.micro_batch=2"]


def test_compiled_experts_run_at_the_grouped_gemm_rate():
    """Compiled, the experts run at w / (w + grouped_half_work) of the dense rate, w = rows x width of one
    expert's GEMM a micro-batch; so do eager, stacked, dropless experts without expert parallelism (their
    permutations priced as ops), where a capacity or expert parallelism keeps moe_efficiency (fitted on such
    eager steps). Compiled, stacks cast to bf16 run w1 and w3 as one GEMM of 2w: two thirds of the FLOPs at its
    rate; stacks held in bf16 run them apart, as eager does."""
    from teratrain.planner.experts import expert_efficiency

    cfg = load_config(None, SETS)
    shape, train = shape_of(cfg), training_of(cfg)
    lay = Layout(micro_batch=2, num_microbatches=1)
    work = 2 * 1024 * 4 / 16 * 512  # rows of one expert x its width
    assert expert_efficiency(shape, train, lay, H200) == pytest.approx(work / (work + H200.grouped_half_work))
    capped = load_config(None, [*SETS, "model.moe.capacity_factor=1.25"])
    assert expert_efficiency(shape_of(capped), training_of(capped), lay, H200) == H200.moe_efficiency
    assert expert_efficiency(shape, train, Layout(dp=2, ep=2, micro_batch=2, num_microbatches=1), H200) == \
        H200.moe_efficiency
    eager_cast = training_of(load_config(None, [*SETS, "memory.precision=bf16"]))  # eager: w1 and w3 apart
    assert expert_efficiency(shape, eager_cast, lay, H200) == pytest.approx(work / (work + H200.grouped_half_work))
    compiled = training_of(load_config(None, [*SETS, "train.compile=true"]))
    assert expert_efficiency(shape, compiled, lay, H200) == pytest.approx(work / (work + H200.grouped_half_work))
    ep2 = Layout(dp=2, ep=2, micro_batch=2, num_microbatches=1)  # each expert gathers rows from 2 ranks
    assert expert_efficiency(shape, compiled, ep2, H200) == pytest.approx(2 * work / (2 * work + H200.grouped_half_work))
    rate = lambda w: w / (w + H200.grouped_half_work)  # noqa: E731
    cast = training_of(load_config(None, [*SETS, "train.compile=true", "memory.precision=bf16"]))
    assert expert_efficiency(shape, cast, lay, H200) == pytest.approx(1 / (2 / 3 / rate(2 * work) + 1 / 3 / rate(work)))
    held = training_of(load_config(None, [*SETS, "train.compile=true", "memory.precision=bf16",
                                          "memory.master_weights=true"]))
    assert expert_efficiency(shape, held, lay, H200) == pytest.approx(rate(work))
    assert expert_efficiency(shape, as_ran(cast, {}), lay, H200) == pytest.approx(rate(work))  # recorded before


def _recorded_moe_run(result: str, run: str, batch: tuple[int, int] | None, card: str = "h200"):
    """The MoE run `run` of a bench/moe.py result on one `card`, as it ran: (the result, shape, Training,
    Layout). `batch`: (micro-batch, global batch) where the run's command set them."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "bench"))
    import moe as bench_moe

    data = json.loads((root / "bench" / "results" / card / result).read_text())
    mb, gb = batch or (data["micro_batch"], bench_moe.MICRO_PER_RANK * data["micro_batch"])
    sets = bench_moe.GPU + [*data["set"], f"train.micro_batch={mb}", f"train.global_batch={gb}",
                            *bench_moe.models(False, [1], [1], data["shape"], 0)["moe_ep1"],
                            *(bench_moe.COMPILED if run.endswith(bench_moe.MODE_TAGS) else [])]
    cfg = load_config(None, sets)
    lay = Layout(micro_batch=mb, num_microbatches=gb // mb)
    # as it ran (planner/refit.py as_ran); bench/moe.py wrote no "norms" nor "linear inputs" (planned with today's),
    # and its first results with the AdamW kernel and the carried gradients (a61c2da) did not name them yet
    ran = {"norms": "residual dtype", "linear inputs": "cast once"}
    if result >= "2026-12-04":
        ran |= {"adamw": "teratrain kernel", "expert gradients": "through the casts"}
    if "running_count" in result:  # the first runs of the layout by a running count did not name it yet
        ran["moe layout"] = "running count"
    train = as_ran(training_of(cfg), {**ran, **data})
    return data, shape_of(cfg), train, lay


FAST_AT_64 = pytest.mark.xfail(strict=True, reason="the Qwen3-shaped MoE at 64 sequences a step (8 micro-batches of "
                               "8) with the layout by a running count: planned 12.3% fast (the run of the sorted "
                               "layout, planned as it ran, 9.7%); at 8 sequences within 1%: not analysed")
SMALL_BATCH = pytest.mark.xfail(strict=True, reason="planned 21% slow at one sequence a micro-batch (512 rows an "
                                "expert); dense at that batch 11% slow too")

EXPERT_TENSORS = pytest.mark.xfail(strict=True, reason="each expert its own parameters (before the experts were "
                                   "stacked), 128 experts: planned 16-18% fast at the grouped GEMM's rate on the GPU's "
                                   "time; the per-micro-batch stacking of 3,072 tensors is priced by its bytes only")


@pytest.mark.parametrize("result, run, batch", [
    ("2026-12-02_moe_dropless.json", "moe_ep1_compiled", None),
    ("2026-12-02_moe_dropless_graphed.json", "moe_ep1_graphed", None),
    pytest.param("2026-12-02_moe_qwen3.json", "moe_ep1_compiled", None, marks=EXPERT_TENSORS),
    pytest.param("2026-12-02_moe_qwen3_mb4.json", "moe_ep1_compiled", (4, 8), marks=EXPERT_TENSORS),
    pytest.param("2026-12-02_moe_mb1.json", "moe_ep1_compiled", (1, 2), marks=SMALL_BATCH),
    ("2026-12-03_moe_stacked_dropless.json", "moe_ep1_compiled", None),
    ("2026-12-03_moe_stacked_qwen3_mb4.json", "moe_ep1_compiled", (4, 8)),
    ("2026-12-03_moe_stacked_qwen3_gb32.json", "moe_ep1_compiled", (4, 32)),
    ("2026-12-03_moe_stacked_qwen3_mw_gb8.json", "moe_ep1_compiled", (4, 8)),
    ("2026-12-03_moe_stacked_qwen3_mw_gb32.json", "moe_ep1_compiled", (4, 32)),
    ("2026-12-03_moe_cast_once_qwen3_gb8.json", "moe_ep1_compiled", (4, 8)),
    ("2026-12-03_moe_cast_once_qwen3_gb32.json", "moe_ep1_compiled", (4, 32)),
    ("2026-12-03_moe_cast_once_dropless.json", "moe_ep1_compiled", None),
    ("2026-12-03_moe_shared_sigmoid_compiled.json", "moe_ep1_compiled", None),
    ("2026-12-04_moe_dropless.json", "moe_ep1_compiled", None),
    ("2026-12-04_moe_qwen3_profile.json", "moe_ep1_compiled", (4, 8)),
    ("2026-12-04_moe_qwen3_mb8.json", "moe_ep1_compiled", (8, 8)),
    ("2026-12-04_moe_gate_up_profile.json", "moe_ep1_compiled", None),  # w1 and w3 one GEMM, planned before
    ("2026-12-04_moe_qwen3_gate_up.json", "moe_ep1_compiled", (4, 8)),  # they ran
    ("2026-12-04_moe_qwen3_gb64.json", "moe_ep1_compiled", (8, 64)),
    ("2026-12-04_moe_dropless_gb32.json", "moe_ep1_compiled", (4, 32)),
    ("2026-12-04_moe_compiled_profile.json", "moe_ep1_compiled", None),  # held out: recorded after the tests
    ("2026-12-04_moe_dropless_graphed.json", "moe_ep1_graphed", None),  # above were written
    # held out: the layout by a running count, 45 ops fewer a layer (planned before they ran)
    ("2026-12-04_moe_running_count_compiled.json", "moe_ep1_compiled", None),
    ("2026-12-04_moe_running_count_qwen3_gb8.json", "moe_ep1_compiled", (4, 8)),
    pytest.param("2026-12-04_moe_running_count_qwen3_gb64.json", "moe_ep1_compiled", (8, 64), marks=FAST_AT_64),
    # held out: the joined SwiGLU as a Triton op (planned before they ran), and the code before it, same jobs
    ("2026-12-04_moe_swiglu_kernel_compiled.json", "moe_ep1_compiled", None),
    ("2026-12-04_moe_swiglu_inductor_compiled.json", "moe_ep1_compiled", None),
    ("2026-12-04_moe_swiglu_kernel_tiles_compiled.json", "moe_ep1_compiled", None),
    ("2026-12-04_moe_qwen3_swiglu_kernel.json", "moe_ep1_compiled", (4, 8)),
    # held out: graphed, the stacks cast once a step into tensors at fixed addresses (planned before it ran)
    ("2026-12-05_moe_gb32_graphed_mb8_cast_once.json", "moe_ep1_graphed", (8, 32))])
def test_one_h200_compiled_moe_steps_are_planned_within_10_percent(result, run, batch):
    """Held out from the grouped GEMM's fit (a micro-benchmark timed on the GPU: CUDA graph replays,
    bench/calibrate/grouped_gemm.py): bench/moe.py's dropless MoE steps on one H200, the 8-expert model
    compiled and graphed and Qwen3-30B-A3B's layers (128 experts of width 768) compiled, planned within 10%
    of the measured tokens/s (tolerance fixed before comparing). The fit timed call by call (the host's
    launches at the small shapes: grouped_half_work 520,000 against 150,000) planned the stacked Qwen3-shaped
    steps 14-25% slow. `batch`:
    (micro-batch, global batch) where the run's command set them (bench/results/INDEX.md), else the
    bench's own (MICRO_PER_RANK micro-batches of the recorded size)."""
    data, shape, train, lay = _recorded_moe_run(result, run, batch)
    planned = evaluate(shape, train, lay, H200).time.tokens_per_s
    assert planned == pytest.approx(data[run]["tokens_per_s"], rel=0.10)


GRAPHED_ONE_MICRO_BATCH = pytest.mark.xfail(strict=True, reason="held out: one micro-batch of 8 under CUDA graphs "
                                            "planned 16% fast; it measured below the compiled step (131,734 tokens/s "
                                            "against 141,232 in another job), which the planner gives it")


MICRO_BATCH_8_AT_32 = pytest.mark.xfail(strict=True, reason="held out: 4 micro-batches of 8 a step planned 11.0-14.0% "
                                        "fast, eager, compiled and graphed, in every job (8 micro-batches of 4: 4-5% "
                                        "fast): the planner gains more from micro-batch 4 to 8 than the step measured; "
                                        "the dense model of the 2026-12-06 jobs is planned 9.4-9.7% fast compiled and "
                                        "graphed, 4.0% eager: mostly not the MoE layer's")


@pytest.mark.parametrize("result, run, batch", [
    ("2026-12-05_moe_compiled_mb4x2.json", "moe_ep1_compiled", (4, 8)),
    ("2026-12-05_moe_compiled_mb8x1.json", "moe_ep1_compiled", (8, 8)),
    ("2026-12-05_moe_graphed_mb4_held_stats.json", "moe_ep1_graphed", (4, 8)),
    pytest.param("2026-12-05_moe_graphed_mb8_held_stats.json", "moe_ep1_graphed", (8, 8),
                 marks=GRAPHED_ONE_MICRO_BATCH),
    # held out: 32 sequences a step, two jobs each (the planner unchanged since before they ran)
    *[pytest.param(f"2026-12-05_moe_gb32_{form}{job}.json", f"moe_ep1_{form.split('_')[0]}", (mb, 32),
                   marks=[MICRO_BATCH_8_AT_32] if mb == 8 else [])
      for form, mb in (("compiled_mb8", 8), ("compiled_mb4", 4), ("graphed_mb8", 8)) for job in ("", "_b")],
    # held out, later jobs: the graphed stacks cast once a step (the default) and every micro-batch
    # (memory.cast_once=false), eager, and compiled once more
    *[pytest.param(f"2026-12-05_moe_gb32_{name}.json", run, (8, 32), marks=MICRO_BATCH_8_AT_32)
      for name, run in (("compiled_mb8_c", "moe_ep1_compiled"), ("eager_mb8", "moe_ep1"),
                        *((f"graphed_mb8_cast_{c}{job}", "moe_ep1_graphed")
                          for c in ("once", "each") for job in ("", "_b")))],
    # held out, a later job: the casts written into the graph's tensors (the default since), and every micro-batch
    *[pytest.param(f"2026-12-06_moe_gb32_graphed_mb8_cast_{c}.json", "moe_ep1_graphed", (8, 32),
                   marks=MICRO_BATCH_8_AT_32) for c in ("into", "each")],
    # held out, a later job: compiled, graphed (cast into the graph's tensors) and eager
    *[pytest.param(f"2026-12-06_moe_gb32_{name}.json", run, (8, 32), marks=MICRO_BATCH_8_AT_32)
      for name, run in (("compiled_mb8", "moe_ep1_compiled"), ("graphed_mb8_cast_into_b", "moe_ep1_graphed"),
                        ("eager_mb8", "moe_ep1"))]])
def test_one_h100_compiled_moe_steps_are_planned_within_10_percent(result, run, batch):
    """Held out (no constant saw an H100 MoE step): the 8-expert model's dropless steps on one H100, compiled
    and graphed (the graph replayed, its statistics held at fixed addresses), planned with the H100's
    constants within 10% of the measured tokens/s, the H200 rows' tolerance."""
    data, shape, train, lay = _recorded_moe_run(result, run, batch, card="h100")
    planned = evaluate(shape, train, lay, GPUS["h100"]).time.tokens_per_s
    assert planned == pytest.approx(data[run]["tokens_per_s"], rel=0.10)


QWEN3_EAGER = pytest.mark.xfail(strict=True, reason="held out: the Qwen3-shaped MoE eager (128 experts, top-8), "
                                "planned 10.2% fast")


@pytest.mark.parametrize("result, batch", [
    ("2026-12-04_moe_combine_bmm_eager_a.json", None), ("2026-12-04_moe_combine_bmm_eager_b.json", None),
    ("2026-12-04_moe_combine_bmm_eager_c.json", None), ("2026-12-04_moe_combine_bmm_eager_d.json", None),
    ("2026-12-04_moe_eager_gate_up_apart.json", None),  # held out: the same code in a later job
    pytest.param("2026-12-04_moe_qwen3_eager.json", (4, 8), marks=QWEN3_EAGER)])
def test_one_h200_eager_dropless_moe_steps_are_planned_within_10_percent(result, batch):
    """Eager, the experts stacked, nothing dropped, ep=1 (expert_efficiency: the grouped GEMM's rate, the
    permutations priced as ops): the 8-expert model's eager steps since its combine runs as batched GEMMs, within
    10% of the measured tokens/s (tolerance fixed before comparing; no constant fitted on them, the rule chosen
    seeing them). Eager steps of older code (the combine broadcast, the rows sorted) are planned 3-35% fast:
    docs/planner.md."""
    data, shape, train, lay = _recorded_moe_run(result, "moe_ep1", batch)
    planned = evaluate(shape, train, lay, H200).time.tokens_per_s
    assert planned == pytest.approx(data["moe_ep1"]["tokens_per_s"], rel=0.10)


@pytest.mark.parametrize("result, run, batch", [
    ("2026-12-03_moe_cast_once_qwen3_gb8.json", "moe_ep1_compiled", (4, 8)),
    ("2026-12-03_moe_cast_once_qwen3_gb32.json", "moe_ep1_compiled", (4, 32)),
    ("2026-12-03_moe_stacked_qwen3_mb4.json", "moe_ep1_compiled", (4, 8)),
    ("2026-12-03_moe_stacked_qwen3_mw_gb8.json", "moe_ep1_compiled", (4, 8)),
    ("2026-12-03_moe_stacked_qwen3_mb4_eager.json", "moe_ep1", (4, 8)),
    ("2026-12-03_moe_stacked_dropless.json", "moe_ep1", None),
    ("2026-12-03_moe_qwen3_block_scope.json", "moe_ep1_compiled", (4, 8)),
    ("2026-12-03_moe_cast_once_dropless.json", "moe_ep1_compiled", None),
    ("2026-12-03_moe_shared_sigmoid_compiled.json", "moe_ep1_compiled", None),
    ("2026-12-04_moe_dropless.json", "moe_ep1_compiled", None),  # held out: the compiled combine keeps the
    ("2026-12-04_moe_dropless.json", "moe_ep1", None),  # experts' rows laid out, carried gradients
    ("2026-12-04_moe_qwen3_profile.json", "moe_ep1_compiled", (4, 8)),
    ("2026-12-04_moe_qwen3_gate_up.json", "moe_ep1_compiled", (4, 8)),  # held out: w1 and w3 one GEMM
    ("2026-12-04_moe_qwen3_gb64.json", "moe_ep1_compiled", (8, 64)),
    ("2026-12-04_moe_dropless_gb32.json", "moe_ep1_compiled", (4, 32)),
    ("2026-12-04_moe_dropless_gb32.json", "moe_ep1", (4, 32)),
    ("2026-12-04_moe_compiled_profile.json", "moe_ep1_compiled", None),  # held out: recorded after the tests
    ("2026-12-04_moe_eager_profile.json", "moe_ep1", None),  # above were written
    # held out: no masks saved where every choice is sent (planned before they ran)
    ("2026-12-04_moe_running_count_compiled.json", "moe_ep1_compiled", None),
    ("2026-12-04_moe_running_count_eager_a.json", "moe_ep1", None),
    ("2026-12-04_moe_running_count_qwen3_gb8.json", "moe_ep1_compiled", (4, 8)),
    ("2026-12-04_moe_running_count_qwen3_gb64.json", "moe_ep1_compiled", (8, 64)),
    ("2026-12-04_moe_combine_bmm_eager_a.json", "moe_ep1", None),  # held out: the eager combine's batched GEMMs
    # held out: the joined SwiGLU as a Triton op, compiled
    ("2026-12-04_moe_swiglu_kernel_compiled.json", "moe_ep1_compiled", None),
    ("2026-12-04_moe_qwen3_swiglu_kernel.json", "moe_ep1_compiled", (4, 8)),
    # the carried gradients held by their layers to the step's end (Training.carried_grads_held), a term
    # written seeing this run (its 18.0 GiB of fp32 expert gradients twice): not held out
    ("2026-12-04_moe_qwen3_eager.json", "moe_ep1", (4, 8))])
def test_one_h200_moe_peaks_are_planned_within_3_percent(result, run, batch):
    """The planned peak allocated (before the allowance) against torch.cuda.max_memory_allocated of bench/moe.py's
    runs on one H200, the dense rows' 3% (test_planner_compiled_memory.py). The compiled Qwen3-shaped MoE at 2
    micro-batches peaks at the end of a backward, where the whole model's compiled backward hands all its 18.8
    GiB of fp32 gradients over at once (compiled.gradients_at_once): 104.3 GiB planned against 103.3 measured
    (96.8 before that term, 6.4% under). Each block compiled apart hands one block's over at a time: 93.4
    planned, 94.1 measured (96.8 planned before it ran, with eager's saved tensors). The compiled 8-expert MoE,
    whose activations weigh most: 28.45 planned, 28.18 measured (31.6, 12% over, with eager's tensors). The
    compiled MoE blocks' count is read off the partition on CPU (planner/compiled.py); those rows' figures were
    known while writing it. Held out: the 8-expert model with sigmoid scores, bias balancing and a shared
    expert, 32.05 GiB planned before it ran (eager's tensors: 35.57), 31.77 measured."""
    data, shape, train, lay = _recorded_moe_run(result, run, batch)
    planned = plan_memory(shape, train, lay, H200).peak_allocated / 2**30
    assert planned == pytest.approx(data[run]["peak_gib"], rel=0.03)


def test_per_layer_tp_forms_run_the_shared_experts_whole_on_every_rank():
    """parallel/tensor.py keeps an MoE layer whole under tp_form all-gather / all-reduce, its shared experts too:
    at tp=2 the shared experts' FLOPs on a rank are the whole model's in those forms, half in the megatron form
    (planned compute with a shared expert less without), and their weights' autocast copies likewise."""
    from teratrain.planner.weight_casts import weight_copies
    from teratrain.planner.experts import shared_flops
    from teratrain.planner.layout import widths
    from teratrain.planner.time import _compute

    sets = ["model.preset=llama-1b", "model.n_layers=4", "train.global_batch=2", "train.micro_batch=2",
            "model.moe.num_experts=4", "model.moe.top_k=2", "memory.precision=bf16"]
    tokens, w = 2 * 2048, widths("bf16", False)
    plain, shared = (load_config(None, sets + more) for more in ([], ["model.moe.shared_experts=1"]))
    s_plain, s_shared = shape_of(plain), shape_of(shared)
    rate = H200.sustained_flops("bf16", plain.model.d_model)
    for form, share in (("megatron", 0.5), ("all-gather", 1.0), ("all-reduce", 1.0)):
        lay = Layout(tp=2, micro_batch=2, tp_form=form)
        extra_s = _compute(s_shared, training_of(shared), lay, H200, tokens)[0] - \
            _compute(s_plain, training_of(plain), lay, H200, tokens)[0]
        assert extra_s == pytest.approx(share * shared_flops(s_shared, tokens) / rate, rel=1e-6), form
        copies = weight_copies(s_shared, w, 2, form=form) - weight_copies(s_plain, w, 2, form=form)
        assert copies == pytest.approx(share * 3 * 2048 * 8192 * 2 * s_shared.moe_share, abs=2), form
