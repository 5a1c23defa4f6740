"""ZB-H1's backward split (parallel/pipeline/backward.py) against one full backward, on a real model
chunk in one process: I alone gives the input gradient and no weight gradient; W then gives every
weight gradient through AccumulateGrad (hooks fire), equal to the full backward's to fp64 rounding."""

import pytest
import torch

from teratrain.memory.recompute import apply_recompute
from teratrain.parallel.pipeline.backward import backward_input, backward_weight
from teratrain.parallel.pipeline.stage import Chunk
from tests.helpers import small_model


@pytest.mark.parametrize("arch,recompute", [("llama", "none"), ("gpt2", "none"), ("llama", "full"),
                                            ("llama", "selective")])
@pytest.mark.parametrize("last", [False, True])
def test_input_then_weight_equals_full_backward(arch, recompute, last):
    keys = dict(arch=arch, n_kv_heads=4, tie_embeddings=True, bias=True) if arch == "gpt2" else {}
    model = apply_recompute(small_model(**keys), recompute)
    chunk = Chunk(model, stage=1, num_stages=2 if last else 3, blocks=range(2))
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 16, 32, dtype=torch.float64, generator=g)
    y = torch.randint(0, 50, (2, 16), generator=g)
    seed = None if last else torch.randn(2, 16, 32, dtype=torch.float64, generator=g)

    def run():
        x = x0.clone().requires_grad_()
        out = chunk.forward(x, y, 16)
        return x, out, torch.tensor(0.5, dtype=out.dtype) if last else seed

    x, out, grad = run()
    torch.autograd.backward(out, grad)
    full = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    full_x = x.grad.clone()
    model.zero_grad(set_to_none=True)

    fired = []
    for p in chunk.weights():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    x, out, grad = run()
    groups = backward_input(out, grad, x, chunk.weights())
    assert torch.allclose(x.grad, full_x, rtol=1e-12, atol=1e-14)
    assert all(p.grad is None for p in model.parameters()), "I must not touch the weights"
    backward_weight(groups)
    split = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert split.keys() == full.keys()
    for n in full:
        assert torch.allclose(split[n], full[n], rtol=1e-10, atol=1e-14), n
    assert len(fired) == len(chunk.weights())
