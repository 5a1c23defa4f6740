"""Model states per rank: parameters, gradients, optimizer state (Rajbhandari et al. 2020, "ZeRO").

ZeRO's accounting (sec. 3.1, Figure 1): mixed-precision Adam over Psi parameters keeps 2*Psi bytes
of fp16/bf16 parameters, 2*Psi of gradients and K*Psi = 12*Psi of optimizer state (fp32 master
copy + two fp32 moments): 16*Psi in all, 24 GB for the 1.5B GPT-2. Over N data-parallel ranks:
    stage 1 (P_os):       2*Psi + 2*Psi + K*Psi/N
    stage 2 (P_os+g):     2*Psi + (2 + K)*Psi/N
    stage 3 (P_os+g+p):   (2 + 2 + K)*Psi/N
Our engines differ in ways counted here, each mirrored from the code:
- LocalEngine / DataParallelEngine (zero=0): bf16 autocast keeps fp32 params and grads (4 + 4) and no
  master copy; fp16, or memory.master_weights=true, keeps 2 + 2 and a 4-byte master in the optimizer.
  Fused AdamW adds one 4-byte `step` tensor per parameter tensor.
- ZeroEngine (parallel/zero.py): flat groups (stage 1/2: buckets of ~parallel.bucket_mb; stage 3: one
  per block plus a root group) each padded to a multiple of dp, so a rank holds ceil(numel/dp) of
  every group. Gradients are in parallel.grad_dtype (fp32 by default, 4 bytes; bf16, 2): stage 1
  keeps the full buffer and reduce-scatters it in place (its shard is a range of it, Megatron-LM's
  distributed optimizer), stages 2/3 keep the shard. With grad_dtype=bf16, stages 1 and 2 are the
  paper's formulas exactly; stage 3 is 2*Psi/N below them (no 2-byte parameter shard beside the
  fp32 master), and with fp32 gradients its total equals the paper's 16*Psi/N. Offload moves
  masters and moments to pinned host memory plus a host copy of the gradient shard; offload=params
  also moves stage-3 parameter shards there. Stage 3 under a
  pipeline schedule keeps the full buffers, as stage 1 does (zero.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import groupby

from teratrain.config_schema import compile_scope_problem, per_op_problem
from teratrain.memory.fp8 import gathers_in_float8
from teratrain.parallel.buckets import ordered_buckets
from teratrain.parallel.cp_plan import cp_problem
from teratrain.parallel.flat import WHOLE_PARAM_OPTIMIZERS, FlatGroup
from teratrain.parallel.pipeline.partition import counts_problem
from teratrain.parallel.pipeline.schedules import ASYNC_SCHEDULES, config_name, problem
from teratrain.parallel.support import grad_dtype_problem, zero_problem
from teratrain.planner.layout import Layout, ModelShape, Training, ceil_div
from teratrain.planner.local import group_size, local_tensors


class PlanError(ValueError):
    """A layout the engines refuse (the rules of parallel/support.py check_supported)."""


def zero_paper_bytes(psi: float, dp: int, stage: int, k: int = 12) -> float:
    """Per-rank model-state bytes exactly as the ZeRO paper counts them (sec. 5.1, Figure 1):
    2-byte params and grads, K bytes of optimizer state per parameter. Our engines differ where
    states.model_states says (4-byte gradients unless parallel.grad_dtype=bf16; no 2-byte parameter
    shard at stage 3); this is the reference."""
    params, grads, opt = 2 * psi, 2 * psi, k * psi
    if stage >= 1:
        opt /= dp
    if stage >= 2:
        grads /= dp
    if stage >= 3:
        params /= dp
    return params + grads + opt


def check_layout(shape: ModelShape, train: Training, lay: Layout) -> None:
    grad_dtype = "bf16" if train.grad_bytes == 2 else "fp32"
    low = train.precision != "fp32" and train.uses_masters(lay.zero, lay.offload)
    why = (zero_problem(lay.zero, lay.offload) or grad_dtype_problem(grad_dtype, lay.zero, low)
           or compile_scope_problem(train.compiled, train.compile_scope, train.graphed, lay.recompute, lay.zero)
           or per_op_problem(lay.recompute, lay.schedule, lay.pp, train.compiled, train.compile_scope, lay.zero))
    if why:
        raise PlanError(why.split(";")[0])
    if train.lora and shape.is_bare:
        raise PlanError("the planner counts LoRA adapters on a model shape, not on a bare parameter count")
    if shape.is_bare and train.optimizer in WHOLE_PARAM_OPTIMIZERS:
        raise PlanError(f"optim.name={train.optimizer} factors each matrix by its rows and columns, which a bare "
                        "parameter count does not give")
    if lay.cp > 1 and shape.cfg is not None:  # the planner plans all-reduce data parallelism only
        c = shape.cfg
        why = cp_problem(lay.cp, lay.cp_form, c.seq_len, c.n_heads, lay.tp, lay.sequence_parallel, train.dropout,
                         "allreduce", train.graphed, lay.pp, config_name(lay.schedule))
        if why:
            raise PlanError(why.split(";")[0])
    if lay.pp > 1:
        why = problem(lay.schedule, lay.pp, lay.num_microbatches, lay.virtual_stages)
        if why:
            raise PlanError(why.rstrip("."))
        S, counts = lay.pp * lay.virtual_stages, lay.stage_layers
        if shape.cfg is not None and S > shape.cfg.n_layers + 2 and not counts:
            raise PlanError(f"{shape.cfg.n_layers} layers cannot fill {S} pipeline stages (parallel.pp x "
                            "parallel.virtual_stages) with a block each but the first and the last")
        why = counts_problem(counts, S, shape.cfg.n_layers if shape.cfg else sum(counts)) if counts else None
        if why:
            raise PlanError(f"parallel.stage_layers={list(counts)} is no split: {why}")
        if lay.zero == 3 and config_name(lay.schedule) in ASYNC_SCHEDULES:
            raise PlanError(f"parallel.zero=3 does not compose with the asynchronous schedule {config_name(lay.schedule)} "
                            "(parallelize.py says why)")


def accumulates(lay: Layout) -> bool:
    """Does ZeroEngine keep full fp32 gradients across micro-steps and reduce them once per step?"""
    return lay.zero == 1 or (lay.zero == 3 and lay.pp > 1)


def _exact(shape: ModelShape, lay: Layout) -> bool:
    """Layouts whose per-rank tensors come from the real transforms (planner/local.py): every one
    with a model shape (a bare parameter count has no tensors)."""
    return not shape.is_bare


@lru_cache(maxsize=4096)
def _stage_params(shape, tp: int, sp: bool, form: str, lora: tuple, pp: int, virtual_stages: int, ep: int,
                  stage_layers: tuple = ()) -> tuple:
    """stage_params of a shaped model, once per distinct layout (the search asks for it per term).
    With uneven stages a middle rank may hold more blocks than the first (Llama 3's 7, 8 x 14, 7): the
    first end then counts as the fuller of the two (its largest block times the middle's block count)."""
    first = local_tensors(shape, tp, sp, form, lora, pp, virtual_stages, 0, ep, stage_layers)
    last = local_tensors(shape, tp, sp, form, lora, pp, virtual_stages, pp - 1, ep, stage_layers)
    def block_sizes(tensors) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in tensors:
            if t.block is not None:
                out[t.block] = out.get(t.block, 0) + t.numel()
        return out

    blocks = block_sizes(first)
    layers = len(blocks)
    blocks = blocks or block_sizes(last)  # the first stage holds the embedding alone: a block's size from the last
    rank_layers = [sum(stage_layers[c * pp + r] for c in range(virtual_stages)) for r in range(1, pp - 1)] \
        if stage_layers else []
    middle = max(rank_layers, default=0) * max(blocks.values(), default=0)
    return tuple({"first": max(middle, sum(t.numel() for t in first)), "last": sum(t.numel() for t in last),
                  "root": max(sum(t.numel() for t in ts if t.block is None) for ts in (first, last)),
                  "block": max(blocks.values(), default=0), "layers": layers,
                  "experts": sum(t.numel() for t in first if is_expert(t)),
                  "float8": sum(t.numel() for t in first if t.float8)}.items())


def _tensors(shape: ModelShape, lay: Layout, lora: tuple = (), end: str = "fuller", expert_tensors: bool = False):
    """The tensors of the first or last pipeline stage's ranks, or of the fuller of the two (`lora`:
    Training.lora, LoRA's adapters; `expert_tensors`: Training.expert_tensors, each stack of experts
    as the expert tensors a run recorded before the stacks held, in their order)."""

    def at(stage_rank: int):
        return local_tensors(shape, lay.tp, lay.sequence_parallel, lay.tp_form, lora, lay.pp, lay.virtual_stages,
                             stage_rank, lay.ep, lay.stage_layers)
    first, last = at(0), at(lay.pp - 1)
    if end == "fuller":
        end = "last" if sum(t.numel() for t in last) >= sum(t.numel() for t in first) else "first"
    tensors = first if end == "first" else last
    return _unstacked(tensors) if expert_tensors else tensors


def stepped_tensors(shape: ModelShape, train: Training, lay: Layout) -> int:
    """Parameter tensors a rank's optimizer steps: the trainable ones of the fuller pipeline end, or under ZeRO the
    pieces of them its shard holds. A bare parameter count has no tensors to count: 0."""
    if not _exact(shape, lay):
        return 0
    if lay.zero:  # the pieces of the flat groups' shards this rank owns (parallel/zero.py steps each)
        sp = stage_params(shape, lay, train)
        return max(1, zero_summary(shape, train, lay, max(sp["first"], sp["last"]))["pieces"])
    return _trained(shape, train.lora, train.expert_tensors, lay.tp, lay.sequence_parallel, lay.tp_form, lay.pp,
                    lay.virtual_stages, lay.ep, lay.stage_layers)


@lru_cache(maxsize=4096)
def _trained(shape, lora, expert_tensors, tp, sp, form, pp, virtual_stages, ep, stage_layers) -> int:
    """stepped_tensors without ZeRO, once per distinct layout of the tensors (the search asks per candidate)."""
    lay = Layout(tp=tp, sequence_parallel=sp, tp_form=form, pp=pp, virtual_stages=virtual_stages, ep=ep,
                 stage_layers=stage_layers)
    return sum(t.trainable for t in _tensors(shape, lay, lora, expert_tensors=expert_tensors))


def trainable_params(shape: ModelShape, lora: tuple) -> int:
    """Parameters the optimizer trains in the whole model (one rank, no layout): LoRA's adapters where `lora`
    (Training.lora) is set, else every parameter."""
    return sum(math.prod(t.shape) for t in _tensors(shape, Layout(), lora) if t.trainable)


_EXPERT_ORDER = ("w1", "b1", "w3", "b3", "w2", "b2")  # an expert's own parameters: w1, w3, w2, each weight, bias


def _unstacked(tensors) -> tuple:
    """Each layer's expert stacks (models/moe.py Experts) as per-expert tensors, expert by expert."""
    out = []
    for stacked, run in groupby(tensors, key=lambda t: ".experts." in t.name):  # a layer's stacks lie together
        run = sorted(run, key=lambda x: _EXPERT_ORDER.index(x.name.rsplit(".", 1)[1])) if stacked else list(run)
        out += [replace(x, name=f"{x.name}.{e}", shape=x.shape[1:]) for e in range(run[0].shape[0]) for x in run] \
            if stacked else run
    return tuple(out)


def stage_params(shape: ModelShape, lay: Layout, train: Training | None = None) -> dict[str, int]:
    """Parameters a rank holds: the first and the last pipeline stage (`train` adds LoRA's adapters);
    `block` is the largest block, `experts` the expert parameters (reduced over dp/ep ranks), `float8`
    the first stage's weights memory.fp8 runs in float8."""
    if _exact(shape, lay):
        return dict(_stage_params(shape, lay.tp, lay.sequence_parallel, lay.tp_form, train.lora if train else (),
                                  lay.pp, lay.virtual_stages, lay.ep, lay.stage_layers))
    p = ceil_div(shape.bare_params, lay.tp * lay.pp)
    return {"first": p, "last": p, "block": 0, "layers": 0, "root": p, "experts": 0, "float8": 0}


def rank_layers(shape: ModelShape, lay: Layout) -> float:
    """Blocks of the average pipeline rank, n_layers / pp: what one rank's per-block time terms (its ops,
    tensor- and context-parallel exchanges) count, as its compute does (time.rank_flops divides by pp);
    pipeline.makespan then weighs each stage by its own blocks. stage_params' `layers`, the first rank's
    count, is for memory: with uneven stages (BLOOM's 5, 6 x 10, 5) it is not the average."""
    return 0.0 if shape.is_bare else shape.cfg.n_layers / lay.pp


@dataclass(frozen=True)
class _Sized:
    """A parameter as FlatGroup sees it, for layouts the planner approximates (1-D, trainable)."""

    shape: tuple[int, ...]
    trainable: bool = True

    def numel(self) -> int:
        return math.prod(self.shape)


def zero_groups(shape: ModelShape, train: Training, lay: Layout, local: int) -> list[tuple[list, int, object]]:
    """(members, ranks sharing them, gather unit) per ZeroEngine flat group: the engine's grouping
    (parallel/zero.py `_make_groups`: by reduction group, tied axes and trainability; stage 1/2
    `ordered_buckets` counted in the compute dtype, stage 3 per block then the root, a block's groups
    gathered together) over the tensors the real transforms leave on a rank. A bare parameter count
    is cut into bucket-sized 1-D groups."""
    w = train.widths(lay.zero, lay.offload)
    bucket_bytes = int(train.bucket_mb * 2**20)
    if _exact(shape, lay):
        grouping = Layout(dp=lay.replicas, tp=lay.tp, pp=lay.pp, ep=lay.ep, zero=3 if lay.zero == 3 else 1,
                          sequence_parallel=lay.sequence_parallel, tp_form=lay.tp_form,
                          virtual_stages=lay.virtual_stages, stage_layers=lay.stage_layers)
        groups = _zero_groups(shape, grouping, train.lora, bucket_bytes, w.param, gathers_float8(train, lay),
                              train.expert_tensors)
        return [(list(members), ranks, key) for members, ranks, key in groups]
    per = max(1, bucket_bytes // w.param)
    sizes = [per] * (local // per) + ([local % per] if local % per else [])
    return [([_Sized((n,))], lay.replicas, i) for i, n in enumerate(sizes)]


@lru_cache(maxsize=1024)
def _zero_groups(shape: ModelShape, lay: Layout, lora: tuple, bucket_bytes: int, param_bytes: int, in8: bool,
                 expert_tensors: bool = False) -> tuple:
    """zero_groups of a shaped model, once per distinct layout (the search asks for it per candidate and term):
    `lay` with only what the grouping reads (tensor, pipeline and expert degrees, ZeRO-3 or not, replicas)."""
    tensors = _tensors(shape, lay, lora, expert_tensors=expert_tensors)
    if lay.zero == 3:
        keys = [k for k in dict.fromkeys(t.block for t in tensors) if k is not None][::-1] + [None]
        units = [(key, [t for t in tensors if t.block == key]) for key in keys]  # last block first, root last
        # float8-gathered weights (in8) form groups of their own (zero_fp8.py)
        buckets = [(key, b) for key, unit in units for b in
                   ordered_buckets(unit[::-1], math.inf, lambda t: _key(t) + (in8 and t.float8,), lambda t: 1)]
    else:
        buckets = [(None, b) for b in ordered_buckets(tensors, bucket_bytes, _key, lambda t: param_bytes)]
    return tuple((tuple(t for _, t in b.members), group_size(b.key[0], lay.dp, lay.tp, lay.ep), key)
                 for key, b in buckets)


def gathers_float8(train: Training, lay: Layout) -> bool:
    """Does ZeRO-3 gather the float8 linears' weights in float8 under this layout (memory/fp8.py)?"""
    return gathers_in_float8(lay.zero, train.fp8, train.fp8_gather)


def is_expert(t) -> bool:
    """A tensor of the experts: reduced over the dp / ep ranks that hold it (planner/local.py)."""
    return t.group.startswith("ep_replicas")


def dp_buckets(shape: ModelShape, train: Training, lay: Layout) -> list[list]:
    """DataParallel's buckets (parallel/data.py: ~parallel.bucket_mb by reduction group, counted in the
    parameters' own width) over the trainable tensors of the fuller pipeline end: their members."""
    w = train.widths(lay.zero, lay.offload)
    tensors = [(t.name, t) for t in _tensors(shape, lay, train.lora, expert_tensors=train.expert_tensors) if t.trainable]
    return [[t for _, t in b.members]
            for b in ordered_buckets(tensors, int(train.bucket_mb * 2**20), lambda t: t.group, lambda t: w.param)]


def _key(t) -> tuple:
    return (t.group, t.tied, t.trainable)  # ZeroEngine's `_key`


def zero_summary(shape: ModelShape, train: Training, lay: Layout, local: int) -> dict:
    """What the memory model needs of the flat groups, computed once per distinct layout."""
    return dict(_zero_summary(shape, train, lay.zero == 3, lay.tp, lay.pp, lay.ep, lay.replicas, local,
                              lay.sequence_parallel, lay.tp_form, lay.virtual_stages, lay.stage_layers))


@lru_cache(maxsize=4096)
def _zero_summary(shape, train: Training, zero3: bool, tp: int, pp: int, ep: int, dp: int, local: int, sp: bool,
                  form: str, virtual_stages: int = 1, stage_layers: tuple = ()) -> tuple:
    """Rank 0's shards from the engine's own `FlatGroup` over the planned members (parallel/flat.py:
    equal flat shards, or whole parameters dealt to ranks for Adafactor/SM3)."""
    lay = Layout(dp=dp, tp=tp, pp=pp, ep=ep, zero=3 if zero3 else 1, sequence_parallel=sp, tp_form=form,
                 virtual_stages=virtual_stages, stage_layers=stage_layers)
    whole = train.optimizer in WHOLE_PARAM_OPTIMIZERS
    planned = zero_groups(shape, train, lay, local)
    groups = [FlatGroup([""] * len(m), m, n, 0, whole) for m, n, _ in planned]
    trained = [g for g in groups if g.params[0].trainable]
    # groups reduced at the step across pipeline stages keep a full fp32 accumulator at every stage (zero.py)
    spans = [g for (m, _, _), g in zip(planned, groups)
             if g.params[0].trainable and getattr(m[0], "group", None) == "pp_ends"]
    owned = tuple(g.shapes[pc.index] if whole else (pc.numel,) for g in trained for pc in g.pieces)
    sums = [g.numel for g in groups] or [0]
    in8 = gathers_float8(train, lay)

    def is8(members: list) -> bool:  # a group gathered in float8: its members share the flag (zero_groups)
        return in8 and getattr(members[0], "float8", False)

    units: dict = {}  # stage 3 gathers every group of a block together (zero_gather.py)
    units8: dict = {}  # of which gathered at 1 byte: float8 groups (zero_fp8.py)
    for (members, _, key), g in zip(planned, groups):
        units[key] = units.get(key, 0) + g.numel
        units8[key] = units8.get(key, 0) + (g.numel if is8(members) else 0)
    blocks = [n for key, n in units.items() if key is not None] if zero3 and len(units) > 1 else sums
    float8 = [g for (m, _, _), g in zip(planned, groups) if is8(m)]
    return tuple({"shard": sum(g.shard_numel for g in trained), "pieces": len(owned), "owned": owned,
                  "padded": sum(g.padded for g in trained),
                  "deferred_padded": sum(g.padded for g in spans), "deferred_shard": sum(g.shard_numel for g in spans),
                  "all_shard": sum(g.shard_numel for g in groups),
                  "all_padded": sum(g.padded for g in groups),
                  "groups": len(sums), "biggest": max(sums), "typical": sorted(sums)[len(sums) // 2],
                  "block": max(blocks), "blocks": len(blocks), "block_float8": max(units8.values(), default=0),
                  # each float8 group's kept 1-byte shard, its scales (fp32) and piece index (int64)
                  "float8_padded": sum(g.padded for g in float8),
                  "float8_bytes": sum(g.shard_numel + 4 * len(g.params) + 8 * len(g.pieces) for g in float8),
                  "root": units.get(None, 0) if zero3 and len(units) > 1 else sums[-1]}.items())


def optimizer_elems(train: Training, shapes: list[tuple[int, ...]], numel: int, sharded: bool) -> int:
    """fp32 optimizer-state elements (master copy excluded). AdamW: m and v (Loshchilov & Hutter);
    SGD: one momentum buffer; Adafactor (Shazeer & Stern 2018, torch.optim.Adafactor): for rank >= 2,
    second-moment sums over the last dim and over the second-to-last (shapes[:-1] and
    shapes[:-2] + shapes[-1:]), full for vectors; SM3 (Anil et al. 2019, optim/sm3.py): the same
    sums, one accumulator per row and per column of each matrix (a stack of experts' matrices: of
    each), full for vectors, plus a full momentum buffer when optim.momentum > 0. Flat shards (ZeRO)
    factor as whole 1-D pieces."""
    name = train.optimizer
    if name == "adamw":
        return 2 * numel
    if name == "sgd":
        return numel if train.momentum > 0 else 0
    if name not in ("adafactor", "sm3"):
        raise PlanError(f"optimizer {name!r} is unknown to the planner")
    if sharded or not shapes:
        return numel + (numel if name == "sm3" and train.momentum > 0 else 0)  # a 1-D piece factors into itself
    factors = sum(math.prod(s[:-1]) + math.prod(s[:-2]) * s[-1] if len(s) >= 2 else math.prod(s) for s in shapes)
    return factors + (numel if name == "sm3" and train.momentum > 0 else 0)


def _replica_states(shape, train: Training, lay: Layout, local: int, w, steps: int) -> dict[str, int]:
    """Unsharded replica (LocalEngine / DataParallelEngine): gradients, masters and optimizer state for
    the trainable parameters only; frozen ones (LoRA's base) stay fp32, or bf16 with lora.base_dtype."""
    if _exact(shape, lay):
        tensors = _tensors(shape, lay, train.lora)
        trained = [t.shape for t in tensors if t.trainable]
        n_train = sum(map(math.prod, trained))
        elems, n_tensors = optimizer_elems(train, trained, n_train, False), len(trained)
        params = n_train * w.param + (local - n_train) * train.frozen_width
    else:
        (elems, n_tensors), n_train = _local_opt_elems(train, shape, local), local
        params = local * w.param
    opt = elems * 4 + n_train * w.master + steps * n_tensors
    return {"params": params, "grads": n_train * w.grad, "optimizer": opt, "host": 0, "gpu_params": params,
            "gpu_grads": n_train * w.grad, "gpu_optimizer": opt, "local_params": local, "shard": local,
            "padded": local}


def _local_opt_elems(train: Training, shape: ModelShape, local: int) -> tuple[int, int]:
    """(optimizer elements, parameter tensors) of an unsharded replica holding `local` params of a
    bare parameter count: scaled by local/total."""
    full = [s for _, s in shape.param_shapes()]
    if not full:
        return optimizer_elems(train, [], local, False), 0
    total = sum(math.prod(s) for s in full)
    elems = optimizer_elems(train, full, total, False)
    return ceil_div(elems * local, total), ceil_div(len(full) * local, total)


def model_states(shape: ModelShape, train: Training, lay: Layout, device: str = "cuda") -> dict[str, int]:
    """Bytes of params, grads, optimizer of the worst rank, as each engine's state_bytes() counts
    them (host copies included in their category), and `host`: the part in CPU memory."""
    check_layout(shape, train, lay)
    w = train.widths(lay.zero, lay.offload)
    sp = stage_params(shape, lay, train)
    local = max(sp["first"], sp["last"])
    steps = 4 if train.optimizer in ("adamw", "adafactor") else 0  # fp32 `step` scalar per tensor
    if lay.zero == 0:
        return _replica_states(shape, train, lay, local, w, steps)
    z = zero_summary(shape, train, lay, local)
    shard, pieces, padded = z["shard"], z["pieces"], z["padded"]
    float8 = z["float8_bytes"]  # the float8-gathered weights' 1-byte shard, kept on the device (zero_fp8.py)
    if lay.zero == 3:  # no low-precision copy of a trainable shard whose fp32 master is on the device (zero.py)
        params = (z["all_shard"] - (shard if w.master and lay.offload == "none" else 0)) * w.param
    else:
        params = z["all_padded"] * w.param  # frozen groups too
    # stage 1 and stage 3 under a pipeline keep every group's full buffer (the shard is a range of it),
    # stage 2/3 the shard, but for groups reduced across pipeline stages at the step (a full buffer)
    kept = padded if accumulates(lay) else shard - z["deferred_shard"] + z["deferred_padded"]
    grads = kept * train.grad_bytes
    host_grad = shard * 4 if lay.offload != "none" and device == "cuda" else 0
    owned = z["owned"]  # whole parameters under Adafactor/SM3 (factored), else 1-D flat pieces
    whole = train.optimizer in WHOLE_PARAM_OPTIMIZERS
    opt = optimizer_elems(train, list(owned), sum(map(math.prod, owned)), not whole) * 4 + shard * w.master + steps * pieces
    host = (opt + host_grad if lay.offload != "none" else 0) + (params if lay.offload == "params" else 0)
    gpu = {"gpu_params": (0 if lay.offload == "params" else params) + float8, "gpu_grads": grads,
           "gpu_optimizer": 0 if lay.offload != "none" else opt}
    if device != "cuda":
        host = 0  # the engine reports host bytes only when there is a device to differ from
    return {"params": params + float8, "grads": grads + host_grad, "optimizer": opt, "host": host, **gpu,
            "local_params": local, "shard": shard, "padded": padded}
