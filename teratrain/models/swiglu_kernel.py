"""SwiGLU over one GEMM's joined gate and up outputs: y = [x W1^T | x W3^T] (rows, 2 f) gives
h = silu(y1) * y3, and the backward the joined gradient [dh/dy1 | dh/dy3] (rows, 2 f), which the joined
GEMM's backward reads (models/grouped.py, `fuses_gate_up`).

On CUDA each direction is one Triton kernel over (row, column of a half): it reads y1, y3 (and the output
gradient) once and writes h (both halves of the gradient). Why: compiled, inductor writes the backward's
concatenation of the halves' gradients as one kernel over the (rows, 2 f) output, each element choosing its
half, so every input is read once per half through masked loads; a custom op stays one node of the compiled
graph (torch.library.triton_op), which inductor fuses nothing into here either way (a grouped GEMM on each
side). Elsewhere (CPU, or torch without Triton) the same function in torch ops, differentiated by autograd.
Both compute in fp32 from the stored dtype and round once, as inductor's fused kernels do.

`silu_mul`: the dense SwiGLU's silu(w1 x) * w3 x over two tensors, eager, keeping only its inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # CUDA builds of torch ship Triton; CPU builds do not
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def available(device: torch.device) -> bool:
    """Whether the Triton kernels run on `device`."""
    return triton is not None and device.type == "cuda"


def swiglu_joined(y: torch.Tensor) -> torch.Tensor:
    """silu(y[:, :f]) * y[:, f:] of a (rows, 2 f) tensor."""
    if available(y.device) and y.dim() == 2:
        return torch.ops.teratrain.swiglu_joined(y)
    y1, y3 = y.chunk(2, -1)
    return F.silu(y1) * y3


def config(f: int) -> tuple[int, int, int]:
    """(rows, columns, warps) of a program for halves of width f: columns the largest power of 2 dividing f
    (no masked lanes), 64 to 256; 512 elements a program, 8 warps. Timed on one H200 at the two MoE shapes of
    bench/moe.py (`python bench/step_kernels.py --only swiglu`, bench/results/h200/2026-12-05_step_kernels_swiglu.json):
    the fastest of 78 tiles at Qwen3-30B-A3B's (f 768), 8% over the fastest at the 8-expert layer's (f 2816)."""
    cols = max(64, min(256, f & -f))
    return 512 // cols, cols, 8


if triton is not None:
    @triton.jit
    def _forward(y_ptr, h_ptr, rows, f, BR: tl.constexpr, BC: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR).to(tl.int64)[:, None]
        c = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
        mask = (r < rows) & (c < f)
        a = tl.load(y_ptr + r * 2 * f + c, mask=mask).to(tl.float32)
        b = tl.load(y_ptr + r * 2 * f + f + c, mask=mask).to(tl.float32)
        tl.store(h_ptr + r * f + c, (a * tl.sigmoid(a) * b).to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward(y_ptr, g_ptr, dy_ptr, rows, f, BR: tl.constexpr, BC: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR).to(tl.int64)[:, None]
        c = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
        mask = (r < rows) & (c < f)
        a = tl.load(y_ptr + r * 2 * f + c, mask=mask).to(tl.float32)
        b = tl.load(y_ptr + r * 2 * f + f + c, mask=mask).to(tl.float32)
        g = tl.load(g_ptr + r * f + c, mask=mask).to(tl.float32)
        s = tl.sigmoid(a)
        out = dy_ptr.dtype.element_ty
        tl.store(dy_ptr + r * 2 * f + c, (g * b * s * (1.0 + a * (1.0 - s))).to(out), mask=mask)
        tl.store(dy_ptr + r * 2 * f + f + c, (g * a * s).to(out), mask=mask)

    def launch(kernel, rows: int, f: int, *args, cfg: tuple[int, int, int] | None = None) -> None:
        br, bc, warps = cfg or config(f)
        grid = (triton.cdiv(rows, br), triton.cdiv(f, bc))
        torch.library.wrap_triton(kernel)[grid](*args, rows, f, BR=br, BC=bc, num_warps=warps)

    @torch.library.triton_op("teratrain::swiglu_joined", mutates_args=())
    def _swiglu_joined(y: torch.Tensor) -> torch.Tensor:
        y = y.contiguous()
        rows, f = y.shape[0], y.shape[1] // 2
        h = y.new_empty(rows, f)
        if rows:
            launch(_forward, rows, f, y, h)
        return h

    @torch.library.triton_op("teratrain::swiglu_joined_backward", mutates_args=())
    def _swiglu_joined_backward(y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        y, g = y.contiguous(), g.contiguous()
        rows, f = g.shape
        dy = torch.empty_like(y)
        if rows:
            launch(_backward, rows, f, y, g, dy)
        return dy

    def _setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def _grad(ctx, g):
        (y,) = ctx.saved_tensors
        return torch.ops.teratrain.swiglu_joined_backward(y, g)

    torch.library.register_autograd("teratrain::swiglu_joined", _grad, setup_context=_setup)


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b of two tensors of one shape (a dense SwiGLU's w1 x and w3 x) keeping only a and b for the
    backward (b only where a needs a gradient): silu(a) is made again there, so a block keeps three of its
    (tokens, d_ff) tensors (a, b and the product, which w2 keeps as its input) instead of autograd's four, as
    Megatron-LM's fused SwiGLU does. The kernels are autograd's own (silu, mul, silu_backward): the same numbers,
    one more silu in the backward. Compiled, the plain expression: inductor chooses what its graph keeps."""
    if torch.compiler.is_compiling():
        return F.silu(a) * b
    return _SiluMul.apply(a, b)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b if ctx.needs_input_grad[0] else None)  # b only for a's gradient
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        a, b = ctx.saved_tensors
        da = torch.ops.aten.silu_backward(g * b, a) if ctx.needs_input_grad[0] else None
        return da, (g * F.silu(a) if ctx.needs_input_grad[1] else None)
