"""How gradients are combined across ranks, for every engine: the reduction rule and the global
norm / inf check over all ranks (the buckets and their launch order: buckets.py).

Reduction (parallel/placement.py): SUM over the parameter's group, divided by dp x cp (the ranks
whose losses the step averages). Done as an average over the group (what the collectives do
natively) times group_size / (dp x cp).
"""

from __future__ import annotations

import torch
from torch import nn

from teratrain.optim.engine import sum_sq
from teratrain.parallel.comm import MAX, SUM, all_reduce
from teratrain.parallel.placement import Placement, counted_here, placement


def group_key(p: nn.Parameter) -> tuple:
    return (placement(p).group, p.dtype)


def reduce_scale(mesh, group: str) -> float:
    """Factor to apply after averaging over `group` so the result is sum / (dp x cp)."""
    return mesh.size(group) / mesh.dims.replicas


class CrossRank:
    """The gradient norm and the overflow check over every worker, counting each logical element
    once: a rank adds the gradients it holds that `counted_here` (placement.py) assigns to it."""

    def __init__(self, mesh, device: torch.device):
        self.mesh, self.device = mesh, device
        self.group = mesh.group("world") if mesh is not None else None

    def counted(self, pl: Placement, replicated_over_group: bool) -> bool:
        rank = self.mesh.rank_in(pl.group) if replicated_over_group else None
        return counted_here(pl, self.mesh.coords, rank)

    def sq_norm(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Squared norm of the whole gradient from the parts this rank counts (fp64, summed over ranks)."""
        sq = sum_sq(tensors).to(self.device)
        all_reduce(sq, self.group, op=SUM)
        return sq

    def any_inf(self, tensors: list[torch.Tensor]) -> bool:
        from teratrain.memory.precision import has_inf_or_nan

        flag = has_inf_or_nan(tensors).float().reshape(1).to(self.device)
        all_reduce(flag, self.group, op=MAX)
        return bool(flag.item())
