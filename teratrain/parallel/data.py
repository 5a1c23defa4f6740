"""Data parallelism (bulk synchronous): every rank holds the whole model, computes gradients on
its slice of the global batch, and gradients are averaged before an identical update everywhere.

Gradients live in flat buckets of ~`parallel.bucket_mb` (each `p.grad` is a view into its bucket,
so nothing is copied). A bucket's all-reduce is launched asynchronously from a post-accumulate-grad
hook as soon as its last gradient is ready, so communication overlaps the rest of backward
(Li et al. 2020, "PyTorch Distributed"). Buckets launch in a fixed order on every rank. On gradient
accumulation micro-steps nothing is communicated; the reduction happens on the last one.
"""

from __future__ import annotations

import torch

from teratrain.memory.precision import DTYPES
from teratrain.optim.engine import LocalEngine, weak_hook
from teratrain.parallel.comm import AVG, all_reduce, group_size
from teratrain.parallel.flat import MAX_INFLIGHT_REDUCES, bucketize_by_dtype


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter], device):
        self.params = params
        numel = sum(p.numel() for p in params)
        self.flat = torch.zeros(numel, dtype=params[0].dtype, device=device)
        offset = 0
        for p in params:  # gradients accumulate in place into views of the flat buffer
            p.grad = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready = 0


class DataParallelEngine(LocalEngine):
    persistent_grads = True

    def __init__(self, model, cfg, group, device: torch.device):
        super().__init__(model, cfg.optim, cfg.memory, cfg.train.grad_clip, cfg.use_master_weights)
        self.group, self.dp = group, group_size(group)
        self.reduce_dtype, self.overlap = DTYPES[cfg.parallel.reduce_dtype], cfg.parallel.overlap_comm
        self.buckets = [_Bucket([p for _, p in members], device)
                        for members in bucketize_by_dtype(self.named, int(cfg.parallel.bucket_mb * 2**20))]
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        for _, p in self.named:
            p.register_post_accumulate_grad_hook(weak_hook(self._on_grad))
        self._next, self._inflight = 0, []  # no communication until the last micro-step (`_sync`)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self._sync:
            return
        self._bucket_of[p].ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        t = b.flat if b.flat.dtype == self.reduce_dtype or self.dp == 1 else b.flat.to(self.reduce_dtype)
        self._inflight.append((all_reduce(t, self.group, async_op=True, op=AVG), b, t))
        while len(self._inflight) > (MAX_INFLIGHT_REDUCES if self.overlap else 0):  # bound copies alive at once
            self._complete(self._inflight.pop(0))

    @staticmethod
    def _complete(item) -> None:
        handle, b, t = item
        handle.wait()
        if t is not b.flat:
            b.flat.copy_(t)
        b.ready = 0

    def _finish_reduction(self) -> None:
        for b in self.buckets[self._next:]:  # buckets whose grads never all arrived (unused params)
            self._launch(b)
        for item in self._inflight:
            self._complete(item)
        self._next, self._inflight = 0, []

    def state_tensors(self):
        """Replicas are identical: dp-rank 0 writes the model and optimizer state, the other ranks
        only their own scaler (their RNG is added by the trainer) and a pointer to rank 0's file."""
        if self.dp > 1 and torch.distributed.get_rank(self.group) != 0:
            return {}, {"scaler": self.scaler.state_dict() if self.scaler else None,
                        "replica_of": torch.distributed.get_global_rank(self.group, 0)}
        return super().state_tensors()

    def step(self, lr: float):
        self._finish_reduction()
        return super().step(lr)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.flat.zero_()
        for m in self.masters or ():
            m.grad = None
