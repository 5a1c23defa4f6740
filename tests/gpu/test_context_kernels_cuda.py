"""Ring attention's CUDA kernels (compat.attention_lse: flash for bf16, memory-efficient for fp32) against
its fp32 math on one GPU: the output, the log-sum-exp, and the backward given them, for a causal and a
full call of unequal query and key lengths (the ring's shapes). Tolerances: fp32 1e-4, bf16 2e-2
relative (the kernels' own rounding); the merge of two calls by their log-sum-exp equals one call over
the keys of both. The NCCL ring itself runs in the layout matrix (test_layouts_nccl.py: cp rows)."""

import pytest
import torch

from teratrain import compat
from teratrain.parallel.ring_attention import _merge, math_backward, math_forward


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.gpu(1)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal, tq, tk", [(True, 256, 256), (False, 256, 512)])
def test_fused_kernel_equals_math(dtype, tol, causal, tq, tk):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, tq, 64, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(2, 8, tk, 64, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    dout = torch.randn(2, 8, tq, 64, device="cuda", dtype=dtype, generator=g)
    kind = compat.attention_lse_kind(q)
    assert kind == ("flash" if dtype == torch.bfloat16 else "efficient")
    out, lse, rest = compat.attention_lse(q, k, v, causal, 0.125, kind)
    ref_out, ref_lse = math_forward(q, k, v, 0.125, None, causal)
    assert _rel(out, ref_out) < tol and _rel(lse, ref_lse) < tol
    grads = compat.attention_lse_backward(dout, q, k, v, out, lse.float(), causal, 0.125, kind, rest)
    refs = math_backward(dout, q, k, v, ref_out, ref_lse, 0.125, None, causal)
    for got, want in zip(grads, refs):
        assert _rel(got, want) < tol


@pytest.mark.gpu(1)
def test_two_calls_merged_equal_one():
    q, k, v = (torch.randn(1, 4, 128, 64, device="cuda") for _ in range(3))
    kind = compat.attention_lse_kind(q)
    whole, whole_lse, _ = compat.attention_lse(q, torch.cat([k, k.flip(2)], 2), torch.cat([v, v.flip(2)], 2),
                                               False, 0.125, kind)
    out = torch.zeros(1, 128, 4, 64, device="cuda").transpose(1, 2)
    lse = torch.full((1, 4, 128), float("-inf"), device="cuda")
    for kk, vv in ((k, v), (k.flip(2), v.flip(2))):
        o, l, _ = compat.attention_lse(q, kk, vv, False, 0.125, kind)
        _merge(out, lse, slice(0, 128), o, l)
    assert _rel(out, whole) < 1e-5 and _rel(lse, whole_lse) < 1e-5
