"""ZB-H1's backward split (parallel/pipeline/backward.py, saved.py) against one full backward, on a
real model chunk in one process, the way the executor runs it (the forward under `SplitSaved`):
I alone gives the input gradient and no weight gradient; W then gives every weight gradient through
AccumulateGrad (hooks fire), equal to the full backward's to fp64 rounding, with dropout replayed
under recomputation. And what the split costs: I + W run B's FLOPs (no forward replayed twice,
whatever the recomputation policy), and after I the chunk holds less than its forward saved."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from teratrain.memory.recompute import apply_recompute
from teratrain.parallel.pipeline.backward import backward_input, backward_weight
from teratrain.parallel.pipeline.saved import SplitSaved
from teratrain.parallel.pipeline.stage import Chunk
from tests.helpers import small_model


def _chunk(arch: str, recompute: str, last: bool, dtype=torch.float64, **more):
    keys = dict(arch=arch, n_kv_heads=4, tie_embeddings=True, bias=True) if arch == "gpt2" else {}
    model = apply_recompute(small_model(dtype=dtype, **keys, **more), recompute)
    return model, Chunk(model, stage=1, num_stages=2 if last else 3, blocks=range(2))


def _inputs(last: bool, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 16, 32, dtype=dtype, generator=g)
    y = torch.randint(0, 50, (2, 16), generator=g)
    seed = torch.tensor(0.5, dtype=dtype) if last else torch.randn(2, 16, 32, dtype=dtype, generator=g)
    return x0, y, seed


def _forward(chunk, x0, y, saved: SplitSaved | None = None):
    torch.manual_seed(1)  # the same dropout masks in both runs
    x = x0.clone().requires_grad_()
    if saved is None:
        return x, chunk.forward(x, y, 16)
    with saved.recording():
        return x, chunk.forward(x, y, 16, segment=saved.segment)


@pytest.mark.parametrize("arch,recompute", [("llama", "none"), ("gpt2", "none"), ("llama", "full"),
                                            ("llama", "selective")])
@pytest.mark.parametrize("last", [False, True])
def test_input_then_weight_equals_full_backward(arch, recompute, last):
    model, chunk = _chunk(arch, recompute, last, dropout=0.1)
    x0, y, seed = _inputs(last)
    x, out = _forward(chunk, x0, y)
    torch.autograd.backward(out, seed)
    full = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    full_x = x.grad.clone()
    model.zero_grad(set_to_none=True)

    fired = []
    for p in chunk.weights():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    saved = SplitSaved()
    x, out = _forward(chunk, x0, y, saved)
    groups = backward_input(out, seed, x, chunk.weights(), saved)
    assert torch.allclose(x.grad, full_x, rtol=1e-12, atol=1e-14)
    assert all(p.grad is None for p in model.parameters()), "I must not touch the weights"
    backward_weight(groups)
    split = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert split.keys() == full.keys()
    for n in full:
        assert torch.allclose(split[n], full[n], rtol=1e-10, atol=1e-14), n
    assert len(fired) == len(chunk.weights())


class _Flops(TorchDispatchMode):
    """FLOPs of the ops run, by torch's own formulas (matmuls, and attention: its CPU kernel too)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if name == "_scaled_dot_product_flash_attention_for_cpu":
            self.total += sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape)
        elif name == "_scaled_dot_product_flash_attention_for_cpu_backward":
            self.total += sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape)
        elif func._overloadpacket in flop_registry:
            self.total += flop_registry[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
        return out


def _count(fn) -> tuple[int, object]:
    with _Flops() as f:
        r = fn()
    return f.total, r


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_split_costs_the_flops_of_one_backward_and_frees_what_only_i_needed(recompute):
    model, chunk = _chunk("llama", recompute, last=False, dtype=torch.float32)
    x0, y, seed = (t.float() for t in _inputs(last=False))
    x, out = _forward(chunk, x0, y)
    b_flops, _ = _count(lambda: torch.autograd.backward(out, seed))

    _, plain = _chunk("llama", "none", last=False, dtype=torch.float32)  # the same weights, nothing recomputed
    params = frozenset(p.untyped_storage().data_ptr() for p in model.parameters())
    everything = SplitSaved()
    _forward(plain, x0, y, everything)
    saved = SplitSaved()
    x, out = _forward(chunk, x0, y, saved)
    i_flops, groups = _count(lambda: backward_input(out, seed, x, chunk.weights(), saved))
    after_i = saved.held_bytes(params)
    w_flops, _ = _count(lambda: backward_weight(groups))
    assert abs((i_flops + w_flops) / b_flops - 1) < 0.02, (i_flops, w_flops, b_flops)
    assert after_i < 0.5 * everything.held_bytes(params), "after I the chunk should hold only what W needs"
