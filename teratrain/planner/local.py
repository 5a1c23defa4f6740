"""The parameters one rank holds, exactly as the engines hold them: the model built on the meta device
(no memory), split by the strategies' own plans (pipeline/split.py `keep_stages`, tp_plan.py
`tp_placements`, ep_plan.py `keep_local_experts`), which the transforms apply too. So the planner's
byte counts follow every rule of the transforms (vocabulary padding, replicated key/value heads, which
gradients are partial, which experts a rank keeps) without restating them, and without running them:
nothing here builds a parallel layer or a process group."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

import torch
from torch import nn

from teratrain.memory.fp8 import aligned, float8_weights
from teratrain.memory.lora import apply_lora
from teratrain.models.transformer import Transformer
from teratrain.parallel.ep_plan import keep_local_experts
from teratrain.parallel.pipeline.partition import split_layers
from teratrain.parallel.pipeline.split import StageLayout, keep_stages, mark_stages
from teratrain.parallel.placement import assign_defaults, place, placement
from teratrain.parallel.tp_plan import TPSplit, tp_placements


@dataclass(frozen=True)
class LocalTensor:
    name: str
    shape: tuple[int, ...]
    group: str  # the mesh group its gradient is reduced over (and ZeRO shards it over)
    tied: tuple[str, ...]
    block: str | None  # key of the block holding it (None: embeddings, final norm, head)
    trainable: bool = True  # False: frozen (LoRA's base weights)
    float8: bool = False  # a weight memory.fp8 runs in float8 (memory/fp8.py: a block linear's, not an expert's)

    def numel(self) -> int:  # a method, like a tensor's: buckets.ordered_buckets reads it
        return math.prod(self.shape)


@lru_cache(maxsize=4)
def _built(shape) -> Transformer:
    """The whole model on the meta device, once per shape: building it runs every layer's initializer (seconds
    at a hundred blocks), a copy does not (about a fifth of that); local_tensors cuts a copy down to one rank's."""
    with torch.device("meta"):
        return Transformer(shape.cfg)


def _copied(shape, blocks: set[int] | None) -> Transformer:
    """A copy of the meta-device model to cut down; with `blocks`, only those blocks are copied (a pipeline
    stage's: copying a hundred blocks to drop all but a few was most of a large model's planning time)."""
    whole = _built(shape)
    if blocks is None:
        return copy.deepcopy(whole)
    kept = nn.ModuleDict({k: copy.deepcopy(b) for k, b in whole.layers.items() if int(k) in blocks})
    return copy.deepcopy(whole, {id(whole.layers): kept})


@lru_cache(maxsize=256)
def local_tensors(shape, tp: int, sp: bool, form: str, lora: tuple = (), pp: int = 1, virtual_stages: int = 1,
                  stage_rank: int = 0, ep: int = 1, stage_layers: tuple[int, ...] = ()) -> tuple[LocalTensor, ...]:
    """The parameters of the rank at pipeline coordinate `stage_rank` and tensor-parallel and
    data-parallel coordinate 0, in registration order (every tp rank holds the same shapes: the last
    vocabulary piece is padded; every ep rank as many experts). `lora` = Training.lora (rank, alpha,
    targets, dropout, base dtype), or () without adapters. Pipeline stages hold `stage_layers` blocks each
    (parallel.stage_layers), or the executor's count split without it (parallel.partition=layers)."""
    layout = None
    if pp > 1:
        stages = pp * virtual_stages
        counts = stage_layers or [len(r) for r in split_layers(shape.cfg.n_layers, stages)]
        starts = [sum(counts[:s]) for s in range(stages)]
        layout = StageLayout(pp, virtual_stages, stage_rank, tuple(range(a, a + n) for a, n in zip(starts, counts)))
    model = _copied(shape, None if layout is None else layout.blocks)
    if lora:
        rank, alpha, targets, dropout, _ = lora
        apply_lora(model, SimpleNamespace(lora=SimpleNamespace(rank=rank, alpha=alpha, targets=targets, dropout=dropout)))
    assign_defaults(model)
    if layout is not None:
        keep_stages(model, layout)
    if tp > 1:  # the pieces of tp rank 0 (every tp rank's are the same shape: the last piece padded)
        split = tp_placements(model, TPSplit(tp, 0, sp, form, shape.cfg.kv_heads))
        for name, p in model.named_parameters():
            if name in split:
                place(p, split[name])
    if layout is not None:  # a tied embedding at both ends: its gradient is summed over both (split.py)
        mark_stages(model, layout, "pp_ends" if shape.cfg.tie_embeddings and stage_rank in (0, pp - 1) else None)
    if shape.cfg.moe.enabled:  # the experts of ep rank 0
        keep_local_experts(model, shape.cfg.moe.num_experts, ep, 0)
    float8 = {id(w) for w in float8_weights(model)}
    out = []
    for name, p in model.named_parameters():
        pl = placement(p)
        block = name.split(".")[1] if name.startswith("layers.") else None
        local = pl.local_shape()
        in8 = id(p) in float8 and aligned(local)
        out.append(LocalTensor(name, local, pl.group, pl.tied, block, p.requires_grad, in8))
    return tuple(out)


def group_size(group: str, dp: int, tp: int, ep: int = 1) -> int:
    """Ranks in a reduction group (mesh.py names; `dp_tp/<r>`: dp x r tensor-parallel peers; expert
    parameters: the dp/ep ranks holding the same experts, expert.py)."""
    if group == "dp":
        return dp
    if group == "dp_tp":
        return dp * tp
    if group == "ep_replicas":
        return dp // ep
    if group == "ep_replicas_tp":
        return dp // ep * tp
    if group == "pp_ends":  # both pipeline ends (parallel/pipeline/split.py)
        return 2 * dp
    if group.startswith("dp_tp/"):
        return dp * int(group.split("/")[1])
    raise ValueError(f"the planner does not know mesh group {group!r}")
