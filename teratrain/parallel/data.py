"""Data parallelism (bulk synchronous): every rank holds the whole model (or its tensor-parallel
part), computes gradients on its slice of the global batch, and gradients are combined before an
identical update everywhere.

Gradients live in flat buckets of ~`parallel.bucket_mb`, one reduction group and dtype per bucket
(each `p.grad` is a view into its bucket, so nothing is copied). A bucket's all-reduce is launched
asynchronously from a post-accumulate-grad hook once it is complete and every earlier bucket has
been launched (parallel/grads.py: one fixed order on every rank), so communication overlaps the rest
of backward (Li et al. 2020, "PyTorch Distributed"). On accumulation micro-steps nothing is
communicated; the reduction happens on the last one.
"""

from __future__ import annotations

import torch

from teratrain.memory.precision import DTYPES
from teratrain.optim.engine import LocalEngine, weak_hook
from teratrain.parallel.comm import AVG, all_reduce, gather_stages, to_global
from teratrain.parallel.buckets import LaunchOrder, ordered_buckets
from teratrain.parallel.flat import MAX_INFLIGHT_REDUCES
from teratrain.parallel.grads import CrossRank, group_key, reduce_scale
from teratrain.parallel.placement import placement


class _Bucket:
    def __init__(self, key, params: list[torch.nn.Parameter], device, mesh):
        self.params, self.group = params, mesh.group(key[0])
        # Reduced over several pipeline stages (a tied embedding): at the step, once every stage's
        # backward is over, so no stage waits on it between a backward and a send its peer needs.
        self.deferred = mesh.spans_stages(key[0])
        self.scale = reduce_scale(mesh, key[0])
        numel = sum(p.numel() for p in params)
        self.flat = torch.zeros(numel, dtype=params[0].dtype, device=device)
        offset = 0
        for p in params:  # gradients accumulate in place into views of the flat buffer
            p.grad = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready = 0


class DataParallelEngine(LocalEngine):
    """Gradients that a group reduces live in flat buckets kept between steps. Those with nothing to
    reduce or scale (a group of this rank alone: tensor or pipeline parallelism without dp) stay
    autograd's own and are freed after each update, as in one process: a bucket kept for them would
    hold 4 bytes a parameter through the next forward. CUDA graph replays need every gradient in a
    buffer of its own (engine.py)."""

    def __init__(self, model, cfg, rt):
        super().__init__(model, cfg.optim, cfg.memory, cfg.train.grad_clip, cfg.use_master_weights)
        self.mesh = rt.mesh
        self.reduce_dtype, self.overlap = DTYPES[cfg.parallel.reduce_dtype], cfg.parallel.overlap_comm
        buckets = ordered_buckets(self.named, int(cfg.parallel.bucket_mb * 2**20), group_key)
        # a group of this rank alone at dp x cp = 1 neither reduces nor rescales (reduce_scale: size / (dp cp))
        kept = [b for b in buckets if cfg.train.cuda_graphs or self.mesh.size(b.key[0]) > 1 or rt.dims.replicas > 1]
        self.buckets = [_Bucket(b.key, [p for _, p in b.members], rt.device, self.mesh) for b in kept]
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._plain = [p for _, p in self.named if p not in self._bucket_of]  # autograd's own gradients
        for p in self._bucket_of:
            p.register_post_accumulate_grad_hook(weak_hook(self._on_grad))
        self.order = LaunchOrder([b for b in self.buckets if not b.deferred], self._launch)
        # reductions launched and not yet waited for: in place (waited for at the step) and of cast copies
        self._inflight, self._copies = [], []  # (a few at a time: each wait makes the compute stream wait)
        # After the all-reduce, gradients are replicated within each group: a norm over the world is
        # needed only when ranks hold different parameters (tensor/pipeline/expert parallelism).
        self.cross = CrossRank(self.mesh, rt.device)
        self.local_norm = rt.dims.workers == rt.dims.replicas and all(b.group == self.mesh.group("dp") for b in self.buckets)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        b = self._bucket_of[p]
        if not self._sync or b.deferred:
            return
        b.ready += 1
        if b.ready == len(b.params):
            self.order.mark_ready(b)

    def _launch(self, b: _Bucket) -> None:
        t = b.flat if b.flat.dtype == self.reduce_dtype or b.group is None else b.flat.to(self.reduce_dtype)
        item = (all_reduce(t, b.group, async_op=True, op=AVG), b, t)
        if not self.overlap:
            self._complete(item)
        elif t is b.flat:  # reduced in place: holds nothing more, waited for at the step
            self._inflight.append(item)
        else:  # a cast copy: bound the copies alive at once
            self._copies.append(item)
            while len(self._copies) > MAX_INFLIGHT_REDUCES:
                self._complete(self._copies.pop(0))

    @staticmethod
    def _complete(item) -> None:
        handle, b, t = item
        handle.wait()
        if t is not b.flat:
            b.flat.copy_(t)
        if b.scale != 1:
            b.flat.mul_(b.scale)
        b.ready = 0

    def end_backward(self) -> None:
        if self._sync:  # buckets whose grads did not all arrive (unused parameters) go now, in order
            self.order.flush()

    def step(self, lr: float):
        for b in self.buckets:
            if b.deferred:
                self._launch(b)
        for item in self._inflight + self._copies:
            self._complete(item)
        self._inflight, self._copies = [], []
        for p in self._plain:  # one this step did not reach steps on a zero gradient, as a bucket's would
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return super().step(lr)

    # ---- cross-rank parts of the update
    def found_inf(self, grads):
        return super().found_inf(grads) if self.local_norm else self.cross.any_inf(grads)

    def global_sq_norm(self, grads):
        if self.local_norm:
            return super().global_sq_norm(grads)
        # `grads` follow self.named: bucket views (or master grads) exist for every parameter
        return self.cross.sq_norm([g for g, (_, p) in zip(grads, self.named)
                                   if self.cross.counted(placement(p), replicated_over_group=True)])

    # ---- tests and readers
    @torch.no_grad()
    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model, whole (collective over tensor, expert and pipeline parallelism)."""
        params = dict(self.model.named_parameters())
        out = {placement(params[n]).name: to_global(t, placement(params[n]), self.mesh).cpu().clone()
               for n, t in self.training_values().items()}
        return gather_stages(out, self.mesh)

    def keeps_grad(self, p: torch.nn.Parameter) -> bool:
        return p in self._bucket_of

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.flat.zero_()
        for p in self._plain:
            p.grad = None
        for m in self.masters or ():
            m.grad = None
