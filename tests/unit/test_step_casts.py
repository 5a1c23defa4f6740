"""memory/step_casts.py: the float8 weights (tensorwise) and the experts' bf16 weight stacks cast once a
step for all its micro-batches give the very losses and gradients of casting them every micro-batch,
exist only inside the step, and are made only where `applies`."""

import dataclasses
import gc
import importlib
import weakref

import pytest
import torch

from teratrain import compat, measure
from teratrain.memory import fp8, step_casts
from teratrain.models import grouped
from teratrain.models.moe import moe_layers
from teratrain.optim.engine import train_step
from tests.helpers import make_config

SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
         "model.vocab_size=50", "model.seq_len=16", "train.device=cpu", "memory.precision=bf16",
         "train.global_batch=6", "train.micro_batch=2"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.expert_d_ff=32"]


def _has_torchao() -> bool:
    try:
        compat.torchao_float8()
    except ImportError:
        return False
    return True


def _run(sets: list[str], once: bool, steps: int = 2, kernel: str = "grouped"):
    """Losses and the final gradients of `steps` steps of 3 micro-batches, casting once a step or not;
    the casts a step made; the model; how many times the GEMMs took a weight cast before the forward."""
    cfg = make_config(*SMALL, *sets)
    used = [0]
    for fn in (fp8._Float8Operand, grouped.MadeCast):
        apply = fn.apply
        spy = staticmethod(lambda *a, apply=apply: (used.__setitem__(0, used[0] + 1), apply(*a))[1])
        fn.apply = spy
    model, engine = measure.build_engine(cfg)
    for _, layer in moe_layers(model):
        layer.kernel = kernel
    if not once:
        step_casts._RUNS.pop(model, None)
    g = torch.Generator().manual_seed(1)
    losses, made = [], []
    grads = {}
    for _ in range(steps):
        micro = [(x, x.roll(-1, 1)) for x in torch.randint(0, 50, (3, 2, 16), generator=g)]
        _, loss = train_step(model, engine, micro, "bf16", 1e-3)
        losses.append(loss.item())
    for name, p in model.named_parameters():  # one more step's gradients, before the update clears them
        p.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.clone()))
    micro = [(x, x.roll(-1, 1)) for x in torch.randint(0, 50, (3, 2, 16), generator=g)]
    with step_casts.around_step(model, len(micro), torch.bfloat16):
        made.append(([lin.float8_weight for lin in fp8.float8_linears(model)],
                     [layer.experts.step_casts for _, layer in moe_layers(model)]))
    train_step(model, engine, micro, "bf16", 1e-3)
    for fn in (fp8._Float8Operand, grouped.MadeCast):
        del fn.apply  # the spy: torch.autograd.Function's own apply again
    return losses, grads, made[0], model, used[0]


@pytest.mark.skipif(not _has_torchao(), reason="torchao is not installed")
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_float8_weights_cast_once_a_step_train_bit_for_bit_as_every_micro_batch(recompute):
    """Also where recomputation replays each block's forward in backward: the replay carries the same
    gradient so far (memory/step_casts.py take_grads) as the first forward."""
    sets = ["memory.fp8=tensorwise", "memory.fp8_emulate=true", f"memory.recompute={recompute}"]
    once_losses, once_grads, (float8, _), model, used = _run(sets, once=True)
    every_losses, every_grads, (none, _), _, unused = _run(sets, once=False)
    replays = 2 if recompute == "full" else 1  # recomputation casts again in backward
    assert (used, unused) == (14 * 3 * 3 * replays, 0)  # 14 linears, 3 micro-batches, 3 steps
    assert len(float8) == 14 and all(isinstance(w, fp8.Float8Weight) for w in float8)
    assert all(w is None for w in none)
    assert once_losses == every_losses
    assert once_grads.keys() == every_grads.keys() and len(once_grads) > 0
    for name, grad in once_grads.items():
        assert torch.equal(grad, every_grads[name]), name
    assert all(lin.float8_weight is None for lin in fp8.float8_linears(model))  # gone after the step


