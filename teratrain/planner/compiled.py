"""What a compiled step keeps for backward (train.compile): inductor's partition of the joint graph.

torch.compile traces a forward and its backward as one joint graph, and AOTAutograd's default partitioner
(torch._functorch.partitioners.min_cut_rematerialization_partition, the one inductor uses) chooses which
forward values cross to the backward: a minimum cut, in bytes, of the graph between the two. Three of its
rules decide what our blocks keep:
- an op that is not elementwise (a matmul, attention) is never recomputed, so its output is kept where
  the backward reads it: q, k, v, the attention's output and logsumexp, wo's and the MLP's matmul outputs;
- a tensor that a backward matmul reads (a linear's input, for its weight gradient) is kept, never rebuilt,
  since rebuilding it would cost as much HBM traffic as reading it: each norm's output in the compute
  dtype, once (the linears that read it share one cast; eager casts once per linear), SwiGLU's product;
- any other elementwise chain is recomputed in backward from what is kept where that is fewer bytes: the
  fp32 upcasts, RoPE's rotation, silu, the normalisation itself; a reduction's small output (the norms'
  statistics) is kept.
So a Llama block keeps, per token: its input (the residual stream, in the parameters' dtype) and two
fp32 statistics; two norm outputs; q, k, v, the attention output, one fp32 logsumexp per head; the
residual stream after attention (the whole model in one graph: the sum, in the parameters' dtype; each
block apart: wo's output, in the compute dtype, from which the sum is rebuilt); w1x, w3x and their
product. Against eager's count (activations.block_tensors) that keeps wo's output (2d) in place of the
second norm's fp32 input (4d): 16d + 4kv + 6f bytes per token of a bf16 block over fp32 weights (8f while
eager kept silu's output) become 14d + 4kv + 6f (+2d, the model scope's fp32 sum), with d the width, kv the
key/value width and f the MLP's. The autocast copies of the weights stay as in eager (a bf16 copy
is half the bytes of the fp32 weight the cut would otherwise keep), and so do the tensors the loss and
the embedding keep, except that the compiled loss keeps the logits in the compute dtype with two fp32
numbers per token (their maximum and log-sum-exp) where eager keeps an fp32 log-softmax.

Read off the partition, not derived alone: which of two equal-cost cuts the partitioner takes depends on
its heuristics (it weighs a tensor by its distance to the backward), and four choices are taken as
counted: under the model scope the first Llama block keeps wo's output (the others the sum), a top-1
MoE layer its experts' outputs on the laid-out rows (the others gathered back to the routed rows), one of the
two LayerNorms of a GPT-2 block recomputes its statistics, and GPT-2 keeps its position embeddings'
output. tests/unit/test_planner_compiled_memory.py counts every term with `saved_tensors_hooks` around
compiled models on CPU (torch 2.13), both flavours, both scopes, fp32, bf16 autocast and bf16 weights.

An MoE layer in place of the MLP (every layer routed, softmax top-k, nothing dropped, the experts on one rank,
bf16 autocast: `moe_counted`) runs its experts as grouped GEMMs over a buffer of the routed rows laid out by
expert (models/permute.py: M = tokens x top_k rows, each expert's from a multiple of
compat.GROUPED_MM_ROW_ALIGN, and one zero row). Its block keeps, beside the attention's: the buffer (the
norm's output gathered, in the compute dtype; the norm's own output is not kept, nor the router's fp32 input,
both recomputed), the experts' w2 outputs on the same rows (top-k > 1: the compiled combine reads each token's
k rows of them elementwise, models/permute.py, and backward reads them again), w1x, w3x and their product on
them; the router's probabilities, the top-k indices and gates; the layout (the permutation, each row's source,
the groups' int32 offsets; unnormalised gates laid out with a zero row) and the aux loss's load vector.
Sigmoid scores keep the scores again and the chosen ones' sum, the normalised gates a tensor more; shared
experts keep their input (the norm's output) and hidden tensors as a dense MLP does, and under a gate its
output and logit. Eager keeps silu's output too and the router's fp32 input (activations._moe_saved). Read on
CPU, the count planned a compiled MoE with sigmoid scores, bias balancing and a shared expert on one H200 (torch
2.11) before it ran: 32.05 GiB, measured 31.77 (tests/unit/test_planner_moe.py).

Float8 linears (memory.fp8, either recipe; `fp8_counted`): each linear's input is cast to float8 in forward and
again in backward, so the partition keeps neither the norms' outputs nor SwiGLU's product (rebuilt from the block's
input and statistics, and from w1x and w3x), and tensorwise keeps two fp32 scales a linear. Read on one H100 (torch
2.11) at llama-1b's width, 1 and 2 blocks, both scopes: every byte but the two int64 scalars cuDNN's attention keeps
a block (bench/results/h100/2026-12-06_fp8_saved_*.json).

Where the count applies (`scope`): dense blocks and those MoE layers, one rank per layer (no tensor,
context or expert parallelism), no dropout, float8 only as above, no recomputation but `selective`, no LoRA. Elsewhere a
compiled step is planned with eager's tensors, which is more than it keeps; under recomputation the blocks
so, and the loss as compiled (`compiled_loss`): on CPU that plans 2-4% above what a recomputed graph keeps
(tests/unit/test_planner_compiled_memory.py), on one H100 at llama-1b 1-8%.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from teratrain.compat import GROUPED_MM_ROW_ALIGN
from teratrain.config_schema import resolved_compile_scope
from teratrain.models.permute import laid_out_rows
from teratrain.planner.activations import INDEX_BYTES
from teratrain.planner.layout import Layout, ModelShape, Training, Widths
from teratrain.planner.weight_casts import fp8_linears, fp8_weights

STAT_BYTES = 4  # a norm's statistics and the loss's per-token numbers are fp32
CPU_RNG_STATE_BYTES = torch.get_rng_state().numel()  # what a checkpoint saves of the CPU generator (uint8)


def graph_scope(train: Training, lay: Layout) -> str | None:
    """How train.compile graphs the step of `lay`, whatever its blocks ("model": the whole forward in one
    graph, "block": each block apart, as a pipeline stage and ZeRO-3 compile them), or None (eager)."""
    if not train.compiled:
        return None
    if lay.pp > 1:  # a pipeline stage compiles its blocks (parallelize.compile_units)
        return "block"
    reduces = lay.replicas > 1 and train.reduces_in_backward
    return resolved_compile_scope(train.compile_scope, lay.zero, reduces, train.graphed, lay.recompute)


def scope(shape: ModelShape, train: Training, lay: Layout) -> str | None:
    """`graph_scope` where this module's count of the saved tensors applies, or None (eager, or a block
    this module does not describe: see the module docstring)."""
    if shape.is_bare or (shape.num_experts > 1 and not (moe_counted(shape, train.widths(lay.zero)) and lay.ep == 1)):
        return None
    recomputed = lay.recompute not in ("none", "selective")
    if lay.tp > 1 or lay.cp > 1 or recomputed or train.dropout > 0 or train.lora or not fp8_counted(shape, train, lay):
        return None
    return graph_scope(train, lay)


def fp8_counted(shape: ModelShape, train: Training, lay: Layout) -> bool:
    """No float8 linears, or float8 on every block linear of a dense Llama without recomputation: the blocks
    whose float8 partition `block_saved` gives (read off on one H100 and on CPU)."""
    return train.fp8 == "none" or (shape.cfg.arch == "llama" and shape.num_experts == 1 and lay.recompute == "none"
                                   and fp8_weights(shape)[1] == 0)


def moe_counted(shape: ModelShape, w: Widths) -> bool:
    """Is every block of this MoE model one whose compiled count `block_saved` gives: a Llama block whose MLP
    is routed in every layer by softmax top-k (softmax scores, normalised or not, or sigmoid scores
    normalised), an fp32 router, the aux loss (over the batch, each layer's own) or the bias balancing and no
    z-loss, no expert or token groups, nothing dropped, shared experts gated or not, bf16 autocast over fp32
    weights (read off the partition for these; elsewhere the eager count stands)?"""
    m = shape.cfg.moe
    return (shape.cfg.arch == "llama" and w.bf16 and w.autocast_copies and not w.expert_tensors
            and m.router == "softmax-topk" and (m.score == "softmax" or m.normalize_topk)
            and m.router_dtype == "fp32" and not m.z_loss_weight and m.aux_loss_kind == "batch"
            and m.aux_loss_convention == "ours" and m.num_groups == 1 and m.expert_groups == 1 and m.capacity == 0
            and m.every == 1 and m.first_dense_layers == 0 and not m.expert_dropout)


def gradients_at_once(train: Training, lay: Layout, made: int, buffered: bool) -> int:
    """Bytes of gradients the compiled whole-model backward holds beside those already kept, at its end:
    its one autograd node hands every parameter's gradient (`made` bytes, in the parameters' dtype) over
    at once (parallelize.compile_units), and only then does autograd add each into the gradient kept from
    the step's earlier micro-batches or into the engine's buffer (`buffered`), one by one. Where nothing
    is kept yet (the step's only micro-batch, autograd's own gradients) they become the kept ones. Eager,
    and each block in its own graph, hand over a parameter's or a block's gradient at a time: not counted
    (CUDA graphs: their pools are not modelled). On one H200 the Qwen3-30B-A3B-shaped MoE compiled at 2
    micro-batches peaks at 103.3 GiB where its states and step casts are 84.1: 18.8 GiB of fp32
    gradients at once (bench/results/h200/2026-12-03_moe_cast_once_qwen3_gb8.json). The weights whose cast
    carries their gradient so far (memory/step_casts.py) are counted too: that run's layers held those
    gradients beside the graph's sums to the step's end; the casts' nodes now hold them alone, and whether
    the compiled backward frees them before its end is not yet measured."""
    if graph_scope(train, lay) != "model" or train.graphed or (lay.num_microbatches == 1 and not buffered):
        return 0
    return made


def compiled_loss(shape: ModelShape, train: Training, lay: Layout, loss_pieces: int) -> bool:
    """Are the final norm and the whole-logits loss compiled too (any scope without a pipeline, whose
    stages compile only their blocks), so that the loss keeps the logits in the compute dtype? Recomputation
    changes only what the blocks keep: the loss is the same graph's with none (one H100, llama-1b compiled at
    micro-batch 4: full recomputation keeps 3.74 GB, its eager blocks and this loss 3.77)."""
    return scope(shape, train, replace(lay, recompute="none")) is not None and lay.pp == 1 and loss_pieces == 1


def block_saved(shape: ModelShape, w: Widths, tokens: int, seq_len: int, where: str,
                recompute: str = "none") -> dict[str, int]:
    """Bytes one compiled Block (dense, or an MoE layer `moe_counted`) keeps for backward for `tokens` = b*T
    tokens, per term, under scope `where` ("model" or "block"); the weights' autocast copies apart
    (weight_casts.weight_copies). `recompute="selective"`: the attention core is checkpointed, so the partition
    reruns it in backward from q, k and v and keeps neither its output nor its logsumexp."""
    c = shape.cfg
    n, d, cb = tokens, c.d_model, w.compute
    llama = c.arch == "llama"
    q, kv = c.n_heads * c.head_width, c.kv_heads * c.head_width
    # RMSNorm keeps rstd; LayerNorm mean and rstd, and one of a GPT-2 block's two recomputes them in one graph
    stats = 2 if llama else (4 if where == "block" else 2)
    out = {
        "block_input": n * d * w.param,  # the residual stream; the norm's fp32 upcast is recomputed
        "norm_statistics": stats * n * STAT_BYTES,
        "norm_outputs": 2 * n * d * cb,  # each norm's output, cast once for the linears that read it
        "q_k_v": n * (q + 2 * kv) * cb,  # after RoPE
        "attention_out": n * q * cb,  # SDPA's output; wo's input is a view of it
        "logsumexp": n * c.n_heads * STAT_BYTES,
        # the residual stream after attention: the sum itself in one graph, else wo's output (the sum rebuilt)
        "residual": n * d * (w.param if where == "model" else cb),
        "mlp_hidden": (3 if llama else 2) * n * c.ffn_dim * cb,  # SwiGLU: w1x, w3x, their product; GELU: w1x, gelu
    }
    if w.fp8 != "none":  # float8 linears (`fp8_counted`): each linear's float8 input is cast again in backward
        out["norm_outputs"] = 0  # from the block's input and the norms' statistics
        out["mlp_hidden"] = 2 * n * c.ffn_dim * cb  # w1x and w3x; their product is rebuilt from them
        # tensorwise: two fp32 scales a linear (one H100; the CPU's emulated GEMMs keep 7 or 15 a block)
        out["fp8_scales"] = 2 * len(fp8_linears(shape)) * STAT_BYTES if w.fp8 == "tensorwise" else 0
    if shape.num_experts > 1:  # the routed experts in place of the MLP (module docstring)
        out["norm_outputs"] = n * d * cb  # the attention's; the experts read the laid-out buffer
        out.update(_moe_saved(shape, w, n, llama, where))
    if llama and where == "block" and cb != 4:  # cos and sin cast once for q and k (one graph keeps the fp32 buffers)
        out["rope_casts"] = 2 * seq_len * c.head_width * cb
    if recompute == "selective":  # and its checkpoint keeps the CPU generator's state to rerun it with
        out["attention_out"] = out["logsumexp"] = 0
        out["rng_state"] = CPU_RNG_STATE_BYTES
    return out


def moe_rows(shape: ModelShape, n: int) -> int:
    """Rows of an MoE layer's laid-out buffer for n tokens (the grouped GEMM's row alignment)."""
    return laid_out_rows(n * shape.top_k, shape.num_experts, GROUPED_MM_ROW_ALIGN)


def _moe_saved(shape: ModelShape, w: Widths, n: int, llama: bool, where: str) -> dict[str, int]:
    """What a compiled MoE layer keeps for n tokens (module docstring), per term. The experts' outputs: on
    the laid-out rows; top-1 in one graph, gathered back to the M routed rows (all blocks but one,
    `outside_saved`'s "first_block")."""
    c, cb, moe = shape.cfg, w.compute, shape.cfg.moe
    e, m = shape.num_experts, n * shape.top_k
    rows = moe_rows(shape, n)
    router = n * e * STAT_BYTES + m * INDEX_BYTES  # the probabilities, the top-k indices
    router += m * STAT_BYTES if moe.normalize_topk else 0  # the gates, normalised
    router += n * (e + 1) * STAT_BYTES if moe.score == "sigmoid" else 0  # the scores again, the gates' sum
    gathered = where == "model" and shape.top_k == 1
    out = {"moe_rows": (rows + (m if gathered else rows)) * c.d_model * cb,  # the input, the outputs
           "mlp_hidden": (3 if llama else 2) * rows * c.expert_ffn_dim * cb,
           "router": router,
           # the permutation, each row's source, the offsets (every choice is sent: no mask) and, where the
           # gates are not normalised (no tensor of the router's holds them), the gates laid out with a zero row
           "moe_layout": m * INDEX_BYTES + rows * INDEX_BYTES + e * 4 + (0 if moe.normalize_topk else (m + 1) * cb),
           # the load vector; under bias balancing or at an aux weight of 0, a scalar more
           "aux_loss": e * STAT_BYTES + (STAT_BYTES if moe.balance == "bias" or not moe.aux_loss_weight else 0)}
    if moe.shared_experts:  # a dense MLP on every token: its input (the norm's output), its hidden tensors
        out["shared_experts"] = n * c.d_model * cb + 3 * n * c.shared_ffn_dim * cb
        if moe.shared_gate:  # sigmoid(x w_g) scales its output: the output, the gate's logit, w_g's bf16 copy
            out["shared_experts"] += n * c.d_model * cb + n * cb + c.d_model * cb
    return out


def outside_saved(shape: ModelShape, w: Widths, tokens: int, seq_len: int, where: str, *, first: bool = True,
                  last: bool = True) -> dict[str, int]:
    """Bytes kept outside the blocks of a compiled model whose final norm and whole-logits loss are compiled
    (`compiled_loss`): token ids, the choices `where` makes at the first block and the embeddings (module
    docstring) on the first stage; the final norm's input and statistics, the head's input, the logits in
    the compute dtype with two fp32 numbers per token and the loss's token count, and the targets on the last."""
    c = shape.cfg
    n, d, cb = tokens, c.d_model, w.compute
    llama = c.arch == "llama"
    out: dict[str, int] = {}
    if first:
        out["token_ids"] = n * INDEX_BYTES
        if not llama:
            out["position_ids"] = seq_len * INDEX_BYTES
            out["position_embeddings"] = seq_len * d * w.param if where == "model" else 0
        elif where == "model":  # the first block keeps wo's output where the others keep the sum
            out["first_block"] = -n * d * (w.param - cb)
        if where == "model" and shape.num_experts > 1 and shape.top_k == 1:  # one top-1 MoE layer its experts' rows
            out["first_block"] = out.get("first_block", 0) + (moe_rows(shape, n) - n * shape.top_k) * d * cb
    if last:
        out["final_norm"] = n * d * w.param + (1 if llama else 2) * n * STAT_BYTES
        out["head_input"] = n * d * cb
        out["log_softmax"] = n * c.vocab_size * cb + 2 * n * STAT_BYTES + STAT_BYTES  # the logits, max, lse, count
        out["targets"] = n * INDEX_BYTES
    return out


def loss_buffers(shape: ModelShape, w: Widths, tokens: int) -> tuple[int, int]:
    """(forward, backward) bytes the compiled whole-logits loss makes beyond what it keeps: nothing in
    forward (the logits it keeps are its input; the log-sum-exp is one fused pass), the logits' gradient
    in the compute dtype in backward (one fused pass over the kept logits: no fp32 copy)."""
    return 0, tokens * shape.cfg.vocab_size * w.compute
