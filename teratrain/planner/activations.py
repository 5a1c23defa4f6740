"""Activation bytes: the tensors our `Block` (models/layers.py) saves for backward, one term each.

Not a generic formula: every coefficient below was read off the autograd graph of our model
(`torch.autograd.graph.saved_tensors_hooks`, shared storages counted once) and is checked against
that count in tests/unit/test_planner_activations.py for every recompute policy, both flavours,
fp32 and bf16. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", sec. 4) is the template: per layer, sum the saved tensors, divide what tensor/sequence
parallelism shards. Differences from their 34*s*b*h + 5*a*s^2*b count, all from our code:
- attention runs through `scaled_dot_product_attention` (flash/cuDNN on GPU, flash on CPU): it keeps
  q, k, v, the output and a logsumexp (fp32, one per head and token), never the T x T scores;
- RMSNorm/LayerNorm run in the residual stream's dtype and keep their input and fp32 statistics: bf16
  under bf16 parameters, as Megatron-LM's fused norms (CUDA autocast would run layer_norm on an fp32
  copy; models/layers.py turns it off there);
- with fp32 parameters under autocast, the attention and the MLP cast the norm output once for
  their projections (wq/wk/wv, w1/w3 share one bf16 copy; a linear on its own would cast its own),
  and every weight is cast to bf16 and held until its backward (`weight_copies`); under megatron
  tensor parallelism the region entry casts once, before its collective; with sequence
  parallelism they keep only this rank's shard of it and gather it again in backward, as Megatron-LM
  does (parallel/comm.py Regather), so it is divided by tp;
- SwiGLU keeps w1x, w3x and their product (3 x d_ff per token; models/swiglu_kernel.py silu_mul makes
  silu(w1x) again in backward; 4 in an MoE's experts and in runs recorded before: Widths.silu_kept).
`device` selects the two kernels that differ: CPU's composite rms_norm keeps fp32 upcasts of its input
and x*rstd, and CPU's layer_norm keeps its statistics in the input's dtype. The GPU numbers assume
dropout inside attention is fused (flash/cuDNN keep only an RNG seed); CPU runs with dropout > 0 take
the math path (T x T kept), which this module does not describe.

Each term is a list of saved tensors (`Saved`: elements, bytes per element, kind), so activation
compression (memory/compression.py, `compress`) can be priced per tensor as it encodes them: under
int8/fp8 a differentiable activation inside the blocks takes 1 byte per element plus a 4-byte scale
per 128 (whole blocks); under every mode a dropout mask takes 1 bit per element (+ the CPU float
mask's one value); statistics, casts of weights, buffers and index tensors are kept as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from teratrain.config_schema import SELECTIVE_OPS
from teratrain.memory.compression import BLOCK
from teratrain.memory.recompute import segment_size
from teratrain.models.chunked_loss import auto_chunks, padded_vocab
from teratrain.models.routers import ROUTERS, sends_every_choice
from teratrain.parallel.pipeline.stage import grad_in_i
from teratrain.planner.layout import ModelShape, Widths, ceil_div
from teratrain.planner.weight_casts import weight_copies

INDEX_BYTES = 8  # token ids and targets are int64


@dataclass(frozen=True)
class Saved:
    """One tensor autograd keeps: `kind` act (a differentiable activation: 8-bit under int8/fp8 inside
    the blocks), mask (a dropout mask: 1 bit under any compression), keep (never encoded), param (a
    cast copy of a replicated parameter: never encoded, never split over tp ranks)."""

    numel: int
    itemsize: int
    kind: str = "act"

    def held(self, compress: str, in_blocks: bool, device: str) -> int:
        """Bytes held for backward under `compress` (memory/compression.py's encodings)."""
        if compress == "none" or self.numel < BLOCK or self.kind in ("keep", "param"):
            return self.numel * self.itemsize
        if self.kind == "mask":  # CPU masks are floats {0, c}: the bits plus c
            return ceil_div(self.numel, 8) + (self.itemsize if device == "cpu" else 0)
        if compress in ("int8", "fp8") and in_blocks:
            blocks = ceil_div(self.numel, BLOCK)
            return blocks * BLOCK + blocks * 4  # 1-byte codes, padded to whole blocks, + fp32 scales
        return self.numel * self.itemsize


def _held(terms: dict[str, list[Saved]], compress: str, in_blocks: bool, device: str) -> dict[str, int]:
    return {k: sum(t.held(compress, in_blocks, device) for t in v) for k, v in terms.items()}


def _norm_saved(shape: ModelShape, w: Widths, n: int, device: str) -> list[Saved]:
    """What one pre-norm keeps for backward, for n tokens: the norm runs in the residual stream's dtype,
    the parameters' (models/layers.py)."""
    c = shape.cfg
    d = c.d_model
    if c.arch == "llama":
        return _rms_saved(w, n * d, n, d, device, w.param)
    # LayerNorm: native_layer_norm keeps its input, mean and rstd (fp32 on CUDA, the input's dtype on CPU)
    if w.norms_fp32 and w.param == 2 and device == "cuda":  # CUDA autocast's fp32 copies of x and the weights
        return [Saved(n * d, 4), Saved(n, 4, "keep"), Saved(n, 4, "keep")] + [Saved(d, 4, "param")] * (
            2 if c.use_bias else 1)
    stats = 4 if device == "cuda" else w.param
    return [Saved(n * d, w.param), Saved(n, stats, "keep"), Saved(n, stats, "keep")]


def _rms_saved(w: Widths, numel: int, rows: int, width: int, device: str, x: int) -> list[Saved]:
    """What one RMSNorm (models/layers.py) keeps for backward: its input of `numel` numbers at `x` bytes,
    normalised over `rows` rows of `width`. Where x is in the weight's dtype CUDA's fused kernel keeps x
    itself, else the x.float() copy; the CPU's composite kernel keeps fp32 upcasts either way."""
    upcast = x != w.param or w.norms_fp32
    copy = [Saved(width, 4, "param")] if upcast and w.param == 2 else []  # weight.float()
    if device == "cpu":  # the fp32 input, rstd, and x * rstd for the weight gradient
        return [Saved(numel, 4), Saved(rows, 4), Saved(numel, 4)] + copy
    return [Saved(numel, 4 if upcast else x), Saved(rows, 4)] + copy


def _qk_norm_saved(shape: ModelShape, w: Widths, n: int, device: str, tp: int) -> list[Saved]:
    """What model.qk_norm's RMSNorms of q and k keep for n tokens: per head (Qwen3) or over the whole
    width (OLMoE), of this rank's heads (key/value heads fewer than tp: one whole head per rank)."""
    c = shape.cfg
    if c.qk_norm == "none":
        return []
    full, hd = c.qk_norm == "full", c.head_width
    out = []
    for heads in (c.n_heads // tp, max(1, c.kv_heads // tp)):
        rows, width = (n, heads * hd) if full else (n * heads, hd)
        out += _rms_saved(w, n * heads * hd, rows, width, device, w.compute)
    return out


def _linear_inputs(shape: ModelShape, w: Widths, n: int, consumers: int, device: str) -> list[Saved]:
    """Saved inputs of the linear layers reading one norm output (n tokens), which is in the parameters'
    dtype: fp32 under autocast is cast once for them all (runs recorded before: a copy each,
    `Widths.linear_casts`)."""
    c = shape.cfg
    out_fp32 = w.param == 4 or (w.norms_fp32 and c.arch == "gpt2" and device == "cuda" and w.compute == 2)
    if out_fp32 and w.compute == 2:
        return [Saved(n * c.d_model, 2)] * (consumers if w.linear_casts else 1)
    return [Saved(n * c.d_model, w.param)]  # one tensor, shared by every consumer


def _region_inputs(shape: ModelShape, w: Widths, n: int, consumers: int, device: str, tp: int, sp: bool,
                   form: str) -> list[Saved]:
    """Saved inputs of the linears reading one norm output (n tokens) under tensor parallelism."""
    if tp > 1 and form == "megatron":  # one cast at the region entry (parallel/tensor.py)
        whole = Saved(n * shape.cfg.d_model, w.compute)
        # under SP the linears keep this rank's shard and gather it again in backward (comm.Regather),
        # as Megatron-LM does; float8 GEMMs (memory/fp8.py) save the gathered input themselves, and ZB-H1's
        # split backward runs linears that keep it whole (parallel/tensor.py TPContext.keep_shard)
        return _div([whole], tp) if sp and w.fp8 == "none" and w.keep_shard else [whole]
    return _div(_linear_inputs(shape, w, n, consumers, device), tp if sp else 1)


def _div(items: list[Saved], k: int) -> list[Saved]:
    """`items` split k ways by tokens (or heads); a parameter's copy stays whole."""
    return [Saved(t.numel // k if t.kind != "param" else t.numel, t.itemsize, t.kind) for t in items]


def block_saved(shape: ModelShape, w: Widths, tokens: int, seq_len: int, *, device: str = "cuda",
                tp: int = 1, sp: bool = False, dropout: float = 0.0, compress: str = "none",
                form: str = "megatron", ep: int = 1, cp: int = 1, cp_form: str = "ring") -> dict[str, int]:
    """Bytes one Block keeps for backward for one micro-batch of `tokens` = b*T tokens, per term,
    as held under activation compression `compress`."""
    return _held(block_tensors(shape, w, tokens, seq_len, device=device, tp=tp, sp=sp, dropout=dropout, form=form,
                               ep=ep, cp=cp, cp_form=cp_form), compress, True, device)


def _mlp_hidden(arch: str, silu_kept: bool) -> int:
    """(tokens, d_ff) tensors an MLP keeps besides its input: GELU's w1x and output; SwiGLU's w1x, w3x and
    product, and silu(w1x) where autograd keeps it (`silu_kept`)."""
    return (4 if silu_kept else 3) if arch == "llama" else 2


def block_tensors(shape: ModelShape, w: Widths, tokens: int, seq_len: int, *, device: str = "cuda",
                  tp: int = 1, sp: bool = False, dropout: float = 0.0, form: str = "megatron",
                  ep: int = 1, cp: int = 1, cp_form: str = "ring") -> dict[str, list[Saved]]:
    """The tensors one Block keeps, per term. Attention/MLP internals are split by tensor
    parallelism; norm-side tensors only with sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2).
    Under SP the column-parallel linears keep their input's sequence shard (gathered again in
    backward), so their saved inputs are split too. The per-layer forms (parallel.tp_form=
    all-gather / all-reduce, parallel/tensor.py) split only the linear layers: see `_per_layer_form`."""
    if tp > 1 and form != "megatron":
        return _per_layer_form(shape, w, tokens, seq_len, device, tp, dropout, form, ep)
    c = shape.cfg
    n, d, ff, cb = tokens, c.d_model, c.ffn_dim, w.compute
    q, kvd = c.n_heads * c.head_width, c.kv_heads * c.head_width
    rep = tp if sp else 1  # replicated tensors are divided by tp only under sequence parallelism
    k_moe = shape.top_k if shape.num_experts > 1 else 1  # each token visits top_k experts
    out = {
        "attention_norm": _div(_norm_saved(shape, w, n, device), rep),
        "qkv_inputs": _region_inputs(shape, w, n, 3, device, tp, sp, form),  # wq, wk, wv
        # q, k after RoPE, v; key/value heads fewer than tp are replicated: one whole head per rank
        "q_k_v": _div([Saved(n * q, cb)], tp) + [Saved(n * (max(1, c.kv_heads // tp) * c.head_width if tp > 1
                                                            else kvd), cb)] * 2,
        "attention_out": _div([Saved(n * q, cb)], tp),  # SDPA output, also wo's input (a view of it)
        "logsumexp": _div([Saved(n * c.n_heads, 4, "keep")], tp),  # fp32, one per head and token
        "qk_norm": _qk_norm_saved(shape, w, n, device, tp),
        "ffn_norm": _div(_norm_saved(shape, w, n, device), rep),
        "mlp_inputs": ([] if shape.num_experts > 1 else  # an MoE layer's: its dispatch buffer (_moe_saved)
                       _region_inputs(shape, w, n, 2 if c.arch == "llama" else 1, device, tp, sp, form)),
        # SwiGLU: w1x, w3x, their product (w2's input), and silu(w1x) in an MoE's experts (and in the dense
        # one before models/swiglu_kernel.py silu_mul: Widths.silu_kept); GELU: w1x, gelu(w1x)
        "mlp_hidden": _div([Saved(n * (ff if k_moe == 1 else c.expert_ffn_dim), cb)]
                           * (k_moe * _mlp_hidden(c.arch, shape.num_experts > 1 or w.silu_kept)), tp),
    }
    if c.arch == "llama" and cb != 4:
        out["rope_casts"] = [Saved(seq_len * c.head_width, cb, "keep")] * 4  # cos/sin cast to bf16, for q and for k
    if shape.num_experts > 1:
        out.update(_moe_saved(shape, w, n, ep))
    if cp > 1 and cp_form == "all-to-all":
        out.update(_all_to_all_saved(shape, n, cb, tp, cp))
    if dropout > 0:
        mask = 1 if device == "cuda" else cb  # CUDA native_dropout keeps a bool mask, the CPU kernel a float one
        out["dropout_masks"] = _div([Saved(n * d, mask, "mask")] * 2, rep)  # after wo and after w2
    return out


def _all_to_all_saved(shape: ModelShape, n: int, cb: int, tp: int, cp: int) -> dict[str, list[Saved]]:
    """What the all-to-all form of context parallelism (parallel/context.py AllToAllCore) changes, for n
    tokens of a rank: SDPA keeps its output in the head layout and wo reads another tensor, the output
    exchanged back (the one-rank output is wo's input itself); key/value heads that cp does not divide
    are repeated to the query heads before the exchange, and SDPA keeps them so. Ring attention keeps
    what SDPA keeps (parallel/ring_attention.py lays its output out as SDPA does)."""
    c = shape.cfg
    out = {"attention_out": [Saved(n * c.n_heads * c.head_width // tp, cb)] * 2}
    kv_local = max(1, c.kv_heads // tp)
    if kv_local % cp:
        q = c.n_heads * c.head_width // tp
        out["q_k_v"] = [Saved(n * q, cb)] * 3
    return out


def pending_block(shape: ModelShape, w: Widths, tokens: int, seq_len: int, *, device: str = "cuda", tp: int = 1,
                  sp: bool = False, form: str = "megatron", **_) -> int | None:
    """Bytes one dense Block holds for a pending weight-gradient pass (ZB-H1's W, Qi et al. 2023 sec. 2;
    parallel/pipeline/backward.py): per linear, its saved input and the gradient of its output, in the
    compute dtype (the norm scales' gradients, d numbers each, are made in I). Column-parallel outputs
    are split by tp, the row-parallel ones' gradients (wo, w2) whole. None where this is not read off
    the graph (MoE layers, the per-layer tp forms): the caller then counts a whole forward's tensors."""
    if shape.num_experts > 1 or (tp > 1 and form != "megatron"):
        return None
    c, cb, n = shape.cfg, w.compute, tokens
    saved = block_tensors(shape, w, n, seq_len, device=device, tp=tp, sp=sp, form=form)
    w2_input = [Saved(n * c.ffn_dim // tp, cb)]  # SwiGLU's product, GELU's output: one of mlp_hidden
    inputs = saved["qkv_inputs"] + saved["attention_out"] + saved["mlp_inputs"] + w2_input
    kvd = c.kv_heads * c.head_width
    column = c.n_heads * c.head_width + 2 * kvd + (2 if c.arch == "llama" else 1) * c.ffn_dim  # q, k, v; w1 (w3)
    grads = n * column * cb // tp + 2 * n * c.d_model * cb  # + wo's and w2's output gradients
    return sum(t.numel * t.itemsize for t in inputs) + grads


def pending_head(shape: ModelShape, w: Widths, tokens: int, *, device: str = "cuda", tp: int = 1, sp: bool = False,
                 form: str = "megatron", **_) -> int:
    """Bytes the output projection holds for a pending W: its input and the (tokens, vocab) gradient of
    the logits, or, where that is larger (parallel/pipeline/stage.py `early_weights`: above about d
    tokens), its (vocab, d) weight gradient made in I; in the compute dtype, vocab-parallel under tp."""
    d, v = shape.cfg.d_model, shape.cfg.vocab_size // tp
    if grad_in_i(tokens, v, d):
        return v * d * w.compute
    head_input = _region_inputs(shape, w, tokens, 1, device, tp, sp, form)
    return sum(t.numel * t.itemsize for t in head_input) + tokens * v * w.compute


def _moe_saved(shape: ModelShape, w: Widths, n: int, ep: int) -> dict[str, list[Saved]]:
    """What an MoE layer (models/moe.py, models/permute.py) keeps besides its experts' hidden
    activations, for n tokens routed to top_k experts each (M = n x top_k rows, capacity drops
    ignored; the router seen whole on every tp rank): the router's input (cast to fp32 for an fp32
    router) and its probabilities, the top-k indices and weights, the load vector of the aux loss;
    the experts' input buffer (M rows and the zero row that choices sent nowhere read, shared by the
    experts' first linears); to combine, the laid-out expert outputs, the gate weights, the
    permutation both ways (M destinations, M + 1 sources) and, where some choice may go nowhere (a
    capacity, random routing: routers.sends_every_choice), two masks of the choices sent (two more
    index tensors under expert parallelism, which lays out the rows it receives again). A rank's
    experts are assumed to receive M rows (balanced routing): read off the autograd graph of
    softmax-topk routing."""
    c = shape.cfg
    k, m = shape.top_k, n * shape.top_k
    router_bytes = 4 if c.moe.router_dtype == "fp32" else w.compute
    masks = 0 if sends_every_choice(ROUTERS[c.moe.router], c.moe.capacity) else 2
    return {"router": [Saved(n * c.d_model, router_bytes), Saved(n * shape.num_experts, 4, "keep"),
                       Saved(n * k, INDEX_BYTES, "keep"), Saved(n * k, 4, "keep"), Saved(n, 4, "keep")],
            "moe_dispatch": [Saved((m + 1) * c.d_model, w.compute)],
            "moe_combine": [Saved(m * c.d_model, w.compute), Saved(m, w.compute, "keep"), Saved(m, INDEX_BYTES, "keep"),
                            Saved(m + 1, INDEX_BYTES, "keep")] + [Saved(m, 1, "keep")] * masks
            + [Saved(m, INDEX_BYTES, "keep")] * (2 if ep > 1 else 0),
            "aux_loss": [Saved(shape.num_experts, 4, "keep")], **_shared_saved(shape, w, n, router_bytes)}


def _shared_saved(shape: ModelShape, w: Widths, n: int, router_bytes: int) -> dict[str, list[Saved]]:
    """The shared experts' MLP (models/moe.py) on all n tokens: its input (unless the router, computing in
    `router_bytes`, saved that very tensor, reading it uncast), its hidden tensors as a dense MLP's, and with
    shared_gate (Qwen2-MoE) what the gated product keeps: the MLP's output and the gate's sigmoid, and the
    gate's own cast of the input where autocast casts it (parameters wider than the compute dtype)."""
    c = shape.cfg
    if not c.moe.shared_experts:
        return {}
    hidden = [Saved(n * c.shared_ffn_dim, w.compute)] * (4 if c.arch == "llama" else 2)
    cast = [Saved(n * c.d_model, w.compute)] if w.compute != w.param else []
    gate = [Saved(n * c.d_model, w.compute), Saved(n, w.compute, "keep")] + cast if c.moe.shared_gate else []
    router_reads_it = router_bytes == w.compute == w.param
    return {"shared_experts": [Saved(n * c.d_model, w.compute)] * (not router_reads_it) + hidden + gate}


def _per_layer_form(shape: ModelShape, w: Widths, n: int, seq_len: int, device: str, tp: int, dropout: float,
                form: str, ep: int) -> dict[str, list[Saved]]:
    """A block under the per-layer forms keeps what one device keeps, except what its split linears see.
    all-gather: each linear reads the whole input (a view, the tensor one device saves too) and its
    output is all-gathered whole, so nothing changes. all-reduce: each linear reads its own contiguous
    1/tp slice of the input's last dimension (`split_last_dim`), which it saves in the compute dtype in
    place of the whole input; the tensors the attention core and the activation function keep stay
    whole, and only w2's input (SwiGLU's product, GELU's output) is no longer kept whole. An MoE
    layer stays whole and replicated (parallel/tensor.py)."""
    out = block_tensors(shape, w, n, seq_len, device=device, dropout=dropout, ep=ep)
    if form == "all-gather":
        return out
    c, cb = shape.cfg, w.compute
    q = c.n_heads * c.head_width
    out["qkv_inputs"] = [Saved(n * c.d_model // tp, cb)] * 3
    out["wo_input"] = [Saved(n * q // tp, cb)]
    if shape.num_experts == 1:
        llama = c.arch == "llama"
        out["mlp_inputs"] = [Saved(n * c.d_model // tp, cb)] * (2 if llama else 1)
        out["mlp_hidden"] = ([Saved(n * c.ffn_dim, cb)] * (_mlp_hidden(c.arch, w.silu_kept) - 1)
                             + [Saved(n * c.ffn_dim // tp, cb)])
    return out


def outside_saved(shape: ModelShape, w: Widths, tokens: int, seq_len: int, *, device: str = "cuda",
                  tp: int = 1, sp: bool = False, dropout: float = 0.0, first: bool = True,
                  last: bool = True, compress: str = "none", form: str = "megatron",
                  loss_pieces: int = 1) -> dict[str, int]:
    """Saved tensors outside the blocks: embedding ids on the first pipeline stage; final norm,
    head input, fp32 log-softmax (lm_loss upcasts the logits) and targets on the last, or, with the
    chunked loss (`loss_pieces` > 1), the input and weight gradients it makes in forward. Compression
    encodes only the dropout mask here (memory/compression.py keeps the head exact)."""
    c = shape.cfg
    n = tokens
    rep = tp if sp else 1
    out: dict[str, list[Saved]] = {}
    if first:
        out["token_ids"] = [Saved(n, INDEX_BYTES, "keep")]
        if c.arch == "gpt2":
            out["position_ids"] = [Saved(seq_len, INDEX_BYTES, "keep")]
        if dropout > 0:
            out["embedding_dropout"] = [Saved(n * c.d_model, 1 if device == "cuda" else w.param, "mask")]
    if last:
        out["final_norm"] = _div(_norm_saved(shape, w, n, device), rep)
        if loss_pieces > 1:  # models/chunked_loss.py: dh (B*T, d) and dW (V, d) in the compute dtype
            out["chunked_loss"] = [Saved(n * c.d_model, w.compute), Saved(c.vocab_size * c.d_model, w.compute)]
            out["log_softmax"] = []
        else:
            out["head_input"] = _region_inputs(shape, replace(w, fp8="none"), n, 1, device, tp, sp, form)  # bf16 head
            out["log_softmax"] = _div([Saved(n * c.vocab_size, 4)], tp)  # fp32 (B*T, V), vocab-parallel under tp
        if loss_pieces == 1:  # the chunked loss's backward reads no targets
            out["targets"] = [Saved(n, INDEX_BYTES, "keep")]  # under tp: the local target ids
        if tp > 1:  # the vocab-parallel loss (parallel/tp_layers.py) also masks the targets outside its piece
            out["target_masks"] = [Saved(n, 1, "keep")] * 2
    return _held(out, compress, False, device)


def head_weight_copy(shape: ModelShape, w: Widths, tp: int = 1, loss_pieces: int = 1, pp: int = 1) -> int:
    """The autocast bf16 copy of the output projection (tied: of the embedding), held to its backward
    (the chunked loss keeps none: its backward needs only the gradients it made); where the vocabulary is
    padded for the GEMMs (one rank's head, no pipeline: models/transformer.py head), the padded copy, made in
    any dtype."""
    if loss_pieces > 1:
        return 0
    V, d, rows = shape.cfg.vocab_size, shape.cfg.d_model, head_rows(shape, tp, pp)
    if rows != V:
        return rows * d * w.compute
    return V * d * w.compute // tp if w.autocast_copies else 0


def head_rows(shape: ModelShape, tp: int = 1, pp: int = 1) -> int:
    """The vocabulary rows the whole-logits head multiplies in training: padded for the GEMMs on one rank's head
    without a pipeline (models/transformer.py head), else the vocabulary (a tp rank's piece: tp_layers.py)."""
    V = shape.cfg.vocab_size
    return padded_vocab(V) if tp == 1 and pp == 1 else V


def loss_pieces(shape: ModelShape, loss_chunks: int, tp: int, tokens: int) -> int:
    """Pieces the chunked loss cuts a micro-batch's `tokens` into (memory.loss_chunks; 0: auto), 1 where
    the logits are whole or vocab-parallel (tp > 1)."""
    if loss_chunks == 1 or tp > 1:
        return 1
    return min(tokens, loss_chunks or auto_chunks(tokens, shape.cfg.vocab_size, shape.cfg.d_model))


def rope_tables(shape: ModelShape) -> int:
    """RoPE cos/sin buffers (fp32, seq_len x head_dim each): module buffers, not activations."""
    c = shape.cfg
    return 2 * c.seq_len * c.head_width * 4 if c.arch == "llama" else 0


def stored_blocks(shape: ModelShape, w: Widths, n_layers: int, tokens: int, seq_len: int, policy: str,
                  every: int, once: bool = False, **kw) -> dict[str, int]:
    """Bytes the blocks of one stage hold from forward to backward for one micro-batch, by policy
    (memory/recompute.py). Segment policies keep only each segment's input hidden state (Chen et al.
    2016); selective drops what the attention core alone keeps (with SDPA that is the logsumexp: q,
    k, v are the checkpoint's inputs and the output is wo's input, so they stay). `once`: casts_once."""
    own, dense = block_mix(shape, n_layers)

    def mixed(per_block) -> int:  # the stage's blocks: `own` as the shape builds them, the rest dense
        return own * per_block(shape) + (n_layers - own) * (per_block(dense) if dense is not None else 0)

    def stage(**bkw) -> int:
        return mixed(lambda s: sum(block_saved(s, w, tokens, seq_len, **bkw).values()))

    tp = kw.get("tp", 1)
    copies = weight_copies(shape, w, tp, kw.get("ep", 1), kw.get("form", "megatron"), kw.get("device", "cuda"),
                           once)
    cp = kw.get("cp", 1)
    # the all-to-all form's two position indices (the whole sample's, int64), shared by every block
    index = 2 * seq_len * cp * INDEX_BYTES if cp > 1 and kw.get("cp_form") == "all-to-all" else 0
    if policy == "none":
        return {"blocks": stage(**kw) + index, "weight_copies": n_layers * copies}
    if policy in SELECTIVE_OPS:  # the casts of the weights are recomputed too: no copies kept
        # the kept outputs live in the checkpoint's own cache, which activation compression never sees
        alternate = policy == "selective-ops-alternate"

        def kept(s: ModelShape) -> int:
            return sum(t.numel * t.itemsize for t in ops_saved(s, w, tokens, alternate, **kw))
        return {"blocks": mixed(kept), "weight_copies": 0}
    if policy == "selective":  # the core's own tensors are replayed: the all-to-all form's among them
        ring = {**kw, "cp_form": "ring"}
        lse = block_saved(shape, w, tokens, seq_len, **ring)["logsumexp"]  # the same in a dense block
        return {"blocks": stage(**ring) - n_layers * lse, "weight_copies": n_layers * copies}
    rep = tp if kw.get("sp") else 1
    hidden = Saved(tokens * shape.cfg.d_model // rep, w.param)  # residual stream in the params' dtype
    held = hidden.held(kw.get("compress", "none"), True, kw.get("device", "cuda"))  # a checkpoint input, in the stack
    return {"blocks": segments(policy, n_layers, every) * held, "weight_copies": 0}


def block_mix(shape: ModelShape, n_layers: int) -> tuple[int, ModelShape | None]:
    """(how many of a stage's `n_layers` blocks are built as `shape` says, the shape of the others or None):
    all of a dense model's or of an MoE model routed in every layer; else its routed blocks, the rest
    being dense blocks (model.moe.every, first_dense_layers) that keep a dense MLP's tensors. The whole
    model's count where the stage holds every layer, else its share, rounded up (an MoE block keeps more)."""
    c = shape.cfg
    routed = shape.routed_layers
    if shape.num_experts == 1 or routed == c.n_layers:
        return n_layers, None
    dense = ModelShape(cfg=c.model_copy(update={"moe": c.moe.model_copy(update={"num_experts": 1})}), name=shape.name)
    return (routed if n_layers == c.n_layers else ceil_div(routed * n_layers, c.n_layers)), dense


def ops_saved(shape: ModelShape, w: Widths, tokens: int, alternate: bool = False, *, tp: int = 1,
              sp: bool = False, form: str = "megatron", **_) -> list[Saved]:
    """What memory.recompute=selective-ops keeps of one Block for `tokens` tokens (memory/recompute.py: the
    outputs of its matrix products and of fused attention; the rest is recomputed): q, k, v; wo's output;
    the MLP's (`_mlp_ops_saved`); the attention output and its fp32 logsumexp. Column-parallel outputs and
    the attention's are split by tp; the row-parallel products (wo, w2) are kept as the GEMM made them, the
    partial sums of all tokens, before their reduction. Plus the block's input, the checkpoint's (the
    residual stream in the parameters' dtype, a sequence shard under SP). `alternate`:
    selective-ops-alternate, which keeps only the 1st, 3rd, ... product's output, in the order the block runs
    them (a dense block's: wq, wk, wv, wo, then w1, w3, w2)."""
    c, cb, n = shape.cfg, w.compute, tokens
    t = tp if form == "megatron" else 1
    kvd = max(1, c.kv_heads // t) * c.head_width if t > 1 else c.kv_heads * c.head_width
    q = c.n_heads * c.head_width // t
    gemms = [Saved(n * q, cb), Saved(n * kvd, cb), Saved(n * kvd, cb), Saved(n * c.d_model, cb)]
    gemms += _mlp_ops_saved(shape, cb, n, t)
    attention = [Saved(n * q, cb), Saved(n * c.n_heads // t, 4, "keep")]
    block_input = Saved(n * c.d_model // (tp if sp else 1), w.param)
    return (gemms[::2] if alternate else gemms) + attention + [block_input]


def _mlp_ops_saved(shape: ModelShape, cb: int, n: int, t: int) -> list[Saved]:
    """selective-ops's kept GEMM outputs of a block's MLP: a dense MLP's w1 (and w3) by column, w2's
    partial sums whole. An MoE layer's: the router's scores (in its dtype), the routed experts' grouped
    GEMMs over n x top_k rows (balanced, as `_moe_saved`; w1 and w3 split by tp, w2 whole), the combine's
    batched product of each token's k rows by its gates (n x d), and the shared experts as a dense MLP of
    their width, with their gate's logit."""
    c = shape.cfg
    gated = 2 if c.arch == "llama" else 1

    def mlp(rows: int, width: int) -> list[Saved]:
        return [Saved(rows * width // t, cb)] * gated + [Saved(rows * c.d_model, cb)]

    if shape.num_experts == 1:
        return mlp(n, c.ffn_dim)
    router = 4 if c.moe.router_dtype == "fp32" else cb
    out = [Saved(n * shape.num_experts, router)] + mlp(n * shape.top_k, c.expert_ffn_dim) + [Saved(n * c.d_model, cb)]
    if c.moe.shared_experts:
        out += mlp(n, c.shared_ffn_dim) + ([Saved(n, cb)] if c.moe.shared_gate else [])
    return out


def segments(policy: str, n_layers: int, every: int) -> int:
    """Checkpointed segments of a stage's blocks under a replaying policy (memory/recompute.py): each
    keeps its input from forward to backward (none on a stage with no blocks)."""
    return ceil_div(n_layers, min(n_layers, segment_size(policy, n_layers, every))) if n_layers else 0


def recompute_transient(shape: ModelShape, w: Widths, n_layers: int, tokens: int, seq_len: int, policy: str,
                        every: int, **kw) -> int:
    """Extra bytes alive while one checkpointed segment is replayed in backward: its k blocks'
    activations and weight copies, rebuilt at once (0 for policies that keep everything)."""
    if policy in ("none", "selective"):
        return 0
    k = min(n_layers, segment_size(policy, n_layers, every))
    kw = {**kw, "compress": "none"}  # the replay runs in backward, outside the compression hooks
    per = sum(block_saved(shape, w, tokens, seq_len, **kw).values())
    return k * (per + weight_copies(shape, w, kw.get("tp", 1), kw.get("ep", 1), kw.get("form", "megatron"),
                                    kw.get("device", "cuda")))


def forward_saved(shape: ModelShape, w: Widths, tokens: int, seq_len: int, policy: str, every: int,
                  device: str = "cuda", dropout: float = 0.0, compress: str = "none", loss_pieces: int = 1) -> int:
    """Everything a whole single-device model keeps from forward to backward for one micro-batch,
    as `saved_tensors_hooks` counts it (parameters excluded): what tests and bench/ compare with."""
    kw = dict(device=device, dropout=dropout, compress=compress)
    blocks = stored_blocks(shape, w, shape.cfg.n_layers, tokens, seq_len, policy, every, **kw)
    total = sum(blocks.values()) + sum(outside_saved(shape, w, tokens, seq_len, loss_pieces=loss_pieces, **kw).values())
    total += head_weight_copy(shape, w, loss_pieces=loss_pieces)
    if w.compute == 4 and policy in ("none", "selective"):
        total += rope_tables(shape)  # fp32 RoPE reads the buffers themselves: views of them are saved
    return total
