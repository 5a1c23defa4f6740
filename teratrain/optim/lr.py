"""Learning-rate rules: batch-size scaling, gradual warmup, decay.

Scaling from the batch the LR was tuned at (B_base) to the global batch B (Goyal et al. 2017,
"Accurate, Large Minibatch SGD"; Granziol et al. 2022 for the square-root rule):
    linear: lr = lr_base * B / B_base      (SGD)
    sqrt:   lr = lr_base * sqrt(B / B_base) (adaptive optimizers: Adam, RMSProp)
Gradual warmup (Goyal et al. 2017, sec. 2.2): lr_t = lr_max * t / T_w for t = 1..T_w.
"""

from __future__ import annotations

import math


def scaled_lr(lr: float, rule: str, base_batch: int | None, global_batch: int) -> float:
    """The peak LR at `global_batch` for an LR tuned at `base_batch`."""
    if rule == "none" or base_batch is None:
        return lr
    ratio = global_batch / base_batch
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    raise ValueError(f"unknown lr scaling rule {rule!r}")


def lr_at(step: int, peak: float, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float) -> float:
    """LR used by optimizer step `step` (0-based)."""
    t = step + 1
    if t <= warmup_steps:
        return peak * t / warmup_steps
    if schedule == "constant":
        return peak
    progress = min(1.0, (t - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif schedule == "linear":
        shape = 1.0 - progress
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    return peak * (min_ratio + (1.0 - min_ratio) * shape)


def suggested_warmup(global_batch: int, base_batch: int | None, base_warmup: int) -> int:
    """Warmup steps for a larger batch: Goyal et al. warm up over a fixed number of *epochs*
    (5), so the number of samples seen in warmup stays constant; we keep at least base_warmup
    steps and scale up with the LR jump so each step's LR increase stays bounded."""
    if base_batch is None or global_batch <= base_batch:
        return base_warmup
    return max(base_warmup, round(base_warmup * math.sqrt(global_batch / base_batch)))
