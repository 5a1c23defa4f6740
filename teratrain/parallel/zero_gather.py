"""ZeRO stage 3's parameter gathering, mixed into ZeroEngine.

Each block's groups are all-gathered just before its forward and again before its backward, the
next block is prefetched, and the gathered copy is freed after use by resizing its storage to 0:
tensors autograd saved still point at that storage and see the data again once it is re-gathered.
The root groups (embeddings, final norm, head) stay gathered from the start of forward until their
gradients are reduced at the end of backward, as the head and the embedding use them at both ends.
Gathers run on a process group of their own (`<group>:gather`), so their order never interleaves
with the reductions', whose timing differs across ranks when a parameter goes unused on one.
A trainable group is freed once its gradients are copied into their reduce-scatter input (before
that reduction's buffers are allocated); a frozen one once its block's backward is over (its input's
gradient is computed), or at the step for a block no backward reached.

Under a pipeline schedule (`step_resident`, zero.py) a block is gathered at its first forward of
the step and kept until its gradients are reduced after the stage's last backward (a recomputation
after that gathers it again), frozen ones until the step; evaluation frees each block after its
forward. The executor brackets each of its calls with `pipeline_call`: the root groups (embedding,
final norm, head) are gathered there, before anything else, since a tied embedding's gather group
spans both end stages: gathered first thing on both ends, it waits on no stage's progress (under
NCCL a rank blocks until its peers join; mid-step it could wait on a peer waiting for a transfer
from this rank). The first block's gather is launched there too.
"""

from __future__ import annotations

import contextlib

import torch

from teratrain.compat import in_backward
from teratrain.memory.offload import Mark, copy_stream, on_stream
from teratrain.models.protocol import blocks
from teratrain.parallel.comm import all_gather
from teratrain.parallel.zero_fp8 import float8_source


class ZeroGatherMixin:
    """Relies on ZeroEngine's `groups`, `model`, `device` and `compute_dtype`."""

    def _install_gather_hooks(self) -> None:
        self.h2d_stream = copy_stream(self.device)
        found = blocks(self.model)  # (qualified name, block): models/protocol.py
        self.block_keys = [key for key, _ in found]
        self.block_groups = {key: [g for g in self.groups if g.block == key] for key in self.block_keys + [None]}
        for i, (_, blk) in enumerate(found):
            blk.register_forward_pre_hook(lambda m, args, i=i: self._before_forward(i, args))
            blk.register_forward_hook(lambda m, args, out, i=i: self._after_forward(i, out))
        self.model.register_forward_pre_hook(lambda m, args: self._ensure_all(self.block_groups[None]))
        self.model.register_forward_hook(lambda m, args, out: self._after_model_forward())

    def _groups_of(self, i: int):
        return self.block_groups[self.block_keys[i]]

    def _start_gather(self, g) -> None:
        if g.gathered or g.gather is not None:
            return
        if g.float8 is not None:  # 1 byte an element, cast once a step (zero_fp8.py)
            if g.float8.stale:
                g.float8.cast(g, float8_source(g, self.compute_dtype, self.device))
            g.full.untyped_storage().resize_(g.padded)
            g.gather = all_gather(g.full.data, g.float8.bytes, g.gather_pg, async_op=True)
            return
        g.full.untyped_storage().resize_(g.padded * g.full.element_size())
        src = g.param_shard if g.param_shard is not None else g.master  # the master: cast to the compute dtype
        side = self.h2d_stream if src.device.type == "cpu" else None  # offloaded: copy off the compute stream
        with on_stream(side):
            if side is None and src.dtype != g.full.dtype:  # cast straight into this rank's slot, gathered in
                shard = g.full.data[g.lo:g.hi]  # place: no shard-sized input alive until the gather ends
                shard.copy_(src)  # (as FSDP2 copies into its all-gather output; 208 MiB a Llama-8B block at dp=2)
            else:
                shard = src.to(device=self.device, dtype=g.full.dtype, non_blocking=True)
            # into `.data`: a write autograd does not version-track, since tensors saved for backward
            # are views of `full` and must accept the re-gathered (identical) values
            g.gather = all_gather(g.full.data, shard, g.gather_pg, async_op=True)
            g.gather_done = Mark(self.device) if side is not None else None

    def _ensure(self, g) -> None:
        self._start_gather(g)
        if g.gather is not None:
            g.gather.wait()
            if g.gather_done is not None:  # the copy (and a gather of one rank) ran on the side stream
                torch.cuda.current_stream(self.device).wait_event(g.gather_done.event)
            g.gather, g.gathered = None, True

    def _release(self, g) -> None:
        if g.gathered:
            g.full.untyped_storage().resize_(0)
            g.gathered = False

    def _ensure_all(self, groups) -> None:
        for g in groups:
            self._ensure(g)

    def _release_all(self, groups=None) -> None:
        for g in self.groups if groups is None else groups:
            self._release(g)

    @contextlib.contextmanager
    def pipeline_call(self, train: bool):
        """Around one call of the pipeline executor (a training step or an evaluation forward)."""
        if not self.step_resident:
            yield
            return
        roots = self.block_groups[None]  # used outside any block's hooks (embed, head): wait for them here
        spanning = [g for g in roots if self.mesh.spans_stages(g.placement.group)]
        self._ensure_all(spanning)  # first: see above
        for g in roots + (self._groups_of(0) if self.block_keys else []):
            self._start_gather(g)
        self._ensure_all(roots)
        try:
            yield
        finally:
            if not train:  # no backward, no step: nothing of this call is needed any more
                self._release_all()

    def _after_model_forward(self) -> None:
        if not torch.is_grad_enabled():  # evaluation: no backward will need the root groups
            self._release_all(self.block_groups[None])

    def _before_forward(self, i: int, args) -> None:
        self._ensure_all(self._groups_of(i))
        if in_backward():  # recomputation inside backward: the gathers are already arranged
            return
        if i + 1 < len(self.block_keys):
            for g in self._groups_of(i + 1):
                self._start_gather(g)  # prefetch the next block
        if self.step_resident:  # kept for the step: frozen groups are freed by step()
            return
        frozen = [g for g in self._groups_of(i) if not g.trainable]
        h = args[0] if args else None
        if frozen and torch.is_grad_enabled() and isinstance(h, torch.Tensor) and h.requires_grad:
            h.register_hook(lambda grad: self._release_all(frozen))

    def _after_forward(self, i: int, out) -> None:
        if in_backward():  # recomputation inside backward: this block's backward needs it next
            return
        if self.step_resident and torch.is_grad_enabled():  # kept across the step's micro-batches
            return
        if isinstance(out, (tuple, list)):  # a block of your own may return (hidden, extras...)
            out = out[0]
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(lambda grad, i=i: self._before_backward(i))
        self._release_all(self._groups_of(i))

    def _before_backward(self, i: int) -> None:
        self._ensure_all(self._groups_of(i))
        if i > 0:
            for g in self._groups_of(i - 1):
                self._start_gather(g)  # prefetch the block whose backward is next
