"""Expert parallelism's plan: which experts an ep rank keeps, the group their gradients are summed
over, and what a layout needs for it (`check_ep`). expert.py applies it and adds the all-to-all
exchange; the planner counts bytes by it (planner/local.py). Nothing here communicates.

Ep rank r of n/ep experts per rank holds experts [r*n/ep, (r+1)*n/ep). An expert's gradient on its
rank already sums the contributions of its ep group's tokens (the all-to-all's backward brings them
back), so it is summed over the ranks holding the same experts (`ep_replicas`) and divided by dp x cp,
the data-parallel replicas (placement.py's one rule); an expert's row-parallel bias, partial over tp
too, over `ep_replicas_tp`.
"""

from __future__ import annotations

from math import comb

import torch
from torch import nn

from teratrain.config_base import ConfigError
from teratrain.models.moe import moe_layers
from teratrain.parallel.placement import place, placement


# parallel.ep_dedup: the receiver's local expert indices (+ 1) travel as columns of the rows in the
# compute dtype, exact integers up to 256 in bf16 (8 significant bits), the narrowest one
MAX_LOCAL = 255


def expected_ranks(num_experts: int, ep: int, k: int) -> float:
    """Ranks a token's k distinct experts fall on, expected under uniform routing: each of the ep ranks
    holds n/ep experts and is missed with probability C(n - n/ep, k) / C(n, k), so
    ep * (1 - C(n - n/ep, k) / C(n, k)) (the rows per token of the deduplicated exchange,
    parallel/expert_dedup.py; k of the per-choice one)."""
    n = num_experts
    return ep * (1 - comb(n - n // ep, k) / comb(n, k))


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    """The global indices of the experts ep rank `ep_rank` holds."""
    local = num_experts // ep
    return range(ep_rank * local, (ep_rank + 1) * local)


def expert_group(group: str) -> str:
    """The group of an expert parameter at ep > 1: the dp part of its dense group becomes `ep_replicas`."""
    if group == "dp":
        return "ep_replicas"
    if group == "dp_tp":  # partial over tp too (an expert's row-parallel bias)
        return "ep_replicas_tp"
    raise ValueError(f"no expert-parallel group for parameters reduced over {group!r}")


def keep_local_experts(model: nn.Module, num_experts: int, ep: int, ep_rank: int) -> None:
    """Keep, of every expert stack of the meta-device model, the rows (experts) this ep rank holds
    (names unchanged) and record it in their placements, with at ep > 1 their expert group."""
    mine = local_experts(num_experts, ep, ep_rank)
    for _, layer in moe_layers(model):
        experts = layer.experts
        for name, p in list(experts.named_parameters()):
            pl = placement(p)
            kept = nn.Parameter(torch.empty((len(mine), *p.shape[1:]), device="meta"), requires_grad=p.requires_grad)
            place(kept, pl.with_(group=expert_group(pl.group) if ep > 1 else pl.group, experts=(mine.start, mine.stop)))
            setattr(experts, name, kept)


def check_ep(cfg) -> None:
    """Refuse, with the fix, expert-parallel layouts this model or run cannot use."""
    p, m = cfg.parallel, cfg.model.moe
    if p.ep == 1:
        return
    if not m.enabled:
        raise ConfigError(f"parallel.ep={p.ep} needs a mixture-of-experts model; set model.moe.num_experts > 1 "
                          "(or a preset such as moe-tiny) or parallel.ep=1.")
    if m.num_experts % p.ep:
        raise ConfigError(f"parallel.ep ({p.ep}) must divide model.moe.num_experts ({m.num_experts}); choose an ep "
                          "that divides it.")
    if p.ep_dedup and m.num_experts // p.ep > MAX_LOCAL:
        raise ConfigError(f"parallel.ep_dedup carries each row's local experts as numbers exact up to {MAX_LOCAL} "
                          f"experts per rank, but model.moe.num_experts / parallel.ep is {m.num_experts // p.ep}; "
                          "raise parallel.ep or set parallel.ep_dedup=false.")
    if p.sync != "allreduce":
        raise ConfigError(f"parallel.sync={p.sync} keeps whole replicas, but expert parallelism splits the experts; "
                          "set parallel.sync=allreduce or parallel.ep=1.")
