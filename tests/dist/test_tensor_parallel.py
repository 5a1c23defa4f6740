"""Tensor (and sequence) parallelism, alone and with data parallelism and ZeRO, against one process
on the same global batch: fp32, 10 AdamW steps with accumulation and clipping.

Tolerance: 1e-5 relative on every step's loss and on every final parameter tensor (||a-b||/||b||,
tensors gathered whole). Measured: about 1e-7 on losses and 1e-7 to 2e-6 on parameters (the splits
change fp32 summation order; AdamW with eps=1e-6 amplifies it least, see test_zero_parity.py)."""

import functools

import pytest
from harness import run_ranks
from layout_workers import BASE, GPT2, batches, build, micro_batches, train_random, train_steps

from teratrain.config import load_config
from teratrain.planner.inputs import layout_of, shape_of, training_of
from teratrain.planner.memory import forward_saved


def max_rel_diff(a: dict, b: dict, floor: float = 1e-3) -> float:
    """Worst per-tensor ||a - b|| / max(||b||, floor): relative, except for tensors that barely
    moved from a zero init (gpt2's key bias, whose true gradient is zero), where it is absolute."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).norm() / max(float(b[k].double().norm()), floor)) for k in a)

TOL = 1e-5
GPT2_SGD = GPT2 + ["optim.name=sgd", "optim.lr=0.05"]


def _compare(layouts: list[list[str]], world: int, worker=None, **kw) -> list[dict]:
    runs = run_ranks(worker or _many, world, layouts, kw)[0]
    refs = {}
    for layout, got in zip(layouts, runs):
        same = tuple(o for o in layout if not o.startswith(("parallel.", "memory.recompute")))  # the math
        if same not in refs:
            refs[same] = train_random(0, 1, list(same), **kw)
        ref = refs[same]
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
        assert loss_err < TOL, f"{layout}: losses differ by {loss_err:.2e}"
        assert got["params"].keys() == ref["params"].keys()
        param_err = max_rel_diff(got["params"], ref["params"])
        assert param_err < TOL, f"{layout}: parameters differ by {param_err:.2e}"
    return runs


def _many(rank: int, world: int, layouts: list[list[str]], kw: dict) -> list[dict]:
    return [train_random(rank, world, layout, **kw) for layout in layouts]


TP2 = [["parallel.tp=2", "parallel.sequence_parallel=false"], ["parallel.tp=2", "parallel.sequence_parallel=true"],
       ["parallel.tp=2", "parallel.tp_form=all-gather"], ["parallel.tp=2", "parallel.tp_form=all-reduce"]]
OVERLAP = ["parallel.tp_overlap=chunked"]
LORA = ["lora.rank=4", "lora.alpha=8", "lora.targets=[\"wq\", \"wk\", \"wo\", \"w1\", \"w2\"]", "optim.name=sgd", "optim.lr=0.1"]
TP2_OVERLAP = [["parallel.tp=2"] + OVERLAP,
               ["parallel.tp=2", "parallel.sequence_parallel=false", "parallel.tp_overlap_chunks=4"] + OVERLAP]


def test_tp2_every_form_and_overlap_llama_and_gpt2():
    """llama: GQA, untied head, no biases; gpt2: biases, learned positions, tied embeddings. gpt2
    runs SGD: its key bias has no true gradient (softmax is invariant to a shift shared by all keys
    of a query), so its gradient is fp32 rounding, which AdamW would scale up to lr-sized steps.
    parallel.tp_overlap=chunked (parallel/tp_overlap.py: collectives split into units under the
    GEMMs, forward and backward) with sequence parallelism on (2 units: the chunked token layout,
    over which gpt2's learned positions are looked up, its biases and tied head) and off (4 units of
    rows); every other layout runs no overlapped function.
    The bytes autograd keeps for one micro-batch on rank 0 equal the planner's count for each form
    exactly (planner.memory.forward_saved: gathered linear inputs, the vocab-parallel loss's masks)."""
    layouts = TP2 + TP2_OVERLAP + [GPT2_SGD + lay for lay in TP2 + TP2_OVERLAP[:1]]
    runs = _compare(layouts, world=2, worker=_counting_overlaps, count_saved=True)
    _assert_overlapped(layouts, runs)
    for layout, got in zip(layouts, runs):
        cfg = load_config(None, BASE + layout)
        assert got["saved"] == forward_saved(shape_of(cfg), training_of(cfg), layout_of(cfg, 2), "cpu"), layout


@pytest.mark.long
def test_tp2_heads_wider_than_d_model_over_heads():
    """model.head_dim=12 at d_model 32 and 4 heads (q 48 wide, as Qwen3-MoE 30B-A3B's 4096 at 2048):
    every form splits the heads' rows and wo's columns by whole heads; the megatron form with the
    per-head q/k norms of Qwen3 (SGD, as Qwen3 in test_hf_layouts.py: their split sums' rounding is
    what AdamW would grow). The bytes autograd keeps for one micro-batch equal the planner's count."""
    wide = ["model.head_dim=12"]
    layouts = [wide + lay for lay in TP2[2:]] + [wide + ["model.qk_norm=head", "optim.name=sgd", "optim.lr=0.5",
                                                         "parallel.tp=2"]]
    runs = _compare(layouts, world=2, count_saved=True)
    for layout, got in zip(layouts, runs):
        cfg = load_config(None, BASE + layout)
        assert got["saved"] == forward_saved(shape_of(cfg), training_of(cfg), layout_of(cfg, 2), "cpu"), layout


def _assert_overlapped(layouts: list[list[str]], runs: list[dict]) -> None:
    for layout, run in zip(layouts, runs):
        # 10 steps of 4 micro-batches (and the forward that counts saved bytes); each: 3 column joints
        # (attention, MLP, head), 2 row exits per block of 2
        n = 40 + (run["saved"] is not None)
        want = {"column": n * 5, "row": n * 4} if OVERLAP[0] in layout else {"column": 0, "row": 0}
        assert run["overlapped"] == want, layout


def test_tp4_and_tp2_dp2_with_every_zero_stage():
    """tp=4 splits 2 key/value heads over 4 ranks (each replicated twice) and a vocabulary of 50
    (padded to 52), also overlapped (parallel.tp_overlap=chunked); tp=2 x dp=2 composes with ZeRO 0-3
    and offload on a 2-D mesh; memory.recompute=selective-ops replays each block's collectives around
    the GEMM outputs it keeps (tp=4, and tp=2 x dp=2)."""
    layouts = [["parallel.tp=4", "parallel.sequence_parallel=false"], ["parallel.tp=4"], GPT2_SGD + ["parallel.tp=4"],
               ["parallel.tp=4"] + OVERLAP]
    layouts += [["parallel.tp=2", f"parallel.zero={z}"] for z in (0, 3)]  # 1 and 2: below
    layouts += [["parallel.tp=2", "parallel.zero=3", "parallel.offload=params"],
                ["parallel.tp=2", "parallel.zero=2", "parallel.sequence_parallel=false", "memory.recompute=full"],
                GPT2_SGD + ["parallel.tp=2", "parallel.zero=1", "memory.recompute=selective"],
                ["parallel.tp=4", "memory.recompute=selective-ops"], ["parallel.tp=2", "memory.recompute=selective-ops"]]
    _compare(layouts, world=4)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.long)])
