"""ZeRO stages 1-3 on flat buffers (Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models"), with mixed-precision master shards and CPU offload.

Parameters are grouped into `FlatGroup`s that share a reduction group (parallel/placement.py) and
whether they train (stage 1/2: buckets of ~`parallel.bucket_mb` in the compute dtype; stage 3: per
transformer block plus root groups for embeddings/final norm/head), and each group is split into
equal contiguous shards over the ranks of its reduction group (N of them: dp for most parameters).
Per rank, for Psi trainable parameters (k bytes each in the compute dtype; g bytes per gradient,
`parallel.grad_dtype`: 4 for fp32, 2 for bf16; 4 for fp32 masters and optimizer dtypes):

    stage  params      grads        optimizer (masters + moments)
      1    k*Psi       g*Psi         (4 + 8)*Psi/N
      2    k*Psi       g*Psi/N       (4 + 8)*Psi/N
      3    0           g*Psi/N       (4 + 8)*Psi/N      (+ gathered: 2 blocks and the root group)
    3, pp>1  0         g*Psi         (4 + 8)*Psi/N      (+ gathered: the stage, during the step)
Stage 1 reduce-scatters its full gradient buffer in place: rank r's range of the buffer receives the
reduced shard (NCCL's in-place reduce-scatter), so no second buffer exists (Megatron-LM's distributed
optimizer: 2 + 4 + 12/N bytes per parameter with fp32 gradients; with bf16 ones, the ZeRO paper's
2 + 2 + 12/N). At stage 3 with fp32 masters on the device no low-precision shard is kept: gathers
cast the master shard to the compute dtype (as FSDP2 does); without masters (fp32) the shard is the
parameter (k*Psi/N), and with offload a k-byte shard stays beside the host masters.

Micro-batch gradients accumulate in the gradient dtype. Stage 1 accumulates full gradients locally
and reduce-scatters them once per step (no traffic on accumulation micro-steps). Stages 2/3
reduce-scatter each group as soon as its gradients are complete in every backward (overlapping the
rest of backward) and keep only their shard, which exists from the step's first reduction to the
group's update (as FSDP2's sharded gradients: the activation peak at the start of backward holds
none). bf16 gradients are cast to fp32 one group at a time for the update. Launches follow one fixed
order on every rank (parallel/grads.py), whatever gradients exist. Stage 3's gathering is in
zero_gather.py. Frozen parameters (requires_grad=False) are materialized like the rest (sharded at
stage 3), get no gradient buffer, no master and no optimizer state.

Stage 3 under a pipeline schedule (`step_resident`), as torchtitan runs FSDP2 under its schedules:
a stage runs the forwards and backwards of several micro-batches interleaved, so gathering a block
around each of them would move its parameters 2m times a step. Instead a stage gathers its blocks
once per step (at each chunk's first forward) and keeps them until their gradients are complete;
gradients accumulate in full buffers, as at stage 1 (reduce-scattered in place), once, from the
stage's last backward (a data-parallel group of the stage's own ranks). A group spanning pipeline
stages (a tied embedding) keeps such a buffer at any stage and is reduced at the step (`deferred`).
Between steps a rank holds only its shards.
"""

from __future__ import annotations

import torch
from torch import nn

from teratrain.compat import pinned_empty
from teratrain.memory.offload import HostUpdate, use_host_threads
from teratrain.memory.precision import DTYPES, make_scaler, param_dtype
from teratrain.models.protocol import blocks as model_blocks
from teratrain.models.protocol import init_buffers
from teratrain.optim.build import build_optimizer, is_matrix
from teratrain.optim.engine import EngineBase, StepStats, step_scaled, tensor_bytes, weak_hook
from teratrain.parallel.comm import AVG, all_gather, reduce_scatter
from teratrain.parallel.buckets import LaunchOrder, ordered_buckets
from teratrain.parallel.flat import BLOCK_REDUCES_IN_FLIGHT, MAX_INFLIGHT_REDUCES, WHOLE_PARAM_OPTIMIZERS, FlatGroup
from teratrain.parallel.grads import CrossRank, reduce_scale
from teratrain.parallel.placement import init_local_, placement
from teratrain.parallel.zero_fp8 import float8_buffer, gathered_in_float8
from teratrain.parallel.zero_gather import ZeroGatherMixin
from teratrain.parallel.zero_state import ZeroCheckpointMixin



