"""models/grouped.py: w1 and w3 of the gated experts as one grouped GEMM over their stacks side by side
("w13", `fuses_gate_up`) give the outputs and gradients of two GEMMs, from the step's casts
(memory/step_casts.py, compiled) carrying the gradients so far and from the cast a compiled forward makes."""

import pytest
import torch

from teratrain import compat
from teratrain.memory import step_casts
from teratrain.models import grouped
from teratrain.models.moe import Experts

E, D, F, ROWS = 4, 16, 8, 24
KERNELS = ["loop", pytest.param("grouped", marks=pytest.mark.skipif(compat.grouped_mm is None,
                                                                     reason="this torch has no grouped GEMM"))]


def experts(bias: bool, dtype=torch.float32) -> Experts:
    """Gated stacks in `dtype`, random (seeded)."""
    ex = Experts(E, D, F, bias=bias, dropout=0.0, gated=True).to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return ex


def rows(dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Laid-out rows and their groups' end offsets (one group empty, two rows past the last group)."""
    x = torch.randn(ROWS, D, generator=torch.Generator().manual_seed(1), dtype=dtype)
    return x, torch.tensor([8, 8, 15, 22], dtype=torch.int32)


def run(ex: Experts, x: torch.Tensor, offsets: torch.Tensor, kernel: str, fused: bool, acc: dict | None = None):
    """Output rows (up to offsets[-1]) and each parameter's gradient, the stacks cast once as the step does
    (fused: as a compiled step does) and `acc` carried into their casts' backward."""
    ex.step_casts = step_casts.stack_casts(ex, x.dtype, grouped.join_gate_up if fused else None)
    assert ("w13" in ex.step_casts) == fused and ("w1" in ex.step_casts) != fused
    ex.grad_acc = acc
    x = x.clone().requires_grad_()
    out = grouped.run_experts(ex, x, offsets, kernel == "grouped")[:offsets[-1]]
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    params = [p for p in ex.parameters()]
    grads = torch.autograd.grad((out * up).sum(), [x, *params], allow_unused=True)
    ex.step_casts = ex.grad_acc = None
    return out.detach(), (grads[0][:offsets[-1]], *grads[1:])  # rows past the groups: no gradient defined


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """a equals b within `tol` of b's norm (the tolerance of the dtype the two were computed in)."""
    return a.dtype == b.dtype and bool((a - b).norm() <= tol * b.norm())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias", [False, True])
def test_one_gemm_for_w1_and_w3_equals_two(kernel, bias):
    """The loop: fp32 parameters computed in fp64 (within 1e-12 of the norm; the gradients rounded to fp32,
    1e-7); torch's grouped GEMM (fp32 at most on a CPU): fp64 parameters computed in fp32 (1e-6). With and
    without biases, and with the gradients of earlier micro-batches carried through the casts."""
    param, compute, tol, grad_tol = (torch.float32, torch.float64, 1e-12, 1e-7) if kernel == "loop" else \
        (torch.float64, torch.float32, 1e-6, 1e-6)
    ex = experts(bias, param)
    x, offsets = rows(compute)
    ref, ref_grads = run(ex, x, offsets, kernel, fused=False)
    got, got_grads = run(ex, x, offsets, kernel, fused=True)
    assert close(got, ref, tol)
    assert all(close(g, r, grad_tol) for g, r in zip(got_grads, ref_grads))
    acc = {"w1": torch.randn(ex.w1.shape, dtype=param), "w3": torch.randn(ex.w3.shape, dtype=param)}
    _, carried = run(ex, x, offsets, kernel, fused=True, acc=acc)
    names = [n for n, _ in ex.named_parameters()]
    for name, g, r in zip(["x", *names], carried, got_grads):
        assert close(g, r + acc[name], grad_tol) if name in acc else torch.equal(g, r), name


def test_compiled_forward_casts_w1_and_w3_into_one_stack():
    """Without the step's casts (one micro-batch a step), a compiled forward casts w1 and w3 into one stack
    (two grouped GEMMs a forward where there were three) and matches eager's two GEMMs (fp64; the fp32
    gradients 1e-7)."""
    ex = experts(False)
    x, offsets = rows()
    widths = []
    gmm = grouped._gmm

    def spy(a, w, *rest):
        widths.append(w.shape[1])
        return gmm(a, w, *rest)

    def fn(x, grouped_mm=True):  # compiled in fp64: the loop of per-group GEMMs inside the graph (_gmm)
        return grouped.run_experts(ex, x, offsets, grouped_mm)[:offsets[-1]]

    ex.step_casts = step_casts.stack_casts(ex, x.dtype)  # two GEMMs, eager
    ref = fn(x, grouped_mm=False)
    ex.step_casts = None
    ref_grads = torch.autograd.grad(ref.square().sum(), list(ex.parameters()), allow_unused=True)
    grouped._gmm = spy
    try:
        got = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    finally:
        grouped._gmm = gmm
    got_grads = torch.autograd.grad(got.square().sum(), list(ex.parameters()), allow_unused=True)
    assert widths == [2 * F, D]
    assert close(got, ref, 1e-12)
    assert all(close(g, r, 1e-7) for g, r in zip(got_grads, ref_grads))


def test_the_join_hands_each_weight_a_whole_gradient():
    """Each stack cast, then the two joined: backward hands w1 and w3 gradients of their own (a slice of one
    joined gradient would be copied again by autograd's accumulation to match the parameter's layout)."""
    ex = experts(False)
    seen = []
    for w in (ex.w1, ex.w3):
        w.register_hook(lambda g: seen.append(g.is_contiguous()))
    grouped.join_gate_up(ex.w1, ex.w3, torch.bfloat16).float().square().sum().backward()
    assert seen == [True, True]


def test_compiled_forward_on_the_steps_separate_casts_carries_their_gradients():
    """Casts the step made apart (its StepCasts not compiled) stand for w1's and w3's casts in a compiled
    forward too, carrying the gradients so far: the forward does not join the parameters anew."""
    ex = experts(False)
    x, offsets = rows()
    acc = {name: torch.randn(w.shape, generator=torch.Generator().manual_seed(3)) for name, w, _ in ex.leaves()}

    def grads(compiled: bool):
        ex.step_casts, ex.grad_acc = step_casts.stack_casts(ex, x.dtype), dict(acc)
        fn = lambda x: grouped.run_experts(ex, x, offsets, compiled)[:offsets[-1]]  # noqa: E731
        out = (torch.compile(fn, backend="aot_eager", fullgraph=True) if compiled else fn)(x)
        ex.step_casts = ex.grad_acc = None
        return torch.autograd.grad(out.square().sum(), [w for _, w, _ in ex.leaves()])

    ref = grads(False)
    for g, r in zip(grads(True), ref):
        assert close(g, r, 1e-7)


def test_stacks_already_in_the_compute_dtype_stay_two():
    """Parameters in the compute dtype are read as they are: joining them would copy both stacks."""
    ex = experts(False)
    assert not grouped.fuses_gate_up(ex, torch.float32) and grouped.fuses_gate_up(ex, torch.bfloat16)
    assert step_casts.stack_casts(ex, torch.float32, grouped.join_gate_up) == {}
    assert not grouped.fuses_gate_up(Experts(E, D, F, bias=False, dropout=0.0, gated=False), torch.bfloat16)
