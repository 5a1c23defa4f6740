"""Local SGD: periodic parameter averaging (Stich 2019, "Local SGD Converges Fast and Communicates
Little"; the "periodic sync" of data-parallel training).

Every rank computes gradients on its slice of the global batch and steps its own optimizer on them,
with no communication in forward or backward. After every `parallel.sync_every` optimizer steps the
replicas are averaged, x <- (1/dp) sum_r x_r, with bucketed flat all-reduces (the fp32 master
weights when they exist, then cast back to the model's dtype). Communication drops by sync_every x.

With sync_every=1 and plain or momentum SGD this is bulk-synchronous data parallelism: starting from
identical x, each rank's buffer b_r = mu*b_r + g_r and x - lr*mean_r(b_r) = x - lr*(mu*mean(b) + mean(g)),
so by induction the averaged model follows the all-reduce trajectory (up to fp32 rounding). Coupled
weight decay is linear in x and keeps this; AdamW's per-element scaling and gradient clipping (each
rank clips by its own local norm) do not. Optimizer state stays per rank and is never averaged.

Between syncs the replicas differ: `full_params()` returns this rank's replica, and each rank saves
its own parameters and optimizer state (as replica `dp rank` of each logical tensor), so `--resume`
continues every replica bitwise; readers (generate, export) take replica 0. The logged
loss is the mean over ranks (the loop averages it); grad_norm is rank 0's local gradient norm.
"""

from __future__ import annotations

import torch

from teratrain.optim.engine import LocalEngine, StepStats
from teratrain.parallel.comm import all_reduce, group_size
from teratrain.parallel.flat import MAX_INFLIGHT_REDUCES
from teratrain.parallel.buckets import ordered_buckets



class LocalSGDEngine(LocalEngine):
    def __init__(self, model, cfg, rt):
        super().__init__(model, cfg.optim, cfg.memory, cfg.train.grad_clip, cfg.use_master_weights)
        group = rt.dp_group
        self.group, self.dp, self.sync_every = group, group_size(group), cfg.parallel.sync_every
        self.dp_rank = rt.dp_rank
        self.num_steps = 0  # optimizer steps taken (skipped fp16 steps too: every rank counts alike)
        targets = self.masters if self.masters is not None else [p for _, p in self.named]
        named = [(name, t) for (name, _), t in zip(self.named, targets)]
        buckets = ordered_buckets(named, int(cfg.parallel.bucket_mb * 2**20), key=lambda t: t.dtype)
        self.buckets = [[t for _, t in b.members] for b in buckets]

    def step(self, lr: float) -> StepStats:
        """Local update from local gradients, then the replica average on every sync_every-th step."""
        stats = super().step(lr)
        self.num_steps += 1
        if self.num_steps % self.sync_every == 0:
            self.average()
        return stats

    @torch.no_grad()
    def average(self) -> None:
        """x <- mean over ranks of x, one flat all-reduce per bucket, at most MAX_INFLIGHT_REDUCES in flight."""
        if self.dp == 1:
            return
        inflight = []
        for tensors in self.buckets:
            flat = torch.cat([t.reshape(-1) for t in tensors])
            inflight.append((all_reduce(flat, self.group, async_op=True), tensors, flat))
            if len(inflight) >= MAX_INFLIGHT_REDUCES:
                self._unpack(*inflight.pop(0))
        for item in inflight:
            self._unpack(*item)
        if self.masters is not None:
            torch._foreach_copy_([p for _, p in self.named], self.masters)

    def _unpack(self, handle, tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
        handle.wait()
        flat.div_(self.dp)
        torch._foreach_copy_(tensors, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors)])

    # ---- checkpoints: every rank keeps its own replica (its pieces carry its dp rank) plus the step count
    def holdings(self):
        h = super().holdings()
        h.replica = self.dp_rank
        return h

    def state_meta(self) -> dict:
        return {**super().state_meta(), "local_sgd": {"num_steps": self.num_steps, "sync_every": self.sync_every}}

    def loaded(self, meta: dict) -> None:
        super().loaded(meta)
        self.num_steps = meta["local_sgd"]["num_steps"]