def test_unused_parameter_on_one_rank_does_not_hang(world):
    """Data-parallel rank 1 takes no gradient through one MLP: its flat groups complete late or
    never, yet every rank launches the same collectives in the same order (no hang, no mismatch)
    and the result equals one process that zeroes the same samples' branch."""
    extra = [] if world == 2 else ["parallel.tp=2"]
    layouts = [extra + [f"parallel.zero={z}"] for z in (0, 1, 2, 3)]
    _compare(layouts, world=world, skip_branch=True)


def test_frozen_parameters_under_zero():
    """A frozen matrix and a frozen norm are materialized, never updated, and left out of the
    optimizer, at every stage (one process freezes the same ones)."""
    frozen = ("layers.0.attention.wq.weight", "layers.1.ffn_norm.weight")
    _compare([[f"parallel.zero={z}"] for z in (0, 1, 2, 3)], world=2, freeze=frozen)


def test_lora_under_zero_and_tensor_parallelism():
    """Adapters on column- (wq, wk with replicated kv heads at tp=4, w1) and row-parallel (wo, w2)
    layers: B splits with a column-parallel W, A with a row-parallel one; ZeRO-2 and tp=2 on 2 ranks
    equal one process (the issue's cases), also with the projections overlapped (the adapters read
    the joint's gathered input and join the row exits' reduction), and ZeRO-3 with the frozen base
    sharded."""
    layouts = [LORA + ["parallel.zero=2"], LORA + ["parallel.tp=2"], LORA + TP2_OVERLAP[0], LORA + ["parallel.zero=3"]]
    _assert_overlapped(layouts, _compare(layouts, world=2, worker=_counting_overlaps))


