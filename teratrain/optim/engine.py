"""The update step of one model replica: loss scaling, fp32 master weights, clipping, optimizer.

The training loop talks to an engine only through this interface, so data parallelism and ZeRO
(`teratrain/parallel/`) plug in by subclassing or replacing `LocalEngine`:

    with engine.accumulate(last=i == n - 1):   # data parallel: no communication until `last`
        engine.backward(loss / n)               # scaled by the fp16 loss scale
    stats = engine.step(lr)                     # unscale, inf check, clip, step, zero grads
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from teratrain.checkpoint.holdings import Holdings, Slot
from teratrain.memory import step_casts
from teratrain.memory.compression import compressed_saves
from teratrain.memory.precision import DTYPES, LossScaler, autocast, has_inf_or_nan, make_scaler, param_dtype
from teratrain.models.moe import moe_layers
from teratrain.optim.build import build_optimizer
from teratrain.parallel.placement import assign_defaults, placement


@dataclass
class StepStats:
    grad_norm: float
    skipped: bool
    loss_scale: float | None
    # engine-specific scalars for metrics.jsonl (train.py `_record`): a "loss" here is the step's loss,
    # already averaged, in place of the ranks' mean; keys ending "_ms" are taken from the slowest rank
    metrics: dict = field(default_factory=dict)


def weak_hook(method):
    """A tensor hook that calls the bound `method` without keeping its object alive. Tensor hooks
    live in C++, out of the garbage collector's sight, so a strong reference from a parameter's hook
    to its engine (which holds the parameter) would keep both forever."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        target = ref()
        return target(*args) if target is not None else None

    return hook


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (shared storages counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def clip_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float, optimizers=()) -> None:
    """Scale gradients so their global L2 norm is at most max_norm (as torch.nn.utils.clip_grad_norm_).
    Where `optimizers` (those about to step on `grads`) are all fused AdamW, the scale goes to their
    kernel instead: it divides each gradient by `grad_scale` as it reads it (the hook torch's GradScaler
    uses) and writes the scaled gradient back, so of the multiplication's pass (4 bytes read and 4
    written a parameter in fp32) one read is saved. Each must step through `step_scaled`, which clears
    it. Equal to the multiplication within fp32 rounding."""
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(grads[0].device, torch.float32)
        if optimizers and all(scales_grads(opt) for opt in optimizers):
            inverse = 1.0 / coef
            for opt in optimizers:
                opt.grad_scale = inverse
            return
        torch._foreach_mul_(grads, coef)
    for opt in optimizers:  # no scale of an earlier step left behind (one that failed mid-update)
        opt.grad_scale = None


def scales_grads(opt) -> bool:
    """torch's fused AdamW takes a gradient scale into its kernel (`grad_scale`)."""
    return isinstance(opt, torch.optim.AdamW) and all(g.get("fused") for g in opt.param_groups)


def step_scaled(opt) -> None:
    """opt.step(), then forget a scale `clip_` handed it (the next step sets its own, or none)."""
    try:
        opt.step()
    finally:
        opt.grad_scale = None


NORM_CHUNK = 1 << 22  # elements per partial norm: bounds the fp64 upcast (CPU) to 32 MiB


