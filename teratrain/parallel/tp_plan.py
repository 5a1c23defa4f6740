"""Tensor parallelism's plan, as data: the style each module of a block and of the model takes, the
piece of every parameter a tp rank holds under it and the group its gradient is summed over, and
the model shapes a split needs (`check_tp`). tensor.py swaps the layers by this plan; the planner
counts bytes by it (planner/local.py). Nothing here communicates.

Styles (tensor.py says what each runs forward and backward):
    colwise      W's rows (output features) split over tp; a bias split like them
    colwise_kv   key/value projections split by whole heads; when tp exceeds model.n_kv_heads, each
                 head is held by tp / n_kv neighbours, its gradient summed over them (`dp_tp/<r>`)
    rowwise      W's columns (input features) split; the bias whole, added after the reduction
    vocab_*      the embedding's and the head's vocabulary rows split (the last piece padded)
    sequence_*   under sequence parallelism each tp rank sees T/tp tokens: a norm's or learned
                 position's gradient is partial over tp (group dp_tp)
    head_norm    model.qk_norm=head's (hs,) weight, whole on every rank: under the megatron form each
                 rank normalises its own heads, so its gradient is partial over tp (a key head held by
                 several ranks gets from each the part of its local query heads: the sum is whole)
LoRA's adapters (memory/lora.py) are split with their base weight: a column split cuts B's rows and
keeps A whole, a row split cuts A's columns and keeps B whole; the whole factor's gradient is
partial over tp.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from teratrain.config_base import ConfigError
from teratrain.models.moe import MoE
from teratrain.parallel.placement import Placement, placement

# Per-block plan: module path inside a block -> style.
BLOCK_PLAN = {
    "attention_norm": "sequence_norm", "ffn_norm": "sequence_norm",
    "attention": "region",
    "attention.wq": "colwise", "attention.wk": "colwise_kv", "attention.wv": "colwise_kv",
    "attention.wo": "rowwise", "attention.q_norm": "head_norm", "attention.k_norm": "head_norm",
    "attention.core": "head_rng", "attention.resid_dropout": "sequence_rng",
    "feed_forward": "region",
    "feed_forward.w1": "colwise", "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise",
    "feed_forward.dropout": "sequence_rng",
}
MODEL_PLAN = {
    "tok_embeddings": "vocab_embedding", "pos_embeddings": "sequence_positions", "dropout": "sequence_rng",
    "norm": "sequence_norm", "output": "vocab_head", "tied_head": "vocab_head", "criterion": "vocab_loss",
}
# The per-layer forms (parallel.tp_form=all-gather / all-reduce) turn every linear into one self-contained
# parallel layer; nothing else is split.
FORM_STYLE = {"all-gather": "colwise_gather", "all-reduce": "rowwise_split"}
# MoE blocks (models/moe.py) replace the feed_forward entries above. Megatron form: the router runs on
# the whole (gathered) tokens on every tp rank (its gradient is partial over tp, like a sequence-
# parallel norm's), each expert is split like the dense MLP, and the gated sum of the experts' partial
# outputs leaves the region once. The per-layer forms keep MoE layers whole, replicated over tp.
MOE_PLAN = {"feed_forward": "moe_region", "feed_forward.router": "moe_router"}
SHARED_EXPERT_PLAN = {"w1": "colwise", "w3": "colwise", "w2": "rowwise_partial", "dropout": "split_rng"}


@dataclass(frozen=True)
class TPSplit:
    """What the plan needs of a layout: the tp degree, this rank's tp coordinate, sequence
    parallelism, the form (parallel.tp_form) and the model's key/value heads."""

    tp: int
    rank: int
    sp: bool
    form: str
    kv_heads: int


def plan_entries(model: nn.Module, form: str) -> list[tuple[nn.Module, str, str, str]]:
    """(owner, attribute, style, global module name) of every module of `model` the plan names, in
    the order tensor.py applies them; modules absent from this model (no w3 in a GELU MLP, no learned
    positions in Llama, no output layer when tied, blocks of other pipeline stages) are skipped."""
    out = []
    for key, block in model.layers.items():
        out += _resolve(block, _block_plan(block, form), form, f"layers.{key}.")
    return out + _resolve(model, MODEL_PLAN, form, "")


