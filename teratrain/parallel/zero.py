"""ZeRO stages 1-3 on flat buffers (Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models"), with mixed-precision master shards and CPU offload.

Parameters are grouped into `FlatGroup`s (stage 1/2: buckets of ~`parallel.bucket_mb`; stage 3: one
group per transformer block plus a root group for embeddings/final norm/head) and each group is
split into `dp` equal contiguous shards. Per rank, for a model of Psi parameters (k bytes each in
the compute dtype, 4 for fp32 masters and optimizer dtypes):

    stage  params      grads                  optimizer (masters + moments)
      1    k*Psi       k*Psi + 4*Psi/N         (4 + 8)*Psi/N
      2    k*Psi       4*Psi/N                 (4 + 8)*Psi/N
      3    k*Psi/N     4*Psi/N                 (4 + 8)*Psi/N      (+ gathered: 2 blocks and the root group)

Stage 1 accumulates full gradients locally and reduce-scatters them once per step (no traffic on
accumulation micro-steps). Stages 2/3 reduce-scatter each group as soon as its gradients are
complete in every backward (overlapping the rest of backward) and keep only their shard. Stage 3
all-gathers a block's parameters just before its forward and again before its backward,
prefetches the next block, and frees the gathered copy after use by resizing its storage to 0:
tensors autograd saved still point at that storage and see the data again once it is re-gathered.
The root group (embeddings, final norm, head) stays gathered from the start of forward until its
gradients are reduced at the end of backward, as the head and the embedding use it at both ends.
"""

from __future__ import annotations

import torch
from torch import nn

from teratrain.compat import in_backward, pinned_empty
from teratrain.memory.offload import HostUpdate
from teratrain.memory.precision import DTYPES, LossScaler, has_inf_or_nan, param_dtype
from teratrain.optim.build import build_optimizer
from teratrain.optim.engine import EngineBase, StepStats, sum_sq, tensor_bytes, weak_hook
from teratrain.parallel.comm import AVG, all_gather, all_reduce, any_rank, group_size, reduce_scatter
from teratrain.parallel.flat import MAX_INFLIGHT_REDUCES, FlatGroup, bucketize
from teratrain.parallel.zero_state import ZeroCheckpointMixin


class _Group(FlatGroup):
    """A FlatGroup plus the buffers one stage keeps for it (see the table in the module docstring)."""

    param_flat: torch.Tensor | None = None  # stage 1/2: full params, compute dtype
    param_shard: torch.Tensor | None = None  # stage 3: this rank's params, compute dtype
    full: torch.Tensor | None = None  # stage 3: gather target; storage is 0 bytes when released
    grad_flat: torch.Tensor | None = None  # stage 1: full grads, compute dtype
    grad_shard: torch.Tensor | None = None  # reduced grads of this rank's shard, optimizer dtype
    master: torch.Tensor | None = None  # fp32 master shard (mixed precision)
    ready: int = 0
    fresh: bool = True  # grad_shard holds nothing of this step yet (the next write may overwrite)
    gather: object | None = None  # pending all-gather handle (stage 3)
    gathered: bool = False


