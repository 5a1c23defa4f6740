"""AdamW's update of a parameter group's fp32 CUDA tensors as one Triton kernel launch: each element's parameter,
gradient and two moments read once and written once (28 bytes), the arithmetic of torch's fused AdamW.

Why. torch's fused AdamW (a multi-tensor CUDA kernel) reaches ~60% of an H200's memory bandwidth, this kernel
79-83%: one step over llama-1b's 1.10 B parameters (147 tensors) 7.78 ms against 10.41 (1.34x), over a 128-expert
model's 5.14 B (99 tensors) 35.9 against 48.2 (1.34x), over gpt2-350m's 355 M in 388 tensors 2.64 against 3.44
(1.30x) (bench/step_kernels.py, bench/results/h200/2026-12-05_step_kernels_adamw.json). A group is one launch: each
tensor is cut into chunks of CHUNK elements, each chunk is a program, and a program finds its tensor's five
addresses in a table on the device (kept between steps, rebuilt where an address moved; 12 bytes a chunk and 48 a
tensor, not counted by the planner). Launched a tensor at a time instead, each tensor cost the host 61 us (one
H100, tests/fixtures/planner_runs/h100_2026-12-05.json): gpt2-350m's 388 tensors took 24.7 ms.

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

import sys

import torch

# Elements an inner iteration (BLOCK) and a program (CHUNK), and the program's warps, timed on one H200 over BLOCK
# 1024-4096, CHUNK 1-64 BLOCKs, 4 or 8 warps (bench/results/h200/2026-12-05_adamw_chunks.json; bench/step_kernels.py
# --only adamw, `chunks`): within 0.3% of the fastest (one BLOCK a program) with half its tables; 64 BLOCKs a
# program took 17% longer over llama-1b's parameters.
BLOCK, CHUNK, WARPS = 1024, 2048, 4


try:  # CUDA builds of torch ship Triton; CPU builds do not, and step through torch's kernel
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def _adamw(table_ptr, sizes_ptr, chunk_tensor_ptr, chunk_start_ptr, scale_ptr, lr, lr_wd, beta1, beta2, eps,
               HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
        pid = tl.program_id(0)
        i = tl.load(chunk_tensor_ptr + pid)
        start = tl.load(chunk_start_ptr + pid)
        n = tl.load(sizes_ptr + i)
        row = table_ptr + i * 5  # the pointer table: parameter, gradient, exp_avg, exp_avg_sq, step
        p_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
        g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        t = tl.load(tl.load(row + 4).to(tl.pointer_type(tl.float32)))
        step_size = tl.div_rn(lr, 1.0 - libdevice.pow(beta1, t))
        bias2_sqrt = tl.sqrt_rn(1.0 - libdevice.pow(beta2, t))
        for off in tl.range(0, CHUNK, BLOCK):  # the per-element code of the kernel launched a tensor at a time
            offs = start + off + tl.arange(0, BLOCK)
            mask = offs < n
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
            p = p - tl.div_rn(step_size * m, denom)
            tl.store(p_ptr + offs, p, mask=mask)
            tl.store(m_ptr + offs, m, mask=mask)
            tl.store(v_ptr + offs, v, mask=mask)


class _Tables:
    """The device tables of one group's launch: each tensor's element count and, per program, its tensor
    and first element (both fixed by the shapes), and the pointer table (rebuilt where an address moved:
    gradients may be new tensors every step). Kept between steps, so a steady run copies nothing."""

    def __init__(self):
        self.shapes = self.pointers = None

    def get(self, tensors: list[tuple[torch.Tensor, ...]], device: torch.device, chunk: int) -> tuple:
        shapes = (device, chunk, *(row[0].numel() for row in tensors))
        if shapes != self.shapes:
            sizes = shapes[2:]
            owner = [i for i, n in enumerate(sizes) for _ in range(triton.cdiv(n, chunk))]
            first = [c * chunk for n in sizes for c in range(triton.cdiv(n, chunk))]
            self.sizes, self.first = _upload(sizes, torch.int64, device), _upload(first, torch.int64, device)
            self.owner = _upload(owner, torch.int32, device)
            self.shapes, self.pointers = shapes, None
        pointers = tuple(t.data_ptr() for row in tensors for t in row)
        if pointers != self.pointers:
            self.table, self.pointers = _upload(pointers, torch.int64, device), pointers
        return self.table, self.sizes, self.owner, self.first


def _upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` on `device` without the host waiting: through pinned memory, which torch's host allocator keeps
    until the copy has run."""
    host = torch.tensor(values, dtype=dtype)
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)


