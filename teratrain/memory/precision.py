"""Mixed precision (Micikevicius et al. 2018, "Mixed Precision Training").

- bf16: fp32 parameters, matmuls under `torch.autocast(bfloat16)`; bf16's fp32-sized exponent needs no loss scaling.
- fp16: fp16 parameters and gradients, fp32 master weights in the optimizer, autocast keeps
  reductions (softmax, norms, loss) in fp32, and dynamic loss scaling keeps small gradients from
  flushing to zero: multiply the loss by S; if any gradient is inf/nan skip the step and set
  S <- S/2, else after `window` clean steps set S <- 2S.
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def uses_master_weights(precision: str, zero: int, offload: str, explicit: bool | None) -> bool:
    """Low-precision params with fp32 masters: always for fp16 (loss-scaled fp16 updates lose small
    steps), for bf16 under ZeRO (whose savings come from sharding the fp32 master copy), and with
    offload (the optimizer steps a host copy, an fp32 master even in fp32 training);
    `memory.master_weights` overrides the first two."""
    if zero >= 1 and offload != "none":
        return True
    if explicit is not None:
        return explicit
    return precision == "fp16" or (precision == "bf16" and zero >= 1)


def make_scaler(memory_cfg) -> "LossScaler | None":
    """The dynamic loss scaler fp16 needs (None otherwise)."""
    if memory_cfg.precision != "fp16":
        return None
    return LossScaler(memory_cfg.loss_scale_init, memory_cfg.loss_scale_window)


def param_dtype(precision: str, master_weights: bool) -> torch.dtype:
    """dtype of the model's own parameters: low precision only when fp32 masters live elsewhere."""
    return DTYPES[precision] if master_weights else torch.float32


class LossScaler:
    """Dynamic loss scale: backoff x0.5 on overflow, growth x2 after `window` clean steps."""

    def __init__(self, init_scale: float = 2.0**16, window: int = 1000, growth: float = 2.0, backoff: float = 0.5,
                 min_scale: float = 1.0):
        self.scale, self.window, self.growth, self.backoff, self.min_scale = init_scale, window, growth, backoff, min_scale
        self.clean_steps = 0
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.min_scale, self.scale * self.backoff)
            self.clean_steps = 0
            self.skipped_steps += 1
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.window:
                self.scale *= self.growth
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps, self.skipped_steps = state["scale"], state["clean_steps"], state["skipped_steps"]


def has_inf_or_nan(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One bool tensor: does any tensor hold an inf or nan? (a single sync, not one per tensor)"""
    if not tensors:
        return torch.tensor(False)
    norms = torch._foreach_norm(tensors, ord=float("inf"))  # inf/nan propagate through max
    return ~torch.stack(norms).float().isfinite().all()
