"""Communication time of one step: every collective our engines and layers issue, alpha-beta priced.

Each collective is a ring (Thakur et al. 2005): all-reduce moves 2(n-1)/n of the bytes in 2(n-1)
steps, reduce-scatter, all-gather and all-to-all (n-1)/n in n-1 steps, a send/receive the bytes in
one. t = steps x alpha + fraction x bytes / bandwidth (Hockney 1994), with bandwidth and alpha of
the link the group spans (hardware.GPU.link: the kind's measured terms inside a node when given,
else NVLink; across nodes the NICs of the group's members on a node, one ring each).

What is counted per step, and where it comes from in our code:
- data parallelism (parallel/data.py, zero.py): gradients all-reduced in buckets (ZeRO-0), reduce-
  scattered once per step (ZeRO-1) or per micro-step (ZeRO-2/3, ZeRO sec. 7), updated shards
  all-gathered after the step (ZeRO-1/2) or each block gathered before its forward and again before
  its backward (ZeRO-3); expert parameters over the dp/ep ranks holding them;
- tensor parallelism (parallel/tensor.py, by parallel.tp_form), per layer and micro-batch:
  megatron: an attention and an MLP region, each entered and left once each way (Shoeybi et al. 2019:
  one all-reduce forward and one backward per region; with sequence parallelism an all-gather and a
  reduce-scatter instead, Korthikanti et al. 2022); the all-gather form: every linear's
  output all-gathered forward, its input's gradient all-reduced backward; the all-reduce form: every
  output all-reduced forward, its input's gradient all-gathered backward. Recomputation that replays
  the blocks replays their forward collectives. The vocab-parallel embedding and head cross once more
  each (and the loss all-reduces three per-token vectors); under eager sequence parallelism the
  column-parallel linears' inputs are all-gathered again in backward: `regather_s`;
- pipeline: an activation forward and its gradient backward across every stage boundary, for each
  micro-batch and model chunk (2 x (v x m + p - 1) on the critical path);
- expert parallelism: 4 all-to-alls per MoE layer and micro-batch (dispatch and combine, forward and
  backward; 6 when recomputation replays the forward);
- context parallelism (parallel/context.py), per layer and micro-batch: `cp_s`.
"""

from __future__ import annotations

from functools import lru_cache

from teratrain.config_schema import REPLAYING, SELECTIVE_OPS
from teratrain.parallel.ep_plan import expected_ranks
from teratrain.planner.hardware import GPU
from teratrain.planner.layout import Layout, ModelShape, Training, block_linears
from teratrain.planner.states import (accumulates, dp_buckets, gathers_float8, is_expert, rank_layers, stage_params,
                                      zero_groups)

FRACTION = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
            "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "p2p": lambda n: 1.0}
STEPS = {"all_reduce": lambda n: 2 * (n - 1), "reduce_scatter": lambda n: n - 1, "all_gather": lambda n: n - 1,
         "all_to_all": lambda n: n - 1, "p2p": lambda n: 1}


