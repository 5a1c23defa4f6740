"""The pipeline split: which blocks this rank keeps, and what its parameters' placements say.

Stages are global (chunk c of pipeline rank r is stage c * pp + r, actions.py). A rank keeps the
blocks of its stages under their global keys (`layers.17` stays `layers.17`), the embedding when it
holds stage 0 (always pipeline rank 0) and the final norm, head and loss when it holds the last stage
(always rank pp - 1); the rest is dropped while the model is still on the meta device.

Tied embeddings (Press & Wolf 2017) with pp > 1: the first and the last rank both hold
`tok_embeddings.weight` (the last uses it as the head only). Its gradient is the sum of both uses,
so its placement's group is `pp_ends`, the ranks of both end stages with the same tensor-parallel
coordinate: the engines' one rule (sum over the group, divide by dp) then adds the two halves and
averages over data parallelism, and both copies take the same update. Init depends only on the
global name, so both copies start equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from teratrain.config_base import ConfigError
from teratrain.parallel.pipeline.partition import counts_problem, partition, profile_layers, split_layers
from teratrain.parallel.placement import place, placement


@dataclass(frozen=True)
class StageLayout:
    """Which blocks every global stage holds, and which stages this rank runs."""

    pp: int
    virtual_stages: int
    rank: int  # pipeline coordinate of this process
    bounds: tuple[range, ...]  # blocks of every global stage

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def stages(self) -> list[int]:
        """This rank's stages, chunk by chunk."""
        return [c * self.pp + self.rank for c in range(self.virtual_stages)]

    @property
    def blocks(self) -> set[int]:
        """The blocks this rank's stages hold."""
        return {i for s in self.stages for i in self.bounds[s]}

    def stage_of_block(self, index: int) -> int:
        return next(s for s, r in enumerate(self.bounds) if index in r)

    @property
    def holds_first(self) -> bool:
        return self.rank == 0

    @property
    def holds_last(self) -> bool:
        return self.rank == self.pp - 1


def check_split(cfg) -> None:
    """Refuse, before launch, a split that cannot be made (one sentence with the fix)."""
    p, n = cfg.parallel, cfg.model.n_layers
    S = p.pp * p.virtual_stages
    if p.stage_layers is not None:
        why = counts_problem(p.stage_layers, S, n)
        if why:
            raise ConfigError(f"parallel.stage_layers={p.stage_layers} is no split: {why}; fix the list or unset it.")
    elif p.pp > 1 and p.partition == "layers" and n % S:
        raise ConfigError(f"parallel.partition=layers gives every one of the parallel.pp x parallel.virtual_stages = "
                          f"{S} pipeline stages the same number of blocks, which model.n_layers={n} does not allow; "
                          f"choose degrees whose product divides {n} or set parallel.partition=profiled.")


def stage_bounds(cfg, rt) -> tuple[range, ...]:
    """Blocks of every global stage: `parallel.stage_layers` when given; else equal counts, or
    PipeDream's DP over times measured on this device by rank 0 (measurements differ across ranks,
    so one rank decides and tells the others), recorded in `parallel.stage_layers`."""
    p = cfg.parallel
    S = p.pp * p.virtual_stages
    if p.stage_layers is None and p.partition == "layers":
        return tuple(split_layers(cfg.model.n_layers, S))
    if p.stage_layers is None:
        counts = [len(r) for r in profiled_bounds(cfg, rt.device, S)] if rt.rank == 0 else None
        p.stage_layers = rt.broadcast(counts)
    starts = [sum(p.stage_layers[:s]) for s in range(S)]
    return tuple(range(a, a + n) for a, n in zip(starts, p.stage_layers))


def apply_pipeline(model: nn.Module, rt, cfg) -> StageLayout:
    """Keep this rank's stages of the meta-device model (`keep_stages`) and record the layout on
    `model.pipeline` (the executor reads it)."""
    layout = StageLayout(rt.dims.pp, cfg.parallel.virtual_stages, rt.coord("pp"), stage_bounds(cfg, rt))
    keep_stages(model, layout)
    model.pipeline = layout
    return layout


