"""The dense SwiGLU's silu_mul (models/swiglu_kernel.py) on CPU: the plain expression's output and gradients bit
for bit, keeping only its two inputs for the backward (autograd's expression keeps silu's output too)."""

import pytest
import torch
import torch.nn.functional as F

from teratrain.models.swiglu_kernel import silu_mul


def _saved(fn, a, b) -> list[torch.Size]:
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(t.shape) or t, lambda t: t):
        fn(a * 1, b * 1)
    return shapes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_the_plain_expression_keeping_two_tensors(dtype):
    torch.manual_seed(0)
    a, b, g = (torch.randn(5, 7, 12, dtype=dtype) for _ in range(3))
    ref_a, ref_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    ref = F.silu(ref_a) * ref_b
    ref.backward(g)
    ours_a, ours_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    h = silu_mul(ours_a, ours_b)
    h.backward(g)
    assert torch.equal(h, ref) and torch.equal(ours_a.grad, ref_a.grad) and torch.equal(ours_b.grad, ref_b.grad)
    assert len(_saved(silu_mul, ours_a, ours_b)) == 2 < len(_saved(lambda x, y: F.silu(x) * y, ours_a, ours_b))


def test_silu_mul_keeps_only_what_the_gradients_asked_for_need():
    """a without a gradient: only a is kept (b's gradient is g * silu(a)), and no gradient is made for it;
    b without one: both are (a's needs b), and b gets none."""
    torch.manual_seed(0)
    a, b, g = (torch.randn(4, 6) for _ in range(3))
    ours_b = b.clone().requires_grad_()
    assert len(_saved(silu_mul, a, ours_b)) == 1
    silu_mul(a, ours_b).backward(g)
    assert torch.equal(ours_b.grad, g * F.silu(a))
    ours_a = a.clone().requires_grad_()
    assert len(_saved(silu_mul, ours_a, b)) == 2
    silu_mul(ours_a, b).backward(g)
    ref_a = a.clone().requires_grad_()
    (F.silu(ref_a) * b).backward(g)
    assert torch.equal(ours_a.grad, ref_a.grad)