def sum_sq(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all tensors (the squared global norm, before any cross-rank sum), as fp64,
    from per-chunk norms: one fused multi-tensor kernel on a GPU (its tree reductions are exact to
    ~1e-7 per chunk), fp64 reductions on a CPU (whose fp32 kernels accumulate sequentially: a
    70k-element shard drifted by 6.5e-6). The chunk norms are squared and summed in fp64. Only tensors
    above a chunk are split (gpt2-350m's 388 tensors: 1.6-3.8 ms of the host split, 0.06 ms listed whole, one CPU)."""
    chunks = []
    for t in tensors:
        if t.numel() > NORM_CHUNK:
            chunks += t.reshape(-1).split(NORM_CHUNK)
        elif t.numel():
            chunks.append(t)
    if not chunks:
        return torch.zeros((), dtype=torch.float64)
    if chunks[0].device.type == "cuda":
        norms = torch._foreach_norm(chunks, dtype=torch.float32)
    else:
        norms = [torch.linalg.vector_norm(c, dtype=torch.float64) for c in chunks]
    return torch.stack(norms).double().square().sum()


class EngineBase:
    """What every engine shares: the micro-step protocol and fp16 loss scaling. Subclasses set
    `self.scaler` (a LossScaler or None) and read `self._sync`: False on accumulation micro-steps."""

    scaler: LossScaler | None = None
    _sync = True

    @contextlib.contextmanager
    def accumulate(self, last: bool):
        """Engines that communicate do so only on the last micro-step of a step."""
        self._sync = last
        try:
            yield
        finally:
            self._sync = True

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.scaler.scale if self.scaler else loss).backward()
        self.end_backward()

    def end_backward(self) -> None:
        """Called once a micro-batch's backward is over (engines launch what is still pending)."""

    def pipeline_call(self, train: bool):
        """Context around one call of the pipeline executor (a training step, or an evaluation
        forward when not `train`), before any of its transfers: ZeRO-3 gathers a stage's parameters
        there (zero_gather.py); other engines need nothing."""
        return contextlib.nullcontext()

    @property
    def skipped_steps(self) -> int:
        return self.scaler.skipped_steps if self.scaler else 0

    # Cross-rank reductions of the update; one replica needs none. Sharded engines override both.
    def found_inf(self, grads: list[torch.Tensor]) -> bool:
        """Does any gradient (of any rank holding a part of them) hold an inf or nan?"""
        return bool(has_inf_or_nan(grads))

    def global_sq_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Squared L2 norm of the whole gradient."""
        return sum_sq(grads)

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """fp16: divide the gradients by the loss scale and update the scale; True if the step must be
        skipped (an overflow on any rank, so every rank skips together)."""
        if self.scaler is None:
            return False
        torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        overflow = self.found_inf(grads)
        self.scaler.update(overflow)
        return overflow

    def clip(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Clip to train.grad_clip by the global norm; returns that norm."""
        norm = self.global_sq_norm(grads).sqrt()
        clip_(grads, norm, self.grad_clip, self.stepping_optimizers())
        return norm

    def stepping_optimizers(self) -> list:
        """The optimizers that step on the clipped gradients on the device (through `step_scaled`):
        `clip_` may hand them the scale. None here: the gradients are multiplied."""
        return []

    def _skip_step(self) -> StepStats:
        """Drop this step's gradients; report the skip."""
        self.zero_grad()
        return StepStats(float("nan"), True, self.scaler.scale)

    def _stepped(self, norm: torch.Tensor) -> StepStats:
        return StepStats(float(norm), False, self.scaler.scale if self.scaler else None)


class LocalEngine(EngineBase):
    """One replica's update. With `master_weights`, the model holds low-precision params and grads,
    and the optimizer steps fp32 copies that are written back after each step."""

    def __init__(self, model: nn.Module, optim_cfg, memory_cfg, grad_clip: float, master_weights: bool,
                 graphed: bool = False):
        self.model, self.grad_clip = model, grad_clip
        assign_defaults(model)  # a model built outside parallelize() is one whole replica
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.masters = None
        if master_weights:
            self.masters = [p.detach().float().clone() for _, p in self.named]
            low = param_dtype(memory_cfg.precision, True)
            for _, p in self.named:
                p.data = p.data.to(low)
        targets = self.masters if self.masters is not None else [p for _, p in self.named]
        self.optimizer = build_optimizer(zip([n for n, _ in self.named], targets), optim_cfg)
        self.scaler = make_scaler(memory_cfg)
        self.last_state_bytes: dict[str, int] | None = None
        self.persistent_grads = graphed
        if graphed:  # CUDA graph replays (train.compile_mode=reduce-overhead) return gradients in the graph's
            # pool, which autograd would adopt as .grad and the next replay overwrite (pytorch#169545):
            # gradients live in buffers of their own, accumulated into in place and zeroed after each step
            for _, p in self.named:
                p.grad = torch.zeros_like(p)

    # ---- update side
    def stepping_optimizers(self) -> list:
        return [self.optimizer]

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for _, p in self.named if p.grad is not None]

    def step(self, lr: float) -> StepStats:
        first = self.last_state_bytes is None
        if first:  # counted once, as grads are held before the update
            self.last_state_bytes = self.state_bytes()
        grads = self._fp32_grads()  # replicated after any data-parallel reduction: local checks suffice
        if self.unscale_and_check(grads):
            return self._skip_step()
        norm = self.clip(grads)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        step_scaled(self.optimizer)
        if first:  # optimizers that create their state lazily (Adafactor) have it only now
            self.last_state_bytes["optimizer"] = self.state_bytes()["optimizer"]
        self.zero_grad()
        if self.masters is not None:
            with torch.no_grad():
                torch._foreach_copy_([p for _, p in self.named], self.masters)
        return self._stepped(norm)

    def _fp32_grads(self) -> list[torch.Tensor]:
        """Gradients the optimizer will read: with masters, fp32 copies attached to the masters
        (and the low-precision grads freed); else the model's own."""
        if self.masters is None:
            return self.grads()
        out = []
        for m, (_, p) in zip(self.masters, self.named):
            m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
            if not self.keeps_grad(p):
                p.grad = None  # free the low-precision copy before the optimizer allocates anything
            out.append(m.grad)
        return out

    def keeps_grad(self, p: nn.Parameter) -> bool:
        """Whether `p.grad` is a buffer kept between steps (zeroed after the update, never freed)."""
        return self.persistent_grads

    def zero_grad(self) -> None:
        if self.persistent_grads:
            torch._foreach_zero_([p.grad for _, p in self.named])
        else:
            for _, p in self.named:
                p.grad = None
        for m in self.masters or ():
            m.grad = None

    # ---- accounting and checkpoints
    def state_bytes(self) -> dict[str, int]:
        """Model-state bytes of this rank, from live tensors: params, grads held now, optimizer
        state (fp32 master weights included)."""
        opt = [t for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
        return {"params": tensor_bytes(p for p in self.model.parameters()),
                "grads": tensor_bytes(p.grad for _, p in self.named),
                "optimizer": tensor_bytes(opt + list(self.masters or []))}

    def holdings(self) -> Holdings:
        """Every parameter's training value and the optimizer's slots (checkpoint/holdings.py)."""
        params = dict(self.model.named_parameters())
        values = [Slot(placement(params[n]), t) for n, t in self.training_values().items()]
        targets = self.masters if self.masters is not None else [p for _, p in self.named]
        return Holdings(values, [(self.optimizer, [Slot(placement(p), t) for (_, p), t in zip(self.named, targets)])])

    def state_meta(self) -> dict:
        return {"scaler": self.scaler.state_dict() if self.scaler else None}

    def loaded(self, meta: dict) -> None:
        """After a checkpoint filled the holdings: parameters from their masters, the loss scale."""
        if self.masters is not None:
            with torch.no_grad():
                torch._foreach_copy_([p for _, p in self.named], self.masters)
        if self.scaler is not None and meta.get("scaler"):
            self.scaler.load_state_dict(meta["scaler"])

    def training_values(self) -> dict[str, torch.Tensor]:
        """Each parameter's values as training continues from them (fp32 masters when they exist),
        frozen ones included, by local name."""
        out = {n: p for n, p in self.model.named_parameters()}
        out.update({n: m for (n, _), m in zip(self.named, self.masters or [])})
        return out

    @torch.no_grad()
    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, on CPU (fp32 masters when they exist)."""
        return {n: t.detach().cpu().clone() for n, t in self.training_values().items()}


def train_step(model: nn.Module, engine: EngineBase, micro_batches: list, precision: str,
               lr: float) -> tuple[StepStats, torch.Tensor]:
    """One optimizer step as the trainer runs it for every strategy: each micro-batch's loss, divided
    by their number, back-propagated inside `engine.accumulate` (which tells data-parallel engines
    when to communicate), then `engine.step`. Returns the stats and the mean loss (a tensor: no sync).
    Where parallelize enabled it, the weights memory/step_casts.py names are cast once for the step."""
    total = None
    with step_casts.around_step(model, len(micro_batches), DTYPES[precision]) as casts:  # some cast once for all
        for i, (x, y) in enumerate(micro_batches):
            if casts is not None:
                casts.take_grads()
            with engine.accumulate(last=i == len(micro_batches) - 1):
                with autocast(precision, x.device), compressed_saves(model):
                    loss = model(x, y)
                engine.backward(loss / len(micro_batches))
            total = loss.detach().clone() if total is None else total + loss.detach()  # a CUDA graph's output
            # (train.compile_mode=reduce-overhead) is overwritten by the next micro-batch's replay: copied out
            for _, layer in moe_layers(model):  # so are the MoE layers' statistics (nothing to do ungraphed)
                layer.settle_stats()
    return engine.step(lr), total / len(micro_batches)