@pytest.mark.skipif(not _has_torchao(), reason="torchao is not installed")
@pytest.mark.parametrize("compiled", [False, True])
def test_float8_weights_carry_the_gradients_so_far_through_their_casts(monkeypatch, compiled):
    """From a step's second micro-batch on, each float8 weight's cast takes the gradient of the earlier
    micro-batches (memory/step_casts.py take_grads) and its backward hands back the sum, contiguous, which
    autograd adopts (no copy into the weight's layout). Compiled, the model stays one graph (torch.compile
    traces the backward on a float8 stand-in for the gradient, which an addition in the float8 operand's
    own backward broke: the model fell back to eager pieces); traced with aot_eager, which sees the same
    graph breaks as inductor in seconds."""
    carried, adopted = [], []
    apply = fp8._CarriedGrad.apply

    def spy(weight, acc):
        carried.append(acc is not None)
        out = apply(weight, acc)

        def seen(g):  # this micro-batch's sum, seen once
            adopted.append(g.is_contiguous())
            handle.remove()

        handle = weight.register_hook(seen)
        return out

    if not compiled:
        monkeypatch.setattr(fp8._CarriedGrad, "apply", spy)
    else:
        compile_fn = torch.compile
        monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_fn(fn, **{**kw, "backend": "aot_eager"}))
        module_compile = torch.nn.Module.compile
        monkeypatch.setattr(torch.nn.Module, "compile",
                            lambda self, **kw: module_compile(self, **{**kw, "backend": "aot_eager"}))
    cfg = make_config(*SMALL, "memory.fp8=tensorwise", "memory.fp8_emulate=true", f"train.compile={compiled}".lower())
    model, engine = measure.build_engine(cfg)
    torch._dynamo.reset()
    counters = importlib.import_module("torch._dynamo.utils").counters
    counters.clear()
    micro = [(x, x.roll(-1, 1)) for x in torch.randint(0, 50, (3, 2, 16), generator=torch.Generator().manual_seed(1))]
    try:
        train_step(model, engine, micro, "bf16", 1e-3)
    finally:  # the aot_eager graphs would count towards the recompile limit of later tests' compiled models
        breaks = sum(counters["graph_break"].values())
        torch._dynamo.reset()
    if not compiled:
        assert carried == [True] * 28 and len(adopted) == 28 and all(adopted)  # 14 linears, 2 micro-batches
    assert breaks == 0


@pytest.mark.skipif(not _has_torchao(), reason="torchao is not installed")
def test_float8_cast_is_torchaos_bytes():
    w = torch.randn(32, 48) * 3
    made = fp8.Float8Weight(*fp8.TensorwiseCast()(w))
    scaling = importlib.import_module("torchao.float8.float8_scaling_utils")
    theirs = scaling.hp_tensor_to_float8_dynamic(w, compat.FLOAT8_E4M3, fp8.Fp8Gemm("tensorwise", True).mm_config)
    assert torch.equal(made.scale, theirs._scale)
    assert torch.equal(made.data.view(torch.uint8), theirs._data.view(torch.uint8))


