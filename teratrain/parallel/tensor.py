"""Megatron tensor parallelism (Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al.
2022), applied from outside by `apply_tp` with plans that are data.

Three forms (`parallel.tp_form`), all splitting every linear layer's weight over the tp ranks:
- `megatron` (default): column-parallel then row-parallel. Attention is split by heads (query heads;
  grouped key/value heads too, replicated when tp exceeds them) and the MLP by its inner width, so a
  block costs one all-reduce forward and one backward per attention and per MLP (`f`/`g`); with
  sequence parallelism those become all-gather / reduce-scatter of the tokens, and norms, dropout
  and residuals run on token shards (B*T/tp rows of the flattened batch per rank, comm.sequence_rows).
  Region entries cast to the compute dtype once, before their collective. With
  parallel.tp_overlap=chunked the region collectives are split into units under their GEMMs
  (parallel/tp_overlap.py).
- `all-gather` (the seeds' first form): each linear keeps W's columns W' and computes X W'; the
  outputs are all-gathered. Everything between linears is replicated.
- `all-reduce` (the seeds' second form): X and W are split along the inner dimension and the partial
  products X'' W'' are all-reduced.
The embedding is vocab-parallel (rows split, padded to a multiple of tp) and so is the head; the
loss is computed from vocab-parallel logits, so the full logits never exist on one rank.
Communication functions and what they run forward/backward are in parallel/comm.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from teratrain.config import ConfigError
from teratrain.memory.precision import to_compute_dtype
from teratrain.models.moe import MoE
from teratrain.parallel import comm
from teratrain.parallel.placement import Placement, place, placement
from teratrain.parallel.tp_layers import (ColumnParallel, ForkedRNG, PartialRowParallel, RowParallel,
                                          SequenceShardPositions, SequenceShards, VocabParallelEmbedding,
                                          VocabParallelHead, VocabParallelLoss)
from teratrain.parallel.tp_overlap import ColumnJoint

# Per-block plan: module path inside a block -> style (what each style means: `_STYLES`).
BLOCK_PLAN = {
    "attention_norm": "sequence_norm", "ffn_norm": "sequence_norm",
    "attention": "region",
    "attention.wq": "colwise", "attention.wk": "colwise_kv", "attention.wv": "colwise_kv",
    "attention.wo": "rowwise",
    "attention.core": "head_rng", "attention.resid_dropout": "sequence_rng",
    "feed_forward": "region",
    "feed_forward.w1": "colwise", "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise",
    "feed_forward.dropout": "sequence_rng",
}
MODEL_PLAN = {
    "tok_embeddings": "vocab_embedding", "pos_embeddings": "sequence_positions", "dropout": "sequence_rng",
    "norm": "sequence_norm", "output": "vocab_head", "tied_head": "vocab_head", "criterion": "vocab_loss",
}
# The seeds' forms turn every linear into one self-contained parallel layer; nothing else is split.
FORM_STYLE = {"all-gather": "colwise_gather", "all-reduce": "rowwise_split"}
# MoE blocks (models/moe.py) replace the feed_forward entries above. Megatron form: the router runs on
# the whole (gathered) tokens on every tp rank (its gradient is partial over tp, like a sequence-
# parallel norm's), each expert is split like the dense MLP, and the gated sum of the experts' partial
# outputs leaves the region once. The seeds' forms leave MoE layers whole, replicated over tp.
MOE_PLAN = {"feed_forward": "moe_region", "feed_forward.router": "moe_router"}
EXPERT_PLAN = {"w1": "colwise", "w3": "colwise", "w2": "rowwise_partial", "dropout": "split_rng"}


@dataclass
class TPContext:
    mesh: object
    tp: int
    rank: int
    sp: bool
    form: str
    cfg: object  # ModelConfig
    chunks: int = 1  # units of the sequence-parallel token layout (comm.sequence_rows)
    overlap: bool = False  # parallel.tp_overlap=chunked: parallel/tp_overlap.py

    def __post_init__(self):
        self.shards = SequenceShards(self.tp, self.rank, self.chunks) if self.sp else None
        self.joints: dict[str, ColumnJoint] = {}  # region name -> its column-parallel projections

    @property
    def group(self):
        return self.mesh.group("tp")


def apply_tp(model: nn.Module, rt, cfg) -> None:
    """Swap the meta-device model's layers for tensor-parallel ones, recording each new parameter's
    placement (global name and shape, which piece this rank holds, its gradient's group)."""
    p = cfg.parallel
    ctx = TPContext(rt.mesh, rt.dims.tp, rt.coord("tp"), p.use_sp, p.tp_form, cfg.model, overlap_chunks(p),
                    p.tp_overlap == "chunked")
    for key, block in model.layers.items():
        for path, style in _block_plan(block, ctx).items():
            _apply(block, path, style, ctx, f"layers.{key}.{path}")
    for path, style in MODEL_PLAN.items():
        _apply(model, path, style, ctx, path)


def _block_plan(block: nn.Module, ctx: TPContext) -> dict[str, str]:
    if not isinstance(block.feed_forward, MoE):
        return BLOCK_PLAN
    plan = {path: style for path, style in BLOCK_PLAN.items() if not path.startswith("feed_forward")}
    if ctx.form == "megatron":
        plan.update(MOE_PLAN)
        plan.update({f"feed_forward.experts.{e}.{leaf}": style for e in block.feed_forward.experts
                     for leaf, style in EXPERT_PLAN.items()})
    return plan


def _apply(root: nn.Module, path: str, style: str, ctx: TPContext, name: str) -> None:
    owner_path, _, leaf = path.rpartition(".")
    owner = root.get_submodule(owner_path) if owner_path else root
    module = getattr(owner, leaf, None)
    if module is None:
        return  # e.g. no w3 in a GELU MLP, no positions in Llama, no output layer when tied
    if ctx.form != "megatron" and style in ("colwise", "colwise_kv", "rowwise"):
        style = FORM_STYLE[ctx.form]
    new = _STYLES[style](module, ctx, name)
    if new is not None:
        setattr(owner, leaf, new)


def overlap_chunks(p) -> int:
    """Units each overlapped collective is split into (1: not overlapped)."""
    return p.tp_overlap_chunks if p.tp_overlap == "chunked" else 1


def _entry(ctx: TPContext, cast: bool = True):
    """How activations enter a region whose ranks each need all of them: cast once to the compute
    dtype where only autocast matmuls read them (`cast`), then gathered (or Megatron's `f`)."""
    def enter(x):
        x = to_compute_dtype(x) if cast else x
        return comm.gather_sequence(x, ctx.group, ctx.chunks) if ctx.sp else comm.copy_to_tp(x, ctx.group)
    return enter


def _exit(ctx: TPContext):
    """How a region's partial sums leave it."""
    if ctx.sp:
        return lambda x: comm.reduce_scatter_sequence(x, ctx.group, ctx.chunks)
    return lambda x: comm.reduce_from_tp(x, ctx.group)


def _split(linear: nn.Module, ctx: TPContext, name: str, dim: int, count: int, group: str = "dp",
           leaf: str = "weight") -> nn.Parameter:
    """The meta-device piece of `linear.<leaf>` along `dim` (0: output rows, 1: input columns)."""
    full = getattr(linear, leaf)
    index = ctx.rank // (ctx.tp // count)
    pl = Placement(name=f"{name}.{leaf}", global_shape=tuple(full.shape), dim=dim, axis="tp",
                   index=index, count=count, group=group, tied=())
    return _new_param(pl, full.requires_grad)


def _new_param(pl: Placement, requires_grad: bool) -> nn.Parameter:
    p = nn.Parameter(torch.empty(pl.local_shape(), device="meta"), requires_grad=requires_grad)
    place(p, pl)
    return p


def _adapter(linear: nn.Module, ctx: TPContext, name: str, w: nn.Parameter, row_split: bool):
    """LoRA's A and B split consistently with the base weight (memory/lora.py): the factor on the
    split side is cut like W, the other stays whole and its gradient is partial over tp."""
    if not hasattr(linear, "lora_a"):
        return None
    wp = placement(w)
    whole = "lora_b" if row_split else "lora_a"
    cut = _split(linear, ctx, name, wp.dim, wp.count, wp.group, leaf="lora_a" if row_split else "lora_b")
    kept = _new_param(Placement(name=f"{name}.{whole}", global_shape=tuple(getattr(linear, whole).shape),
                                group="dp_tp", tied=()), True)
    a, b = (cut, kept) if row_split else (kept, cut)
    drop = linear.dropout  # on X: replicated for a column split (masks agree), split for a row split
    return a, b, linear.scale, (_rng(drop, ctx, True) or drop) if row_split else drop


def _bias(linear: nn.Linear, ctx: TPContext, name: str, split_like: Placement | None, partial: bool):
    """A column-parallel bias is split like its weight's rows; a row-parallel one is whole, added
    after the reduction (partial over tp on sequence shards)."""
    if linear.bias is None:
        return None
    shape = tuple(linear.bias.shape)
    if split_like is not None:
        pl = split_like.with_(name=f"{name}.bias", global_shape=shape, dim=0)
    else:
        pl = Placement(name=f"{name}.bias", global_shape=shape, group="dp_tp" if partial else "dp",
                       tied=() if partial else ("tp",))
    return _new_param(pl, linear.bias.requires_grad)


def _colwise(linear, ctx, name, count=None, entry=None, exit=None, group="dp"):
    w = _split(linear, ctx, name, 0, count or ctx.tp, group)
    layer = ColumnParallel(w, _bias(linear, ctx, name, placement(w), False), entry, exit,
                           _adapter(linear, ctx, name, w, row_split=False))
    joint = ctx.joints.get(name.rpartition(".")[0])
    if joint is not None:  # overlapped: computed with its region's other projections
        joint.add(layer)
    return layer


def _colwise_kv(linear, ctx, name):
    """Key/value projections split by whole heads; when tp exceeds the heads, each head is
    replicated over tp / n_kv neighbours whose gradients add up (every one's query heads use it)."""
    count = min(ctx.tp, ctx.cfg.kv_heads)
    if count == ctx.tp:
        return _colwise(linear, ctx, name)
    rep = ctx.tp // count
    group = ctx.mesh.define(f"dp_tp/{rep}", lambda c: (c["pp"], c["tp"] // rep))
    return _colwise(linear, ctx, name, count=count, group=group)


def _rowwise(linear, ctx, name, entry=None, exit=None, partial=None):
    w = _split(linear, ctx, name, 1, ctx.tp)
    partial = ctx.sp if partial is None else partial
    layer = RowParallel(w, _bias(linear, ctx, name, None, partial), entry, exit or _exit(ctx),
                        _adapter(linear, ctx, name, w, row_split=True))
    if ctx.overlap and exit is None:  # the megatron exit, reduced unit by unit under the GEMM
        layer.overlap = ctx
    return layer


def _region(module, ctx, name):
    """Activations enter the block's attention / MLP once (one `f` or one sequence all-gather shared
    by all its column-parallel projections). Overlapped, the entry only casts: the projections'
    joint runs the collective with their GEMMs."""
    if ctx.overlap:
        ctx.joints[name] = ColumnJoint(ctx)
        module.register_forward_pre_hook(lambda m, args: (to_compute_dtype(args[0]), *args[1:]))
        return None
    entry = _entry(ctx)
    module.register_forward_pre_hook(lambda m, args: (entry(args[0]), *args[1:]))
    return None


def _moe_region(module, ctx, name):
    """The tokens enter once (every tp rank routes all of them the same way); the experts' gated
    partial sums leave once. The aux loss, computed whole on every tp rank, gets 1/tp of its gradient
    on each, since the router's gradients are summed over tp. The router computes in fp32 from its
    input, so the tokens enter uncast."""
    entry, exit = _entry(ctx, cast=False), _exit(ctx)
    module.register_forward_pre_hook(lambda m, args: (entry(args[0]), *args[1:]))

    def leave(m, args, out):
        m.scale_aux_grad(1.0 / ctx.tp)
        return exit(out)

    module.register_forward_hook(leave)
    return None


def _rowwise_partial(linear, ctx, name):
    """An expert's w2: its rows of the partial product, no reduction (the MoE region reduces the
    gated sum); the whole bias is added on tp rank 0 only, so its gradient is partial over tp."""
    w = _split(linear, ctx, name, 1, ctx.tp)
    return PartialRowParallel(w, _bias(linear, ctx, name, None, partial=True), ctx.rank == 0)


def _sequence_norm(module, ctx, name):
    """Under sequence parallelism a norm sees T/tp tokens: its weight's gradient is partial over tp."""
    return _partial_over_tp(module) if ctx.sp else None


def _partial_over_tp(module):
    """Each tp rank's gradient of these (replicated) parameters is a part of the whole: sum over dp and tp."""
    for p in module.parameters():
        place(p, placement(p).with_(group="dp_tp", tied=()))
    return None


def _rng(module, ctx, split: bool):
    """A dropout (or attention core) of a split region draws on this tp rank's own stream."""
    p = getattr(module, "p", getattr(module, "dropout", 0.0))  # nn.Dropout.p, CoreAttention.dropout
    return ForkedRNG(module, ctx.rank) if split and p > 0 else None


_STYLES = {
    "colwise": _colwise,
    "colwise_kv": _colwise_kv,
    "rowwise": _rowwise,
    "colwise_gather": lambda m, ctx, name: _colwise(m, ctx, name,
                                                    entry=lambda x: comm.copy_to_tp(to_compute_dtype(x), ctx.group),
                                                    exit=lambda x: comm.gather_last_dim(x, ctx.group)),
    "rowwise_split": lambda m, ctx, name: _rowwise(m, ctx, name, entry=lambda x: comm.split_last_dim(x, ctx.group),
                                                   exit=lambda x: comm.reduce_from_tp(x, ctx.group), partial=False),
    "region": lambda m, ctx, name: _region(m, ctx, name) if ctx.form == "megatron" else None,
    "sequence_norm": _sequence_norm,
    "moe_region": _moe_region,
    "moe_router": lambda m, ctx, name: _partial_over_tp(m),
    "rowwise_partial": _rowwise_partial,
    "split_rng": lambda m, ctx, name: ForkedRNG(m, ctx.rank) if m.p > 0 else None,  # a split hidden activation
    "head_rng": lambda m, ctx, name: _rng(m, ctx, ctx.form == "megatron"),  # local heads under the megatron form
    "sequence_rng": lambda m, ctx, name: _rng(m, ctx, ctx.sp),
    "vocab_embedding": lambda m, ctx, name: VocabParallelEmbedding(
        _split(m, ctx, name, 0, ctx.tp), ctx.cfg.vocab_size, _exit(ctx), ctx.shards),
    "sequence_positions": lambda m, ctx, name: _sequence_positions(m, ctx, name),
    "vocab_head": lambda m, ctx, name: _vocab_head(m, ctx, name),
    "vocab_loss": lambda m, ctx, name: VocabParallelLoss(ctx, ctx.rank, ctx.tp, ctx.cfg.vocab_size),
}


def _sequence_positions(module, ctx, name):
    if not ctx.sp:
        return None
    new = SequenceShardPositions(module.weight, ctx.shards)  # keeps the parameter and its name
    _sequence_norm(new, ctx, name)  # each rank adds only its tokens' positions: a partial gradient
    return new


def _vocab_head(module, ctx, name):
    """The output projection as a column-parallel layer over the (padded) vocabulary: logits stay
    split across ranks, which the vocab-parallel loss consumes. Tied, the embedding's piece is it."""
    if ctx.overlap:  # the entry only casts; the collective runs under the head's GEMM
        if not isinstance(module, nn.Linear):
            return VocabParallelHead(to_compute_dtype, overlap=ctx)
        layer = _colwise(module, ctx, name, entry=to_compute_dtype)
        ColumnJoint(ctx).add(layer)  # a joint of its own
        return layer
    if isinstance(module, nn.Linear):
        return _colwise(module, ctx, name, entry=_entry(ctx))
    return VocabParallelHead(_entry(ctx))


def check_tp(cfg) -> None:
    """Refuse, with the fix, tensor-parallel layouts this model's shape cannot be split into."""
    p, m = cfg.parallel, cfg.model
    tp = p.tp
    if tp == 1:
        return
    checks = [(m.n_heads % tp == 0, f"model.n_heads ({m.n_heads}) must be divisible by parallel.tp ({tp})"),
              (m.ffn_dim % tp == 0, f"the MLP width ({m.ffn_dim}, model.d_ff) must be divisible by parallel.tp ({tp})"),
              (m.vocab_size >= tp, f"model.vocab_size ({m.vocab_size}) must be at least parallel.tp ({tp})")]
    if p.tp_form == "megatron":
        checks.append((m.kv_heads % tp == 0 or tp % m.kv_heads == 0,
                       f"model.n_kv_heads ({m.kv_heads}) and parallel.tp ({tp}) must divide one another"))
    else:
        checks += [(m.kv_heads % tp == 0, f"parallel.tp_form={p.tp_form} splits key/value heads: model.n_kv_heads "
                                          f"({m.kv_heads}) must be divisible by parallel.tp ({tp})"),
                   (m.d_model % tp == 0, f"model.d_model ({m.d_model}) must be divisible by parallel.tp ({tp})"),
                   (not p.sequence_parallel, f"parallel.sequence_parallel needs parallel.tp_form=megatron "
                                             f"(this run has {p.tp_form})")]
    if p.use_sp:
        checks.append((m.seq_len % tp == 0, f"sequence parallelism splits model.seq_len ({m.seq_len}) into "
                                            f"parallel.tp ({tp}) shards, so tp must divide it"))
    for ok, why in checks:
        if not ok:
            raise ConfigError(f"{why}; choose another parallel.tp or change the model.")
    check_overlap(cfg)


def check_overlap(cfg) -> None:
    """What parallel.tp_overlap=chunked or async needs (one sentence with the fix)."""
    p, m = cfg.parallel, cfg.model
    if p.tp_overlap == "none" or p.tp == 1:
        return
    if p.tp_form != "megatron":
        raise ConfigError(f"parallel.tp_overlap={p.tp_overlap} overlaps the megatron form's region collectives (this "
                          f"run has parallel.tp_form={p.tp_form}); set parallel.tp_form=megatron or "
                          f"parallel.tp_overlap=none.")
    if p.tp_overlap == "async":
        if not cfg.train.compile or not p.use_sp:
            raise ConfigError("parallel.tp_overlap=async is inductor's fusion of sequence parallelism's gathers and "
                              "reduce-scatters with their GEMMs; set train.compile=true and "
                              "parallel.sequence_parallel=true, or parallel.tp_overlap=none.")
        return
    pieces = p.tp_overlap_chunks * (p.tp if p.use_sp else 1)
    if m.seq_len % pieces:
        raise ConfigError(f"parallel.tp_overlap_chunks ({p.tp_overlap_chunks}) splits every "
                          f"{'sequence shard' if p.use_sp else 'sequence'} into pieces, so "
                          f"{'parallel.tp x ' if p.use_sp else ''}parallel.tp_overlap_chunks ({pieces}) must divide "
                          f"model.seq_len ({m.seq_len}); choose another parallel.tp_overlap_chunks.")
    if p.pp > 1 and p.schedule == "zb-h1":  # its weight pass would rerun each function's collectives
        raise ConfigError("parallel.schedule=zb-h1 splits each backward into an input and a weight pass, while "
                          "parallel.tp_overlap=chunked computes both in one function with its collectives; set "
                          "parallel.tp_overlap=none or another parallel.schedule.")
