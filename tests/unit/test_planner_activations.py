"""The activation formula against what autograd really keeps: `saved_tensors_hooks` over one
forward (+ loss) of our model on CPU, shared storages counted once, parameters excluded. Every
recompute policy, both flavours, fp32, bf16 autocast over fp32 params, bf16 params with fp32
masters. Tolerance 5% (measured: exact to the 4-byte loss scalar). Dropout 0: CPU SDPA with
dropout takes the math path (T x T kept), which the GPU (flash/cuDNN) never does."""

import pytest

from teratrain.config import load_config
from teratrain.planner.activations import block_saved, forward_saved, stored_blocks
from teratrain.planner.layout import ModelShape, widths
from teratrain.measure import build_engine, live_bytes, random_batch, saved_bytes

POLICIES = ["none", "full", "every-k", "sqrt", "selective"]  # selective-ops: see test_one_block_keeps_what_the_planner_counts
PRECISIONS = [("fp32", False), ("bf16", False), ("bf16", True)]


def _cfg(arch: str, precision: str, masters: bool, policy: str, seq_len: int = 48, n_layers: int = 5, *extra: str):
    sets = ["model.preset=tiny", f"model.arch={arch}", f"model.seq_len={seq_len}", f"model.n_layers={n_layers}",
            f"memory.precision={precision}", f"memory.recompute={policy}", "memory.recompute_every=2", *extra]
    if masters:
        sets.append("memory.master_weights=true")
    if arch == "gpt2":
        sets.append("model.tie_embeddings=true")  # GPT-2 ties; the tiny llama does not
    return load_config(None, sets)


def _predicted(cfg, batch: int) -> int:
    w = widths(cfg.memory.precision, cfg.use_master_weights)
    T = cfg.model.seq_len
    return forward_saved(ModelShape(cfg=cfg.model), w, batch * T, T, cfg.memory.recompute,
                         cfg.memory.recompute_every, device="cpu", dropout=cfg.model.dropout,
                         compress=cfg.memory.compress_activations)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("precision, masters", PRECISIONS)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_saved_bytes_match_hooks(arch, precision, masters, policy):
    cfg = _cfg(arch, precision, masters, policy)
    model, _ = build_engine(cfg)  # casts parameters to bf16 when masters are kept, as training does
    x, y = random_batch(cfg, 2)
    measured = saved_bytes(model, x, y, precision)
    assert _predicted(cfg, 2) == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_saved_bytes_match_hooks(ep):
    """A top-2 MoE block (4 experts): router, dispatch and combine tensors as autograd keeps them, in one
    process (exact to the loss scalar); expert parallelism adds two index tensors per layer."""
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.memory import forward_saved as rank_saved

    cfg = _cfg("llama", "fp32", False, "none", 16, 2, "model.moe.num_experts=4", "model.moe.top_k=2")
    model, _ = build_engine(cfg)
    measured = saved_bytes(model, *random_batch(cfg, 2), "fp32", targets_in_model=True)
    predicted = rank_saved(shape_of(cfg), training_of(cfg), layout_of(cfg, 1).with_(dp=ep, ep=ep, micro_batch=2), "cpu")
    assert predicted - measured == (0 if ep == 1 else 2 * 2 * 64 * 8) - 4  # 2 layers x 2 x (2 x 32 rows) int64


@pytest.mark.parametrize("mix, policy", [("model.moe.every=2", "none"), ("model.moe.first_dense_layers=1", "none"),
                                         ("model.moe.every=2", "selective")])
def test_dense_blocks_of_an_moe_model_keep_a_dense_mlps_tensors(mix, policy):
    """GShard's every other layer and DeepSeek's first dense layers: each dense block counted as a dense
    block, not as an MoE one (exact to the loss scalar)."""
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.memory import forward_saved as rank_saved

    cfg = _cfg("llama", "fp32", False, policy, 16, 4, "model.moe.num_experts=4", "model.moe.top_k=2", mix)
    model, _ = build_engine(cfg)
    measured = saved_bytes(model, *random_batch(cfg, 2), "fp32", targets_in_model=True)
    predicted = rank_saved(shape_of(cfg), training_of(cfg), layout_of(cfg, 1).with_(micro_batch=2), "cpu")
    assert predicted - measured == -4