def _block_plan(block: nn.Module, form: str) -> dict[str, str]:
    if not isinstance(block.feed_forward, MoE):
        return BLOCK_PLAN
    plan = {path: style for path, style in BLOCK_PLAN.items() if not path.startswith("feed_forward")}
    if form == "megatron":
        plan.update(MOE_PLAN)
        plan["feed_forward.experts"] = "experts"
        # the shared experts are split like an expert; their gate, like the router, runs whole
        if block.feed_forward.shared_expert is not None:
            plan.update({f"feed_forward.shared_expert.{leaf}": style for leaf, style in SHARED_EXPERT_PLAN.items()})
            plan["feed_forward.shared_expert_gate"] = "moe_router"
    return plan


def _resolve(root: nn.Module, plan: dict[str, str], form: str, prefix: str) -> list:
    out = []
    for path, style in plan.items():
        owner_path, _, leaf = path.rpartition(".")
        owner = root.get_submodule(owner_path) if owner_path else root
        if getattr(owner, leaf, None) is None:
            continue
        if form != "megatron" and style in ("colwise", "colwise_kv", "rowwise"):
            style = FORM_STYLE[form]
        out.append((owner, leaf, style, prefix + path))
    return out


def tp_placements(model: nn.Module, split: TPSplit) -> dict[str, Placement]:
    """The placement, by global parameter name, of every parameter of `model` (on the meta device,
    placements assigned: placement.assign_defaults) that tensor parallelism splits or whose gradient
    it makes partial over tp. The others keep theirs."""
    out: dict[str, Placement] = {}
    for owner, leaf, style, name in plan_entries(model, split.form):
        rule = _RULES.get(style)
        if rule is not None:
            rule(getattr(owner, leaf), split, name, out)
    return out