def test_lora_with_a_bf16_base_under_data_parallelism():
    """lora.base_dtype=bf16 (frozen weights stored in bf16 under bf16 autocast) on the plain
    data-parallel engine, 2 ranks against one process on the same global batch."""
    _compare([LORA + ["memory.precision=bf16", "lora.base_dtype=bf16"]], world=2)


def _counting_overlaps(rank: int, world: int, layouts: list[list[str]], kw: dict) -> list[dict]:
    """_many, counting the overlapped column groups and row exits each layout ran."""
    from teratrain.parallel import tp_overlap

    counts = {"column": 0, "row": 0}
    for cls, key in ((tp_overlap._ColumnGroup, "column"), (tp_overlap._RowExit, "row")):
        def counted(*args, apply=cls.apply, key=key):
            counts[key] += 1
            return apply(*args)
        cls.apply = counted
    runs = []
    for layout in layouts:
        before = dict(counts)
        run = train_random(rank, world, layout, **kw)
        runs.append({**run, "overlapped": {k: counts[k] - before[k] for k in counts}})
    return runs


def _held_grads(rank: int, world: int, layouts: list[list[str]]) -> list[tuple[set, set, set]]:
    """Per layout, after 2 steps: the parameters holding a gradient, those whose gradient is a kept
    buffer, and all of them (by name)."""
    out = []
    for layout in layouts:
        cfg, rt, model, engine = build(layout)
        if not cfg.train.compile:
            train_steps(cfg, rt, model, engine, 2)
        named = list(model.named_parameters())
        out.append(({n for n, p in named if p.grad is not None}, {n for n, p in named if engine.keeps_grad(p)},
                    {n for n, _ in named}))
    return out


def test_gradients_with_nothing_to_reduce_are_freed_between_steps():
    """At dp=1 no group reduces a tensor- or pipeline-parallel weight's gradient: it stays autograd's
    and is freed after the update, as in one process (a flat buffer held it through the next forward:
    4 bytes a parameter over DTensor TP's peak). With sequence parallelism the norms' gradients are summed over
    the tp group and keep their bucket, as does a pipeline's tied embedding (summed over its two ends);
    under CUDA graphs every gradient keeps one (engine.py). The planner counts the same
    (tests/unit/test_planner_recorded.py: GPipe's peaks after this change within 0.2%)."""
    graphed = ["parallel.tp=2", "train.compile=true", "train.compile_mode=reduce-overhead"]
    gpipe = ["parallel.pp=2", "parallel.schedule=gpipe", "model.tie_embeddings=true"]
    no_sp, sp, graphs, pipe = run_ranks(_held_grads, 2, [["parallel.tp=2", "parallel.sequence_parallel=false"],
                                                         ["parallel.tp=2", "parallel.sequence_parallel=true"],
                                                         graphed, gpipe])[0]
    held, kept, every = no_sp
    assert held == kept == set()
    held, kept, every = pipe  # pp alone likewise, but the tied embedding: reduced over the two ends
    assert held == kept == {"tok_embeddings.weight"}, kept
    held, kept, every = sp
    assert held == kept and kept and all("norm" in n for n in kept), kept
    held, kept, every = graphs
    assert kept == every


@pytest.mark.long
def test_tp2_compiled_is_one_graph_and_matches_one_process():
    """train.compile under tensor parallelism: every tp collective (the f/g pair, the sequence-parallel
    gather and reduce-scatter, the all-gather form's, the vocab-parallel loss's all-reduces) is traced as a functional
    collective (parallel/comm.py, `traced`), so the model compiles with fullgraph=True: no graph
    break at any collective, forward or backward. The compiler here is aot_eager (the traced forward
    and backward graphs run eagerly: inductor would compile for ~90 s on 2 cores and add nothing to
    what is checked: the graphs and their collectives). Also under full recomputation (the checkpointed
    blocks look the tp group up inside the checkpoint, which must mutate nothing), ZeRO-1, and the
    chunked overlap with and without SP (parallel/tp_overlap.py: traced, each unit's collective a
    functional one beside another unit's GEMMs). Losses and parameters match one process."""
    _compare([["parallel.tp=2", "parallel.sequence_parallel=false"], ["parallel.tp=2"],
              ["parallel.tp=2", "parallel.tp_form=all-gather"], ["parallel.tp=2", "memory.recompute=full"],
              ["parallel.tp=2", "parallel.zero=1"], ["parallel.tp=2"] + OVERLAP,
              ["parallel.tp=2", "parallel.sequence_parallel=false", "parallel.tp_overlap_chunks=4"] + OVERLAP],
             world=2, worker=compiled_worker, steps=2)


