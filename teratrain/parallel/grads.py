"""How gradients are combined across ranks, for every engine: buckets keyed by reduction group in
one fixed launch order, the reduction rule, and the global norm / inf check over all ranks.

Fixed order. Every rank launches its buckets' collectives in the same order, whatever gradients
happen to exist: bucket i is launched once it is complete and buckets 0..i-1 have been launched;
whatever is still incomplete when backward ends (a parameter unused on this rank this step) is
launched then, in order, with zeros for the missing gradients. Buckets are ordered by when backward
is expected to complete them (reverse registration order), so in the usual case nothing waits.

Reduction (parallel/placement.py): SUM over the parameter's group, divided by dp. Done as an
average over the group (what the collectives do natively) times group_size / dp.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from teratrain.optim.engine import sum_sq
from teratrain.parallel.comm import MAX, SUM, all_reduce
from teratrain.parallel.placement import Placement, counted_here, placement

@dataclass
class Bucket:
    """Parameters that share a reduction group and dtype, reduced by one collective."""

    key: tuple  # (group name, dtype, ...): what the bucket's members share
    members: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    nbytes: int = 0

    @property
    def group(self) -> str:
        return self.key[0]


def ordered_buckets(named, bucket_bytes: float, key, itemsize=None) -> list[Bucket]:
    """Greedy buckets of ~`bucket_bytes` per `key(param)`, in reverse registration order (about the
    order backward produces gradients); the returned order is the launch order: a bucket takes its
    place when it closes. `itemsize(param)` gives the bytes per element that count (the dtype the
    engine will hold; default the parameter's own). `named` holds (name, param) pairs, or anything
    with `numel()` (the planner passes its own records, so engine and planner share this rule)."""
    open_: dict[tuple, Bucket] = {}
    done: list[Bucket] = []
    for item in reversed(named):
        name, p = item if isinstance(item, tuple) else (getattr(item, "name", None), item)
        k = key(p)
        b = open_.setdefault(k, Bucket(k))
        b.members.append((name, p))
        b.nbytes += p.numel() * (itemsize(p) if itemsize else p.element_size())
        if b.nbytes >= bucket_bytes:
            done.append(open_.pop(k))
    return done + list(open_.values())


def group_key(p: nn.Parameter) -> tuple:
    return (placement(p).group, p.dtype)


def reduce_scale(mesh, group: str) -> float:
    """Factor to apply after averaging over `group` so the result is sum / dp."""
    return mesh.size(group) / mesh.dims.dp


class LaunchOrder:
    """Launch items (buckets or flat groups) strictly in list order, each once it is ready."""

    def __init__(self, items: list, launch):
        self.items, self.launch = items, launch
        self.ready = [False] * len(items)
        self.index = {id(x): i for i, x in enumerate(items)}
        self.next = 0

    def mark_ready(self, item) -> None:
        self.ready[self.index[id(item)]] = True
        while self.next < len(self.items) and self.ready[self.next]:
            self.launch(self.items[self.next])
            self.next += 1

    def flush(self) -> None:
        """Backward is over: launch every item not launched yet, in order; start afresh."""
        for item in self.items[self.next:]:
            self.launch(item)
        self.ready = [False] * len(self.items)
        self.next = 0


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