@pytest.mark.skipif(not _has_torchao(), reason="torchao is not installed")
def test_float8_cast_compiles_whole_to_the_same_bytes():
    """Under train.compile the step's casts are compiled: one graph for all the weights (a graph break, or a
    call a weight, would cost each a Python round trip), each the eager cast's bytes."""
    cast = fp8.TensorwiseCast()
    weights = [torch.randn(48, 32) * 5, torch.randn(16, 48) / 7, torch.randn(48, 32)]
    try:
        made = torch.compile(cast.many, fullgraph=True, dynamic=False)(weights)
    finally:
        torch._dynamo.reset()
    assert len(made) == len(weights)
    for w, (data, scale) in zip(weights, made):
        ref, ref_scale = cast(w)
        assert torch.equal(scale, ref_scale) and torch.equal(data.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.skipif(not _has_torchao(), reason="torchao is not installed")
def test_float8_casts_compiled_into_held_tensors_are_the_same_bytes_in_place():
    """Under CUDA graphs a step after the first casts into the first one's tensors (`many_into`): compiled whole,
    each weight's bytes and scale are the eager cast's, written where the graph reads them."""
    cast = fp8.TensorwiseCast()
    weights = [torch.randn(48, 32) * 5, torch.randn(16, 48) / 7]
    held = [cast(torch.randn_like(w)) for w in weights]
    where = [(data.data_ptr(), scale.data_ptr()) for data, scale in held]
    try:
        torch.compile(cast.many_into, fullgraph=True, dynamic=False)(weights, held)
    finally:
        torch._dynamo.reset()
    assert [(data.data_ptr(), scale.data_ptr()) for data, scale in held] == where
    for w, (data, scale) in zip(weights, held):
        ref, ref_scale = cast(w)
        assert torch.equal(scale, ref_scale) and torch.equal(data.view(torch.uint8), ref.view(torch.uint8))


def test_graphed_compiled_steps_join_the_gate_and_up_stacks_into_the_first_ones():
    """Compiled under CUDA graphs, w1 and w3 are cast side by side into one "w13" stack at the first step, and
    every later step writes both halves into that same tensor (one compiled join_gate_up_into) with the new
    weights' bf16 values."""
    model = measure.build_engine(make_config(*SMALL, *MOE))[0]
    casts = step_casts.StepCasts(model, compiled=True, graphed=True)
    experts = casts.experts[0]
    seen = []
    try:
        for _ in range(3):
            with casts.step(torch.bfloat16):
                made = dict(experts.step_casts)
                seen.append({k: v.data_ptr() for k, v in made.items()})
                assert made.keys() == {"w13", "w2"}
                assert torch.equal(made["w13"], grouped.join_gate_up(experts.w1, experts.w3, torch.bfloat16))
                assert torch.equal(made["w2"], experts.w2.to(torch.bfloat16))
            with torch.no_grad():
                experts.w1.mul_(1.5)
                experts.w3.add_(0.25)
    finally:
        torch._dynamo.reset()
    assert seen[0] == seen[1] == seen[2]


@pytest.mark.parametrize("kernel, recompute", [("grouped", "none"), ("loop", "none"), ("grouped", "full")])
def test_expert_stacks_cast_once_a_step_train_bit_for_bit_as_every_micro_batch(kernel, recompute):
    """Also where recomputation replays each block's forward in backward: the replayed cast carries the same
    accumulated gradient (memory/step_casts.py take_grads) as the first."""
    if kernel == "grouped" and compat.grouped_mm is None:
        pytest.skip("this torch has no grouped GEMM")
    sets = [*MOE, f"memory.recompute={recompute}"]
    once_losses, once_grads, (_, stacks), model, used = _run(sets, once=True, kernel=kernel)
    every_losses, every_grads, (_, none), _, unused = _run(sets, once=False, kernel=kernel)
    replays = 2 if recompute == "full" else 1  # recomputation casts again in backward
    assert (used, unused) == (2 * 3 * 3 * 3 * replays, 0)  # 2 layers of 3 stacks, 3 micro-batches, 3 steps
    assert len(stacks) == 2 and all(set(s) == {"w1", "w3", "w2"} for s in stacks)
    assert all(t.dtype == torch.bfloat16 for s in stacks for t in s.values())
    assert none == [None, None]
    assert once_losses == every_losses
    for name, grad in once_grads.items():
        assert grad.dtype == torch.float32 and torch.equal(grad, every_grads[name]), name
    assert all(layer.experts.step_casts is None for _, layer in moe_layers(model))


@pytest.mark.parametrize("kind, compiled", [
    ("experts", False), ("float8", False),
    pytest.param("experts", True, marks=pytest.mark.long), pytest.param("float8", True, marks=pytest.mark.long)])
def test_the_gradients_carried_through_the_casts_are_freed_as_they_are_summed(kind, compiled, monkeypatch):
    """Eager: a weight's gradient from the step's earlier micro-batches, taken off it before a forward
    (memory/step_casts.py take_grads), lives until its cast's backward has made the sum: after each backward
    none is alive. Held by its layer to the step's end, each doubled the carried weights' gradient bytes at
    the end of the last backward."""
    if kind == "float8" and not _has_torchao():
        pytest.skip("torchao is not installed")
    if kind == "experts" and compat.grouped_mm is None:
        pytest.skip("this torch has no grouped GEMM")
    taken, alive = [], []
    take = step_casts._take_grad

    def spy(w):
        g = take(w)
        if g is not None:
            taken.append(weakref.ref(g))
        return g

    monkeypatch.setattr(step_casts, "_take_grad", spy)
    cfg = make_config(*SMALL, *(MOE if kind == "experts" else ["memory.fp8=tensorwise", "memory.fp8_emulate=true"]),
                      f"train.compile={str(compiled).lower()}")
    model, engine = measure.build_engine(cfg)
    backward = engine.backward

    def checked(loss):
        backward(loss)
        gc.collect()
        alive.append((len(taken), sum(ref() is not None for ref in taken)))
        taken.clear()

    engine.backward = checked
    micro = [(x, x.roll(-1, 1)) for x in torch.randint(0, 50, (3, 2, 16), generator=torch.Generator().manual_seed(0))]
    train_step(model, engine, micro, "bf16", 1e-3)
    carried = 2 * 3 if kind == "experts" else 2 * 7  # 2 layers of 3 stacks, or of 7 float8 linears
    assert alive == [(0, 0), (carried, 0), (carried, 0)]


def test_the_stacks_cast_once_add_nothing_to_the_peak():
    """tests/gpu/test_step_casts_cuda.py's peak check counted on the CPU (measure.PeakStorages): the most
    bytes alive at once in 3 steps of 3 micro-batches with the experts' stacks cast once a step within 1% of
    casting them every micro-batch (bound of the GPU test). The carried gradients held by their layers to the
    step's end put the once-a-step run 2.7% above."""
    if compat.grouped_mm is None:
        pytest.skip("this torch has no grouped GEMM")
    sets = ["model.n_layers=2", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=512",
            "model.vocab_size=512", "model.seq_len=128", "train.device=cpu", "memory.precision=bf16",
            "train.global_batch=6", "train.micro_batch=2", "model.moe.num_experts=8", "model.moe.top_k=2",
            "model.moe.expert_d_ff=128"]  # the GPU test's shapes, where the stacks' gradients weigh most
    peaks = []
    for once in (True, False):
        cfg = make_config(*sets)
        model, engine = measure.build_engine(cfg)
        for _, layer in moe_layers(model):
            layer.kernel = "grouped"  # as on a GPU
        if not once:
            step_casts._RUNS.pop(model, None)
        g = torch.Generator().manual_seed(1)
        with measure.PeakStorages() as count:
            for _ in range(3):
                micro = [(x, x.roll(-1, 1)) for x in torch.randint(0, 512, (3, 2, 128), generator=g)]
                train_step(model, engine, micro, "bf16", 1e-3)
        peaks.append(count.peak)
    assert peaks[0] <= 1.01 * peaks[1], peaks


@pytest.mark.long
def test_compiled_expert_stacks_carry_the_gradients_so_far_through_their_casts():
    """Compiled (bf16 autocast, the grouped GEMM), the backward of each stack's cast adds the gradient of
    the step's earlier micro-batches (memory/step_casts.py take_grads): the same losses (1e-5) and
    gradients (1e-3 relative in norm, the tolerance of tests/gpu/test_step_casts_cuda.py) as casting
    every micro-batch, where autograd accumulates."""
    if compat.grouped_mm is None:
        pytest.skip("this torch has no grouped GEMM")
    sets = [*MOE, "train.compile=true"]
    once_losses, once_grads, *_ = _run(sets, once=True, steps=1)
    every_losses, every_grads, *_ = _run(sets, once=False, steps=1)
    assert once_losses == pytest.approx(every_losses, rel=1e-5)
    for name, grad in once_grads.items():
        ref = every_grads[name]
        assert (grad - ref).norm() <= 1e-3 * ref.norm() + 1e-12, name


@pytest.mark.long
@pytest.mark.skipif(not _has_torchao(), reason="torchao is not installed")
def test_compiled_float8_weights_carry_the_gradients_so_far_through_their_casts():
    """Compiled (emulated float8), the backward of each float8 weight's cast adds the gradient of the step's
    earlier micro-batches: the same losses (1e-5) and gradients (1e-3 relative in norm) as casting every
    micro-batch, where autograd accumulates (tests/gpu/test_step_casts_cuda.py's tolerances)."""
    sets = ["memory.fp8=tensorwise", "memory.fp8_emulate=true", "train.compile=true"]
    once_losses, once_grads, *_ = _run(sets, once=True, steps=1)
    every_losses, every_grads, *_ = _run(sets, once=False, steps=1)
    assert once_losses == pytest.approx(every_losses, rel=1e-5)
    for name, grad in once_grads.items():
        ref = every_grads[name]
        assert (grad - ref).norm() <= 1e-3 * ref.norm() + 1e-12, name


def test_stacks_in_the_compute_dtype_are_not_copied():
    """Parameters already in bf16 (fp32 masters in the optimizer) are what the grouped GEMMs read."""
    *_, (_, stacks), _, used = _run([*MOE, "memory.master_weights=true"], once=True, steps=1)
    assert stacks == [None, None] and used == 0


def test_cast_once_false_casts_every_micro_batch_and_is_planned_so():
    from teratrain.planner.inputs import training_of

    *_, model, used = _run([*MOE, "memory.cast_once=false"], once=True, steps=1)
    assert step_casts._RUNS.get(model) is None and used == 0
    assert training_of(make_config(*SMALL, *MOE, "memory.cast_once=false")).casts_per_micro_batch
    assert not training_of(make_config(*SMALL, *MOE)).casts_per_micro_batch


@pytest.mark.parametrize("zero, pp, sync, expected", [
    (0, 1, "allreduce", True), (2, 1, "allreduce", True), (3, 1, "allreduce", False),
    (0, 2, "allreduce", False), (0, 1, "param-server", False),
])
def test_where_the_casts_are_made_once(zero, pp, sync, expected):
    assert step_casts.applies(zero, pp, sync) is expected


def test_graphed_casts_are_made_once_and_cast_into_after():
    """Under CUDA graphs (graphed=True) the casts are the same tensors every step, marked static, holding
    each step's weights; no gradient is taken off a weight; and a step trains bit for bit as one casting every
    micro-batch (eager on the CPU: the graph's addresses are what this checks, not the replay)."""
    model = measure.build_engine(make_config(*SMALL, *MOE))[0]
    casts = step_casts.StepCasts(model, graphed=True)
    experts = casts.experts[0]
    seen = []
    for _ in range(2):
        with casts.step(torch.bfloat16):
            made = dict(experts.step_casts)
            seen.append({k: id(v) for k, v in made.items()})
            fresh = step_casts.stack_casts(experts, torch.bfloat16)
            assert made.keys() == fresh.keys() == {"w1", "w3", "w2"}
            assert all(torch.equal(made[k], fresh[k]) for k in made)
            # torch._dynamo.mark_static_address's mark, the same in 2.11 and 2.13
            assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in made.values())
            experts.w1.grad = torch.ones_like(experts.w1)
            casts.take_grads()
            assert experts.grad_acc is None and experts.w1.grad is not None  # nothing taken
            experts.w1.grad = None
        with torch.no_grad():
            experts.w1.add_(1.0)  # the next step's weights differ: cast into the same tensors
    assert seen[0] == seen[1] and experts.step_casts is None


