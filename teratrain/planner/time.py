"""Time per optimizer step of one rank, and what it implies (tokens/s, MFU).

Terms, each with its source or assumption:
- compute: model FLOPs (PaLM appendix B: 6N + 12*L*H*Q*T per token, N the matmul weights a token
  multiplies), plus one more forward of what recomputation replays (Chen et al. 2016; selective
  recomputation replays only the attention core, 4*L*H*Q*T per token), at the datasheet peak times
  a sustained efficiency that grows with the width d, fitted per card (planner/calibration/<card>.toml).
  Pipeline stages split all of it; tensor parallelism splits the matmul weights' part,
  and the attention core's only in the megatron form (the per-layer forms, parallel.tp_form=all-gather /
  all-reduce, gather every head everywhere).
- eager ops: every op our model issues costs a launch and, for the elementwise kernels between the
  matmuls, some HBM time; a calibrated cost per op (ops counted from our Block). This is what makes
  small models slower than their FLOPs say. memory.recompute=selective-ops replays a block's norms, casts,
  RoPE and activations in backward: their ops and HBM traffic (planner/replay.py).
- optimizer: the AdamW sweep streams params, grads and states: teratrain's kernel 28 bytes/param at its
  measured share of hbm_gbps, torch's fused one ~36 at mem efficiency (+12 with fp32 masters): optimizer_s.
- MoE: FLOPs of the active weights only (router + top_k experts per token: MFU on active FLOPs), the
  experts' at the grouped GEMM's rate by rows x width (compiled, and eager where stacked, dropless and
  at ep = 1), else at gpu.moe_efficiency of the dense rate (the grouped GEMMs and the masks and exchanges
  around them: measured by bench/moe.py against the dense model; that overhead is not split by tensor
  parallelism, which splits only the experts' weights; planner/experts.py expert_efficiency); expert
  parallelism adds 4 all-to-alls per MoE layer and micro-batch (dispatch and combine, forward and
  backward; 6 when recomputation replays the forward), exposed; expert gradients reduce over dp/ep ranks.
- communication: every collective of the step, alpha-beta priced per ring (planner/comm.py says
  which, from measured terms when given). Data-parallel reductions overlap the backward of the last
  micro-batch (bucketed, Li et al. 2020); ZeRO-3 gathers overlap compute (prefetch); tensor-parallel
  collectives, pipeline sends and all-to-alls are exposed; ring attention's transfers hide under the
  attention of each ring step, up to its length (comm.cp_s).
- pipeline bubble: the idle time of the simulated schedule (planner/pipeline.py over
  parallel/pipeline/simulate.py): (p-1)/(m+p-1) of the step for GPipe and 1F1B on even stages (Huang
  et al. 2019), (p-1)/(v*m+p-1) interleaved (Narayanan et al. 2021), less for ZB-H1 (Qi et al. 2023);
  the stages are simulated as they are, the last one running the LM head besides its blocks.
- host: eager PyTorch issues every op from Python; where the GPU's work per op is short (tensor
  parallelism splits each matmul tp ways) the GPU waits on the host, so a rank's time is the larger
  of its GPU time and the host's issue time (per op, per tensor-parallel collective, per launch of
  the data-parallel engines: hardware.GPU). Under CUDA graphs (train.compile_mode=reduce-overhead)
  the host issues nothing per op. Compiled (train.compile), inductor's fused kernels are what the host
  issues and the GPU runs: fewer of them (COMPILED_OPS_SHARE), less elementwise HBM traffic in the
  blocks (COMPILED_FUSED_BYTES) and in the loss (COMPILED_LOSS_BYTES_PER_LOGIT): `issued_ops` and `fused_s`.
- fp8 (memory.fp8): the block linears' FLOPs at the float8 GEMM's measured speed-up over bf16
  (hardware.GPU.fp8_speedup_*), plus the HBM traffic of their casts; eager, their casts' ops on the host
  at FP8_HOST_OP_SHARE of a dense op each.
- offload (ZeRO-Offload, Ren et al. 2021): gradient shards down over PCIe, the CPU optimizer, the
  updated fp32 masters up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from teratrain.config_schema import REPLAYING, SELECTIVE_OPS
from teratrain.models.transformer import flops_per_token
from teratrain.planner import pipeline
from teratrain.planner.weight_casts import casts_float8_once, fp8_linears
from teratrain.planner.comm import (gather_passes, reduce_messages, reduce_passes, self_overlapped, step_comm,
                                    tp_per_microbatch)
from teratrain.planner.experts import (expert_efficiency, expert_stack_s, mlp_matrices, moe_extra_flops, moe_flops,
                                       shared_flops)
from teratrain.planner.hardware import GPU, calibrated
from teratrain.planner.layout import Layout, ModelShape, Training
from teratrain.planner.memory import MemoryBreakdown
from teratrain.planner.replay import (LINEAR_CAST_OPS, alternate_replayed, replay_detaches, replay_ops, replay_s,
                                      silu_kept_ops)
from teratrain.planner.states import is_expert, rank_layers, stage_params, stepped_tensors, zero_groups

_COMMON = calibrated("common")  # the fitted and counted constants of every card

# aten ops one block issues per micro-batch, (forward, backward), counted with a TorchDispatchMode
# over our Block: fp32; bf16/fp16 autocast over fp32 params (every linear casts its weight and
# input: more ops); low-precision params (fp32 masters in the optimizer). Priced by
# hardware.GPU.op_overhead_s, which was calibrated with these counts (llama's low column then 76 forward, since
# 72; llama's backward one op fewer while its SwiGLU kept silu's output: replay.SILU_KEPT_OPS;
# tests/unit/test_planner_replay.py counts every column again).
OPS_PER_BLOCK = {("llama", "fp32"): (68, 132), ("llama", "autocast"): (81, 143), ("llama", "low"): (72, 138),
                 ("gpt2", "fp32"): (39, 93), ("gpt2", "autocast"): (53, 109), ("gpt2", "low"): (39, 93)}
OPS_OUTSIDE = 60
# an MoE layer's ops beyond the dense MLP it replaces (router, top-k, permutation, the cast expert
# stacks, grouped expert GEMMs, the stacks' gradient accumulations), (forward, backward), counted the
# same way over moe.MoE (top-2, grouped kernel, nothing dropped): the same at any expert count
# (bench/calibrate/moe_host_ops.py's block: 315 ops at 4 and at 12 SwiGLU experts, the dense one 227)
OPS_MOE_EXTRA = (56, 32)
# Runs recorded while the layout sorted the rows and masked every choice (Training.moe_sorted_layout): the
# block's count then (360 ops).
OPS_MOE_EXTRA_SORTED = (91, 37)
# Runs recorded while each expert held its own parameters (Training.expert_tensors): the count at 4
# experts, and (E - OPS_MOE_EXPERTS) x (an expert's parameter tensors) gradient accumulations more for
# E local experts (that block: 376, 388, 412, 460 ops at 4, 8, 16, 32 experts), which ran outside a
# compiled graph (autograd's AccumulateGrad), so compiling kept them.
OPS_MOE_EXTRA_PER_EXPERT = (95, 48)
OPS_MOE_EXPERTS = 4
# The host's cost of one of those ops, in units of host_op_s (the dense host probe's cost per op, which
# never runs an MoE layer): the router's, the permutation's and the expert dispatch's ops carry more
# Python and index arithmetic each than a dense block's. Fitted on runs of the sorted layout, and for the
# current code scaled by the ratio measured on CPU (calibration/common.toml says on what).
MOE_HOST_OP_SHARE_SORTED = _COMMON["moe_host_op_share"]
MOE_HOST_OP_SHARE = MOE_HOST_OP_SHARE_SORTED * _COMMON["moe_running_count_op_share"]
# A split backward (ZB-H1's I, then W: parallel/pipeline/backward.py) issues this many ops more per
# block and micro-batch than one backward: its saved-tensor hook detaches every tensor the forward
# saves (saved.py), and I hands the gradients at the weight-side edges back through the engine.
# Counted with a TorchDispatchMode over the last stage's program of pp=2 x tp=2 at two depths
# (bench/calibrate/split_cost.py; tests/integration/test_bench_smoke.py counts it again on CPU): net of the
# sequence shards ZB-H1 does not re-gather (parallel/tensor.py keep_shard: 2 collectives a block fewer, each
# 4 ops since one unit's gather runs through flat views). None launches a kernel: the host alone pays,
# priced here at the average op (`python bench/calibrate/split_cost.py --layers 8 32` times the host's
# cost of them on one GPU; bench/README.md, "Calibration scripts"). The first stage
# does not split (no input gradient to send); every later one does, the last among them, which the host
# paces. MoE blocks (more saved tensors) and recomputed ones (fewer) are charged the same.
OPS_SPLIT_EXTRA = 71
# memory.fp8 (memory/fp8.py): aten ops one float8 linear adds per micro-batch, (forward, backward), by
# recipe: the dynamic casts of its input and weight (amax, scale, clamp, convert), of the output gradient and
# of the input again for the weight gradient, and the scaled GEMMs' layout copies. Where the step casts its
# tensorwise weights once for its micro-batches (weight_casts.casts_once) a linear issues
# OPS_FP8_LINEAR_CAST_ONCE a micro-batch and OPS_FP8_STEP_CAST a step. Counted with a TorchDispatchMode over
# teratrain's train step, bf16 against fp8 through torchao's emulation on CPU
# (tests/unit/test_planner_fp8.py counts them again); on one H200 the same steps added the same ops (bench/fp8.py
# aten_ops_per_step: 3,640 over 56 linears at one micro-batch; 2,800 over 28 at two, cast once, the step's
# casts one compiled call there), so the CPU count stands for the GPU's.
OPS_FP8_LINEAR = {"tensorwise": (21, 44), "rowwise": (27, 56)}
OPS_FP8_LINEAR_CAST_ONCE, OPS_FP8_STEP_CAST = (11.3, 35.7), 8
# The host's cost of one of those ops, in units of host_op_s: each passes through torchao's float8 tensor
# subclass and its Python casts (calibration/common.toml says what it was fitted on and what the CPU measures).
FP8_HOST_OP_SHARE = _COMMON["fp8_host_op_share"]
# HBM bytes per element the casts around one float8 linear move, counted from torchao's tensorwise path
# as eager runs it (a cast reads its input twice, for the amax and for the scaled copy, and writes one
# byte): the input, bf16, cast forward and again for the weight gradient (2 x (2 + 2 + 1)); the output
# gradient, bf16, once (2 + 2 + 1); the weight, from the parameters' width (2 x param + 1), forward and
# again for the input gradient; and the copy each operand gets into the layout torch._scaled_mm takes
# (1 + 1).
# torch.compile fuses some of these passes into the neighbouring kernels (not modelled).
FP8_CAST_INPUT_BYTES, FP8_CAST_GRAD_BYTES, FP8_LAYOUT_BYTES = 10, 5, 2
# Compiled rowwise casts of the activations and their gradients (inductor's kernels that fuse SwiGLU's
# backward and the norms with the row- and column-scaled casts of transposed operands) run those bytes at a
# rate of their own, the same on the H100 and the H200 (one die), not at HBM speed (calibration/common.toml).
FP8_ROWWISE_CAST_GBPS = _COMMON["fp8_rowwise_cast_gbps"]
# torch's fused AdamW: read p, g, m, v, write p, m, v (fp32); the norm reads g; the clip's scale, applied
# inside the kernel (optim/engine.py clip_), writes g back (a separate multiplication read and wrote it: 8).
# teratrain's kernel (optim/adamw_kernel.py) moves the 28 bytes at its own measured share of the bandwidth
# (calibration/common.toml adamw_kernel_share) and writes no gradient back; the norm's read stays.
OPTIMIZER_BYTES_PER_PARAM = 28 + 4 + 4
ADAMW_KERNEL_BYTES, ADAMW_KERNEL_SHARE, NORM_READ_BYTES = 28, _COMMON["adamw_kernel_share"], 4


# train.compile's constants of issued_ops, fused_s and the compiled loss_s (calibration/common.toml says what each
# scales and what it was counted or fitted on): kernels launched per eager op, HBM bytes per logit of the fused
# loss (x the compute width), HBM bytes per token, block and unit of d_model that fusion saves against eager.
COMPILED_OPS_SHARE = _COMMON["compiled_ops_share"]
COMPILED_LOSS_BYTES_PER_LOGIT = _COMMON["compiled_loss_bytes_per_logit"]
COMPILED_FUSED_BYTES = _COMMON["compiled_fused_bytes"]


@dataclass
class TimeBreakdown:
    compute_s: float
    ops_s: float
    optimizer_s: float
    comm_s: float
    comm_exposed_s: float
    bubble_s: float
    offload_s: float
    step_time_s: float
    tokens_per_s: float
    mfu: float
    model_flops_per_step: float  # per rank, without recomputation
    terms: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def host_paced(self) -> bool:
        """The host takes longer to issue the step than the GPU to run it (eager or compiled; never graphed)."""
        return self.terms.get("host_s", 0.0) > self.terms.get("gpu_s", 0.0) > 0


def model_flops(shape: ModelShape, tokens: float) -> float:
    """PaLM FLOPs for `tokens` tokens (no recomputation); MoE counts the active weights only: the
    router and the top_k experts a token visits (count_params' `matmul`)."""
    return flops_per_token(shape.cfg) * tokens


def fp8_terms(shape: ModelShape, train: Training, lay: Layout, gpu: GPU, tokens: float) -> tuple[float, float]:
    """memory.fp8 on one rank, for `tokens` tokens (one data-parallel replica's step): (the FLOPs of
    its float8 GEMMs, seconds of HBM traffic of their casts). Every local block linear that runs in
    float8 (weight_casts.fp8_linears) does 6 FLOPs per weight and token; pipeline stages split the
    blocks. The casts move FP8_CAST_* bytes per element of input (tokens x in), output gradient
    (tokens x out) and weight (each micro-batch, or once a step where the step casts once: casts_once), at
    the HBM rate; compiled under rowwise scales, the activations' at FP8_ROWWISE_CAST_GBPS."""
    if train.fp8 == "none" or shape.is_bare:
        return 0.0, 0.0
    if not gpu.peak_tflops.get("fp8"):
        from teratrain.config_base import ConfigError

        raise ConfigError(f"memory.fp8={train.fp8} needs float8 tensor cores, and the {gpu.name} has none; plan "
                          "another GPU (--gpu h100 or h200) or set memory.fp8=none.")
    layers = shape.cfg.n_layers / lay.pp
    param = train.widths(lay.zero, lay.offload).param
    m = lay.num_microbatches
    if casts_float8_once(train, lay):  # the step's cast serves every GEMM of the step
        weight = (2 * param + 1) + m * FP8_LAYOUT_BYTES
    else:
        weight = m * ((2 * param + 1) * 2 + FP8_LAYOUT_BYTES)
    flops = acts = weights = 0.0
    for rows, cols, share in fp8_linears(shape, lay.tp, lay.tp_form):  # (out, in) of the local weight
        flops += 6 * tokens * rows * cols * share
        acts += share * (tokens * cols * (FP8_CAST_INPUT_BYTES + FP8_LAYOUT_BYTES)
                         + tokens * rows * (FP8_CAST_GRAD_BYTES + FP8_LAYOUT_BYTES))
        weights += share * rows * cols * weight
    hbm = gpu.hbm_gbps * 1e9 * gpu.mem_efficiency
    rowwise = train.fp8 == "rowwise" and train.compiled  # the activations' casts, fused into inductor's kernels
    return layers * flops, layers * (acts / (FP8_ROWWISE_CAST_GBPS * 1e9 if rowwise else hbm) + weights / hbm)


def fp8_ops(shape: ModelShape, train: Training, lay: Layout) -> float:
    """The ops memory.fp8 adds to one rank's eager step (OPS_FP8_LINEAR per float8 linear and micro-batch, the
    forward's again where a recomputed segment replays it; cast once, OPS_FP8_LINEAR_CAST_ONCE and the step's
    casts). Compiled, none: inductor fuses each cast into a kernel or
    two, whose HBM traffic fp8_terms counts. Eager, the host issues each at FP8_HOST_OP_SHARE of a dense
    op's cost (host_s), which paces the step: FP8 is a setting for compiled runs (memory/fp8.py)."""
    if train.fp8 == "none" or shape.is_bare or train.compiled:
        return 0.0
    once = casts_float8_once(train, lay)
    fwd, bwd = OPS_FP8_LINEAR_CAST_ONCE if once else OPS_FP8_LINEAR[train.fp8]
    per = fwd + bwd + (fwd if lay.recompute in REPLAYING else 0)
    linears = sum(share for _, _, share in fp8_linears(shape, lay.tp, lay.tp_form))
    return rank_layers(shape, lay) * linears * (per * lay.num_microbatches + (OPS_FP8_STEP_CAST if once else 0))


def attention_flops(shape: ModelShape, tokens: float) -> float:
    """The attention core's share of the model FLOPs, 12*L*H*Q*T per token (PaLM appendix B)."""
    c = shape.cfg
    return 12 * c.n_layers * c.n_heads * c.head_width * c.seq_len * tokens


def head_flops(shape: ModelShape, tokens: float) -> float:
    """The LM head's share of the model FLOPs: forward and backward of the (d, V) matmul, 6*d*V per
    token (never recomputed: the policies replay blocks)."""
    return 6 * shape.cfg.d_model * shape.cfg.vocab_size * tokens


# HBM bytes the loss moves per logit (the last stage's (tokens, V/tp) logits), forward and backward,
# counted from the code. lm_loss (models/transformer.py) under autocast: the fp32 upcast (read 2,
# write 4), log_softmax (4 + 4), nll's dense fp32 gradient (4), log_softmax's backward (4 + 4 + 4) and
# the cast back (4 + 2): 36; in fp32 the casts go: 24. The vocab-parallel loss (parallel/tp_layers.py):
# the max (2), the shift into fp32 (2 + 4), exp in place (4 + 4), the sum (4), the division in place
# (4 + 4), the backward's scaled cast (4 + 2): 34; in fp32 the max reads 4 and the backward scales in
# place (4 + 4): 40. No FLOP count sees it: at Llama 3's 128k vocabulary and 16k tokens a micro-batch
# it is ~24 ms on an H200. Each kernel is counted as one pass; a softmax over rows that wide may read a
# row more than once, and under train.compile inductor fuses some passes (not modelled either way).
LOSS_BYTES_PER_LOGIT = {"lm_loss": 36, "lm_loss_fp32": 24, "vocab_parallel": 34, "vocab_parallel_fp32": 40}


def loss_s(shape: ModelShape, train: Training, lay: Layout, gpu: GPU, tokens: float) -> float:
    """Seconds of the memory-bound loss over one rank's logits for `tokens` tokens (its last stage)."""
    compute = train.widths(lay.zero, lay.offload).compute
    fp32 = "_fp32" if compute == 4 else ""
    per = LOSS_BYTES_PER_LOGIT[("vocab_parallel" if lay.tp > 1 else "lm_loss") + fp32]
    if train.compiled and lay.tp == 1:
        per = COMPILED_LOSS_BYTES_PER_LOGIT * compute
    return tokens * shape.cfg.vocab_size / lay.tp * per / (gpu.hbm_gbps * 1e9 * gpu.mem_efficiency)


def recompute_flops(shape: ModelShape, lay: Layout, tokens: float) -> float:
    """The extra forward recomputation adds: the blocks (2N_blocks + 4LHQT per token), or only the
    attention core for selective (4LHQT per token, Korthikanti et al. 2022, sec. 5), or no matrix
    product at all for selective-ops (it keeps every GEMM's and fused attention's output and replays
    only norms, casts and activations, memory-bound kernels whose FLOPs the 6N count leaves out);
    selective-ops-alternate replays the 2nd, 4th, ... of a block's products (replay.alternate_replayed)."""
    c = shape.cfg
    attn = attention_flops(shape, tokens) / 3
    if lay.recompute == "selective-ops-alternate":
        return 2 * c.n_layers * alternate_replayed(shape) * tokens
    if lay.recompute in ("none", "selective-ops"):
        return 0.0
    if lay.recompute == "selective":
        return attn
    blocks = shape.counts()["matmul"] - c.vocab_size * c.d_model
    return 2 * blocks * tokens + attn


def rank_flops(shape: ModelShape, lay: Layout, flops: float, attn: float) -> float:
    """One rank's share of `flops` of which `attn` are the attention core: pipeline stages split all,
    tensor parallelism the matmul weights, and the attention core only in the megatron form (the
    per-layer forms gather every head on every rank)."""
    split_attn = lay.tp if lay.tp_form == "megatron" else 1
    return ((flops - attn) / lay.tp + attn / split_attn) / lay.pp


def _mode(train: Training, lay: Layout) -> str:
    """Which OPS_PER_BLOCK column a layout's precision uses."""
    w = train.widths(lay.zero, lay.offload)
    return "fp32" if w.compute == 4 else ("autocast" if w.autocast_copies else "low")


def block_ops(shape: ModelShape, train: Training, lay: Layout) -> tuple[int, int]:
    """OPS_PER_BLOCK of this layout's precision, (forward, backward), as the run issues them."""
    mode = _mode(train, lay)
    fwd, bwd = OPS_PER_BLOCK[(shape.cfg.arch, mode)]
    bwd += silu_kept_ops(shape, train.silu_kept, "backward")
    if train.linear_casts and mode == "autocast":
        return fwd + LINEAR_CAST_OPS[shape.cfg.arch][0], bwd + LINEAR_CAST_OPS[shape.cfg.arch][1]
    return fwd, bwd


def eager_ops(shape: ModelShape, train: Training, lay: Layout, fp8: float | None = None) -> int:
    """Ops one rank issues per step: every block's forward and backward per micro-batch, the
    forward again when a segment is recomputed, what MoE layers add (`moe_ops`), the embedding/head/loss,
    the optimizer step's per-tensor work (gradient bookkeeping, the fused kernels' chunks) and memory.fp8's
    (`fp8`: this plan's `fp8_ops`, counted here where not given)."""
    fwd, bwd = block_ops(shape, train, lay)
    replay = fwd if lay.recompute in REPLAYING else 0
    layers = rank_layers(shape, lay)
    tensors = (len(shape.param_shapes()) + expert_tensors(shape, train)) // lay.pp
    fp8 = fp8_ops(shape, train, lay) if fp8 is None else fp8
    return round((layers * (fwd + replay + bwd) + OPS_OUTSIDE) * lay.num_microbatches + moe_ops(shape, train, lay)
                 + tensors + expert_grad_ops(shape, train, lay) + fp8
                 + replay_ops(shape, lay, _mode(train, lay), train.compiled, train.linear_casts, train.silu_kept))


def expert_grad_ops(shape: ModelShape, train: Training, lay: Layout) -> float:
    """Runs recorded with a parameter per expert (Training.expert_tensors): the gradient accumulations of
    one rank's experts beyond the OPS_MOE_EXPERTS that OPS_MOE_EXTRA_PER_EXPERT counts, a step: one op per
    expert parameter tensor per micro-batch (negative below that count). Stacked experts: none."""
    if shape.num_experts == 1 or not train.expert_tensors:
        return 0.0
    local = shape.num_experts // lay.ep
    return rank_layers(shape, lay) * shape.moe_share * _expert_leaves(shape) * (local - OPS_MOE_EXPERTS) \
        * lay.num_microbatches


def expert_tensors(shape: ModelShape, train: Training) -> int:
    """Runs recorded with a parameter per expert: the model's parameter tensors beyond the stacks
    ModelShape.param_shapes lists, every expert's (each stepped by the optimizer's op per tensor)."""
    if shape.num_experts == 1 or not train.expert_tensors:
        return 0
    return shape.routed_layers * _expert_leaves(shape) * (shape.num_experts - 1)


def _expert_leaves(shape: ModelShape) -> int:
    """Parameter tensors of one expert: its matrices, and their biases where the model has them."""
    return mlp_matrices(shape.cfg) * (2 if shape.cfg.use_bias else 1)


def issued_ops(shape: ModelShape, train: Training, lay: Layout, fp8: float | None = None) -> float:
    """Ops (kernels) one rank issues per step: eager_ops, or compiled, the model's share of them at
    COMPILED_OPS_SHARE (the optimizer step, one op per parameter tensor and its fused kernels, and the
    experts' gradient accumulations stay eager). `fp8`: this plan's `fp8_ops`, where the caller has it."""
    ops = eager_ops(shape, train, lay, fp8)
    if not train.compiled:
        return ops
    eager = (len(shape.param_shapes()) + expert_tensors(shape, train)) // lay.pp + expert_grad_ops(shape, train, lay)
    return (ops - eager) * COMPILED_OPS_SHARE + eager


def fused_s(shape: ModelShape, train: Training, lay: Layout, gpu: GPU, tokens: float) -> float:
    """Seconds of elementwise HBM traffic compiling saves one rank against eager (COMPILED_FUSED_BYTES per
    token, block and unit of width; sequence-parallel or tp-split activations divide by tp)."""
    if not train.compiled:
        return 0.0
    layers = rank_layers(shape, lay)
    hbm = gpu.hbm_gbps * 1e9 * gpu.mem_efficiency
    return COMPILED_FUSED_BYTES * tokens * layers * shape.cfg.d_model / lay.tp / hbm


def issued_collectives(shape: ModelShape, train: Training, lay: Layout) -> float:
    """Tensor- and expert-parallel collectives one rank issues per step, each with its autograd
    function and launch. An MoE layer's all-to-alls go through the same wrapper as tp's: each forward
    exchanges the counts, dispatches and combines (3; again when a recomputed segment replays it),
    each backward returns the two (parallel/expert.py). parallel.ep_overlap_chunks, which multiplies
    the dispatch and combine, is not modelled."""
    layers = rank_layers(shape, lay)
    n = tp_per_microbatch(shape, train, lay, None, layers, count=True)
    if shape.num_experts > 1 and lay.ep > 1:
        n += layers * shape.moe_share * (3 * (2 if lay.recompute in REPLAYING else 1) + 2)
    return lay.num_microbatches * n


# A data-parallel engine's launch (a bucket's all-reduce, a ZeRO group's reduce-scatter or gather: a
# gradient hook and an async collective, no autograd function) costs the host this share of what a
# tensor-parallel collective costs it (gpu.host_collective_s), where the host probe did not measure it
# (gpu.host_launch_s: the probe's ZeRO-3 row, bench/planner_rows.py). Fitted (calibration/common.toml).
DP_LAUNCH_SHARE = _COMMON["dp_launch_share"]


def engine_launches(shape: ModelShape, train: Training, lay: Layout) -> float:
    """Collectives the data-parallel engines launch per step on one rank, dense and expert
    parameters apart (comm.reduce_messages: their buckets or flat groups), as parallel/data.py and
    zero.py launch them (tests/dist/test_engine_launches.py counts them): ZeRO-0 reduces once a step;
    ZeRO-1 reduces once and gathers the updated shards once, ZeRO-2 reduces every micro-batch; ZeRO-3
    reduces every micro-batch and gathers each block's groups before its forward and its backward, the
    root's (embedding, final norm, head) once a micro-batch (held from forward to backward); under a
    pipeline it reduces and gathers once a step (comm.reduce_passes, gather_passes). ZeRO's clip sums the norm over
    the ranks' shards: one all-reduce."""
    if lay.replicas == 1 or shape.is_bare:
        return 0.0
    sp, gathered = stage_params(shape, lay), gather_passes(lay)
    total = 1.0 if lay.zero else 0.0
    for experts, n, ranks in ((False, sp["first"] - sp["experts"], lay.replicas),
                              (True, sp["experts"], lay.replicas // lay.ep)):
        if ranks > 1 and n > 0:
            reduces, gathers = reduce_messages(shape, train, lay, experts, n)
            total += reduces * reduce_passes(lay)
            if lay.zero == 3 and lay.pp == 1:  # the root's groups: once a micro-step, not twice
                units = [key for members, _, key in zero_groups(shape, train, lay, n)
                         if is_expert(members[0]) == experts]
                total += sum(gathered // 2 if key is None else gathered for key in units)
            elif lay.zero:
                total += gathers * gathered
    return total


def launch_s(gpu: GPU) -> float:
    """Host seconds of one data-parallel engine launch: measured (gpu.host_launch_s) or DP_LAUNCH_SHARE
    of a tensor-parallel collective's."""
    return gpu.host_launch_s if gpu.host_launch_s is not None else DP_LAUNCH_SHARE * gpu.host_collective_s


def host_s(shape: ModelShape, train: Training, lay: Layout, gpu: GPU, ops: float, fp8: float | None = None) -> float:
    """Seconds the host needs to issue one rank's step in eager mode: every op (`ops`, and a split
    backward's extra ones, `split_ops`; gpu.host_op_s each), every tensor- and expert-parallel
    collective `issued_collectives` counts (gpu.host_collective_s) and every launch of the data-parallel
    engines (`launch_s`), and the detaches of recomputed blocks (`replay_detaches`: no kernel, so not in
    `ops`, which the GPU's per-op overhead prices too). When the GPU's work per op is short (tensor
    parallelism splits every matmul) the GPU waits on it. An MoE layer's own ops (`moe_ops`) cost
    MOE_HOST_OP_SHARE of an op each, memory.fp8's (`fp8_ops`; `fp8`, where the caller has counted them)
    FP8_HOST_OP_SHARE. The host probe's rows
    (refit.fit_host) have no pipeline, no MoE layer and no float8: none of these ops."""
    fp8 = fp8_ops(shape, train, lay) if fp8 is None else fp8
    ops += (split_ops(shape, lay) + (moe_host_share(train) - 1) * moe_ops(shape, train, lay)
            + (FP8_HOST_OP_SHARE - 1) * fp8 + replay_detaches(shape, lay, train.compiled, train.silu_kept))
    return (ops * gpu.host_op_s + issued_collectives(shape, train, lay) * gpu.host_collective_s
            + engine_launches(shape, train, lay) * launch_s(gpu))


def moe_host_share(train: Training) -> float:
    """MOE_HOST_OP_SHARE, or for runs recorded with the sorted layout the share fitted on them."""
    return MOE_HOST_OP_SHARE_SORTED if train.moe_sorted_layout else MOE_HOST_OP_SHARE


def moe_ops(shape: ModelShape, train: Training, lay: Layout, forward_only: bool = False) -> float:
    """The ops of `eager_ops` that MoE layers add to one rank's step (OPS_MOE_EXTRA, the forward again
    where a recomputed segment replays it), or to its first forward pass only (`forward_only`)."""
    if shape.num_experts == 1:
        return 0.0
    fwd, bwd = OPS_MOE_EXTRA_PER_EXPERT if train.expert_tensors else \
        OPS_MOE_EXTRA_SORTED if train.moe_sorted_layout else OPS_MOE_EXTRA
    per_block = fwd if forward_only else fwd + (fwd if lay.recompute in REPLAYING else 0) + bwd
    return rank_layers(shape, lay) * shape.moe_share * per_block * lay.num_microbatches


def split_ops(shape: ModelShape, lay: Layout) -> float:
    """The host's ops beyond `eager_ops` on a stage whose backward is split (OPS_SPLIT_EXTRA)."""
    if not pipeline.splits_backward(lay):
        return 0.0
    return rank_layers(shape, lay) * OPS_SPLIT_EXTRA * lay.num_microbatches


def _offload_s(train: Training, lay: Layout, gpu: GPU, shard: int) -> float:
    """ZeroEngine with offload (memory/offload.py): the gradient shards (parallel.grad_dtype) down to
    pinned host memory, the CPU optimizer, the host's cast of the masters into the parameters' dtype,
    and those back up. The engine copies one group ahead of the CPU step, but on the H200 host the
    steps ran one after another (bench/planner_validate.py), so they add up. The cast was missing: the
    4 x H200 offload row measured 28% above the planner, and a CPU core casts at about twice its
    AdamW rate."""
    if lay.offload == "none":
        return 0.0
    pcie = gpu.pcie_gbps * 1e9
    # offload=params keeps the parameter shard on the host: no upload here (its gathers are zero_gather)
    up = shard * train.widths(lay.zero, lay.offload).param / pcie if lay.offload == "optimizer" else 0.0
    return shard * train.grad_bytes / pcie + shard / gpu.host_adam_params_per_s + shard / gpu.host_cast_rate() + up


def _compute(shape: ModelShape, train: Training, lay: Layout, gpu: GPU,
             tokens: float) -> tuple[float, float, float, float]:
    """(seconds of one rank's compute for `tokens` tokens, its model FLOPs, the FLOPs recomputation
    replays, the FLOPs of its float8 GEMMs): everything at the sustained rate of the width, the experts' extra
    at theirs, the float8 GEMMs at their speed-up over it and their casts' HBM traffic on top."""
    attn = attention_flops(shape, tokens)
    flops = rank_flops(shape, lay, model_flops(shape, tokens), attn)
    replay_attn = attn / 3 if lay.recompute not in ("none", *SELECTIVE_OPS) else 0.0
    replay = rank_flops(shape, lay, recompute_flops(shape, lay, tokens), replay_attn)
    moe = moe_flops(shape, tokens)  # the experts' share, at their own rate
    fp8_flops, cast_s = fp8_terms(shape, train, lay, gpu, tokens)
    rate = gpu.sustained_flops(train.precision, shape.cfg.d_model)
    speedup = getattr(gpu, f"fp8_speedup_{train.fp8}", 1.0)
    rest = flops - fp8_flops + replay + moe_extra_flops(lay, moe, gpu, expert_efficiency(shape, train, lay, gpu),
                                                        shared_flops(shape, tokens))
    compute_s = rest / rate + fp8_flops / (rate * speedup) + cast_s + expert_stack_s(shape, train, lay, gpu)
    return compute_s, flops, replay, fp8_flops


def optimizer_s(train: Training, w, shard: float, gpu: GPU, tensors: int = 0) -> float:
    """The optimizer step's HBM sweep over the `shard` parameters this rank steps (fp32 masters: their copy
    back to the parameters, 12 bytes more): torch's fused AdamW (and every other optimizer) at
    OPTIMIZER_BYTES_PER_PARAM and the fitted mem_efficiency, teratrain's AdamW kernel (a launch a group) at its
    own share. The runs recorded while the kernel was launched a tensor at a time (Training.adamw_per_tensor)
    took, where longer, the host's time to launch it on each of the `tensors` they stepped
    (gpu.host_optimizer_tensor_s: gpt2's 388 tensors on one H100, 24.7 ms against a 4.2 ms sweep)."""
    hbm = gpu.hbm_gbps * 1e9 * gpu.mem_efficiency
    masters = (12 if w.master else 0) / hbm
    if train.optimizer != "adamw" or train.torch_adamw:
        return shard * (OPTIMIZER_BYTES_PER_PARAM / hbm + masters)
    kernel = ADAMW_KERNEL_BYTES / (gpu.hbm_gbps * 1e9 * ADAMW_KERNEL_SHARE)
    launches = tensors * gpu.host_optimizer_tensor_s if train.adamw_per_tensor else 0.0
    return max(shard * (kernel + NORM_READ_BYTES / hbm + masters), launches)


def plan_time(shape: ModelShape, train: Training, lay: Layout, gpu: GPU, mem: MemoryBreakdown) -> TimeBreakdown:
    """Predicted time of one optimizer step of train.global_batch sequences under `lay`."""
    w = train.widths(lay.zero, lay.offload)
    shard = mem.terms["shard_params"]  # the parameters this rank's optimizer steps
    hbm = gpu.hbm_gbps * 1e9 * gpu.mem_efficiency
    tensors = stepped_tensors(shape, train, lay) if train.adamw_per_tensor else 0  # only their launches cost
    opt_s = 0.0 if lay.offload != "none" else optimizer_s(train, w, shard, gpu, tensors)
    offload_s = _offload_s(train, lay, gpu, shard)
    comm = step_comm(shape, train, lay, gpu) if lay.gpus > 1 else {}
    own = self_overlapped(shape, train, lay, gpu) if comm else {}  # each (seconds, exposed), computed once
    comm.update({k: total for k, (total, _) in own.items()})
    if shape.is_bare:  # no shape, no FLOPs: only the model-state traffic can be timed
        c_s = sum(comm.values())
        return TimeBreakdown(0.0, 0.0, opt_s, c_s, c_s, 0.0, offload_s, opt_s + offload_s + c_s, 0.0, 0.0, 0.0,
                             {"note": "bare parameter count: no compute term"})
    c = shape.cfg
    tokens = lay.tokens(c.seq_len) * lay.num_microbatches  # one rank's share of its replica's samples
    compute_s, flops, replay, fp8_flops = _compute(shape, train, lay, gpu, tokens)
    fp8 = fp8_ops(shape, train, lay)  # counted once: the ops, the host's time and the terms read it
    ops = issued_ops(shape, train, lay, fp8)
    ops_s = ops * gpu.op_overhead_s
    compute_s += replay_s(shape, w, lay, c.seq_len, hbm, train.compiled) - fused_s(shape, train, lay, gpu, tokens)
    loss = loss_s(shape, train, lay, gpu, tokens)  # on the last stage; spread over the stages like the head here
    busy = compute_s + ops_s + loss / lay.pp
    if lay.offload == "params":  # stage-3 shards come up over PCIe before each gather
        gathers = 1 if lay.pp > 1 else 2 * lay.num_microbatches
        comm["zero_gather"] = comm.get("zero_gather", 0.0) + gathers * shard * w.param / (gpu.pcie_gbps * 1e9)
    # Bucketed gradient reduces hide behind the last micro-batch's backward, ZeRO-3 gathers behind
    # all compute; both share the data-parallel links, so together they cannot hide more than `busy`.
    # parallel.overlap_comm=false waits for each reduction where it is launched: none hides (as
    # Megatron-LM's local DDP and DeepSpeed's pipeline engine reduce, after the last backward).
    dp_s, gather_s = comm.get("dp", 0.0), comm.get("zero_gather", 0.0)
    if train.overlap_comm:
        exposed = max(0.0, dp_s - busy * 2 / 3 / lay.num_microbatches, dp_s + gather_s - busy)
    else:
        exposed = dp_s + max(0.0, gather_s - busy)
    exposed += sum(comm.get(k, 0.0) for k in ("param_gather", "tp", "pp", "ep"))
    exposed += sum(part for _, part in own.values())  # what the attention or the dgrad GEMMs do not hide
    cp_exposed = own.get("cp", (0.0, 0.0))[1]
    # eager execution: the GPU runs what the host has issued, so a rank's step is the longer of the
    # two timelines (the host runs ahead where the GPU is the bottleneck, the GPU idles where it is
    # not). A pipeline's idle time is the GPU's, waiting for a neighbour's activations: the host goes
    # on issuing meanwhile, so a host-bound pipeline hides its bubble.
    # CUDA graphs (train.compile_mode=reduce-overhead) replay the step with one launch per graph: the
    # host issues nothing per op, and the GPU's timeline is the step (graphed tp on 2 and 4 H200s: the
    # planner 0.4-9.7% over it, tests/unit/test_planner_recorded.py). Their memory pools are not modelled.
    issue_s = 0.0 if train.graphed else host_s(shape, train, lay, gpu, ops, fp8)
    # ZB-H1's split backward costs the GPU nothing extra: I is one autograd call and W launches B's own
    # weight kernels (parallel/pipeline/backward.py; I + W measured at 1.02-1.19x B's GPU time per stage
    # on 4 x H200, bench/results/h200x4/2026-11-27_pipeline.json "zb_vs_1f1b"); its host pays more
    # (split_ops, in host_s)
    waits = _readback_s(shape, train, lay, gpu, busy)  # the GPU waits on the host
    critical = max(busy + exposed, issue_s) + waits
    bubble_s = head_s = 0.0
    if lay.pp > 1:  # rank_flops spread the head over the stages: it runs on the last one
        head_s = rank_flops(shape, lay, head_flops(shape, tokens), 0.0) * lay.pp / gpu.sustained_flops(
            train.precision, c.d_model) + loss
        even = busy - head_s / lay.pp + exposed + waits
        layers = pipeline.stage_split(shape, lay)  # uneven stages: the busiest one paces the step
        bubble_s = max(0.0, pipeline.makespan(lay, even, head_s, layers) - critical)
    step = critical + bubble_s + opt_s + offload_s
    global_tokens = train.global_batch * c.seq_len
    mfu = model_flops(shape, global_tokens) / step / (lay.gpus * gpu.peak_flops(train.precision))
    return TimeBreakdown(compute_s, ops_s, opt_s, sum(comm.values()), exposed, bubble_s, offload_s, step,
                         global_tokens / step, mfu, flops,
                         {"recompute_flops": replay, "fp8_flops": fp8_flops, "fp8_ops": fp8,
                          "host_s": issue_s, "gpu_s": busy + exposed, "loss_s": loss, "head_s": head_s,
                          "cp_exposed_s": cp_exposed, "optimizer_tensors": tensors,
                          **{f"comm_{k}_s": v for k, v in comm.items()}})


def _readback_s(shape: ModelShape, train: Training, lay: Layout, gpu: GPU, busy: float) -> float:
    """Dropless expert parallelism reads each MoE layer's counts back to the host in the forward
    (parallel/expert.py): the host waits for the GPU there and the GPU then waits for the host, so
    the forward loses the overlap of the two: the shorter of its host time and its GPU time (the
    forward is 1 of the 1 + backward_ratio parts of the compute)."""
    if shape.num_experts == 1 or lay.ep == 1 or shape.cfg.moe.capacity > 0:
        return 0.0
    fwd_ops = ((rank_layers(shape, lay) * block_ops(shape, train, lay)[0] + OPS_OUTSIDE) * lay.num_microbatches
               + moe_host_share(train) * moe_ops(shape, train, lay, forward_only=True))
    return min(fwd_ops * gpu.host_op_s, busy / (1 + pipeline.backward_ratio(lay)))
