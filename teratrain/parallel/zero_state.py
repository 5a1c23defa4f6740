"""ZeRO engine state for checkpoints and tests: what each rank saves, how it is restored, and the
consolidated full parameters (gathered from all shards)."""

from __future__ import annotations

import torch

from teratrain.checkpoint.io import CheckpointError
from teratrain.checkpoint.state import optimizer_from_flat, optimizer_to_flat
from teratrain.parallel.comm import all_gather
from teratrain.parallel.expert import gather_experts
from teratrain.parallel.placement import placement, placements_json, to_global


class ZeroCheckpointMixin:
    """Mixed into ZeroEngine; relies on its `groups`, `trainable`, `optimizers`, `stage`, `scaler`,
    `mesh`, `_shard_params(g)` and `_opt_target(g)`."""

    def layout(self) -> dict:
        return {"stage": self.stage, "groups": [[g.names, g.numels, self.mesh.ranks(g.placement.group)] for g in self.groups]}

    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        """This rank's shards (params, fp32 masters, optimizer state); a stage 1/2 rank that is the
        first of its data-parallel group also saves its full model part so `teratrain generate` can
        read it without gathering."""
        tensors, opt_meta = {}, []
        optimizer_of = dict(zip(map(id, self.trainable), self.optimizers))
        for i, g in enumerate(self.groups):
            tensors[f"zero.{i}.params"] = self._shard_params(g)
            if g.master is not None:
                tensors[f"zero.{i}.master"] = g.master
            opt = optimizer_of.get(id(g))
            flat, meta = optimizer_to_flat(opt) if opt is not None else ({}, None)
            tensors.update({k.replace("optim.", f"optim.g{i}.", 1): v for k, v in flat.items()})
            opt_meta.append(meta)
        if self.stage < 3 and self.mesh.rank_in("ep_replicas") == 0:  # dense params: dp rank 0; experts: each ep rank
            first = self.mesh.rank_in("dp") == 0
            for g in self.groups:
                tensors.update({f"model.{n}": q for n, q in zip(g.names, g.params)
                                if first or placement(q).expert is not None})
        meta = {"zero": self.layout(), "optimizer": opt_meta, "placements": placements_json(self.model),
                "scaler": self.scaler.state_dict() if self.scaler else None}
        return tensors, meta

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        if meta.get("zero") != self.layout():  # train._restore refuses config changes that cause this first
            raise CheckpointError("the checkpoint's ZeRO groups differ from this run's (another stage, "
                                  "parallel.bucket_mb or model); resume with the settings it was written with.")
        handles = []
        optimizer_of = dict(zip(map(id, self.trainable), self.optimizers))
        with torch.no_grad():
            for i, g in enumerate(self.groups):
                self._shard_params(g).copy_(tensors[f"zero.{i}.params"])
                if g.master is not None:
                    g.master.copy_(tensors[f"zero.{i}.master"])
                opt = optimizer_of.get(id(g))
                if opt is not None:
                    prefix = f"optim.g{i}."
                    flat = {"optim." + k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
                    optimizer_from_flat(opt, flat, meta["optimizer"][i])
                if self.stage < 3:
                    handles.append(all_gather(g.param_flat, g.param_flat[g.lo:g.hi], g.gather_pg, async_op=True))
        for h in handles:
            h.wait()
        if self.scaler is not None and meta.get("scaler"):
            self.scaler.load_state_dict(meta["scaler"])

    @torch.no_grad()
    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of this rank's model part (all experts), whole, on CPU (collective: all ranks call it),
        by global name. With master weights the fp32 masters are gathered, since they are the
        values training continues from."""
        out = {}
        for g in self.groups:
            src = self._opt_target(g)
            full = torch.empty(g.padded, dtype=src.dtype, device=self.device)
            all_gather(full, src.to(self.device), g.gather_pg)
            for q, v in zip(g.params, g.views(full)):
                pl = placement(q)
                out[pl.name] = to_global(v, pl, self.mesh).cpu().clone()
        return gather_experts(out, self.model, self.mesh, self.device)
