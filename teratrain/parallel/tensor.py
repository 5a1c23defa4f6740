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
- `all-gather` (a per-layer form): each linear keeps W's columns W' and computes X W'; the outputs
  are all-gathered. Everything between linears is replicated.
- `all-reduce` (a per-layer form): X and W are split along the inner dimension and the partial
  products X'' W'' are all-reduced.
The embedding is vocab-parallel (rows split, padded to a multiple of tp) and so is the head; the
loss is computed from vocab-parallel logits, so the full logits never exist on one rank.
The plan (which style each module takes, which piece of each parameter a rank holds, its gradient's
group) is data in parallel/tp_plan.py, which the planner reads too; this module swaps the layers by
it. Communication functions and what they run forward/backward are in parallel/comm.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from teratrain.models.layers import to_compute_dtype
from teratrain.parallel import comm
from teratrain.parallel.placement import Placement, place
from teratrain.parallel.tp_layers import (ColumnParallel, ForkedRNG, PartialRowParallel, RowParallel,
                                          SequenceShardPositions, SequenceShards, VocabParallelEmbedding,
                                          VocabParallelHead, VocabParallelLoss)
from teratrain.parallel.tp_overlap import ColumnJoint
from teratrain.parallel.tp_plan import TPSplit, plan_entries, tp_placements


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
    # linears keep their input's sequence shard (comm.Regather); not under ZB-H1, whose split backward
    # has no weight rule for that Function and would run its backward again in W
    keep_shard: bool = True
    placements: dict[str, Placement] = field(default_factory=dict)  # tp_plan.tp_placements, by global name

    def __post_init__(self):
        self.shards = SequenceShards(self.tp, self.rank, self.chunks) if self.sp else None
        self.joints: dict[str, ColumnJoint] = {}  # region name -> its column-parallel projections

    @property
    def group(self):
        return self.mesh.group("tp")


