"""ZeRO engine state for checkpoints and tests: the pieces each rank holds (flat ranges of local
tensors, checkpoint/holdings.py), how they are published after a restore, and the consolidated
full parameters (gathered from all shards)."""

from __future__ import annotations

import torch

from teratrain.checkpoint.holdings import Holdings, Slot
from teratrain.parallel.comm import all_gather, gather_stages, to_global
from teratrain.parallel.placement import placement


class ZeroCheckpointMixin:
    """Mixed into ZeroEngine; relies on its `groups`, `trainable`, `optimizers`, `stage`, `scaler`,
    `mesh`, `_shard_params(g)`, `_opt_target(g)` and `_publish(groups, cast)`."""

    def holdings(self) -> Holdings:
        """This rank's shard of every group: the masters (or the compute-dtype parameters where there
        are none), and each optimizer with the pieces it steps. Stage 1/2 parameters are whole on every
        rank, but the shard is what this rank writes: every element is written once."""
        optimizer_of = dict(zip(map(id, self.trainable), self.optimizers))
        values, optimizers = [], []
        for g in self.groups:
            values += _slots(g, g.shard_views(self._opt_target(g)))
            opt = optimizer_of.get(id(g))
            if opt is not None:
                optimizers.append((opt, _slots(g, g.opt_views)))
        return Holdings(values, optimizers)

    def state_meta(self) -> dict:
        return {"scaler": self.scaler.state_dict() if self.scaler else None}

    def loaded(self, meta: dict) -> None:
        """The restored shards to the compute parameters: cast the masters, all-gather (stage 1/2)."""
        with torch.no_grad():
            self._publish(self.groups, cast=True)
        if self.scaler is not None and meta.get("scaler"):
            self.scaler.load_state_dict(meta["scaler"])

    @torch.no_grad()
    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model, whole, on CPU (collective: all ranks call it; pipeline
        stages exchange their parts, ep ranks their experts), by global name. With master weights the fp32 masters are
        gathered, since they are the values training continues from."""
        out = {}
        for g in self.groups:
            src = self._opt_target(g)
            full = torch.empty(g.padded, dtype=src.dtype, device=self.device)
            all_gather(full, src.to(self.device), g.gather_pg)
            for q, v in zip(g.params, g.views(full)):
                pl = placement(q)
                out[pl.name] = to_global(v, pl, self.mesh).cpu().clone()
        return gather_stages(out, self.mesh)


def _slots(g, views: list[torch.Tensor]) -> list[Slot]:
    """One slot per piece of the group in this rank's shard: the flat range of its local tensor."""
    out = []
    for pc, view in zip(g.pieces, views):
        lo = g.lo + pc.shard_lo - g.offsets[pc.index]
        out.append(Slot(placement(g.params[pc.index]), view, lo, lo + pc.numel))
    return out