def keep_stages(model: nn.Module, layout: StageLayout) -> None:
    """Drop, from the meta-device model, every block and end module the stages of `layout.rank` do
    not hold. Pure: the planner runs it on a meta-device model."""
    mine = layout.blocks
    for key in list(model.layers.keys()):
        if int(key) not in mine:
            del model.layers[key]
    if not layout.holds_first:
        model.pos_embeddings = None
        if not (layout.holds_last and model.cfg.tie_embeddings):  # tied: the last rank keeps it as its head
            model.tok_embeddings = None
    if not layout.holds_last:
        model.norm = model.output = None


def ends_group(rt, layout: StageLayout) -> str | None:
    """Create `pp_ends`, the ranks of both end stages with the same tensor-parallel coordinate, which
    a tied embedding's gradient is summed over (and ZeRO gathers it over, `pp_ends:gather`). Every
    rank takes part (mesh.define_everywhere); returns the name on the end ranks, None elsewhere."""
    ends = (0, layout.pp - 1)
    key = lambda c: c["tp"] if c["pp"] in ends else None  # noqa: E731
    return rt.mesh.define_everywhere([("pp_ends", key), ("pp_ends:gather", key)])[0]


def mark_stages(model: nn.Module, layout: StageLayout, tied_group: str | None) -> None:
    """Every parameter's placement gets its stage; a tied embedding held at both ends gets
    `tied_group` (see ends_group). Runs after tensor parallelism, which re-creates what it splits.
    Pure: the planner can run it on a meta-device model."""
    last = layout.num_stages - 1
    for name, p in model.named_parameters():
        pl = placement(p)
        if name.startswith("layers."):
            stage = layout.stage_of_block(int(name.split(".")[1]))
        elif name.startswith(("tok_embeddings.", "pos_embeddings.")):
            stage = 0 if layout.holds_first else last
        else:
            stage = last
        place(p, pl.with_(stage=stage))
    if tied_group is not None and model.tok_embeddings is not None:
        w = model.tok_embeddings.weight
        place(w, placement(w).with_(group=tied_group))


# ---------------------------------------------------------------- profiled partitioning

class _Part(nn.Module):
    """One profiled piece: `fn(x)`, using the modules in `owned` (registered, so that only their
    parameters count and get gradients)."""

    def __init__(self, fn, owned: list[nn.Module]):
        super().__init__()
        self.fn, self.owned = fn, nn.ModuleList([m for m in owned if m is not None])

    def forward(self, x):
        return self.fn(x)


def profiled_bounds(cfg, device: torch.device, num_stages: int) -> list[range]:
    """Measure the embedding, every block and the head + loss on `device` with one micro-batch
    (each materialized alone, then freed; whole, before any tensor-parallel split, whose shares are
    alike for every block), and split by `partition` (PipeDream's DP). Memory of a
    piece: params, grads and AdamW moments (4x its fp32 parameter bytes) plus the activations of pp
    micro-batches in flight (1F1B's first stage); the cap is the device's memory (none on CPU)."""
    from teratrain.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.init_buffers(device)
    g = torch.Generator().manual_seed(cfg.train.seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.model.seq_len), generator=g).to(device)
    _, _, pos = model.sequence(tokens, None, 0, model.rope)
    tied = model.tok_embeddings if model.output is None else None
    parts = [_Part(model.embed, [model.tok_embeddings, model.pos_embeddings])]
    parts += [_Part(lambda h, b=b: b(h, pos), [b]) for b in model.layers]
    model.chunked_loss.chunks = cfg.memory.loss_chunks  # the head and loss as training runs them
    parts += [_Part(lambda h: model.loss(h, tokens), [model.norm, model.output, tied])]
    costs, x = [], tokens
    for i, part in enumerate(parts):
        part.owned.to_empty(device=device)
        with torch.no_grad():  # values do not change the time; vectors (norms, biases) at 1
            for p in part.owned.parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, cfg.model.init_std)
        costs += profile_layers([part], x)
        if i + 1 < len(parts):
            with torch.no_grad():
                x = part(x)
            part.owned.to(device="meta")  # free it before the next piece (a tied weight is re-made)
    mem = [4 * c.param_bytes + cfg.parallel.pp * c.activation_bytes for c in costs]
    cap = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else float("inf")
    return partition([c.time_s for c in costs[1:-1]], num_stages, memory_bytes=mem[1:-1], memory_cap_bytes=cap,
                     first=(costs[0].time_s, mem[0]), last=(costs[-1].time_s, mem[-1]))
