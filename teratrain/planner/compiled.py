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
second norm's fp32 input (4d) and drops silu's output: 16d + 4kv + 8f bytes per token of a bf16 block
over fp32 weights become 14d + 4kv + 6f (+2d, the model scope's fp32 sum), with d the width, kv the
key/value width and f the MLP's. The autocast copies of the weights stay as in eager (a bf16 copy
is half the bytes of the fp32 weight the cut would otherwise keep), and so do the tensors the loss and
the embedding keep, except that the compiled loss keeps the logits in the compute dtype with two fp32
numbers per token (their maximum and log-sum-exp) where eager keeps an fp32 log-softmax.

Read off the partition, not derived alone: which of two equal-cost cuts the partitioner takes depends on
its heuristics (it weighs a tensor by its distance to the backward), and three choices are taken as
counted: under the model scope the first Llama block keeps wo's output (the others the sum), one of the
two LayerNorms of a GPT-2 block recomputes its statistics, and GPT-2 keeps its position embeddings'
output. tests/unit/test_planner_compiled_memory.py counts every term with `saved_tensors_hooks` around
compiled models on CPU (torch 2.13), both flavours, both scopes, fp32, bf16 autocast and bf16 weights.

Where the count applies (`scope`): dense blocks, one rank per layer (no tensor or context parallelism),
no dropout, no float8 linears, no recomputation, no LoRA. Elsewhere a compiled step is planned with eager's
tensors, which is more than it keeps.
"""

from __future__ import annotations

from teratrain.config_schema import resolved_compile_scope
from teratrain.planner.activations import INDEX_BYTES
from teratrain.planner.layout import Layout, ModelShape, Training, Widths

STAT_BYTES = 4  # a norm's statistics and the loss's per-token numbers are fp32


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
    if shape.is_bare or shape.num_experts > 1:
        return None
    if lay.tp > 1 or lay.cp > 1 or lay.recompute != "none" or train.dropout > 0 or train.fp8 != "none" or train.lora:
        return None
    return graph_scope(train, lay)


def gradients_at_once(train: Training, lay: Layout, made: int, buffered: bool) -> int:
    """Bytes of gradients the compiled whole-model backward holds beside those already kept, at its end:
    its one autograd node hands every parameter's gradient (`made` bytes, in the parameters' dtype) over
    at once (parallelize.compile_units), and only then does autograd add each into the gradient kept from
    the step's earlier micro-batches or into the engine's buffer (`buffered`), one by one. Where nothing
    is kept yet (the step's only micro-batch, autograd's own gradients) they become the kept ones. Eager,
    and each block in its own graph, hand over a parameter's or a block's gradient at a time: not counted
    (CUDA graphs: their pools are not modelled). On one H200 the Qwen3-30B-A3B-shaped MoE compiled at 2
    micro-batches peaks at 103.3 GiB where its states and step casts are 84.1: 18.8 GiB of fp32
    gradients at once (bench/results/h200/2026-12-03_moe_cast_once_qwen3_gb8.json)."""
    if graph_scope(train, lay) != "model" or train.graphed or (lay.num_microbatches == 1 and not buffered):
        return 0
    return made


def compiled_loss(shape: ModelShape, train: Training, lay: Layout, loss_pieces: int) -> bool:
    """Are the final norm and the whole-logits loss compiled too (any scope without a pipeline, whose
    stages compile only their blocks), so that the loss keeps the logits in the compute dtype?"""
    return scope(shape, train, lay) is not None and lay.pp == 1 and loss_pieces == 1


def block_saved(shape: ModelShape, w: Widths, tokens: int, seq_len: int, where: str) -> dict[str, int]:
    """Bytes one compiled dense Block keeps for backward for `tokens` = b*T tokens, per term, under scope
    `where` ("model" or "block"); the weights' autocast copies apart (activations.weight_copies)."""
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
    if llama and where == "block" and cb != 4:  # cos and sin cast once for q and k (one graph keeps the fp32 buffers)
        out["rope_casts"] = 2 * seq_len * c.head_width * cb
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