def test_flash_attention_keeps_no_seq_by_seq_scores():
    """Doubling T doubles what a block keeps (it would quadruple a T x T term)."""
    cfg = _cfg("llama", "fp32", False, "none", seq_len=64, n_layers=1)
    shape, w = ModelShape(cfg=cfg.model), widths("fp32", False)
    short = sum(block_saved(shape, w, 2 * 64, 64, device="cpu").values())
    long = sum(block_saved(shape, w, 2 * 128, 128, device="cpu").values())
    assert long == 2 * short
    model, _ = build_engine(cfg)
    m64 = saved_bytes(model, *random_batch(cfg, 2), "fp32")
    cfg2 = _cfg("llama", "fp32", False, "none", seq_len=128, n_layers=1)
    model2, _ = build_engine(cfg2)
    m128 = saved_bytes(model2, *random_batch(cfg2, 2), "fp32")
    assert m128 < 2.1 * m64


def test_recomputation_orders_memory():
    """What stays saved, L = 16: every block's tensors > all but the logsumexp (selective) > 16
    block inputs (full) > 8 segment inputs (every-k, k = 2) > 4 (sqrt: k = 4)."""
    saved = {}
    for policy in POLICIES:
        cfg = _cfg("llama", "bf16", True, policy, n_layers=16)
        saved[policy] = _predicted(cfg, 2)
    assert saved["none"] > saved["selective"] > saved["full"] > saved["every-k"] > saved["sqrt"]


def test_tensor_and_sequence_parallel_split_activations():
    """Tensor parallelism splits what the heads and the MLP width hold, sequence parallelism also the
    norms' side (Korthikanti et al. 2022); the projections' input is one tensor shared by the region's
    projections (the megatron entry casts it once, parallel/tensor.py), kept whole without sequence
    parallelism and as this rank's sequence shard with it (gathered again in backward, comm.Regather).
    With fp32 parameters one process also casts it once for the region's projections."""
    for masters in (True, False):
        cfg = _cfg("llama", "bf16", masters, "none")
        shape, w = ModelShape(cfg=cfg.model), widths("bf16", masters)
        one, tp, sp = (block_saved(shape, w, 256, 48, **kw) for kw in ({}, dict(tp=2), dict(tp=2, sp=True)))
        assert sum(sp.values()) < sum(tp.values()) < sum(one.values())
        whole = 256 * cfg.model.d_model * 2  # bf16
        assert tp["qkv_inputs"] == tp["mlp_inputs"] == whole
        assert sp["qkv_inputs"] == sp["mlp_inputs"] == whole // 2
        assert one["qkv_inputs"] == whole
        assert sp["ffn_norm"] * 2 == tp["ffn_norm"] and sp["mlp_hidden"] == tp["mlp_hidden"] == one["mlp_hidden"] // 2


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("precision, masters", PRECISIONS)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_compressed_saved_bytes_match_hooks(arch, precision, masters, policy):
    """int8 activation compression (memory/compression.py), counted through its encoder by the same
    hooks: exact to the loss scalar, like the uncompressed count."""
    cfg = _cfg(arch, precision, masters, policy, 48, 5, "memory.compress_activations=int8")
    model, _ = build_engine(cfg)
    measured = saved_bytes(model, *random_batch(cfg, 2), precision)
    assert _predicted(cfg, 2) == pytest.approx(measured, rel=0.05, abs=8)


