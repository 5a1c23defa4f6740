"""AdamW's update of one fp32 CUDA tensor as one Triton kernel: each element's parameter, gradient and
two moments read once and written once (28 bytes), the arithmetic of torch's fused AdamW.

Why. torch's fused AdamW (a multi-tensor CUDA kernel) reaches ~60% of an H200's memory bandwidth, this
streaming kernel 79-87%: one step over llama-1b's 1.10 B parameters (147 tensors) 8.19 ms against
10.57 (1.29x), over a 128-expert model's 5.14 B (99 tensors) 34.4 against 48.5 (1.41x)
(bench/step_kernels.py, bench/results/h200/2026-12-04_step_kernels.json). torch.compile over torch's foreach
AdamW is faster on llama-1b (7.49 ms; likely its one launch for many tensors, where this kernel launches
one a tensor: not measured apart) and slower on the 5.14 B (38.3), after 52 and 103 s of compiling.

What it computes, element by element, as torch's CUDA kernel (ATen's fused_adam_utils, ADAMW mode):
g = grad / grad_scale (the clip's scale, optim/engine.py clip_; 1 without one); p -= lr * wd * p;
m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g g; p -= (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps),
with t the parameter's own step counter on the device (incremented first, as torch does), read by the
kernel: the host never waits for the device. Division and square root are correctly rounded, as
nvcc's defaults are; results agree with torch's to a few ulp (its powers come from CUDA's powf). The
gradient is not written back scaled (torch's fused kernel does, for GradScaler, which teratrain does
not use: the engine zeroes the gradients after the step).

`AdamW` is torch.optim.AdamW (fused=True) whose step runs this kernel where every parameter of a group
qualifies (`kernel_applies`) and torch's fused step otherwise: the same state (`step`, `exp_avg`,
`exp_avg_sq`), state_dict and checkpoints. `optim.kernel=torch` keeps torch's step everywhere.
"""

from __future__ import annotations

import torch

BLOCK = 1024  # elements a program: of 1024, 2048 and 4096 the fastest on an H200 over 5.14 B parameters


try:  # CUDA builds of torch ship Triton; CPU builds do not, and step through torch's kernel
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def _adamw(p_ptr, g_ptr, m_ptr, v_ptr, step_ptr, scale_ptr, n, lr, lr_wd, beta1, beta2, eps,
               HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        t = tl.load(step_ptr)
        bias1 = 1.0 - libdevice.pow(beta1, t)
        bias2_sqrt = tl.sqrt_rn(1.0 - libdevice.pow(beta2, t))
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask)
        if HAS_SCALE:
            g = tl.div_rn(g, tl.load(scale_ptr))
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        p = p - lr_wd * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
        p = p - tl.div_rn(tl.div_rn(lr, bias1) * m, denom)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


def launch(p, grad, exp_avg, exp_avg_sq, step, scale, lr: float, weight_decay: float, beta1: float, beta2: float,
           eps: float) -> None:
    """One parameter's update in place (module docstring); `scale` a device scalar or None."""
    n = p.numel()
    if n:
        _adamw[(triton.cdiv(n, BLOCK),)](p, grad, exp_avg, exp_avg_sq, step, step if scale is None else scale, n,
                                         lr, lr * weight_decay, beta1, beta2, eps, HAS_SCALE=scale is not None,
                                         BLOCK=BLOCK, num_warps=4)


def available() -> bool:
    """Whether this process can run the kernel: Triton importable and a CUDA device present."""
    return triton is not None and torch.cuda.is_available()


def kernel_applies(opt: torch.optim.AdamW, group: dict) -> bool:
    """Every parameter with a gradient in `group` is an fp32 CUDA tensor stored densely with its
    gradient and moments, the step is plain AdamW (no amsgrad, maximize, differentiable, tensor lr,
    found_inf), and the kernel is available."""
    if group["amsgrad"] or group["maximize"] or group.get("differentiable") or torch.is_tensor(group["lr"]):
        return False
    if getattr(opt, "found_inf", None) is not None or not available():
        return False
    for p in group["params"]:
        if p.grad is None:
            continue
        state = opt.state.get(p, {})
        tensors = [p, p.grad, state.get("exp_avg"), state.get("exp_avg_sq"), state.get("step")]
        if any(t is None or not t.is_cuda or t.dtype != torch.float32 for t in tensors):
            return False
        if not all(t.is_contiguous() for t in tensors[:4]):
            return False
    return True


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW with fused=True, whose step runs teratrain's kernel on the groups it applies to
    (module docstring). Build it as torch's: the state must exist before the first step (optim/build.py
    init_state creates it)."""

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None or not all(kernel_applies(self, g) for g in self.param_groups):
            return super().step(closure)
        scale = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            steps = [self.state[p]["step"] for p in params]
            torch._foreach_add_(steps, 1)
            beta1, beta2 = group["betas"]
            s = None if scale is None else scale.to(params[0].device)
            for p, t in zip(params, steps):
                state = self.state[p]
                launch(p, p.grad, state["exp_avg"], state["exp_avg_sq"], t, s, float(group["lr"]),
                       float(group["weight_decay"]), beta1, beta2, group["eps"])
        return None