class _Group(FlatGroup):
    """A FlatGroup plus the buffers one stage keeps for it (see the table in the module docstring)."""

    param_flat: torch.Tensor | None = None  # stage 1/2: full params, compute dtype
    param_shard: torch.Tensor | None = None  # stage 3: this rank's params, compute dtype (unless the master is)
    full: torch.Tensor | None = None  # stage 3: gather target; storage is 0 bytes when released
    grad_flat: torch.Tensor | None = None  # stage 1: full grads, gradient dtype (reduced in place)
    grad_shard: torch.Tensor | None = None  # reduced grads of this rank's shard (stage 1: a view of grad_flat)
    master: torch.Tensor | None = None  # fp32 master shard (mixed precision)
    ready: int = 0
    fresh: bool = True  # grad_shard holds nothing of this step yet (the next write may overwrite)
    gather: object | None = None  # pending all-gather handle (stage 3)
    gather_done: object | None = None  # offload.Mark of a gather launched from the copy stream
    gathered: bool = False
    float8: object | None = None  # zero_fp8.Float8Shard where the group's weights are gathered in float8

    def __init__(self, names, params, mesh, block: str | None, whole: bool):
        pl = placement(params[0])
        super().__init__(names, params, mesh.size(pl.group), mesh.rank_in(pl.group), whole)
        self.pg, self.gather_pg = mesh.group(pl.group), mesh.group(pl.group + ":gather")
        self.scale, self.placement = reduce_scale(mesh, pl.group), pl  # shared by every member (bucket key)
        self.trainable, self.block = params[0].requires_grad, block
        # Reduced over several pipeline stages (a tied embedding): only once every stage's backward is
        # over, at the step, so no stage waits on it between a backward and a send its peer needs.
        self.deferred = self.trainable and mesh.spans_stages(pl.group)


def _key(p: nn.Parameter) -> tuple:
    """What a flat group's members share: reduction group, the axes it is copied along, trainability."""
    pl = placement(p)
    return (pl.group, pl.tied, p.requires_grad)