class ZeroEngine(ZeroCheckpointMixin, EngineBase):
    def __init__(self, model: nn.Module, cfg, group, device: torch.device, init_fn):
        """`model` is on the meta device; `init_fn(name, tensor)` initializes one parameter in place.
        Only one group's full fp32 parameters exist at a time while materializing."""
        p = cfg.parallel
        self.model, self.cfg, self.group, self.device = model, cfg, group, device
        self.stage, self.dp = p.zero, group_size(group)
        self.rank = torch.distributed.get_rank(group) if group is not None else 0
        self.offload = p.offload
        # With offload the optimizer works on a host copy even in fp32: that copy is the master.
        self.masters = cfg.use_master_weights or p.offload != "none"
        self.compute_dtype = param_dtype(cfg.memory.precision, self.masters)
        self.opt_dtype = torch.float32 if self.masters else self.compute_dtype
        self.reduce_dtype, self.overlap = DTYPES[p.reduce_dtype], p.overlap_comm
        self.host = torch.device("cpu")
        self.groups = self._make_groups(model, p.bucket_mb)
        for g in self.groups:
            self._materialize(g, init_fn)
        model.init_buffers(device)
        self.optimizers = [self._build_optimizer(g, cfg.optim) for g in self.groups]
        if self.offload != "none":
            self.host_update = HostUpdate([g.shard_numel for g in self.groups], device, self.opt_dtype, self.compute_dtype)
        self.scaler = LossScaler(cfg.memory.loss_scale_init, cfg.memory.loss_scale_window) if cfg.memory.precision == "fp16" else None
        self._group_of = {prm: g for g in self.groups for prm in g.params}
        for prm in self._group_of:
            prm.register_post_accumulate_grad_hook(weak_hook(self._on_grad))
        if self.stage == 3:
            self._install_gather_hooks()
        self._pending = []
        self.last_state_bytes = None
        self.grad_clip = cfg.train.grad_clip

    # ------------------------------------------------------------------ construction
    def _make_groups(self, model: nn.Module, bucket_mb: float) -> list[_Group]:
        named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
        if self.stage == 3:  # one group per block, in forward order, then the root group
            blocks = [[(f"layers.{i}.{n}", q) for n, q in blk.named_parameters()] for i, blk in enumerate(model.layers)]
            in_blocks = {q for blk in blocks for _, q in blk}
            members = blocks + [[(n, q) for n, q in named if q not in in_blocks]]
        else:
            itemsize = torch.empty((), dtype=self.compute_dtype).element_size()
            members = bucketize(named, int(bucket_mb * 2**20 // 4 * itemsize))
        return [_Group([n for n, _ in m], [q for _, q in m], self.dp, self.rank) for m in members if m]

    def _materialize(self, g: _Group, init_fn) -> None:
        full32 = torch.zeros(g.padded, dtype=torch.float32, device=self.device)
        for name, view in zip(g.names, g.views(full32)):
            init_fn(name, view)
        opt_home = self.host if self.offload != "none" else self.device
        if self.masters:
            g.master = _clone_to(full32[g.lo:g.hi], opt_home, torch.float32)
        if self.stage == 3:
            shard_home = self.host if self.offload == "params" else self.device
            g.param_shard = _clone_to(full32[g.lo:g.hi], shard_home, self.compute_dtype, pinned=True)
            g.full = torch.empty(g.padded, dtype=self.compute_dtype, device=self.device)
            _bind(g, g.full, self.model)
            g.full.untyped_storage().resize_(0)
        else:
            g.param_flat = full32 if self.compute_dtype == torch.float32 else full32.to(self.compute_dtype)
            _bind(g, g.param_flat, self.model)
        del full32
        g.grad_shard = torch.zeros(g.shard_numel, dtype=self.opt_dtype, device=self.device)
        if self.stage == 1:
            g.grad_flat = torch.zeros(g.padded, dtype=self.compute_dtype, device=self.device)
            for q, view in zip(g.params, g.views(g.grad_flat)):
                q.grad = view

    def _opt_target(self, g: _Group) -> torch.Tensor:
        """The tensor the optimizer updates for this group's shard (the values training continues from)."""
        return g.master if g.master is not None else self._shard_params(g)

    def _build_optimizer(self, g: _Group, optim_cfg):
        """An optimizer over this rank's pieces of the group (views of the flat shard, so sharding
        is exact for elementwise optimizers), each piece's gradient a view of the gradient shard.
        Offloaded, the gradients are bound to host staging buffers at each step instead."""
        g.opt_views = [_mark_decay(v, g.shapes[pc.index]) for v, pc in zip(g.shard_views(self._opt_target(g)), g.pieces)]
        if self.offload == "none":
            for view, grad in zip(g.opt_views, g.shard_views(g.grad_shard)):
                view.grad = grad
        if not g.opt_views:  # this rank's shard is all padding (tiny groups, many ranks)
            return None
        return build_optimizer([(g.names[pc.index], v) for v, pc in zip(g.opt_views, g.pieces)], optim_cfg)

    # ------------------------------------------------------------------ backward side
    def _on_grad(self, prm: nn.Parameter) -> None:
        g = self._group_of[prm]
        g.ready += 1
        if g.ready < len(g.params):
            return
        g.ready = 0
        if self.stage == 1:
            if self._sync:  # full grads stay local across micro-steps; reduce once per step
                self._reduce(g, g.grad_flat)
            return
        self._reduce_grads(g)

    def _reduce_grads(self, g: _Group) -> None:
        """Stage 2/3: send the group's gradients (a missing one counts as zero) to the shards, free them."""
        if self.dp == 1:  # nothing to reduce: land the gradients in the shard directly
            self._accumulate_local(g)
        else:
            self._reduce(g, g.flatten([q.grad for q in g.params], self.reduce_dtype, self.device))
        for q in g.params:
            q.grad = None
        if self.stage == 3:
            self._release(g)

    def _flush_partial(self) -> None:
        """Groups whose gradients did not all arrive (parameters unused this step) are reduced now,
        so no gradient is dropped. A no-op when every parameter got its gradient."""
        for g in self.groups:
            if self.stage == 1 and g.fresh:
                self._reduce(g, g.grad_flat)
            elif self.stage >= 2 and any(q.grad is not None for q in g.params):
                self._reduce_grads(g)
            g.ready = 0

    def _accumulate_local(self, g: _Group) -> None:
        """dp=1, stage 2/3: the shard is the whole group; copy (first micro-step) or add the grads."""
        dst = g.views(g.grad_shard)
        src = [q.grad if q.grad is not None else torch.zeros_like(q) for q in g.params]
        (torch._foreach_copy_ if g.fresh else torch._foreach_add_)(dst, src)
        g.fresh = False

    def _reduce(self, g: _Group, flat: torch.Tensor) -> None:
        """Reduce-scatter (averaging) one group's flat gradient into its shard, asynchronously. The
        first reduction of a step writes straight into the shard; later ones (accumulation
        micro-steps of stage 2/3) go through a temporary that `_drain` adds in."""
        if flat.dtype != self.reduce_dtype and self.dp > 1:
            flat = flat.to(self.reduce_dtype)
        first, direct = g.fresh, g.fresh and (g.grad_shard.dtype == self.reduce_dtype or self.dp == 1)
        out = g.grad_shard if direct else torch.empty(g.shard_numel, dtype=self.reduce_dtype, device=self.device)
        g.fresh = False
        handle = reduce_scatter(out, flat, self.group, async_op=True, op=AVG)
        self._pending.append((handle, g, None if direct else out, first, flat))
        if len(self._pending) > (MAX_INFLIGHT_REDUCES if self.overlap else 0):  # no overlap: wait right here
            self._drain(1)

    def _drain(self, n: int | None = None) -> None:
        """Wait for the oldest `n` pending reductions (all if None). An indirect one (through a
        temporary) is copied into the shard if it was the step's first, else added."""
        done, self._pending = (self._pending, []) if n is None else (self._pending[:n], self._pending[n:])
        for handle, g, out, first, _flat in done:
            handle.wait()
            if out is not None:
                (g.grad_shard.copy_ if first else g.grad_shard.add_)(out)

    # ------------------------------------------------------------------ stage 3 gathering
    def _install_gather_hooks(self) -> None:
        blocks = list(self.model.layers)
        for i, blk in enumerate(blocks):
            blk.register_forward_pre_hook(lambda m, a, i=i: self._before_forward(i))
            blk.register_forward_hook(lambda m, a, out, i=i: self._after_forward(i, out))
        root = self.groups[-1]
        self.model.register_forward_pre_hook(lambda m, a: self._ensure(root))
        self.model.register_forward_hook(lambda m, a, out: None if torch.is_grad_enabled() else self._release(root))

    def _start_gather(self, g: _Group) -> None:
        if g.gathered or g.gather is not None:
            return
        g.full.untyped_storage().resize_(g.padded * g.full.element_size())
        shard = g.param_shard.to(self.device, non_blocking=True)
        # into `.data`: a write autograd does not version-track, since tensors saved for backward are
        # views of `full` and must accept the re-gathered (identical) values
        g.gather = all_gather(g.full.data, shard, self.group, async_op=True)

    def _ensure(self, g: _Group) -> None:
        self._start_gather(g)
        if g.gather is not None:
            g.gather.wait()
            g.gather, g.gathered = None, True

    def _release(self, g: _Group) -> None:
        if g.gathered:
            g.full.untyped_storage().resize_(0)
            g.gathered = False

    def _before_forward(self, i: int) -> None:
        self._ensure(self.groups[i])
        if i + 1 < len(self.model.layers) and not in_backward():
            self._start_gather(self.groups[i + 1])  # prefetch the next block

    def _after_forward(self, i: int, out: torch.Tensor) -> None:
        g = self.groups[i]
        if in_backward():  # recomputation inside backward: this block's backward needs it next
            return
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(lambda grad, i=i: self._before_backward(i))
        self._release(g)

    def _before_backward(self, i: int) -> None:
        self._ensure(self.groups[i])
        if i > 0:
            self._start_gather(self.groups[i - 1])  # prefetch the block whose backward is next

    # ------------------------------------------------------------------ update
    def step(self, lr: float) -> StepStats:
        self._flush_partial()
        self._drain()
        for g in self.groups:
            if g.fresh:  # no gradient reached this group this step (unused parameters)
                g.grad_shard.zero_()
                g.fresh = False
        if self.last_state_bytes is None:  # counted once, as grads are held before the update
            self.last_state_bytes = self.state_bytes()
        grads = [g.grad_shard for g in self.groups]
        if self.unscale_and_check(grads):
            return self._skip_step()
        norm = self.clip(grads)
        self._update(lr)
        self._publish()
        self.zero_grad()
        return self._stepped(norm)

    def found_inf(self, grads: list[torch.Tensor]) -> bool:
        return any_rank(bool(has_inf_or_nan(grads)), self.group, self.device)  # an inf may sit in one shard

    def global_sq_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        sq = sum_sq(grads).to(self.device)
        all_reduce(sq, self.group)  # squared norms of the shards add up to the global one
        return sq

    def _update(self, lr: float) -> None:
        """Optimizer step on every shard: on the device, or on the host when offloaded
        (`HostUpdate` pipelines transfers with the CPU arithmetic and also publishes the masters)."""
        for opt in self.optimizers:
            for pg in (opt.param_groups if opt else ()):
                pg["lr"] = lr
        if self.offload != "none":
            self.host_update.step((g, opt, self._shard_params(g)) for g, opt in zip(self.groups, self.optimizers))
            return
        for opt in self.optimizers:
            if opt is not None:
                opt.step()

    def _shard_params(self, g: _Group) -> torch.Tensor:
        """This rank's shard of the group's compute-dtype parameters."""
        return g.param_shard if self.stage == 3 else g.param_flat[g.lo:g.hi]

    def _publish(self) -> None:
        """Updated shards back to the compute parameters: cast masters (already done by the host
        update when offloaded), then all-gather the full parameters (stage 1/2)."""
        handles = []
        for g in self.groups:
            mine = self._shard_params(g)
            if g.master is not None and self.offload == "none":
                mine.copy_(g.master)
            if self.stage < 3:
                handles.append(all_gather(g.param_flat, mine, self.group, async_op=True))
        for h in handles:
            h.wait()

    def zero_grad(self) -> None:
        for g in self.groups:
            g.fresh = True  # the next reduction overwrites the shard: no memset needed
            if g.grad_flat is not None:
                g.grad_flat.zero_()
            else:
                for q in g.params:
                    q.grad = None

    # ------------------------------------------------------------------ accounting
    def state_bytes(self) -> dict[str, int]:
        """Live bytes of this rank's model state; `host` is the part of it held in CPU memory."""
        params = [g.param_shard if self.stage == 3 else g.param_flat for g in self.groups]
        grads = [t for g in self.groups for t in (g.grad_flat, g.grad_shard) if t is not None]
        opt = [t for o in self.optimizers if o for st in o.state.values() for t in st.values() if torch.is_tensor(t)]
        opt += [g.master for g in self.groups if g.master is not None]
        everything = params + grads + opt
        return {"params": tensor_bytes(params), "grads": tensor_bytes(grads), "optimizer": tensor_bytes(opt),
                "host": tensor_bytes(t for t in everything if t.device.type == "cpu") if self.device.type == "cuda" else 0}


def _bind(g: _Group, flat: torch.Tensor, model: nn.Module) -> None:
    """Replace each (meta) parameter of the group by a Parameter that is a view into `flat`."""
    for i, (name, view) in enumerate(zip(g.names, g.views(flat))):
        owner, _, leaf = name.rpartition(".")
        g.params[i] = model.get_submodule(owner)._parameters[leaf] = nn.Parameter(view, g.params[i].requires_grad)


def _clone_to(t: torch.Tensor, device: torch.device, dtype: torch.dtype, pinned: bool = False) -> torch.Tensor:
    """A copy of `t` on `device` in `dtype`; page-locked when asked (host tensors copied every use)."""
    if pinned and device.type == "cpu":
        out = pinned_empty(t.numel(), dtype)
        out.copy_(t)
        return out
    return t.to(device=device, dtype=dtype, copy=True)


def _mark_decay(view: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Pieces are 1-D views, so record whether the parameter they come from is a matrix (decayed)."""
    view._decay = len(shape) >= 2  # read by optim.build.param_groups
    return view