def _scheduled(rank: int, world: int, layout: list[str]) -> tuple[list[str], list[str], dict]:
    """The order inductor (the default backend) launches collectives, waits and GEMMs in, per compiled
    graph (forward, backward) of a 1-block model: AG / RS / AR issued, w a wait, mm a GEMM; under
    parallel.tp_overlap=async, what the async-TP pass finds in each graph (test below); and the run."""
    import re

    import torch._functorch.config
    import torch._inductor.config
    import torch.distributed._symmetric_memory as symm
    from torch._inductor import graph
    from torch._inductor.fx_passes import micro_pipeline_tp as tp_pass
    from torch._inductor.fx_passes import post_grad

    from teratrain import compat
    from teratrain.parallel import parallelize

    torch._inductor.config.fx_graph_cache = False  # a cached graph is loaded, not lowered: nothing to read
    torch._functorch.config.enable_autograd_cache = False
    codes, compile_to_module = [], graph.GraphLowering.compile_to_module

    def spy(self, *args, **kwargs):
        module = compile_to_module(self, *args, **kwargs)
        codes.append(open(module.__file__).read())
        return module

    fusible = []  # per graph: what inductor's async-TP pass finds (its fusion needs NCCL, absent on CPU)

    def tp_group(rt, cfg):  # parallel.tp_overlap=async on CPU, over no symmetric memory: what the pass finds
        return rt.group("tp") if cfg.parallel.tp_overlap == "async" else None

    def gathers(match):  # AGn: an all-gather whose result n GEMMs read
        fusible[-1].append(f"AG{len(tp_pass._find_consumer_matmuls(match.res_node))}")

    def scatters(match):  # RS1: a reduce-scatter of a GEMM's output (RS0: of something else)
        fusible[-1].append(f"RS{int(tp_pass._find_producer_matmul(match.input_node) is not None)}")

    def fused_in_graph(graph):
        fusible.append([])
        pass_(graph)

    saved = (graph.GraphLowering.compile_to_module, parallelize.async_tp_group, symm.is_symm_mem_enabled_for_group,
             symm.get_symm_mem_workspace, tp_pass.fuse_all_gather_matmul, tp_pass.fuse_matmul_reduce_scatter,
             post_grad.micro_pipeline_tp_pass)
    pass_ = saved[-1]
    graph.GraphLowering.compile_to_module, parallelize.async_tp_group = spy, tp_group
    symm.is_symm_mem_enabled_for_group, symm.get_symm_mem_workspace = lambda name: True, lambda name, min_size: None
    tp_pass.fuse_all_gather_matmul, tp_pass.fuse_matmul_reduce_scatter = gathers, scatters
    post_grad.micro_pipeline_tp_pass = fused_in_graph
    try:
        run = train_random(rank, world, layout + ["train.compile=true", "model.n_layers=1"], steps=1)
    finally:
        (graph.GraphLowering.compile_to_module, parallelize.async_tp_group, symm.is_symm_mem_enabled_for_group,
         symm.get_symm_mem_workspace, tp_pass.fuse_all_gather_matmul, tp_pass.fuse_matmul_reduce_scatter,
         post_grad.micro_pipeline_tp_pass) = saved
        compat.compile_async_tp(None)
    names = {"all_gather_into_tensor": "AG", "reduce_scatter_tensor": "RS", "all_reduce": "AR", "wait_tensor": "w"}
    pattern = re.compile(r"_c10d_functional\.(\w+)\.default\(|extern_kernels\.(mm|addmm)\(")
    order = [" ".join(names.get(m[0], m[0]) if m[0] else "mm" for m in pattern.findall(code)) for code in codes]
    return order, [" ".join(found) for found in fusible], run