class ZeroEngine(ZeroCheckpointMixin, ZeroGatherMixin, EngineBase):
    def __init__(self, model: nn.Module, cfg, rt, init_fn):
        """`model` is on the meta device; `init_fn(tensor, name)` fills a whole parameter in place.
        Only one group's full fp32 parameters exist at a time while materializing."""
        p = cfg.parallel
        self.model, self.cfg, self.mesh, self.device = model, cfg, rt.mesh, rt.device
        self.stage, self.offload = p.zero, p.offload
        if self.offload != "none":  # the rank's share of the CPUs for its host step (memory/offload.py)
            use_host_threads(p.offload_threads)
        self.masters = cfg.use_master_weights  # with offload, always: the host copy is the master
        self.compute_dtype = param_dtype(cfg.memory.precision, self.masters)
        self.opt_dtype = torch.float32 if self.masters else self.compute_dtype
        self.reduce_dtype, self.overlap = DTYPES[p.reduce_dtype], p.overlap_comm
        self.grad_dtype = DTYPES[p.grad_dtype]  # gradient buffer and accumulation (parallelize.py checks it)
        # reduce inputs alive at once: one block-sized one at stage 3 (FSDP2's default), a few buckets else
        self.in_flight = BLOCK_REDUCES_IN_FLIGHT if self.stage == 3 else MAX_INFLIGHT_REDUCES
        self.host = torch.device("cpu")
        self.step_resident = self.stage == 3 and rt.dims.pp > 1  # see the module docstring
        # full gradients kept across micro-steps and reduced (in place) once per step
        self.accumulates = self.stage == 1 or self.step_resident
        # Row/column statistics (Adafactor, SM3) need whole matrices: shard by whole parameters (flat.py)
        self.whole = cfg.optim.name in WHOLE_PARAM_OPTIMIZERS
        float8 = gathered_in_float8(model, cfg)  # ids of the weights gathered in float8 (zero_fp8.py)
        self.groups = self._make_groups(model, p.bucket_mb, lambda q: _key(q) + (id(q) in float8,))
        for g in self.groups:
            self._materialize(g, init_fn, id(g.params[0]) in float8)
        init_buffers(model, self.device, getattr(init_fn, "buffers", None))
        self.trainable = [g for g in self.groups if g.trainable]  # in launch order
        self.optimizers = [self._build_optimizer(g, cfg.optim) for g in self.trainable]
        if self.offload != "none":
            self.host_update = HostUpdate([g.shard_numel for g in self.trainable], self.device, self.opt_dtype,
                                          self.compute_dtype)  # bf16 grad shards are cast as they are copied
        self.scaler = make_scaler(cfg.memory)
        self._group_of = {prm: g for g in self.trainable for prm in g.params}
        self._acc_view_of = {q: v for g in self.trainable if g.grad_flat is not None for q, v in zip(g.params, g.acc_views)}
        for prm in self._group_of:
            prm.register_post_accumulate_grad_hook(weak_hook(self._on_grad))
        self.order = LaunchOrder([g for g in self.trainable if not g.deferred], self._launch)
        if self.stage == 3:
            self._install_gather_hooks()
        self._pending = []
        self.cross = CrossRank(self.mesh, self.device)
        self.last_state_bytes = None
        self.grad_clip = cfg.train.grad_clip

    # ------------------------------------------------------------------ construction
    def _make_groups(self, model: nn.Module, bucket_mb: float, same) -> list[_Group]:
        """Groups in launch order (the order backward completes them): stage 3 per block, last block
        first, root groups last; stage 1/2 buckets counted in the compute dtype's bytes. Members share
        `same(param)`: `_key`'s, and at stage 3 whether the weight is gathered in float8."""
        named = list(model.named_parameters())
        if self.stage == 3:
            blocks = [(key, [(f"{key}.{n}", q) for n, q in blk.named_parameters()])
                      for key, blk in model_blocks(model)]  # key: the block's qualified name
            in_blocks = {q for _, members in blocks for _, q in members}
            units = blocks[::-1] + [(None, [(n, q) for n, q in named if q not in in_blocks])]
            members = [(key, b.members) for key, unit in units
                       for b in ordered_buckets(unit[::-1], float("inf"), same)]  # split by `same`, in order
        else:
            itemsize = torch.empty((), dtype=self.compute_dtype).element_size()
            members = [(None, b.members) for b in ordered_buckets(named, int(bucket_mb * 2**20), _key, lambda _: itemsize)]
        return [_Group([n for n, _ in m], [q for _, q in m], self.mesh, key, self.whole) for key, m in members if m]

    def _materialize(self, g: _Group, init_fn, in_float8: bool) -> None:
        full32 = torch.zeros(g.padded, dtype=torch.float32, device=self.device)
        read = getattr(init_fn, "read_piece", None)
        if read is not None and self.stage == 3:  # trained weights: read only this rank's shard of them
            for pc, view in zip(g.pieces, g.shard_views(full32[g.lo:g.hi])):
                lo = g.lo + pc.shard_lo - g.offsets[pc.index]
                read(view, placement(g.params[pc.index]), lo, lo + pc.numel)
        else:
            for prm, view in zip(g.params, g.views(full32)):
                init_local_(view, placement(prm), init_fn)
        opt_home = self.host if self.offload != "none" else self.device
        if self.masters and g.trainable:
            g.master = _clone_to(full32[g.lo:g.hi], opt_home, torch.float32)
        if self.stage == 3:
            if g.master is None or self.offload != "none":  # else gathers cast the fp32 master shard itself
                shard_home = self.host if self.offload == "params" else self.device
                g.param_shard = _clone_to(full32[g.lo:g.hi], shard_home, self.compute_dtype, pinned=True)
            g.full = torch.empty(g.padded, dtype=self.compute_dtype, device=self.device)
            _bind(g, g.full, self.model)
            g.full.untyped_storage().resize_(0)
            if in_float8:  # the parameters keep the empty buffer (gradients only); gathers fill a 1-byte one
                g.full = float8_buffer(g, self.model, self.device)
        else:
            g.param_flat = full32 if self.compute_dtype == torch.float32 else full32.to(self.compute_dtype)
            _bind(g, g.param_flat, self.model)
        del full32
        if not g.trainable or not (self.accumulates or g.deferred):  # stage 2/3 shards: made by the step's first reduction
            return
        # p.grad is a view of the buffer when the dtypes agree (autograd adds in place), else the hook adds it in
        g.grad_flat = torch.zeros(g.padded, dtype=self.grad_dtype, device=self.device)
        g.grad_shard = g.grad_flat[g.lo:g.hi]  # the in-place reduce-scatter's output range
        g.acc_views = g.views(g.grad_flat)
        if self.compute_dtype == self.grad_dtype:
            for q, view in zip(g.params, g.acc_views):
                q.grad = view

    def _opt_target(self, g: _Group) -> torch.Tensor:
        """The tensor the optimizer updates for this group's shard (the values training continues from)."""
        return g.master if g.master is not None else self._shard_params(g)

    def _build_optimizer(self, g: _Group, optim_cfg):
        """An optimizer over this rank's pieces of the group (views of the flat shard, so sharding
        is exact for elementwise optimizers), each piece's gradient a view of the gradient shard.
        The gradients are bound at each step (`_update`): the shard's own views, an fp32 copy of a
        bf16 shard, or (offloaded) host staging buffers."""
        g.opt_views = [_mark_decay(self._shaped(v, g, pc), g.names[pc.index], g.shapes[pc.index])
                       for v, pc in zip(g.shard_views(self._opt_target(g)), g.pieces)]
        if not g.opt_views:  # this rank's shard is all padding (tiny groups, many ranks)
            return None
        return build_optimizer([(g.names[pc.index], v) for v, pc in zip(g.opt_views, g.pieces)], optim_cfg)

    def _shaped(self, view: torch.Tensor, g: _Group, pc) -> torch.Tensor:
        """A piece as the optimizer sees it: 1-D for elementwise optimizers, the parameter's own
        shape when pieces are whole parameters."""
        return view.view(g.shapes[pc.index]) if self.whole else view

    # ------------------------------------------------------------------ backward side
    def _on_grad(self, prm: nn.Parameter) -> None:
        g = self._group_of[prm]
        if g.grad_flat is not None:  # stage 1, stage 3 under a pipeline, or reduced at the step (deferred)
            if self.compute_dtype != self.grad_dtype:  # add the grad into the buffer (of the gradient dtype)
                self._acc_view_of[prm].add_(prm.grad)
                prm.grad = None
            if g.deferred or not self._sync:  # full grads stay local across micro-steps; reduce once per step
                return
        g.ready += 1
        if g.ready == len(g.params):
            self.order.mark_ready(g)

    def _launch(self, g: _Group) -> None:
        g.ready = 0
        if g.grad_flat is not None:
            self._reduce_in_place(g)
            if self.step_resident:  # its gradients are complete: this step's backwards are done with it
                self._release(g)
        else:
            self._reduce_grads(g)

    def end_backward(self) -> None:
        """Launch, in order, the groups whose gradients did not all arrive (parameters unused this
        micro-step, on this rank): every rank reduces every group once per reduction round. At
        stage 3, then wait for the reductions, so their block-sized inputs are not held through the
        next forward. Not at stages 1/2, which pipeline stages use: there a rank waiting on its
        data-parallel peers between a pipeline send and receive could close a cycle of waits (gloo
        waits block the process); their inputs are bucket-sized and wait for the next launch or the step."""
        if not self.accumulates or self._sync:
            self.order.flush()
            if self.stage == 3 and not self.step_resident:
                self._drain()

    def _reduce_grads(self, g: _Group) -> None:
        """Stage 2/3: send the group's gradients (a missing one counts as zero) to the shards. The
        gradients, and at stage 3 the gathered parameters, are freed once copied, before the shard
        and the reduction's buffers are allocated (as FSDP2 frees them after its copy-in)."""
        flat = None
        if g.pg is None:  # nothing to reduce: land the gradients in the shard directly
            self._accumulate_local(g)
        else:
            self._make_room()
            flat = g.flatten([q.grad for q in g.params], self.reduce_dtype, self.device)
        for q in g.params:
            q.grad = None
        if self.stage == 3:
            self._release(g)
        if flat is not None:
            self._reduce(g, flat)

    def _accumulate_local(self, g: _Group) -> None:
        """A group of one rank, stage 2/3: the shard is the whole group; copy (first micro-step) or add."""
        if g.fresh:
            g.grad_shard = torch.empty(g.shard_numel, dtype=self.grad_dtype, device=self.device)
        dst = g.views(g.grad_shard)
        src = [q.grad if q.grad is not None else torch.zeros_like(q) for q in g.params]
        (torch._foreach_copy_ if g.fresh else torch._foreach_add_)(dst, src)
        g.fresh = False

    def _reduce_in_place(self, g: _Group) -> None:
        """Stage 1 (and every group with a full buffer): reduce-scatter (averaging) the full gradient buffer into this rank's own range of
        it, asynchronously. In another reduce dtype a cast copy is reduced in place instead, and
        `_drain` copies its range back into the buffer."""
        if g.pg is None:  # the buffer is the shard: nothing to reduce
            return
        self._make_room()
        buf = g.grad_flat if g.grad_flat.dtype == self.reduce_dtype else g.grad_flat.to(self.reduce_dtype)
        handle = reduce_scatter(buf[g.lo:g.hi], buf, g.pg, async_op=True, op=AVG)
        self._launched(handle, g, None if buf is g.grad_flat else buf[g.lo:g.hi], True, buf)

    def _reduce(self, g: _Group, flat: torch.Tensor) -> None:
        """Stage 2/3: reduce-scatter (averaging) one group's flat gradient into its shard,
        asynchronously. The first reduction of a step makes the shard and writes straight into it;
        later ones (accumulation micro-steps), or a reduce dtype other than the shard's, go through
        a temporary that `_drain` copies or adds in."""
        first = g.fresh
        if first:
            g.grad_shard = torch.empty(g.shard_numel, dtype=self.grad_dtype, device=self.device)
        direct = first and g.grad_shard.dtype == flat.dtype
        out = g.grad_shard if direct else torch.empty(g.shard_numel, dtype=flat.dtype, device=self.device)
        g.fresh = False
        handle = reduce_scatter(out, flat, g.pg, async_op=True, op=AVG)
        self._launched(handle, g, None if direct else out, first, flat)

    def _launched(self, handle, g: _Group, out: torch.Tensor | None, first: bool, flat: torch.Tensor) -> None:
        self._pending.append((handle, g, out, first, flat))  # `flat` stays alive until its reduction is over
        if not self.overlap:  # wait right here (to measure what the overlap saves)
            self._drain()

    def _make_room(self) -> None:
        """Before a new reduce input is made: wait for the oldest reductions until fewer than
        `in_flight` are pending, so at most that many inputs are alive at once (their memory is
        reused by the next one; FSDP2 keeps one block's)."""
        while len(self._pending) >= self.in_flight:
            self._drain(1)

    def _drain(self, n: int | None = None) -> None:
        """Wait for the oldest `n` pending reductions (all if None). An indirect one (through a
        temporary) is copied into the shard if it was the step's first, else added."""
        done, self._pending = (self._pending, []) if n is None else (self._pending[:n], self._pending[n:])
        for handle, g, out, first, _flat in done:
            handle.wait()
            if out is not None:
                (g.grad_shard.copy_ if first else g.grad_shard.add_)(out)

    # ------------------------------------------------------------------ update
    def step(self, lr: float) -> StepStats:
        for g in self.trainable:
            if g.deferred:  # every stage's backward is over: reduce across stages now
                self._launch(g)
        self._drain()
        if self.stage == 3:
            self._release_all()  # frozen groups whose block saw no backward
        for g in self.trainable:
            if g.scale != 1:  # the average over the group, times group size / (dp cp) (placement.py)
                g.grad_shard.mul_(g.scale)
        first = self.last_state_bytes is None
        if first:  # counted once, as grads are held before the update
            self.last_state_bytes = self.state_bytes()
        grads = [g.grad_shard for g in self.trainable]
        if self.unscale_and_check(grads):
            return self._skip_step()
        norm = self.clip(grads)
        self._update(lr)
        if first:  # optimizers that create their state lazily (Adafactor) have it only now
            self.last_state_bytes["optimizer"] = self.state_bytes()["optimizer"]
        self._publish(self.trainable, cast=self.offload == "none")
        self.zero_grad()
        stats = self._stepped(norm)
        if self.offload != "none":
            stats.metrics.update(self.host_update.times)
        return stats

    def found_inf(self, grads: list[torch.Tensor]) -> bool:
        return self.cross.any_inf(grads)  # an inf may sit in one shard

    def stepping_optimizers(self) -> list:
        """The device optimizers (`_update`); offloaded, the host steps them (memory/offload.py)."""
        return [opt for opt in self.optimizers if opt is not None] if self.offload == "none" else []

    def global_sq_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Shards are disjoint within a group; copies along `tied` axes count once."""
        return self.cross.sq_norm([g.grad_shard for g in self.trainable
                                   if self.cross.counted(g.placement, replicated_over_group=False)])

    def _update(self, lr: float) -> None:
        """Optimizer step on every shard: on the device, or on the host when offloaded
        (`HostUpdate` pipelines transfers with the CPU arithmetic and also publishes the masters)."""
        for opt in self.optimizers:
            for pg in (opt.param_groups if opt else ()):
                pg["lr"] = lr
        if self.offload != "none":
            self.host_update.step((g, opt, self._shard_params(g)) for g, opt in zip(self.trainable, self.optimizers))
            return
        for g, opt in zip(self.trainable, self.optimizers):
            if opt is None:
                continue
            # the shard's own views; a bf16 shard is cast to the optimizer's fp32 one group at a time
            grad = g.grad_shard if g.grad_shard.dtype == self.opt_dtype else g.grad_shard.to(self.opt_dtype)
            for view, piece, pc in zip(g.opt_views, g.shard_views(grad), g.pieces):
                view.grad = self._shaped(piece, g, pc)
            step_scaled(opt)
            for view in g.opt_views:
                view.grad = None
            del grad  # a bf16 shard's fp32 copy goes before the next group's is made
            if g.grad_flat is None:
                g.grad_shard = None  # updated: its memory returns before the next group's copy

    def _shard_params(self, g: _Group) -> torch.Tensor | None:
        """This rank's shard of the group's compute-dtype parameters (None at stage 3 when only the
        fp32 master shard is kept: gathers cast it, FSDP2's layout, 2 bytes per parameter / N less)."""
        return g.param_shard if self.stage == 3 else g.param_flat[g.lo:g.hi]

    def _publish(self, groups: list[_Group], cast: bool) -> None:
        """The shards of `groups` back to the compute parameters: cast the masters (with `cast`; after
        an update the offloaded host update already did), then all-gather the full parameters (stage 1/2)."""
        handles = []
        for g in groups:
            if g.float8 is not None:  # cast anew at the group's next gather
                g.float8.stale = True
            mine = self._shard_params(g)  # None at stage 3 when gathers cast the master itself
            if cast and mine is not None and g.master is not None:
                mine.copy_(g.master)
            if self.stage < 3:
                handles.append(all_gather(g.param_flat, mine, g.gather_pg, async_op=True))
        for h in handles:
            h.wait()

    def zero_grad(self) -> None:
        for g in self.trainable:
            g.fresh = True  # the next reduction makes the shard anew (stage 2/3) or overwrites it (stage 1)
            if g.grad_flat is not None:
                g.grad_flat.zero_()
            else:
                g.grad_shard = None
                for q in g.params:
                    q.grad = None

    # ------------------------------------------------------------------ accounting
    def state_bytes(self) -> dict[str, int]:
        """Live bytes of this rank's model state; `host` is the part of it held in CPU memory."""
        params = [t for g in self.groups if (t := g.param_shard if self.stage == 3 else g.param_flat) is not None]
        params += [t for g in self.groups if g.float8 is not None for t in (g.float8.bytes, g.float8.scales,
                                                                             g.float8.index)]
        grads = [t for g in self.trainable for t in (g.grad_flat, g.grad_shard) if t is not None]
        opt = [t for o in self.optimizers if o for st in o.state.values() for t in st.values() if torch.is_tensor(t)]
        opt += [g.master for g in self.trainable if g.master is not None]
        everything = params + grads + opt
        return {"params": tensor_bytes(params), "grads": tensor_bytes(grads), "optimizer": tensor_bytes(opt),
                "host": tensor_bytes(t for t in everything if t.device.type == "cpu") if self.device.type == "cuda" else 0}


def _bind(g: _Group, flat: torch.Tensor, model: nn.Module) -> None:
    """Replace each (meta) parameter of the group by a Parameter that is a view into `flat`,
    keeping its placement."""
    for i, (name, view) in enumerate(zip(g.names, g.views(flat))):
        owner, _, leaf = name.rpartition(".")
        old = g.params[i]
        new = nn.Parameter(view, old.requires_grad)
        new.placement = old.placement
        g.params[i] = model.get_submodule(owner)._parameters[leaf] = new


def _clone_to(t: torch.Tensor, device: torch.device, dtype: torch.dtype, pinned: bool = False) -> torch.Tensor:
    """A copy of `t` on `device` in `dtype`; page-locked when asked (host tensors copied every use)."""
    if pinned and device.type == "cpu":
        out = pinned_empty(t.numel(), dtype)
        out.copy_(t)
        return out
    return t.to(device=device, dtype=dtype, copy=True)


def _mark_decay(view: torch.Tensor, name: str, shape: torch.Size) -> torch.Tensor:
    """Pieces are 1-D views, so record whether the parameter they come from is a matrix (decayed)."""
    view._decay = is_matrix(name, shape)  # read by optim.build.param_groups
    return view