@pytest.mark.parametrize("mode", ["none", "lossless", "fp8"])
@pytest.mark.parametrize("policy", ["selective", "full"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_dropout_masks_and_fp8_match_hooks(arch, policy, mode):
    """Dropout 0.1 (recomputed attention core, so the CPU math path's T x T keeps nothing): the float
    masks the CPU kernel saves are counted as 1 bit each under every compression mode."""
    cfg = _cfg(arch, "bf16", True, policy, 48, 3, "model.dropout=0.1", f"memory.compress_activations={mode}")
    model, _ = build_engine(cfg)
    measured = saved_bytes(model, *random_batch(cfg, 2), "bf16")
    assert _predicted(cfg, 2) == pytest.approx(measured, rel=0.05, abs=8)


def test_compression_ratio_of_a_block():
    """int8 stores a block's differentiable activations at 1 + 4/128 bytes per element: ~3.9x less
    than fp32, ~1.9x less than bf16; statistics and the logsumexp stay as they are."""
    cfg = _cfg("llama", "fp32", False, "none", 256, 1)
    shape, n = ModelShape(cfg=cfg.model), 4 * 256
    for precision, masters, ratio in (("fp32", False, 4 / (1 + 4 / 128)), ("bf16", True, 2 / (1 + 4 / 128))):
        w = widths(precision, masters)
        plain = block_saved(shape, w, n, 256, device="cuda")
        packed = block_saved(shape, w, n, 256, device="cuda", compress="int8")
        for term in ("q_k_v", "attention_out", "mlp_hidden"):
            assert plain[term] / packed[term] == pytest.approx(ratio), term
        assert packed["logsumexp"] == plain["logsumexp"]


@pytest.mark.parametrize("policy", ["full", "sqrt", "every-k"])
def test_end_of_backward_holds_one_segment_input_beside_the_replay(policy):
    """In the first block's backward a replaying policy holds that segment's stored input (one hidden
    state in the parameters' width) and the replayed segment (`recompute`, counted apart), not the
    block's whole activations: the recomputing ZeRO-3 row on 2 x H200 was +11% over its peak when they
    were counted (tests/fixtures/planner_runs/h200x2_2026-11-27_*.json, 3.2% under the rule)."""
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.memory import _saved

    cfg = load_config(None, ["model.preset=llama-1b", "model.n_layers=16", "model.vocab_size=32000",
                             "memory.precision=bf16", f"memory.recompute={policy}", "memory.recompute_every=4",
                             "train.micro_batch=2", "train.global_batch=2"])
    train, lay = training_of(cfg), layout_of(cfg, 1)
    saved = _saved(shape_of(cfg), train, lay, "cuda")
    hidden = 2 * cfg.model.seq_len * cfg.model.d_model * train.widths(lay.zero, lay.offload).param
    assert saved["first_block"] == hidden and saved["recompute"] >= saved["per_block"] > hidden
    assert saved["blocks"] == hidden * {"full": 16, "sqrt": 4, "every-k": 4}[policy]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("policy", ["none", "full"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fp8_saved_bytes_match_hooks(arch, recipe, policy):
    """memory.fp8 (emulated on CPU): a float8 linear saves its bf16 input and the weight itself (cast again
    in backward), where autocast saves a bf16 copy of the weight: 12% of the whole here; the bound is the
    loss scalar's bytes."""
    pytest.importorskip("torchao")
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.memory import forward_saved as rank_saved

    cfg = _cfg(arch, "bf16", False, policy, 48, 3, "model.d_model=64", f"memory.fp8={recipe}", "memory.fp8_emulate=true")
    model, _ = build_engine(cfg)
    measured = saved_bytes(model, *random_batch(cfg, 2), "bf16", targets_in_model=True)
    predicted = rank_saved(shape_of(cfg), training_of(cfg), layout_of(cfg, 1).with_(micro_batch=2), "cpu")
    assert abs(predicted - measured) <= 8


@pytest.mark.parametrize("policy", ["none", "selective", "full", "selective-ops", "selective-ops-alternate"])
@pytest.mark.parametrize("precision, masters", PRECISIONS)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_one_block_keeps_what_the_planner_counts(arch, precision, masters, policy):
    """What one more block leaves alive from forward to backward (measure.live_bytes of 2 blocks less
    1: its saved tensors, weight copies, checkpoint input, and selective-ops's own cache of GEMM and
    attention outputs, which saved-tensor hooks never see) equals planner.activations.stored_blocks
    for one layer, exactly."""
    got = []
    for n_layers in (1, 2):
        cfg = _cfg(arch, precision, masters, policy, 48, n_layers)
        model, _ = build_engine(cfg)
        got.append(live_bytes(model, *random_batch(cfg, 2), precision))
    w = widths(precision, cfg.use_master_weights)
    planned = stored_blocks(ModelShape(cfg=cfg.model), w, 1, 2 * 48, 48, policy, 2, device="cpu")
    assert got[1] - got[0] == sum(planned.values())


ATTENTION_SHAPES = [["model.head_dim=48"], ["model.arch=gpt2", "model.tie_embeddings=true", "model.head_dim=48"],
                    ["model.qk_norm=head", "model.head_dim=48"], ["model.qk_norm=full", "model.n_kv_heads=1"]]


@pytest.mark.parametrize("policy", ["none", "selective-ops", "selective-ops-alternate"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda sets: ",".join(sets))
def test_wide_heads_and_qk_norms_keep_what_the_planner_counts(shape, precision, policy):
    """model.head_dim = 48 at d_model 128 and 4 heads: q, the attention output, wo's input and the
    weights autocast copies are 192 wide, not 128; Qwen3's per-head and OLMoE's whole-width q/k
    RMSNorms keep their inputs and statistics. One more block keeps what the planner counts, exactly."""
    got = []
    for n_layers in (1, 2):
        cfg = _cfg("llama", precision, False, policy, 48, n_layers, *shape)
        model, _ = build_engine(cfg)
        got.append(live_bytes(model, *random_batch(cfg, 2), precision))
    planned = stored_blocks(ModelShape(cfg=cfg.model), widths(precision, False), 1, 2 * 48, 48, policy, 2,
                            device="cpu")
    assert got[1] - got[0] == sum(planned.values())


def _published(name: str) -> dict:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
    import published  # bench/published.py: the runs and the --set items each ran with

    return published, next(r for r in published.load_runs() if r["name"] == name)


@pytest.mark.parametrize("name", ["korthikanti22-530b-sp-selective", "korthikanti22-1t-sp-selective"])
def test_published_sequence_parallel_runs_fit_their_a100s(name):
    """The 530B (t8 p35) and 1T (t8 p64) layouts of Korthikanti et al. 2022 (bench/published_runs.toml:
    selective recomputation, sequence parallelism, on A100 80 GB) plan under 80 GB with bf16 parameters,
    fp32 masters and AdamW, no ZeRO (dp = 1): with the column-parallel linears keeping their input's
    sequence shard, as those runs did (planned at the published batch: 58.55 and 64.19 GiB; with the linears
    keeping it whole, 1F1B, 70.76 and 91.70 GiB)."""
    from teratrain.planner.hardware import gpu_with
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.search import evaluate

    published, r = _published(name)
    # as it ran (bench/published.py: 530B interleaved over 3 virtual stages), with pp micro-batches a step:
    # as many in flight as the published batch has (1F1B holds pp at most), fewer to simulate
    sets = published.sets_of(r) + [f"train.global_batch={r['pp'] * r['dp'] * r['micro_batch']}"]
    cfg = load_config(None, sets)
    cand = evaluate(shape_of(cfg), training_of(cfg), layout_of(cfg, r["gpus"]), gpu_with(r["gpu"]))
    assert cand.memory.total < 80e9, f"{name}: {cand.memory.total / 2**30:.2f} GiB"


@pytest.mark.parametrize("precision, masters", PRECISIONS)
def test_chunked_loss_saved_bytes_match_hooks(precision, masters):
    """memory.loss_chunks=3: the chunked head + loss keeps its input and weight gradients instead of the
    logits' fp32 log-softmax, the head's input and the weight's autocast copy (exact to the loss scalar)."""
    cfg = _cfg("llama", precision, masters, "none", 16, 2, "memory.loss_chunks=3")
    model, _ = build_engine(cfg)
    measured = saved_bytes(model, *random_batch(cfg, 2), precision, targets_in_model=True)
    w = widths(cfg.memory.precision, cfg.use_master_weights)
    predicted = forward_saved(ModelShape(cfg=cfg.model), w, 32, 16, "none", 2, device="cpu", loss_pieces=3)
    assert predicted == pytest.approx(measured, rel=0.05) and abs(predicted - measured) <= 8


GATED = ["model.moe.shared_experts=1", "model.moe.shared_gate=true"]
MOE_OPS = [(p, m, "selective-ops", extra) for p, m in PRECISIONS
           for extra in ([], GATED, ["model.moe.expert_d_ff=96", "model.moe.router_dtype=compute"])]


@pytest.mark.parametrize("precision, masters, policy, extra", MOE_OPS + [
    ("fp32", False, "none", ["model.moe.shared_experts=1"]), ("bf16", False, "none", ["model.moe.shared_experts=1"]),
    ("fp32", False, "none", GATED), ("bf16", False, "none", GATED), ("bf16", True, "none", GATED)])
def test_one_moe_block_keeps_what_the_planner_counts(precision, masters, policy, extra):
    """An MoE block (4 experts, top-2): under selective-ops the router's scores, the experts' grouped GEMM
    outputs, the combine's product and the shared experts' GEMM outputs (activations._mlp_ops_saved); with
    shared experts in fp32 the router and the shared MLP read one input tensor, counted once; Qwen2-MoE's gate
    keeps the MLP's output, its sigmoid and, under autocast over fp32 parameters, its own cast of the input;
    with bf16 parameters the fp32 router keeps its weight cast up. What one more block leaves alive equals the
    plan within 64 bytes: the layer's float64 routing statistics (models/moe.py _record), made anew each
    forward, are live storages but no activation."""
    got = []
    for n_layers in (1, 2):
        cfg = _cfg("llama", precision, masters, policy, 48, n_layers, "model.moe.num_experts=4", "model.moe.top_k=2",
                   *extra)
        model, _ = build_engine(cfg)
        got.append(live_bytes(model, *random_batch(cfg, 2), precision))
    planned = stored_blocks(ModelShape(cfg=cfg.model), widths(precision, cfg.use_master_weights), 1, 2 * 48, 48,
                            policy, 2, device="cpu")
    assert 0 <= got[1] - got[0] - sum(planned.values()) <= 64
