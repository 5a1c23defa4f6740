"""The weights a step holds beside its activations: autocast's bf16 copies of each block's weights
(`weight_copies`), the float8 linears and their weights (memory/fp8.py: `fp8_linears`, `fp8_weights`), and what
a step that casts its weights once for all micro-batches keeps (memory/step_casts.py: `casts_once`,
`step_cast_bytes`, `carried_grad_bytes`). planner/activations.py counts the activations beside them.
"""

from __future__ import annotations

from teratrain.memory import step_casts
from teratrain.planner.layout import Layout, ModelShape, Training, Widths


def block_matrices(shape: ModelShape, tp: int = 1, form: str = "megatron") -> list[tuple[int, int, float]]:
    """(rows, columns, share of the blocks) of each attention, dense-MLP and shared-expert weight of one block
    on a rank: megatron tensor parallelism splits q/k/v and w1/w3 by rows, wo and w2 by columns (key/value
    heads fewer than tp are replicated, as parallel/tp_plan.py places them); MoE layers (moe_share of the
    blocks) have no dense MLP, and their shared experts, one MLP of model.moe's shared width that every token
    passes, split as the dense MLP is in the megatron form (the per-layer tp forms keep MoE layers whole,
    parallel/tensor.py)."""
    c = shape.cfg
    d, q, kv = c.d_model, c.n_heads * c.head_width // tp, max(1, c.kv_heads // tp) * c.head_width
    moe = shape.num_experts > 1
    dense = 1 - shape.moe_share if moe else 1.0
    shared = shape.moe_share if moe and c.shared_ffn_dim else 0.0
    attn = [(q, d, 1.0), (kv, d, 1.0), (kv, d, 1.0), (d, q, 1.0)]  # key/value heads fewer than tp: one whole a rank

    def mlp(width: int, share: float, t: int) -> list[tuple[int, int, float]]:  # w1 (w3) by rows, w2 by columns
        return [(width // t, d, share)] * (2 if c.arch == "llama" else 1) + [(d, width // t, share)]

    out = attn + mlp(c.ffn_dim, dense, tp) + mlp(c.shared_ffn_dim, shared, tp if form == "megatron" else 1)
    return [(r, k, share) for r, k, share in out if share]


def fp8_linears(shape: ModelShape, tp: int = 1, form: str = "megatron") -> list[tuple[int, int, float]]:
    """The `block_matrices` that run in float8 under memory.fp8 (memory/fp8.py apply_fp8): those whose local
    weight has both dimensions multiples of 16. The routers, the shared experts' gate and the routed experts
    keep bf16. The shared experts' FLOPs are a dense MLP's (planner/experts.py moe_flops leaves them out of the
    experts'), so time.py `fp8_terms` moves them to the float8 rate by the same rule."""
    from teratrain.memory.fp8 import aligned

    return [(r, k, share) for r, k, share in block_matrices(shape, tp, form) if aligned((r, k))]


def fp8_weights(shape: ModelShape, tp: int = 1, form: str = "megatron") -> tuple[int, int]:
    """(elements in float8, elements not) of one mean block's `block_matrices` on a rank under memory.fp8."""
    total = sum(r * k * share for r, k, share in block_matrices(shape, tp, form))
    fp8 = sum(r * k * share for r, k, share in fp8_linears(shape, tp, form))
    return int(fp8), int(total - fp8)


def casts_once(train: Training, lay: Layout) -> bool:
    """Does the step cast its float8 weights (tensorwise) and its experts' weight stacks once for all its
    micro-batches (memory/step_casts.py `applies`; not under memory.cast_once=false nor in the runs recorded
    before: Training.casts_per_micro_batch)?"""
    return (lay.num_microbatches > 1 and not train.casts_per_micro_batch
            and step_casts.applies(lay.zero, lay.pp, "allreduce"))


def casts_float8_once(train: Training, lay: Layout) -> bool:
    """Does the step cast its float8 weights once for its micro-batches (tensorwise only: rowwise casts each
    weight two ways, memory/step_casts.py)?"""
    return train.fp8 == "tensorwise" and casts_once(train, lay)


def carries_grads(train: Training, lay: Layout) -> bool:
    """Does the backward of each weight cast once a step (`casts_once`) add the gradient so far into the one it
    makes (memory/step_casts.py take_grads)? Where the gradients are autograd's own: one GPU, no ZeRO (on several
    the engines' buffers may hold them as views), not under CUDA graphs (the graph's gradients are added into
    the engine's buffers), not in the runs recorded before (Training.grads_after_casts)."""
    return (casts_once(train, lay) and lay.gpus == 1 and lay.zero == 0 and not train.graphed
            and not train.grads_after_casts)


def _cast_once(shape: ModelShape, w: Widths, tp: int, ep: int, form: str, device: str) -> tuple[int, int]:
    """Elements a block's step casts once (`casts_once`): its float8 weights (tensorwise), and its expert
    weight stacks held wider than the compute dtype."""
    float8 = fp8_weights(shape, tp, form)[0] if w.fp8 == "tensorwise" else 0
    stacks = shape.num_experts > 1 and w.autocast_copies
    experts = _expert_copies(shape, w, ep, form, device, tp) // w.compute if stacks else 0
    return float8, experts


def step_cast_bytes(shape: ModelShape, w: Widths, layers: int, tp: int = 1, ep: int = 1, form: str = "megatron",
                    device: str = "cuda") -> int:
    """What a step that casts once (`casts_once`) holds from its first forward to its last backward in
    `layers` blocks: each float8 weight in 1 byte (tensorwise), each expert weight stack held wider than
    the compute dtype in it (the copies `weight_copies` then leaves out)."""
    float8, experts = _cast_once(shape, w, tp, ep, form, device)
    return layers * (float8 + experts * w.compute)


def carried_grad_bytes(shape: ModelShape, w: Widths, layers: int, tp: int = 1, ep: int = 1, form: str = "megatron",
                       device: str = "cuda") -> int:
    """The gradients of the weights `step_cast_bytes` casts once, in the gradient's width: those its casts'
    backward carries from micro-batch to micro-batch (memory/step_casts.py take_grads)."""
    return layers * sum(_cast_once(shape, w, tp, ep, form, device)) * w.grad


def weight_copies(shape: ModelShape, w: Widths, tp: int = 1, ep: int = 1, form: str = "megatron",
                  device: str = "cuda", once: bool = False) -> int:
    """bf16 copies of one block's weight matrices that autocast makes (fp32 params) and autograd
    holds until that block's backward. Biases are cast too but not saved. For MoE (a mean block),
    every local expert (num_experts / ep) is assumed to receive tokens; the per-layer tp forms keep
    MoE layers whole. The experts' grouped GEMM (models/grouped.py: bf16 on a GPU) takes each stack of
    the local experts' weights cast to the compute dtype, saved for backward (runs recorded while each
    expert was its own parameter stacked them: a copy also where autocast makes none, bf16 parameters).
    `once`: the step casts the stacks once for all micro-batches (`casts_once`; `step_cast_bytes` holds them)."""
    c = shape.cfg
    d = c.d_model
    # once, the stacks' copies are the step's (step_cast_bytes), not a block's
    experts = 0 if once or shape.num_experts == 1 else _expert_copies(shape, w, ep, form, device, tp)
    # the shared experts' gate (d -> 1, whole on every tp rank, bf16 under memory.fp8 too)
    gate = int(shape.moe_share * d * w.compute) if c.moe.shared_experts and c.moe.shared_gate else 0
    # an fp32 router over narrower parameters multiplies by its weight cast up, a copy autograd keeps
    router = int(shape.moe_share * d * shape.num_experts * 4) if c.moe.router_dtype == "fp32" and w.param < 4 \
        and shape.num_experts > 1 else 0
    if not w.autocast_copies:
        return router + experts
    # attention, dense MLP and shared experts as a rank holds them; a float8 linear saves the weight itself:
    # no copy (memory/fp8.py Fp8Gemm)
    copied = fp8_weights(shape, tp, form)[1] if w.fp8 != "none" else sum(
        r * k * share for r, k, share in block_matrices(shape, tp, form))
    return int(copied * w.compute) + gate + router + experts


def _expert_copies(shape: ModelShape, w: Widths, ep: int, form: str, device: str, tp: int) -> int:
    """weight_copies' experts: their (experts, out, in) operands of the grouped GEMM in the compute dtype,
    a copy where the parameters are wider (and, Widths.expert_tensors, on a GPU also where not)."""
    c = shape.cfg
    mlp = (3 if c.arch == "llama" else 2) * c.d_model * c.expert_ffn_dim  # one expert's weights
    experts = (max(1, shape.num_experts // ep) - 1) * shape.moe_share * mlp  # beyond one MLP's worth
    mlp_tp = tp if form == "megatron" else 1
    stacked = int((shape.moe_share * mlp + experts) * w.compute) // mlp_tp
    if not w.autocast_copies:
        return stacked if device == "cuda" and w.bf16 and w.expert_tensors else 0
    return stacked