def apply_tp(model: nn.Module, rt, cfg) -> None:
    """Swap the meta-device model's layers for tensor-parallel ones, each new parameter holding its
    piece and placement (tp_plan.tp_placements); the whole parameters whose gradients become partial
    over tp get their new placements too."""
    p = cfg.parallel
    ctx = TPContext(rt.mesh, rt.dims.tp, rt.coord("tp"), p.use_sp, p.tp_form, cfg.model, overlap_chunks(p),
                    p.tp_overlap == "chunked", keep_shard=not (p.pp > 1 and p.schedule == "zb-h1"))
    ctx.placements = tp_placements(model, TPSplit(ctx.tp, ctx.rank, ctx.sp, ctx.form, cfg.model.kv_heads))
    for group in sorted({pl.group for pl in ctx.placements.values() if pl.group.startswith("dp_tp/")}):
        rep = int(group.split("/")[1])  # the dp x tp ranks holding the same replicated key/value heads
        rt.mesh.define(group, lambda c, rep=rep: (c["pp"], c["tp"] // rep))
    for owner, leaf, style, name in plan_entries(model, ctx.form):
        new = _STYLES[style](getattr(owner, leaf), ctx, name)
        if new is not None:
            setattr(owner, leaf, new)
    for name, param in model.named_parameters():
        if name in ctx.placements:
            place(param, ctx.placements[name])


def overlap_chunks(p) -> int:
    """Units each overlapped collective is split into (1: not overlapped)."""
    return p.tp_overlap_chunks if p.tp_overlap == "chunked" else 1


def _entry(ctx: TPContext, cast: bool = True):
    """How activations enter a region whose ranks each need all of them: cast once to the compute
    dtype where only autocast matmuls read them (`cast`), then gathered (or Megatron's `f`)."""
    def enter(x):
        x = to_compute_dtype(x) if cast else x
        if not ctx.sp:
            return comm.copy_to_tp(x, ctx.group)
        if cast and ctx.keep_shard:  # read by linears only: they keep the shard and gather it again in backward
            return comm.gather_sequence_to_linears(x, ctx.group, ctx.chunks)
        return comm.gather_sequence(x, ctx.group, ctx.chunks)
    return enter


def _exit(ctx: TPContext):
    """How a region's partial sums leave it."""
    if ctx.sp:
        return lambda x: comm.reduce_scatter_sequence(x, ctx.group, ctx.chunks)
    return lambda x: comm.reduce_from_tp(x, ctx.group)


def _param(module: nn.Module, ctx: TPContext, name: str, leaf: str) -> nn.Parameter | None:
    """The meta-device piece of `module.<leaf>` that its placement gives this rank (None: no such tensor)."""
    full = getattr(module, leaf, None)
    if full is None:
        return None
    pl = ctx.placements[f"{name}.{leaf}"]
    p = nn.Parameter(torch.empty(pl.local_shape(), device="meta"), requires_grad=full.requires_grad)
    place(p, pl)
    return p


def _adapter(linear: nn.Module, ctx: TPContext, name: str, row_split: bool):
    """LoRA's A and B split consistently with the base weight (memory/lora.py, tp_plan.py)."""
    if not hasattr(linear, "lora_a"):
        return None
    a, b = _param(linear, ctx, name, "lora_a"), _param(linear, ctx, name, "lora_b")
    drop = linear.dropout  # on X: replicated for a column split (masks agree), split for a row split
    return a, b, linear.scale, (_rng(drop, ctx, True) or drop) if row_split else drop


def _colwise(linear, ctx, name, entry=None, exit=None):
    layer = ColumnParallel(_param(linear, ctx, name, "weight"), _param(linear, ctx, name, "bias"), entry, exit,
                           _adapter(linear, ctx, name, row_split=False))
    joint = ctx.joints.get(name.rpartition(".")[0])
    if joint is not None:  # overlapped: computed with its region's other projections
        joint.add(layer)
    return layer


def _rowwise(linear, ctx, name, entry=None, exit=None):
    layer = RowParallel(_param(linear, ctx, name, "weight"), _param(linear, ctx, name, "bias"), entry,
                        exit or _exit(ctx), _adapter(linear, ctx, name, row_split=True))
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
    """The shared experts' w2: its rows of the partial product, no reduction (the MoE region reduces the
    gated sum); the whole bias is added on tp rank 0 only, so its gradient is partial over tp."""
    return PartialRowParallel(_param(linear, ctx, name, "weight"), _param(linear, ctx, name, "bias"), ctx.rank == 0)


def _experts(experts, ctx, name):
    """The expert stacks' pieces of this tp rank (tp_plan.py `_experts`), in place: every expert split
    like the dense MLP, its hidden dropout on this rank's stream, b2 added on tp rank 0 only."""
    for leaf in ("w1", "w3", "w2", "b1", "b3", "b2"):
        piece = _param(experts, ctx, name, leaf)
        if piece is not None:
            setattr(experts, leaf, piece)
    experts.bias_share = 1.0 if ctx.rank == 0 else 0.0
    experts.dropout = ForkedRNG(experts.dropout, ctx.rank) if experts.dropout.p > 0 else experts.dropout
    return None


def _rng(module, ctx, split: bool):
    """A dropout (or attention core) of a split region draws on this tp rank's own stream."""
    p = getattr(module, "p", getattr(module, "dropout", 0.0))  # nn.Dropout.p, CoreAttention.dropout
    return ForkedRNG(module, ctx.rank) if split and p > 0 else None


_STYLES = {  # how each style of the plan (tp_plan.py) swaps a module; None: it is kept
    "colwise": _colwise,
    "colwise_kv": _colwise,  # its piece (whole heads, maybe replicated) is the placement's
    "rowwise": _rowwise,
    "colwise_gather": lambda m, ctx, name: _colwise(m, ctx, name,
                                                    entry=lambda x: comm.copy_to_tp(to_compute_dtype(x), ctx.group),
                                                    exit=lambda x: comm.gather_last_dim(x, ctx.group)),
    "rowwise_split": lambda m, ctx, name: _rowwise(m, ctx, name, entry=lambda x: comm.split_last_dim(x, ctx.group),
                                                   exit=lambda x: comm.reduce_from_tp(x, ctx.group)),
    "region": lambda m, ctx, name: _region(m, ctx, name) if ctx.form == "megatron" else None,
    "sequence_norm": lambda m, ctx, name: None,  # replicated: only its placement changes (partial under sp)
    "moe_region": _moe_region,
    "moe_router": lambda m, ctx, name: None,  # replicated: its gradient is partial over tp (its placement)
    "head_norm": lambda m, ctx, name: None,  # replicated: each rank normalises its heads (its placement)
    "rowwise_partial": _rowwise_partial,
    "experts": _experts,
    "split_rng": lambda m, ctx, name: ForkedRNG(m, ctx.rank) if m.p > 0 else None,  # a split hidden activation
    "head_rng": lambda m, ctx, name: _rng(m, ctx, ctx.form == "megatron"),  # local heads under the megatron form
    "sequence_rng": lambda m, ctx, name: _rng(m, ctx, ctx.sp),
    "vocab_embedding": lambda m, ctx, name: VocabParallelEmbedding(
        _param(m, ctx, name, "weight"), ctx.cfg.vocab_size, _exit(ctx), ctx.shards),
    "sequence_positions": lambda m, ctx, name: _sequence_positions(m, ctx, name),
    "vocab_head": lambda m, ctx, name: _vocab_head(m, ctx, name),
    "vocab_loss": lambda m, ctx, name: VocabParallelLoss(ctx, ctx.rank, ctx.tp, ctx.cfg.vocab_size),
}


def _sequence_positions(module, ctx, name):
    if not ctx.sp:
        return None
    return SequenceShardPositions(module.weight, ctx.shards)  # keeps the parameter and its name


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