def _cut(module: nn.Module, split: TPSplit, name: str, leaf: str, dim: int, count: int,
         group: str = "dp") -> Placement:
    """`module.<leaf>` split along `dim` into `count` pieces (count < tp: each held by tp / count ranks)."""
    return Placement(name=f"{name}.{leaf}", global_shape=tuple(getattr(module, leaf).shape), dim=dim, axis="tp",
                     index=split.rank // (split.tp // count), count=count, group=group, tied=())


def _whole(module: nn.Module, name: str, leaf: str, partial: bool) -> Placement:
    """`module.<leaf>` whole on every tp rank: its gradient partial over tp, or identical (tied over tp)."""
    shape = tuple(getattr(module, leaf).shape)
    if partial:
        return Placement(name=f"{name}.{leaf}", global_shape=shape, group="dp_tp", tied=())
    return Placement(name=f"{name}.{leaf}", global_shape=shape)


def _column(module, split: TPSplit, name: str, out: dict, count: int | None = None, group: str = "dp") -> None:
    w = out[f"{name}.weight"] = _cut(module, split, name, "weight", 0, count or split.tp, group)
    if module.bias is not None:
        out[f"{name}.bias"] = w.with_(name=f"{name}.bias", global_shape=tuple(module.bias.shape), dim=0)
    if hasattr(module, "lora_a"):
        out[f"{name}.lora_b"] = _cut(module, split, name, "lora_b", 0, w.count, w.group)
        out[f"{name}.lora_a"] = _whole(module, name, "lora_a", partial=True)


def _column_kv(module, split: TPSplit, name: str, out: dict) -> None:
    count = min(split.tp, split.kv_heads)
    group = "dp" if count == split.tp else f"dp_tp/{split.tp // count}"
    _column(module, split, name, out, count, group)


def _row(module, split: TPSplit, name: str, out: dict, partial: bool) -> None:
    out[f"{name}.weight"] = _cut(module, split, name, "weight", 1, split.tp)
    if module.bias is not None:
        out[f"{name}.bias"] = _whole(module, name, "bias", partial)
    if hasattr(module, "lora_a"):
        out[f"{name}.lora_a"] = _cut(module, split, name, "lora_a", 1, split.tp)
        out[f"{name}.lora_b"] = _whole(module, name, "lora_b", partial=True)


def _experts(module, split: TPSplit, name: str, out: dict) -> None:
    """The expert stacks (models/moe.py's Experts) split like the dense MLP, expert by expert: w1, w3
    and their biases by rows of d_ff (dim 1), w2 by its d_ff columns (dim 2); b2 whole, added on tp
    rank 0 only (its gradient partial over tp), as the MoE region reduces the gated sum."""
    for leaf, dim in (("w1", 1), ("w3", 1), ("w2", 2), ("b1", 1), ("b3", 1)):
        if getattr(module, leaf) is not None:
            out[f"{name}.{leaf}"] = _cut(module, split, name, leaf, dim, split.tp)
    if module.b2 is not None:
        out[f"{name}.b2"] = _whole(module, name, "b2", partial=True)


def _partial_over_tp(module, name: str, out: dict) -> None:
    """Each tp rank's gradient of these (replicated) parameters is a part of the whole: sum over dp and tp."""
    for leaf, p in module.named_parameters():
        out[f"{name}.{leaf}"] = placement(p).with_(group="dp_tp", tied=())


def _vocab_head(module, split: TPSplit, name: str, out: dict) -> None:
    if isinstance(module, nn.Linear):  # tied: the embedding's piece is the head, nothing more to place
        _column(module, split, name, out)


_RULES = {
    "colwise": _column,
    "colwise_kv": _column_kv,
    "rowwise": lambda m, s, name, out: _row(m, s, name, out, partial=s.sp),
    "colwise_gather": _column,
    "rowwise_split": lambda m, s, name, out: _row(m, s, name, out, partial=False),
    "rowwise_partial": lambda m, s, name, out: _row(m, s, name, out, partial=True),  # the shared experts' w2: the
    # MoE region reduces the gated sum, the whole bias is added on tp rank 0 only
    "experts": _experts,
    "sequence_norm": lambda m, s, name, out: _partial_over_tp(m, name, out) if s.sp else None,
    "sequence_positions": lambda m, s, name, out: _partial_over_tp(m, name, out) if s.sp else None,
    "moe_router": lambda m, s, name, out: _partial_over_tp(m, name, out),
    "head_norm": lambda m, s, name, out: _partial_over_tp(m, name, out) if s.form == "megatron" else None,
    "vocab_embedding": lambda m, s, name, out: out.update({f"{name}.weight": _cut(m, s, name, "weight", 0, s.tp)}),
    "vocab_head": _vocab_head,
}


def splits_kv_heads(kv_heads: int, tp: int, form: str) -> bool:
    """Whether `tp` ranks can hold the key/value heads: split evenly, or in the megatron form also replicated,
    one whole head a rank (colwise_kv) where tp is a multiple of them."""
    return kv_heads % tp == 0 or (form == "megatron" and tp % kv_heads == 0)


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
        checks.append((splits_kv_heads(m.kv_heads, tp, p.tp_form),
                       f"model.n_kv_heads ({m.kv_heads}) and parallel.tp ({tp}) must divide one another"))
        checks.append((m.qk_norm != "full", f"model.qk_norm=full normalises over the whole q and k widths, which "
                                            f"parallel.tp_form=megatron splits over parallel.tp ({tp}) ranks (the "
                                            f"all-gather form keeps them whole)"))
    else:
        checks += [(splits_kv_heads(m.kv_heads, tp, p.tp_form),
                    f"parallel.tp_form={p.tp_form} splits key/value heads: model.n_kv_heads "
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
    if p.tp_form == "megatron" and m.moe.shared_experts and cfg.lora.rank and "w2" in cfg.lora.targets:
        raise ConfigError("lora.targets names w2, and under tensor parallelism the shared experts' w2 is a partial "
                          "row-parallel product that carries no adapter; drop w2 from lora.targets or set "
                          "parallel.tp=1.")
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
