"""Optimizer construction: AdamW (fused/foreach; on CUDA fp32 parameters teratrain's kernel,
optim/adamw_kernel.py, unless optim.kernel=torch), SGD with momentum, Adafactor, SM3 (optim/sm3.py).

Weight decay applies to matrices only (dim >= 2; a stack of experts' biases, models/moe.py Experts, is a
stack of vectors); norms, biases and other vectors get none.
"""

from __future__ import annotations

import torch

from teratrain.optim.sm3 import SM3


def is_matrix(name: str, shape) -> bool:
    """Is the parameter `name` of `shape` a matrix, or a stack of matrices (decayed)? The stacked
    experts' biases (`...experts.b1`, (experts, out)) are vectors."""
    stack, _, leaf = name.rpartition(".experts.")
    return len(shape) >= 2 and not (stack and leaf.startswith("b"))


def param_groups(named_params, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in named_params:
        # ZeRO hands in 1-D pieces of flat shards; they carry `_decay` from the parameter they cut
        (decay if getattr(p, "_decay", is_matrix(name, p.shape)) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(named_params, cfg) -> torch.optim.Optimizer:
    """`named_params`: (name, tensor) pairs to optimize (model params or fp32 master copies)."""
    named_params = list(named_params)
    groups = param_groups(named_params, cfg.weight_decay)
    if cfg.name == "adamw":
        fused = _fused_ok(named_params)
        impl = {"fused": True} if fused else {"foreach": True}
        cls = torch.optim.AdamW
        if fused and cfg.kernel == "auto" and any(p.is_cuda for _, p in named_params):
            from teratrain.optim import adamw_kernel  # imports Triton: only where a CUDA tensor steps
            cls = adamw_kernel.AdamW
        opt = cls(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)
    elif cfg.name == "sgd":
        opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=True)
    elif cfg.name == "adafactor":
        return torch.optim.Adafactor(groups, lr=cfg.lr)  # factored state: left to torch's lazy init
    elif cfg.name == "sm3":
        return SM3(groups, lr=cfg.lr, momentum=cfg.momentum)  # creates its state eagerly itself
    else:
        raise ValueError(f"unknown optimizer {cfg.name!r}")
    init_state(opt)
    return opt


@torch.no_grad()
def init_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW/SGD state now instead of at the first step, so its memory exists (and is
    counted) from the start. Bitwise the same trajectory as torch's lazy init: AdamW starts from
    step 0 and zero moments; SGD's buffer b = momentum*0 + g equals its first-step b = g."""
    for group in opt.param_groups:
        for p in group["params"]:
            if isinstance(opt, torch.optim.AdamW):
                on_device = group["fused"] or group["capturable"]
                step = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                opt.state[p] = {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            elif group["momentum"]:
                opt.state[p] = {"momentum_buffer": torch.zeros_like(p)}


def _fused_ok(named_params) -> bool:
    """Fused AdamW needs floating-point tensors on one CUDA or CPU device."""
    return all(p.is_floating_point() and p.device.type in ("cuda", "cpu") for _, p in named_params)
