"""What the planner reasons about: a model shape, a parallel layout, and the byte widths they imply.

Both are plain values built from a `Config` (or a bare parameter count), so the planner can describe
layouts the distributed code cannot run yet. No tensor is made here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from teratrain.memory.precision import uses_master_weights
from teratrain.models.routers import router_param_names, router_rows
from teratrain.models.transformer import count_params


@dataclass(frozen=True, kw_only=True, eq=False)  # hashed by identity: the planner caches per shape
class ModelShape:
    """The model as the planner sees it: a `ModelConfig` (None for `--params N`), mixture of experts
    included (`model.moe`, also filled from a HF Mixtral config.json)."""

    cfg: object | None  # teratrain.config.ModelConfig
    bare_params: int = 0  # --params N: parameter count with no shape (model states only)
    name: str = ""

    @property
    def is_bare(self) -> bool:
        return self.cfg is None

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer (1: a dense model)."""
        return 1 if self.is_bare else self.cfg.moe.num_experts

    @property
    def top_k(self) -> int:
        """Experts each token visits in an MoE layer."""
        return 1 if self.is_bare or self.num_experts == 1 else self.cfg.moe.experts_per_token

    @property
    def moe_hidden(self) -> int:
        """Inner width one token passes through in an MoE layer: top_k routed experts of
        model.moe.expert_d_ff and the shared experts (models/moe.py)."""
        return self.top_k * self.cfg.expert_ffn_dim + self.cfg.shared_ffn_dim

    @property
    def routed_layers(self) -> int:
        """Blocks that hold experts (model.moe.every, first_dense_layers); 0 in a dense model."""
        if self.num_experts == 1:
            return 0
        return sum(self.cfg.moe.is_moe_layer(i) for i in range(self.cfg.n_layers))

    @property
    def moe_share(self) -> float:
        """Fraction of the blocks that hold experts."""
        return self.routed_layers / self.cfg.n_layers if self.num_experts > 1 else 0.0

    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    @cached_property
    def _counts(self) -> dict[str, int]:
        """`count_params` (MoE layers included: `total` counts every expert, `active` what one token
        uses, `matmul` the weights a token multiplies, which is what the PaLM FLOP formula wants)."""
        if self.is_bare:
            n = self.bare_params
            return {"total": n, "embedding": 0, "matmul": n, "per_block": 0, "expert": 0, "active": n}
        return dict(count_params(self.cfg))

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return self._shapes

    @cached_property
    def _shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter tensor of our Transformer in `named_parameters()` order,
        nn.Linear weights as (out, in). ZeRO's bucketing and per-tensor optimizer state follow it.
        An MoE block's feed-forward is its router (models/moe.py), the experts' MLPs stacked (of width
        model.moe.expert_d_ff: weights, then biases), then the shared experts' MLP and its gate."""
        if self.is_bare:
            return []
        c = self.cfg
        d, ff, q, kv = c.d_model, c.ffn_dim, c.n_heads * c.head_width, c.kv_heads * c.head_width
        norm = [("weight", (d,))] + ([("bias", (d,))] if c.arch == "gpt2" and c.use_bias else [])

        def linear(name, out, inp, bias=False):
            return [(f"{name}.weight", (out, inp))] + ([(f"{name}.bias", (out,))] if c.use_bias or bias else [])

        def mlp_of(ff):
            names = [("w1", ff, d), ("w2", d, ff)]
            if c.arch == "llama":
                names.insert(1, ("w3", ff, d))
            return [t for n, o, i in names for t in linear(n, o, i)]

        mlp, moe = mlp_of(ff), []
        if self.num_experts > 1:
            rows = router_rows(c.moe)
            moe = [(f"router.{n}", (rows, d)) for n in router_param_names(c.moe)]
            stacks = [(n.split(".")[0], s) for n, s in mlp_of(c.expert_ffn_dim)]  # models/moe.py's Experts
            moe += [(f"experts.{n}", (self.num_experts, *s)) for n, s in stacks if len(s) == 2]
            moe += [(f"experts.b{n[1:]}", (self.num_experts, *s)) for n, s in stacks if len(s) == 1]
            moe += [(f"shared_expert.{n}", s) for n, s in (mlp_of(c.shared_ffn_dim) if c.moe.shared_experts else [])]
            moe += [("shared_expert_gate.weight", (1, d))] if c.moe.shared_gate else []
        head = ([(f"attention_norm.{n}", s) for n, s in norm]
                + [(f"attention.{n}", s) for m, o, i in (("wq", q, d), ("wk", kv, d), ("wv", kv, d), ("wo", d, q))
                   for n, s in linear(m, o, i, c.qkv_bias and m != "wo")]
                + [(f"attention.{n}_norm.weight", (w,)) for n, w in qk_norm_widths(c)]
                + [(f"ffn_norm.{n}", s) for n, s in norm])
        out = [("tok_embeddings.weight", (c.vocab_size, d))]
        if c.arch == "gpt2":
            out.append(("pos_embeddings.weight", (c.seq_len, d)))
        for i in range(c.n_layers):
            ffn = moe if c.moe.is_moe_layer(i) else mlp
            out += [(f"layers.{i}.{n}", s) for n, s in head + [(f"feed_forward.{n}", s) for n, s in ffn]]
        out += [(f"norm.{n}", s) for n, s in norm]
        if not c.tie_embeddings:
            out.append(("output.weight", (c.vocab_size, d)))
        return out


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to run a step. Degrees multiply to the GPU count: dp * cp * tp * pp; ep divides dp (expert
    parallelism borrows data-parallel ranks, as in mesh.py). cp ranks split each sample's sequence:
    a rank computes T/cp tokens of every sample, and gradients reduce (ZeRO shards) over dp x cp."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0  # 0-3 (Rajbhandari et al. 2020: 1 = P_os, 2 = P_os+g, 3 = P_os+g+p)
    micro_batch: int = 1  # sequences per forward/backward on one rank
    num_microbatches: int = 1  # micro-batches per optimizer step on one rank (accumulation or pipeline)
    recompute: str = "none"  # a memory.recompute policy (memory/recompute.py)
    recompute_every: int = 2
    offload: str = "none"  # none | optimizer | params
    sequence_parallel: bool = False
    tp_form: str = "megatron"  # parallel.tp_form: megatron | all-gather | all-reduce
    schedule: str = "one_f_one_b"  # a parallel/pipeline/schedules.py name (function or config name)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved_1f1b)
    # blocks of each of the pp x virtual_stages global stages (parallel.stage_layers); empty: the
    # executor's count split (parallel.partition=layers). The search fills in pipeline.planned_split.
    stage_layers: tuple[int, ...] = ()
    cp: int = 1  # context-parallel degree (parallel/context.py)
    cp_form: str = "ring"  # parallel.cp_form: ring | all-to-all

    @property
    def gpus(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters, over which gradients are reduced and ZeRO shards (the
        mesh's `dp` group): dp x cp."""
        return self.dp * self.cp

    def tokens(self, seq_len: int) -> int:
        """Tokens of one micro-batch that one rank computes: micro_batch x seq_len / cp."""
        return self.micro_batch * seq_len // self.cp

    @property
    def keeps_shard(self) -> bool:
        """Whether sequence parallelism's column-parallel linears may keep their input's sequence shard and gather
        it again in backward (parallel/tensor.py TPContext.keep_shard): not under ZB-H1's split backward."""
        return not (self.pp > 1 and self.schedule in ("zb_h1", "zb-h1"))

    def as_dict(self) -> dict:
        """The fields as JSON holds them (stage_layers a list)."""
        return {k: list(v) if isinstance(v, tuple) else v for k in self.__dataclass_fields__ for v in [getattr(self, k)]}

    def with_(self, **kw) -> "Layout":
        return replace(self, **kw)


@dataclass(frozen=True)
class Widths:
    """Bytes per element of each kind of tensor, as our code makes them (memory/precision.py,
    optim/engine.py, Config.use_master_weights)."""

    param: int  # model parameters: 2 with fp32 master copies elsewhere, else 4
    grad: int  # gradients as held between backward and the step (the params' dtype)
    compute: int  # matmul outputs: 2 under bf16/fp16 autocast, 4 in fp32
    master: int  # fp32 master copy per param in the optimizer (0 without masters)
    autocast_copies: bool  # fp32 params under autocast: each linear casts its weight and input
    bf16: bool = False  # computes in bf16, where the experts run as grouped GEMMs (models/grouped.py)
    fp8: str = "none"  # memory.fp8: the block linears' GEMMs in float8 (memory/fp8.py)
    keep_shard: bool = True  # under SP the linears keep their input's sequence shard (not under ZB-H1)
    norms_fp32: bool = False  # Training.norms_fp32
    linear_casts: bool = False  # Training.linear_casts
    expert_tensors: bool = False  # Training.expert_tensors
    silu_kept: bool = False  # Training.silu_kept


def widths(precision: str, master_weights: bool, fp8: str = "none", norms_fp32: bool = False,
           linear_casts: bool = False, expert_tensors: bool = False, silu_kept: bool = False) -> Widths:
    low, bf16 = precision != "fp32", precision == "bf16"
    ran = {"norms_fp32": norms_fp32, "linear_casts": linear_casts, "expert_tensors": expert_tensors,
           "silu_kept": silu_kept}
    if master_weights:  # params in the compute dtype (fp32 stays fp32), fp32 copy in the optimizer
        k = 2 if low else 4
        return Widths(param=k, grad=k, compute=k, master=4, autocast_copies=False, bf16=bf16, fp8=fp8, **ran)
    return Widths(param=4, grad=4, compute=2 if low else 4, master=0, autocast_copies=low, bf16=bf16, fp8=fp8, **ran)


@dataclass(frozen=True, kw_only=True)
class Training:
    """The run-level settings the planner reads from a Config (units in the names)."""

    precision: str = "bf16"
    master_weights: bool | None = None  # None: Config's rule (fp16, or bf16 under ZeRO)
    optimizer: str = "adamw"
    momentum: float = 0.9  # SGD/SM3 momentum (0 = no momentum buffer)
    global_batch: int = 32  # sequences per optimizer step
    bucket_mb: float = 25.0
    overlap_comm: bool = True  # parallel.overlap_comm: false waits for each data-parallel reduction where it starts
    reduce_bytes: int = 4  # parallel.reduce_dtype width
    grad_bytes: int = 4  # parallel.grad_dtype width: ZeRO's gradient buffer (stage 1) or shard (2/3)
    dropout: float = 0.0
    compress: str = "none"  # memory.compress_activations: none | lossless | int8 | fp8
    lora: tuple = ()  # (rank, alpha, targets, dropout, base_dtype) when lora.rank > 0
    graphed: bool = False  # train.compile_mode=reduce-overhead: CUDA graphs replay the step (no host issue time)
    compiled: bool = False  # train.compile (planner/time.py: issued_ops, fused_s)
    loss_chunks: int = 1  # memory.loss_chunks: pieces of the chunked head + loss (0 auto, 1 whole logits)
    compile_scope: str = "auto"  # train.compile_scope
    reduces_in_backward: bool = True  # parallel.overlap_comm and parallel.sync=allreduce (resolves compile_scope=auto)
    fp8: str = "none"  # memory.fp8: none | tensorwise | rowwise
    fp8_gather: bool = True  # memory.fp8_gather: ZeRO-3 gathers tensorwise float8 weights in 1 byte
    ep_dedup: bool = True  # parallel.ep_dedup: one row per (token, rank) in the expert exchange, not per choice
    # The norms ran on fp32 copies of a bf16 residual stream (RMSNorm's x.float(), CUDA autocast's layer_norm)
    # before they ran in its dtype (models/layers.py): how the runs recorded before measured, which
    # planner/refit.py plans as they ran. Never set from a Config.
    norms_fp32: bool = False
    # Under autocast over fp32 parameters each projection cast its own bf16 copy of the norm output (3 before
    # wq/wk/wv, 2 before w1/w3) before the attention and the MLP cast it once for all (models/layers.py):
    # how the runs recorded before measured, planned as they ran by planner/refit.py. Never set from a Config.
    linear_casts: bool = False
    # Each routed expert held its own parameters (3,072 tensors for 128 experts of 8 layers, each gradient
    # accumulated by its own op) before the experts were stacked (models/moe.py Experts): how the runs
    # recorded before measured, planned as they ran by planner/refit.py. Never set from a Config.
    expert_tensors: bool = False
    # An eager dense SwiGLU kept silu(w1 x) for its backward beside w1 x, w3 x and their product, before it kept
    # its two inputs alone (models/swiglu_kernel.py silu_mul): how the runs recorded before measured, planned as
    # they ran by planner/refit.py. Never set from a Config.
    silu_kept: bool = False
    # Each micro-batch casts the float8 weights and the experts' weight stacks anew, not the step once for all
    # (memory/step_casts.py): memory.cast_once=false, and the runs recorded before the step cast them once
    # (planner/refit.py plans them as they ran)
    casts_per_micro_batch: bool = False
    # AdamW steps through torch's fused kernel (optim.kernel=torch; and the runs recorded before teratrain's
    # kernel, optim/adamw_kernel.py, which planner/refit.py and the tests plan as they ran), else teratrain's
    torch_adamw: bool = False
    # teratrain's AdamW kernel launched a tensor at a time, each launch costing the host
    # hardware.GPU.host_optimizer_tensor_s: the runs recorded before it launched once a group (planned as they ran
    # by planner/refit.py). Never set from a Config.
    adamw_per_tensor: bool = False
    # Each stacked expert weight's gradient was cast back and then added by autograd, before the cast's
    # backward carried the accumulated one (memory/step_casts.py take_grads): how the runs recorded before
    # measured, planned as they ran by planner/refit.py. Never set from a Config.
    grads_after_casts: bool = False
    # The gradients carried through the casts were held by their layers to the step's end, beside the sums
    # the casts' backward made of them (memory/step_casts.py take_grads): at the end of the last backward,
    # the carried weights' gradients twice. How the runs recorded before measured, planned as they ran by
    # planner/refit.py. Never set from a Config.
    carried_grads_held: bool = False
    # Compiled gated experts ran w1 and w3 as two grouped GEMMs, before one over their stacks side by side
    # (models/grouped.py fuses_gate_up): how the runs recorded before measured, planned as they ran by
    # planner/refit.py. Never set from a Config.
    gate_up_apart: bool = False
    # An MoE layer laid its rows out by a stable sort and masked every choice, sent or not, and summed its
    # statistics in more ops, before the running count and the masks only where a choice may go nowhere
    # (models/permute.py, models/moe.py; planner/time.py OPS_MOE_EXTRA_SORTED): how the runs recorded before
    # measured, planned as they ran by planner/refit.py. Never set from a Config.
    moe_sorted_layout: bool = False

    @property
    def frozen_width(self) -> int:
        """Bytes of a frozen parameter: LoRA's base in lora.base_dtype (parallelize stores it in bf16), else fp32."""
        return 2 if self.lora and self.lora[-1] == "bf16" else 4

    def uses_masters(self, zero: int, offload: str = "none") -> bool:
        """Config.use_master_weights's rule (memory/precision.py) for this layout."""
        return uses_master_weights(self.precision, zero, offload, self.master_weights)

    def widths(self, zero: int, offload: str = "none") -> Widths:
        # compiled, the SwiGLU is the plain expression (models/swiglu_kernel.py silu_mul): where its graph is not
        # read off (planner/compiled.py), autograd's four tensors are counted
        return widths(self.precision, self.uses_masters(zero, offload), self.fp8, self.norms_fp32, self.linear_casts,
                      self.expert_tensors, self.silu_kept or self.compiled)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def block_linears(shape: ModelShape, moe_layer: bool = False) -> list[tuple[int, int]]:
    """(in, out) features of one block's linear layers in the order it runs them: wq, wk, wv, wo, then a dense
    MLP's w1, (w3,) w2; an MoE layer's attention alone (its experts are not linear layers)."""
    c = shape.cfg
    d, q, kv, ff = c.d_model, c.n_heads * c.head_width, c.kv_heads * c.head_width, c.ffn_dim
    attn = [(d, q), (d, kv), (d, kv), (q, d)]
    if moe_layer:
        return attn
    return attn + ([(d, ff), (d, ff), (ff, d)] if c.arch == "llama" else [(d, ff), (ff, d)])


def qk_norm_widths(c) -> list[tuple[str, int]]:
    """(q or k, width) of the attention's query/key RMSNorm weights (model.qk_norm; models/layers.py)."""
    if c.qk_norm == "none":
        return []
    full = c.qk_norm == "full"
    hd = c.head_width
    return [("q", c.n_heads * hd if full else hd), ("k", c.kv_heads * hd if full else hd)]
