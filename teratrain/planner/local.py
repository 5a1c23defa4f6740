"""The parameters one rank holds, exactly as the engines see them: the model built on the meta device
(no memory) and split by the real `apply_pipeline`, `apply_tp` and `apply_ep`, so the planner's byte
counts follow every rule of the transforms (vocabulary padding, replicated key/value heads, which
gradients are partial, which experts a rank keeps) without restating them. No process group is created: the mesh is only asked for names."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

import torch


@dataclass(frozen=True)
class LocalTensor:
    name: str
    shape: tuple[int, ...]
    group: str  # the mesh group its gradient is reduced over (and ZeRO shards it over)
    tied: tuple[str, ...]
    block: str | None  # key of the block holding it (None: embeddings, final norm, head)
    trainable: bool = True  # False: frozen (LoRA's base weights)

    def numel(self) -> int:  # a method, like a tensor's: grads.ordered_buckets reads it
        return math.prod(self.shape)


@lru_cache(maxsize=256)
def local_tensors(shape, tp: int, sp: bool, form: str, lora: tuple = (), pp: int = 1, virtual_stages: int = 1,
                  stage_rank: int = 0, ep: int = 1) -> tuple[LocalTensor, ...]:
    """The parameters of the rank at pipeline coordinate `stage_rank` and tensor-parallel and
    data-parallel coordinate 0, in registration order (every tp rank holds the same shapes: the last
    vocabulary piece is padded; every ep rank as many experts). `lora` = Training.lora (rank, alpha,
    targets, dropout, base dtype), or () without adapters. Pipeline stages hold equal block counts (parallel.partition=layers)."""
    from teratrain.memory.lora import apply_lora
    from teratrain.mesh import Mesh, ParallelDims, Runtime
    from teratrain.models.transformer import Transformer
    from teratrain.parallel.expert import apply_ep
    from teratrain.parallel.pipeline.split import apply_pipeline, mark_stages
    from teratrain.parallel.placement import assign_defaults, placement
    from teratrain.parallel.tensor import apply_tp

    with torch.device("meta"):
        model = Transformer(shape.cfg)
    if lora:
        rank, alpha, targets, dropout, _ = lora
        apply_lora(model, SimpleNamespace(lora=SimpleNamespace(rank=rank, alpha=alpha, targets=targets, dropout=dropout)))
    assign_defaults(model)
    dims = ParallelDims(dp=ep, tp=tp, pp=pp, ep=ep)
    rank = next(r for r in range(dims.workers) if dims.coords(r)["pp"] == stage_rank and dims.coords(r)["dp"] == 0
                and dims.coords(r)["tp"] == 0)
    rt = Runtime(rank=rank, world=dims.world, local_rank=0, device=torch.device("meta"), dims=dims,
                 mesh=Mesh(dims, rank))
    cfg = SimpleNamespace(model=shape.cfg, parallel=SimpleNamespace(
        use_sp=sp, tp_form=form, pp=pp, virtual_stages=virtual_stages, stage_layers=None, partition="layers",
        tp_overlap="none", tp_overlap_chunks=1))  # overlapping changes no parameter
    layout = apply_pipeline(model, rt, cfg) if pp > 1 else None
    if tp > 1:
        apply_tp(model, rt, cfg)
    if layout is not None:  # a tied embedding at both ends: its gradient is summed over both (split.py)
        mark_stages(model, layout, "pp_ends" if shape.cfg.tie_embeddings and stage_rank in (0, pp - 1) else None)
    if shape.cfg.moe.enabled:
        chunks = SimpleNamespace(ep_overlap_chunks=1)  # nor does chunking the exchange
        apply_ep(model, rt, SimpleNamespace(model=shape.cfg, parallel=chunks))
    out = []
    for name, p in model.named_parameters():
        pl = placement(p)
        block = name.split(".")[1] if name.startswith("layers.") else None
        out.append(LocalTensor(name, tuple(p.shape), pl.group, pl.tied, block, p.requires_grad))
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