@pytest.mark.long
def test_chunked_overlap_compiled_issues_the_next_piece_before_waiting():
    """parallel.tp_overlap=chunked under train.compile (inductor, SP): a traced collective is waited
    for where issued, so without reordering each piece's all-gather is waited for before the next is
    issued; the passes tp_overlap turns on (compat.compile_comm_overlap) issue both gathers before the
    first wait, and the exit's first reduce-scatter before the second piece's GEMM."""
    plain, chunked = _schedule("none"), _schedule("chunked")
    forward = chunked[0][0]
    assert "AG AG w mm w mm" in forward and "RS mm RS" in forward, forward
    assert "AG AG" not in plain[0][0], plain[0][0]


@functools.cache
def _schedule(overlap: str) -> tuple:
    """_scheduled of tp=2 with SP under parallel.tp_overlap=`overlap` (none: plain): one inductor compile
    each, shared by the two tests (the default run compiles only the two it reads)."""
    return run_ranks(_scheduled, 2, ["parallel.tp=2"] + ([f"parallel.tp_overlap={overlap}"] if overlap != "none" else []))[0]


def test_sequence_parallel_compiles_to_what_async_tp_fuses():
    """parallel.tp_overlap=async turns on inductor's micro-pipeline pass, which fuses an all-gather with
    the GEMMs that read its result and a GEMM with the reduce-scatter of its output (the fusion itself
    needs NCCL, so on CPU only its search runs; AGn: a gather n GEMMs read, RS1: a reduce-scatter of a
    GEMM's output). The traced sequence gather and reduce-scatter hand the GEMMs one (rows, d) matrix
    (parallel/comm.py) and compat's reshape folding removes the block's (B, T, d) view between them, so
    in one block's forward the attention's entry gather feeds its 3 projections, the MLP's its 2, the
    head's 1, and both exits reduce-scatter a GEMM's output (the embedding's reduce-scatter has none);
    backward, the exits' gathered gradients feed a GEMM each and the head's input gradient is
    reduce-scattered from its GEMM. The step's loss and parameters equal the plain compiled run's."""
    (_, _, plain), (_, fusible, run) = _schedule("none"), _schedule("async")
    forward, backward = (graph.split() for graph in fusible)
    assert run["losses"] == pytest.approx(plain["losses"], rel=1e-6)  # the reshape folding changes no value
    assert max_rel_diff(run["params"], plain["params"]) < 1e-6
    assert sorted(forward) == ["AG1", "AG2", "AG3", "RS0", "RS1", "RS1"], forward
    assert backward.count("AG1") == 2 and backward.count("RS1") == 1, backward


