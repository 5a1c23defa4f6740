"""models/swiglu_kernel.py on a GPU: the Triton SwiGLU over a joined (rows, 2 f) GEMM output against the
same function in torch ops. Tolerances fixed before the run: in fp32, values and gradients within 1e-6
relative of the float64 reference (the kernel's arithmetic is fp32 throughout); in bf16, within one bf16
rounding of the float64 result computed from the same bf16 inputs (4e-3 relative of each tensor's
largest); compiled (fullgraph), equal bit for bit to the op run eagerly."""

import pytest
import torch
import torch.nn.functional as F

from teratrain.models import swiglu_kernel


def _reference(y: torch.Tensor, g: torch.Tensor):
    y = y.detach().double().requires_grad_()
    y1, y3 = y.chunk(2, -1)
    h = F.silu(y1) * y3
    (dy,) = torch.autograd.grad(h, y, g.double())
    return h, dy


def _ours(fn, y: torch.Tensor, g: torch.Tensor):
    y = y.detach().clone().requires_grad_()
    h = fn(y)
    (dy,) = torch.autograd.grad(h, y, g)
    return h, dy


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def _needs_triton():
    if swiglu_kernel.triton is None:
        pytest.skip("needs Triton")


@pytest.mark.gpu(1)
@pytest.mark.parametrize("rows,f", [(1000, 2816), (257, 768), (33, 40), (0, 128)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 4e-3)])
def test_the_kernel_matches_torch(rows, f, dtype, tol):
    gen = torch.Generator(device="cuda").manual_seed(rows + f)
    y = (torch.randn(rows, 2 * f, device="cuda", generator=gen) * 3).to(dtype)
    g = torch.randn(rows, f, device="cuda", generator=gen).to(dtype)
    h, dy = _ours(swiglu_kernel.swiglu_joined, y, g)
    assert h.dtype == dtype and dy.dtype == dtype and h.shape == (rows, f) and dy.shape == y.shape
    if rows == 0:
        return
    h_ref, dy_ref = _reference(y, g)
    assert _rel(h, h_ref) <= tol and _rel(dy, dy_ref) <= tol


@pytest.mark.gpu(1)
def test_compiled_equals_eager_bit_for_bit():
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(4096, 2 * 2816, device="cuda", generator=gen, dtype=torch.bfloat16)
    g = torch.randn(4096, 2816, device="cuda", generator=gen, dtype=torch.bfloat16)
    compiled = torch.compile(swiglu_kernel.swiglu_joined, fullgraph=True)
    for a, b in zip(_ours(compiled, y, g), _ours(swiglu_kernel.swiglu_joined, y, g)):
        assert torch.equal(a, b)
    torch._dynamo.reset()