@pytest.mark.parametrize("sets", [
    pytest.param(MOE, id="experts"),
    pytest.param(["memory.fp8=tensorwise", "memory.fp8_emulate=true"], id="float8",
                 marks=pytest.mark.skipif(not _has_torchao(), reason="torchao is not installed")),
])
def test_graphed_casts_train_as_every_micro_batch(sets):
    """A step with graphed=True casts (the experts' stacks and the float8 weights cast into kept tensors, no
    gradient carried) gives the losses and gradients of casting every micro-batch, bit for bit, eager on the CPU."""
    real = step_casts.StepCasts
    step_casts.StepCasts = lambda model, compiled=False, graphed=False: real(model, compiled, graphed=True)
    try:
        once_losses, once_grads, _, model, used = _run(sets, once=True, steps=3)
    finally:
        step_casts.StepCasts = real
    every_losses, every_grads, *_ = _run(sets, once=False, steps=3)
    assert step_casts._RUNS[model].graphed and used > 0
    assert once_losses == every_losses
    assert all(torch.equal(g, every_grads[n]) for n, g in once_grads.items())


@pytest.mark.parametrize("sets", [
    pytest.param(["memory.fp8=tensorwise", "memory.fp8_emulate=true"], id="float8",
                 marks=pytest.mark.skipif(not _has_torchao(), reason="torchao is not installed")),
    pytest.param([*MOE, "model.moe.shared_experts=1"], id="experts"),
    pytest.param([*MOE, "memory.fp8=tensorwise", "memory.fp8_emulate=true"], id="both",
                 marks=pytest.mark.skipif(not _has_torchao(), reason="torchao is not installed")),
])
def test_planner_counts_the_casts_live_bytes(sets):
    """What the step holds (its tensors, counted live) is the planner's step_casts term, and the planner
    leaves the stacks out of the blocks' autocast copies."""
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.memory import plan_memory

    *_, (float8, stacks), _, _ = _run(sets, once=True, steps=1)
    live = sum(w.data.numel() * w.data.element_size() for w in float8)
    live += sum(t.numel() * t.element_size() for s in stacks if s for t in s.values())
    cfg = make_config(*SMALL, *sets)
    shape, train, lay = shape_of(cfg), training_of(cfg), layout_of(cfg)
    assert lay.num_microbatches == 3
    planned = plan_memory(shape, train, lay, device="cpu")
    assert live > 0 and planned.terms["step_casts"] == live
    per_micro_batch = plan_memory(shape, dataclasses.replace(train, casts_per_micro_batch=True), lay, device="cpu")
    assert per_micro_batch.terms["step_casts"] == 0
    stacks_bytes = sum(t.numel() * t.element_size() for s in stacks if s for t in s.values())
    copies = per_micro_batch.terms["autocast_weight_copies"] - planned.terms["autocast_weight_copies"]
    assert copies == stacks_bytes  # a block's copies no more