def compiled_worker(rank: int, world: int, layouts: list[list[str]], kw: dict) -> list[dict]:
    """Each layout with train.compile (aot_eager, fullgraph), with its graph breaks and compiled graphs
    (test_moe_compile.py uses it too)."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    compile_module, compile_fn = torch.nn.Module.compile, torch.compile  # ZeRO-3 compiles each block's forward
    torch.nn.Module.compile = lambda self, **_: compile_module(self, backend="aot_eager", fullgraph=True)
    torch.compile = lambda fn, **_: compile_fn(fn, backend="aot_eager", fullgraph=True)
    try:
        runs = []
        for layout in layouts:
            torch._dynamo.reset()
            counters.clear()
            run = train_random(rank, world, layout + ["train.compile=true"], **kw)
            runs.append({**run, "graph_breaks": sum(counters["graph_break"].values()),
                         "graphs": counters["stats"]["unique_graphs"]})
        return runs
    finally:
        torch.nn.Module.compile, torch.compile = compile_module, compile_fn


# One block's bytes under tensor + sequence parallelism: what one more block leaves alive from forward
# to backward (measure.live_bytes of 2 blocks less 1) on every rank, against the planner and against
# the per-layer formula of Korthikanti et al. 2022 (sec. 4, Table 2) derived for our block.
BLOCK_PRECISION = ["memory.precision=bf16", "memory.master_weights=true"]  # bf16 activations, as the paper's
BLOCK_POLICIES = ["none", "selective", "full", "selective-ops", "selective-ops-alternate"]


def _block_bytes(rank: int, world: int, policies: list[str]) -> dict[str, int]:
    from teratrain.measure import live_bytes

    out = {}
    for policy in policies:
        got = []
        for n_layers in (1, 2):
            cfg, rt, model, _ = build([f"parallel.tp={world}", f"model.n_layers={n_layers}",
                                       f"memory.recompute={policy}"] + BLOCK_PRECISION)
            x, y = micro_batches(cfg, rt, batches(cfg, 1)[0])[0]
            got.append(live_bytes(model, x, y, cfg.memory.precision))
        out[policy] = got[1] - got[0]
    return out


def korthikanti_block_bytes(s: int, b: int, h: int, a: int, kv: int, f: int, t: int, policy: str) -> int:
    """Bytes one of our Llama blocks keeps (bf16 activations and parameters, tensor parallelism t with
    sequence parallelism, CPU kernels), term by term as Korthikanti et al. 2022 count GPT's 34 s b h / t
    + 5 a s^2 b / t (sec. 4.2, Table 2). Ours differs where the architecture does: SDPA keeps the output
    and a fp32 logsumexp (4 a s b / t), no s x s scores nor their dropout mask (the 5 a s^2 b / t term);
    the CPU's composite RMSNorm keeps fp32 upcasts of its bf16 input (4 s b h, where the GPU's fused kernel
    keeps the input itself: LayerNorm's 2) and x * rstd (4 s b h), and its fp32 statistics (4 s b); GQA's
    k and v are kv wide (replicated heads under t > their count); SwiGLU keeps w1 x, w3 x and their
    product (3 x 2 s b f / t; silu(w1 x) is made again in backward) where GELU keeps 2 x 2 s b 4h / t
    plus a dropout mask; no
    dropout (p = 0); RoPE's cos and sin cast to bf16 for q and k (4 x 2 s d_head). The column-parallel
    linears keep the sequence shard of their input (2 s b h / t each region), as the paper does."""
    n, hd = s * b, h // a
    kv_t = max(1, kv // hd // t) * hd  # key/value width on a rank
    norms = 2 * (n * h * (4 + 4) // t + n * 4 // t)  # fp32 input, x * rstd, rstd
    attention = 2 * n * h // t + 2 * n * h // t + 2 * 2 * n * kv_t + 2 * n * h // t  # input shard, q, k and v, output
    logsumexp = 4 * n * a // t
    mlp = 2 * n * h // t + 3 * 2 * n * f // t  # input shard, SwiGLU's three
    rope = 4 * 2 * s * hd
    if policy == "none":
        return norms + attention + logsumexp + mlp + rope
    if policy == "selective":  # the core (ours: only its logsumexp) recomputed
        return norms + attention + mlp + rope
    if policy == "full":  # the block's input, a sequence shard (Korthikanti et al., sec. 5: 2 s b h / t)
        return 2 * n * h // t
    if policy == "selective-ops-alternate":  # of wq, wk, wv, wo, w1, w3, w2's outputs: q, v, w1 x, w2's sums
        return 2 * n * h // t + 2 * n * kv_t + 2 * n * f // t + 2 * n * h + 2 * n * h // t + logsumexp + 2 * n * h // t
    # selective-ops: GEMM outputs (q, k, v; w1, w3 split; wo's and w2's partial sums whole), attention's
    # output and logsumexp, the block's input
    return 2 * n * h // t + 2 * 2 * n * kv_t + 2 * 2 * n * f // t + 2 * n * h // t + logsumexp + 2 * 2 * n * h \
        + 2 * n * h // t


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.long), pytest.param(4, marks=pytest.mark.long)])
def test_one_block_bytes_equal_the_planner_and_the_formula(tp):
    """tp = 1 (in this process), 2, 4 (tp=4 replicates the 2 key/value heads): every rank's bytes for
    one block, each recompute policy, equal planner.activations.stored_blocks and
    korthikanti_block_bytes exactly (a single-process sb x h shard is one tp rank's share)."""
    from teratrain.planner.activations import stored_blocks
    from teratrain.planner.layout import ModelShape, widths

    ranks = [_block_bytes(0, 1, BLOCK_POLICIES)] if tp == 1 else run_ranks(_block_bytes, tp, BLOCK_POLICIES)
    cfg = load_config(None, BASE + BLOCK_PRECISION)
    m, s, b = cfg.model, cfg.model.seq_len, cfg.train.micro_batch
    w = widths("bf16", True)
    for policy in BLOCK_POLICIES:
        planned = stored_blocks(ModelShape(cfg=m), w, 1, s * b, s, policy, 2, device="cpu", tp=tp, sp=tp > 1)
        formula = korthikanti_block_bytes(s, b, m.d_model, m.n_heads, m.kv_heads * m.head_width, m.ffn_dim, tp, policy)
        assert [r[policy] for r in ranks] == [sum(planned.values())] * tp == [formula] * tp, policy