def collective(kind: str, n: int, nbytes: float, gbps: float, alpha: float, messages: int = 1) -> float:
    """Ring alpha-beta time of one collective over n ranks moving `nbytes` per rank (the whole
    tensor: an all-gather's output, a reduce-scatter's input), in `messages` pieces."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return messages * STEPS[kind](n) * alpha + FRACTION[kind](n) * nbytes / (gbps * 1e9)


def on_link(gpu: GPU, kind: str, n: int, span: int, nbytes: float, messages: int = 1) -> float:
    """`collective` over the link a group of n ranks spread over `span` consecutive GPUs uses."""
    return collective(kind, n, nbytes, *gpu.link(kind, span, n), messages)


def step_comm(shape: ModelShape, train: Training, lay: Layout, gpu: GPU) -> dict[str, float]:
    """Seconds per step of each communication term (before overlap), but `self_overlapped`'s."""
    w = train.widths(lay.zero, lay.offload)
    sp = stage_params(shape, lay)
    out = {"dp": 0.0, "param_gather": 0.0, "zero_gather": 0.0, "tp": 0.0, "pp": 0.0, "ep": 0.0}
    # dense parameters are reduced over dp, experts over the dp / ep ranks holding the same ones, which spread
    # over the same GPUs as the dp ranks, ep x tp apart (mesh.py)
    for experts, n, ranks in ((False, sp["first"] - sp["experts"], lay.replicas),
                              (True, sp["experts"], lay.replicas // lay.ep)):
        messages = reduce_messages(shape, train, lay, experts, n)
        float8 = 0 if experts else float8_gathered(shape, train, lay)
        for key, t in dp_terms(train, lay, w, n, ranks, gpu, messages, float8, lay.replicas * lay.tp).items():
            out[key] += t
    if shape.is_bare:
        return out
    m, layers = lay.num_microbatches, rank_layers(shape, lay)
    out["tp"] = m * tp_per_microbatch(shape, train, lay, gpu, layers)
    if lay.pp > 1:
        out["pp"] = 2 * (lay.virtual_stages * m + lay.pp - 1) * p2p_s(shape, train, lay, gpu)
    if shape.num_experts > 1:
        per_layer = 6 if lay.recompute in REPLAYING else 4
        out["ep"] = m * layers * shape.moe_share * per_layer * all_to_all_s(shape, train, lay, gpu)
    return out


def self_overlapped(shape: ModelShape, train: Training, lay: Layout, gpu: GPU) -> dict[str, tuple[float, float]]:
    """(seconds, seconds exposed) of the terms that hide part of themselves under their own neighbours' kernels,
    which plan_time adds to step_comm's: context parallelism's exchanges and sequence parallelism's re-gathers."""
    return {"cp": cp_s(shape, train, lay, gpu), "regather": regather_s(shape, train, lay, gpu)}


def regathers(train: Training, lay: Layout) -> bool:
    """Whether the column-parallel linears keep their input's sequence shard and gather it again in backward
    (parallel/comm.py Regather, Layout.keeps_shard): eager megatron-form sequence parallelism with bf16 GEMMs
    (float8 GEMMs keep the gathered input, the compiler's graph gathers as it chooses)."""
    return (lay.tp > 1 and lay.sequence_parallel and lay.tp_form == "megatron" and not train.compiled
            and train.fp8 == "none" and lay.keeps_shard)


def regather_s(shape: ModelShape, train: Training, lay: Layout, gpu: GPU) -> tuple[float, float]:
    """(seconds, seconds exposed) of one rank's step's `regathers`: per micro-batch one all-gather of the
    attention's input a block, one of a dense MLP's (an MoE layer's tokens enter whole) and one of the head's,
    each launched by the first linear of its region that autograd reaches and run under that linear's
    input-gradient GEMM (wv's, w3's or GELU's w1's, the head's: Megatron-LM's order, Korthikanti et al. 2022
    sec. 4.2.2), so only what outlasts that GEMM is exposed."""
    if not regathers(train, lay) or shape.is_bare:
        return 0.0, 0.0
    c, tp = shape.cfg, lay.tp
    n, cb = lay.tokens(c.seq_len), train.widths(lay.zero, lay.offload).compute
    gather = on_link(gpu, "all_gather", tp, tp, n * c.d_model * cb)
    rate = gpu.sustained_flops(train.precision, c.d_model)
    dense = 1 - (shape.moe_share if shape.num_experts > 1 else 0.0)
    ends = ((1.0, c.kv_heads * c.head_width), (dense, c.ffn_dim))  # per block: (share of blocks, GEMM width)

    def outlasts(width: int) -> float:  # what of the gather its GEMM (n x d in, width / tp out) does not hide
        return max(0.0, gather - 2 * n * c.d_model * width / tp / rate)

    per_block = sum(share for share, _ in ends) * gather
    exposed = sum(share * outlasts(width) for share, width in ends)
    m, layers = lay.num_microbatches, rank_layers(shape, lay)
    return m * (layers * per_block + gather), m * (layers * exposed + outlasts(c.vocab_size))


def cp_s(shape: ModelShape, train: Training, lay: Layout, gpu: GPU) -> tuple[float, float]:
    """(seconds, seconds exposed) of one rank's context-parallel exchanges in a step: every block of its
    stage, every micro-batch, the forward again where recomputation replays the attention core. The cp
    ranks are tp GPUs apart (mesh.py), a group spanning cp x tp GPUs.
    ring (parallel/ring_attention.py): a forward sends this rank's keys and values (2 x tokens x local
    key/value width, compute dtype) on cp-1 times, each transfer posted before a ring step's attention
    and waited for after it, so only what outlasts that step's attention (1/cp of the block's) is
    exposed; a backward sends them cp-1 times with cp passes of their fp32 gradient, each under a
    step's attention backward (twice the forward's FLOPs), the last pass exposed whole.
    all-to-all (Ulysses): q, k and v to head shards and the output back, forward and backward, each
    (cp-1)/cp of the tensor's bytes, all exposed (attention waits for them)."""
    if lay.cp == 1 or shape.is_bare:
        return 0.0, 0.0
    c, cp, tp = shape.cfg, lay.cp, lay.tp
    n, cb = lay.tokens(c.seq_len), train.widths(lay.zero, lay.offload).compute
    kv_local = max(1, c.kv_heads // tp) * c.head_width
    q_local = c.n_heads * c.head_width // tp
    forwards = 2 if lay.recompute != "none" else 1  # every policy replays the core (selective: only it)
    span = cp * tp
    if lay.cp_form == "all-to-all":
        kv = q_local if kv_local // c.head_width % cp else kv_local  # repeated to the query heads before the exchange
        one = sum(on_link(gpu, "all_to_all", cp, span, n * width * cb) for width in (q_local, kv, kv, q_local))
        per_block = (forwards + 1) * one
        exposed = per_block
    else:
        rate = gpu.sustained_flops(train.precision, c.d_model)
        attn_step = 4 * n * c.seq_len * q_local / rate / cp  # one ring step's attention forward (PaLM's 4HQT a token)
        kv = on_link(gpu, "p2p", 2, span, 2 * n * kv_local * cb)
        grad = on_link(gpu, "p2p", 2, span, 2 * n * kv_local * 4)
        per_block = forwards * (cp - 1) * kv + (cp - 1) * kv + cp * grad
        exposed = (forwards * (cp - 1) * max(0.0, kv - attn_step)
                   + (cp - 1) * max(0.0, kv + grad - 2 * attn_step) + grad)
    blocks = rank_layers(shape, lay) * lay.num_microbatches
    return blocks * per_block, blocks * exposed


def reduce_messages(shape: ModelShape, train: Training, lay: Layout, experts: bool, local: int) -> tuple[int, int]:
    """`_reduce_messages` once per layout that can differ in them: the flat groups do not depend on the
    micro-batch, recomputation or the schedule (the search varies those around the same groups)."""
    same = lay.with_(micro_batch=1, num_microbatches=1, recompute="none", recompute_every=2,
                     schedule="one_f_one_b", cp_form="ring")
    return _reduce_messages(shape, train, same, experts, local)


@lru_cache(maxsize=4096)
def _reduce_messages(shape: ModelShape, train: Training, lay: Layout, experts: bool, local: int) -> tuple[int, int]:
    """(reductions, gathers) that carry a rank's dense or expert gradients and parameters each pass:
    the engines' own flat groups over the fuller pipeline end's tensors, as the memory model's
    (states.zero_groups, states.dp_buckets). Buckets of ~parallel.bucket_mb counted in the
    parameters' width, each tensor whole (parallel/buckets.py `ordered_buckets`: a weight larger than a
    bucket is a bucket of its own, so a 1b-width model has about 4 a block, not bytes / bucket_mb).
    One all-gather per flat group: ZeRO 1/2 after the step, ZeRO-3 per block's group, its frozen
    groups too (parallel/zero_gather.py). A bare parameter count: bucket-sized pieces."""
    if local <= 0:
        return 0, 0
    if shape.is_bare:
        n = max(1, int(local * train.widths(lay.zero, lay.offload).param / (train.bucket_mb * 2**20)))
        return n, n
    if lay.zero == 0:
        n = sum(1 for members in dp_buckets(shape, train, lay) if is_expert(members[0]) == experts)
        return n, n
    groups = [members for members, _, _ in zero_groups(shape, train, lay, local) if is_expert(members[0]) == experts]
    trained = sum(1 for members in groups if members[0].trainable)
    return trained, len(groups) if lay.zero == 3 else trained


def dp_terms(train: Training, lay: Layout, w, local: int, ranks: int, gpu: GPU,
             messages: tuple[int, int], float8: int = 0, span: int | None = None) -> dict[str, float]:
    """Gradient reduction (and ZeRO's parameter gathers) of `local` parameters over `ranks`, spread over
    `span` consecutive GPUs (by default tp apart: the mesh's dp axis is outside tp), in `messages` =
    (reductions, gathers); `float8` of them gathered at 1 byte (`float8_gathered`)."""
    red = train.reduce_bytes
    buckets, gathers = (max(1, k) for k in messages)
    span = span or ranks * lay.tp
    if lay.zero == 0:
        return {"dp": on_link(gpu, "all_reduce", ranks, span, local * red, buckets)}
    rs = on_link(gpu, "reduce_scatter", ranks, span, local * red, buckets)
    ag = on_link(gpu, "all_gather", ranks, span, local * w.param - float8 * (w.param - 1), gathers)
    out = {"dp": rs * reduce_passes(lay)}
    if lay.zero < 3:
        out["param_gather"] = ag  # updated shards to every rank after the step: nothing left to hide it
    else:
        out["zero_gather"] = ag * gather_passes(lay)
    return out


def float8_gathered(shape: ModelShape, train: Training, lay: Layout) -> int:
    """Elements of a rank's weights that ZeRO-3 gathers in float8, 1 byte each (parallel/zero_fp8.py):
    its blocks' float8 linears' weights (planner/local.py marks them), under memory.fp8=tensorwise with
    memory.fp8_gather."""
    return stage_params(shape, lay)["float8"] if gathers_float8(train, lay) else 0


def reduce_passes(lay: Layout) -> int:
    """Times a step reduces each gradient bucket or flat group: once (ZeRO-0, ZeRO-1, and ZeRO-3 under a
    pipeline: states.accumulates), else every micro-step (ZeRO-2/3; ZeRO sec. 7: 2 Psi, 3 Psi volume)."""
    return 1 if lay.zero == 0 or accumulates(lay) else lay.num_microbatches


def gather_passes(lay: Layout) -> int:
    """Times a step all-gathers each flat group: ZeRO 1/2 once after the update; ZeRO-3 each block before
    its forward and its backward every micro-step, once a step under a pipeline (parallel/zero.py)."""
    return 1 if lay.zero < 3 or lay.pp > 1 else 2 * lay.num_microbatches


def tp_per_microbatch(shape: ModelShape, train: Training, lay: Layout, gpu: GPU | None, layers: int,
                      count: bool = False) -> float:
    """Tensor-parallel collectives of one micro-batch on one stage of `layers` blocks (module
    docstring): their seconds, or with `count` how many are launched."""
    if lay.tp == 1:
        return 0.0
    c, tp = shape.cfg, lay.tp
    n = lay.tokens(c.seq_len)
    cb = train.widths(lay.zero, lay.offload).compute
    fwd_passes = 2 if lay.recompute in REPLAYING else 1
    # a per-op policy's replay reruns the block's forward collectives up to the MLP's last product (its output, and
    # so what follows, no backward reads: the checkpoint stops before them)
    per_op = lay.recompute in SELECTIVE_OPS

    def coll(kind: str, nbytes: float) -> float:
        return 1.0 if count else on_link(gpu, kind, tp, tp, nbytes)

    act = n * c.d_model * cb
    # one crossing of a region boundary, forward or backward (entry and exit of a region are one each way)
    unit = coll("all_gather", act) + coll("reduce_scatter", act) if lay.sequence_parallel else coll("all_reduce", act)
    vocab = 2 * unit + 3 * coll("all_reduce", n * 4)  # the embedding's exit and the head's entry; the loss's vectors
    if lay.tp_form == "megatron":  # two regions a block, each crossed once per forward pass and once backward
        # per-op replay: the attention's region whole, the MLP's entry (under SP its all-gather; else none forward)
        replay = unit + (coll("all_gather", act) if lay.sequence_parallel else 0.0) if per_op else 0.0
        return layers * (2 * (fwd_passes + 1) * unit + replay) + vocab
    fwd, bwd = ("all_gather", "all_reduce") if lay.tp_form == "all-gather" else ("all_reduce", "all_gather")
    moe = shape.moe_share if shape.num_experts > 1 else 0.0
    per_block = 0.0
    # the linear layers tensor parallelism splits (an MoE layer's experts stay whole under the per-layer forms,
    # parallel/tp_plan.py)
    for share, lin in ((1 - moe, block_linears(shape)), (moe, block_linears(shape, moe_layer=True))):
        if share:
            passes = [fwd_passes + (per_op and k < len(lin) - 1) for k in range(len(lin))]  # not the last again
            per_block += share * sum(p * coll(fwd, n * o * cb) + coll(bwd, n * i * cb)
                                     for p, (i, o) in zip(passes, lin))
    return layers * per_block + vocab


def all_to_all_s(shape: ModelShape, train: Training, lay: Layout, gpu: GPU) -> float:
    """One expert-parallel all-to-all of one micro-batch: each token's top_k routed copies,
    (micro_batch x T x top_k, d) in the compute dtype, (ep-1)/ep of them leaving the rank (GShard's
    dispatch or combine, parallel/expert.py; capacity drops and padded slots ignored). Deduplicated
    (parallel.ep_dedup, parallel/expert_dedup.py): one copy per rank holding one of its experts,
    `expected_ranks` of them under uniform routing, each d + 2 min(top_k, n/ep) wide (its gates and
    expert ids ride along). Every tp rank sends the whole (gathered) tokens to the ep peers of its
    own tp index."""
    c = shape.cfg
    rows, width = lay.tokens(c.seq_len) * shape.top_k, c.d_model
    if train.ep_dedup:
        rows = lay.tokens(c.seq_len) * expected_ranks(shape.num_experts, lay.ep, shape.top_k)
        width += 2 * min(shape.top_k, shape.num_experts // lay.ep)
    nbytes = rows * width * train.widths(lay.zero, lay.offload).compute
    return on_link(gpu, "all_to_all", lay.ep, lay.ep * lay.cp * lay.tp, nbytes)


def p2p_s(shape: ModelShape, train: Training, lay: Layout, gpu: GPU) -> float:
    """One activation (or its gradient) between neighbouring pipeline stages: (micro_batch, T, d),
    T/tp tokens under sequence parallelism (parallel/pipeline/runtime.py). Without it, with tp > 1, each
    tp rank sends 1/tp of the message and the receiver all-gathers the pieces over tp (p2p.Scatter;
    Narayanan et al. 2021 sec. 4.1): bytes/tp over the stage-to-stage link plus an all-gather within
    the tp group's node."""
    tokens = lay.tokens(shape.cfg.seq_len) // (lay.tp if lay.sequence_parallel else 1)  # a sequence shard
    act = tokens * shape.cfg.d_model * train.widths(lay.zero, lay.offload).compute
    span = 2 * lay.replicas * lay.tp  # pp is the outermost mesh axis: this far
    if lay.tp == 1 or lay.sequence_parallel or act % lay.tp:
        return on_link(gpu, "p2p", 2, span, act)
    return on_link(gpu, "p2p", 2, span, act / lay.tp) + on_link(gpu, "all_gather", lay.tp, lay.tp, act)