def launch(tables: _Tables, tensors: list[tuple[torch.Tensor, ...]], scale, lr: float, weight_decay: float,
           beta1: float, beta2: float, eps: float, tile: tuple[int, int, int] = (BLOCK, CHUNK, WARPS)) -> None:
    """One group's update in place, one kernel launch: `tensors` holds each parameter's (param, grad,
    exp_avg, exp_avg_sq, step), `scale` a device scalar or None (module docstring); `tile` (BLOCK, CHUNK,
    warps), CHUNK a multiple of BLOCK."""
    tensors = [row for row in tensors if row[0].numel()]
    if not tensors:
        return
    block, chunk, warps = tile
    table, sizes, owner, first = tables.get(tensors, tensors[0][0].device, chunk)
    _adamw[(owner.numel(),)](table, sizes, owner, first, table if scale is None else scale, lr, lr * weight_decay,
                             beta1, beta2, eps, HAS_SCALE=scale is not None, BLOCK=block, CHUNK=chunk, num_warps=warps)


def available() -> bool:
    """Whether this process can run the kernel: Triton importable, a CUDA device present, and no launch of it
    failed here."""
    return triton is not None and torch.cuda.is_available() and not _BROKEN


def kernel_applies(opt: torch.optim.AdamW, group: dict) -> bool:
    """Every parameter with a gradient in `group` is an fp32 CUDA tensor stored densely with its
    gradient and moments, the step is plain AdamW (no amsgrad, maximize, differentiable, tensor lr,
    found_inf), and the kernel is available."""
    return _plain(opt, group) and _rows(opt, group) is not None


def _plain(opt: torch.optim.AdamW, group: dict) -> bool:
    if group["amsgrad"] or group["maximize"] or group.get("differentiable") or torch.is_tensor(group["lr"]):
        return False
    return getattr(opt, "found_inf", None) is None and available()


def _rows(opt: torch.optim.AdamW, group: dict) -> list[tuple[torch.Tensor, ...]] | None:
    """(param, grad, exp_avg, exp_avg_sq, step) of each parameter of `group` with a gradient, or None where one
    of them is not an fp32 CUDA tensor (the first four dense)."""
    rows, f32 = [], torch.float32
    for p in group["params"]:
        g = p.grad
        if g is None:
            continue
        state = opt.state.get(p)
        row = (p, g, state.get("exp_avg"), state.get("exp_avg_sq"), state.get("step")) if state else (None,)
        if any(t is None or t.dtype != f32 or not t.is_cuda for t in row):
            return None
        if not (p.is_contiguous() and g.is_contiguous() and row[2].is_contiguous() and row[3].is_contiguous()):
            return None
        rows.append(row)
    return rows


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW with fused=True, whose step runs teratrain's kernel, one launch a group, where every
    group qualifies (module docstring), and torch's fused step otherwise. Build it as torch's: the state must
    exist before the first step (optim/build.py init_state creates it)."""

    @torch.no_grad()
    def step(self, closure=None):
        groups = []
        for group in self.param_groups:
            rows = _rows(self, group) if closure is None and _plain(self, group) else None
            if rows is None:
                return super().step(closure)
            groups.append((group, rows))
        steps = [row[4] for _, rows in groups for row in rows]
        if not steps:  # no gradient anywhere: nothing to step, as torch's AdamW
            return None
        torch._foreach_add_(steps, 1)
        scale = getattr(self, "grad_scale", None)
        tables = self.__dict__.setdefault("_tables", {})  # a group's device tables (not in state_dict)
        stepped = False
        for index, (group, rows) in enumerate(groups):
            if not rows:
                continue
            beta1, beta2 = group["betas"]
            s = None if scale is None else scale.to(rows[0][0].device)
            try:
                launch(tables.setdefault(index, _Tables()), rows, s, float(group["lr"]), float(group["weight_decay"]),
                       beta1, beta2, group["eps"])
            except Exception as e:  # noqa: BLE001 - Triton could not build or launch the kernel on this machine
                if stepped:
                    raise  # a group before this one stepped already: no way back to torch's step
                _unavailable(e)
                torch._foreach_add_(steps, -1)
                return super().step(closure)
            stepped = True
        return None


_BROKEN: list[str] = []  # why the kernel could not run here, once it failed: torch's step from then on


def _unavailable(e: Exception) -> None:
    if not _BROKEN:
        print(f"teratrain: warning: teratrain's AdamW kernel could not run here ({type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}); stepping with torch's fused AdamW instead "
              "(optim.kernel=torch chooses it from the start).", file=sys.stderr)
    _BROKEN.append(type(e).__name__)
