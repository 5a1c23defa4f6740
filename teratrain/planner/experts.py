"""The routed experts' terms of one rank's step time (planner/time.py adds them up): their FLOPs, the rate
their grouped GEMMs run at against the dense one, and the HBM traffic of their weight stacks' casts and
gradients beyond what the FLOPs pay for."""

from __future__ import annotations

from teratrain.planner.weight_casts import carries_grads, casts_once
from teratrain.planner.hardware import GPU
from teratrain.planner.layout import Layout, ModelShape, Training
from teratrain.planner.states import rank_layers


def expert_efficiency(shape: ModelShape, train: Training, lay: Layout, gpu: GPU) -> float:
    """The experts' rate as a share of the dense rate: the grouped GEMM's own rate, w / (w + gpu.grouped_half_work)
    for w = an expert's rows (a micro-batch's tokens x top_k over the experts, which expert parallelism gathers
    from its ep ranks) times its width (bench/calibrate/grouped_gemm.py), wherever the permutations around it are
    priced with the rest of the step: compiled (fused into few kernels), and eager where the experts are stacked,
    nothing is dropped and nothing exchanged (each permutation an op of `issued_ops`). Other eager steps (a
    capacity, expert parallelism, each expert its own parameters) keep gpu.moe_efficiency, fitted on eager 4-GPU
    steps with a capacity, whose masks and exchanges it stands for. Compiled, gated experts whose stacks are cast
    (not held in the compute dtype, nor frozen in bf16 under LoRA) run w1 and w3 as one GEMM of twice the width
    (models/grouped.py fuses_gate_up): two thirds of the FLOPs at that GEMM's rate; eager runs them apart."""
    c = shape.cfg
    if shape.num_experts == 1 or not train.compiled and (lay.ep > 1 or c.moe.capacity > 0 or train.expert_tensors):
        return gpu.moe_efficiency
    widths = train.widths(lay.zero, lay.offload)
    work = lay.tokens(c.seq_len) * shape.top_k * lay.ep / shape.num_experts * c.expert_ffn_dim / expert_tp(lay)
    rate = lambda w: w / (w + gpu.grouped_half_work)  # noqa: E731
    cast = widths.param != widths.compute and train.frozen_width == 4  # a bf16 LoRA base is read as it is
    if train.compiled and c.arch == "llama" and cast and not train.gate_up_apart:
        return 1 / (2 / 3 / rate(2 * work) + 1 / 3 / rate(work))
    return rate(work)


def moe_extra_flops(lay: Layout, moe: float, gpu: GPU, efficiency: float | None = None, shared: float = 0.0) -> float:
    """What one rank's MoE layers cost beyond their experts' FLOPs at the dense rate, as FLOPs at that
    rate: the experts run at `efficiency` of it (`expert_efficiency`; gpu.moe_efficiency by default).
    Pipeline stages split it. Tensor parallelism does not: in the megatron form every tp rank routes
    and permutes all of its tokens (parallel/tensor.py, the MoE region) and only the experts' weights
    are split; the per-layer forms keep MoE layers whole on every tp rank, FLOPs too (the routed experts'
    `moe` and the shared experts' `shared`), so rank_flops' division by tp is taken back (divided by tp,
    this term plans the recorded MoE rows with tp up to 28% fast)."""
    whole = moe / lay.pp
    extra = whole * (1 / (gpu.moe_efficiency if efficiency is None else efficiency) - 1)
    if lay.tp_form != "megatron":
        extra += (whole + shared / lay.pp) * (1 - 1 / lay.tp)
    return extra


def shared_flops(shape: ModelShape, tokens: float) -> float:
    """The shared experts' FLOPs of the model FLOPs: one MLP of their width on every token of every MoE
    layer, forward and backward, at the dense rate."""
    c = shape.cfg
    if shape.num_experts == 1 or not c.moe.shared_experts:
        return 0.0
    return 6 * tokens * c.n_layers * shape.moe_share * mlp_matrices(c) * c.d_model * c.shared_ffn_dim

def moe_flops(shape: ModelShape, tokens: float) -> float:
    """The MoE layers' expert FLOPs of the model FLOPs: each token's top_k routed expert MLPs (of
    model.moe.expert_d_ff), forward and backward (6 per weight), in every MoE layer. The shared
    experts are a dense MLP, at the dense rate."""
    if shape.num_experts == 1:
        return 0.0
    return 6 * tokens * shape.cfg.n_layers * shape.moe_share * shape.top_k * expert_weights(shape.cfg)

def mlp_matrices(c) -> int:
    """Weight matrices of one MLP (an expert's): SwiGLU's w1, w3, w2; GELU's w1, w2."""
    return 3 if c.arch == "llama" else 2

def expert_tp(lay: Layout) -> int:
    """The ways tensor parallelism splits each expert: tp in the megatron form, none in the per-layer
    forms, which keep MoE layers whole."""
    return lay.tp if lay.tp_form == "megatron" else 1

def expert_weights(c, tp: int = 1) -> int:
    """Weight elements of one routed expert, its matrices split `tp` ways."""
    return mlp_matrices(c) * c.d_model * c.expert_ffn_dim // tp

def expert_stack_s(shape: ModelShape, train: Training, lay: Layout, gpu: GPU) -> float:
    """Seconds of HBM traffic one rank's experts move per step beyond what their FLOPs pay for: each MoE layer casts its
    local experts' weight stacks to the compute dtype (read the parameter, write the copy: models/grouped.py
    cast_stacks; none where the parameters are in it, but in runs recorded while each expert was its own
    parameter, stacked) every micro-batch, or once a step (casts_once); every micro-batch casts their gradient
    back (read, write) and, after the first, adds it to the accumulated one (read both, write); cast once a step
    where the gradients are autograd's own (one GPU, no ZeRO; on several the engines' buffers may hold them as
    views: not measured there), the cast's backward adds the compute-width gradient to the accumulated one in the
    same pass (read both, write: memory/step_casts.py take_grads). The fitted rates price that traffic for the
    top_k experts a token runs (a dense MLP's weights, cast by autocast, move as much per FLOP), so only the
    local experts beyond top_k are charged: nothing where a rank holds top_k of them, most of the step for many
    fine-grained experts (128 of width 768, top-8)."""
    if shape.num_experts == 1:
        return 0.0
    c, w = shape.cfg, train.widths(lay.zero, lay.offload)
    idle = max(0, shape.num_experts // lay.ep - shape.top_k) * expert_weights(c, expert_tp(lay)) \
        * rank_layers(shape, lay) * shape.moe_share
    m = lay.num_microbatches
    copy = w.param + w.compute if w.param != w.compute or w.expert_tensors else 0
    copies = copy if casts_once(train, lay) else m * copy
    back = w.compute + w.grad if w.compute != w.grad else 0
    fused = back and carries_grads(train, lay)
    later = w.compute + 2 * w.grad if fused else back + 3 * w.grad  # each micro-batch after the first
    return idle * (copies + back + (m - 1) * later) / (gpu.hbm_gbps * 1e9 * gpu.mem_efficiency)
