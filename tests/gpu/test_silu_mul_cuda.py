"""The dense SwiGLU's silu_mul (models/swiglu_kernel.py) on CUDA: the plain expression's output and gradients bit
for bit, in bf16 and fp32, keeping only its two inputs."""

import pytest
import torch
import torch.nn.functional as F

from teratrain.models.swiglu_kernel import silu_mul

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_is_the_plain_expression_keeping_two_tensors(dtype):
    torch.manual_seed(0)
    shape = (3, 1000, 1376)
    a, b, g = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
    ref_a, ref_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    ref = F.silu(ref_a) * ref_b
    ref.backward(g)
    ours_a, ours_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        h = silu_mul(ours_a, ours_b)
    h.backward(g)
    assert [t.shape for t in saved] == [shape, shape]
    assert torch.equal(h, ref) and torch.equal(ours_a.grad, ref_a.grad) and torch.equal(ours_b.grad, ref_b.grad)
