"""Tensor-parallel building blocks that run in one process (a tp group of one): the vocab-parallel
cross-entropy against torch's, in fp32 and from bf16 logits (its fp32 softmax is computed straight
from them and its backward works in the saved softmax), with padding columns; the sequence-parallel
token layout."""

import pytest
import torch
import torch.nn.functional as F

from teratrain.parallel.comm import sequence_rows
from teratrain.parallel.tp_layers import _VocabParallelCrossEntropy


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_vocab_parallel_cross_entropy_equals_torch(dtype, tol):
    torch.manual_seed(0)
    real, padded = 11, 13  # two padding columns: no probability, no gradient
    logits = torch.randn(6, padded).to(dtype).requires_grad_()
    targets = torch.randint(0, real, (6,))
    loss = _VocabParallelCrossEntropy.apply(logits, targets, None, 0, real).mean()
    loss.backward(retain_graph=True)
    ref_logits = logits.detach()[:, :real].float().requires_grad_()
    ref = F.cross_entropy(ref_logits, targets)
    ref.backward()
    assert abs(loss.item() - ref.item()) < tol
    assert logits.grad.dtype == dtype
    assert torch.allclose(logits.grad[:, :real].float(), ref_logits.grad, atol=tol / 10)
    assert not logits.grad[:, real:].any()
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()  # the softmax was consumed in place by the first


def test_sequence_rows_cover_every_token_once_in_contiguous_blocks():
    total, n, chunks = 24, 2, 3
    rows = [r for rank in range(n) for a, b in sequence_rows(total, n, rank, chunks) for r in range(a, b)]
    assert sorted(rows) == list(range(total))
    assert sequence_rows(total, n, 1, chunks) == [(4, 8), (12, 16), (20, 24)]
