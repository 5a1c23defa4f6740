"""memory/step_casts.py on a GPU: float8 weights (tensorwise, on the tensor cores, not emulated) and the
experts' bf16 stacks (the grouped GEMM) cast once a step against each micro-batch casting its own, bf16
autocast over fp32 parameters, 3 micro-batches a step, 3 steps. Eager: the same bytes, so the same losses
and gradients, bit for bit. Compiled: the per-micro-batch casts are traced into inductor's kernels and the
step's are made eagerly; tolerance fixed before the run: losses within 1e-5 relative, gradients within
1e-3 relative in norm (one float8 step of the input gradient, 2^-3, would be far above it). The compiled
experts' case failed it once (one H200, 2026-12-03: the token embedding's gradient 1.9e-3 relative, the
gradients summed by tensor hooks), passed twice (2026-12-04, the accumulated gradients compared, the stacks'
casts carrying them; again with w1 and w3 one GEMM) and failed in both runs since w1 and w3 are cast before
their join (ec92e87; the second run, to read the message: the third step's loss 1.28e-5 relative, the first
two equal within it; the bytes of the casts are the same either way, the compiled kernels around them are
not): recorded as failing, not passed."""

import gc

import pytest
import torch

from teratrain import compat
from teratrain.config import load_config
from teratrain.memory import step_casts
from teratrain.mesh import Runtime
from teratrain.models.transformer import Transformer
from teratrain.optim.engine import train_step
from teratrain.parallel.parallelize import parallelize

BASE = ["model.n_layers=2", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=512",
        "model.vocab_size=512", "model.seq_len=128", "train.device=cuda", "memory.precision=bf16",
        "train.global_batch=6", "train.micro_batch=2", "model.dropout=0.0"]
KINDS = {"float8": ["memory.fp8=tensorwise"],
         "experts": ["model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.expert_d_ff=128"]}


def _run(sets: list[str], once: bool):
    cfg = load_config(None, [*BASE, *sets])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    engine = parallelize(model, Runtime.single("cuda"), cfg)
    if not once:
        step_casts._RUNS.pop(model, None)
    g = torch.Generator().manual_seed(1)
    losses, grads = [], {}
    batches = [torch.randint(0, 512, (3, 2, 128), generator=g).cuda() for _ in range(3)]
    for i, xs in enumerate(batches):
        micro = [(x, x.roll(-1, 1)) for x in xs]
        if i == len(batches) - 1:
            for name, p in model.named_parameters():
                p.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.float()))
        losses.append(train_step(model, engine, micro, "bf16", 1e-3)[1].item())
    return losses, grads, model


MODES = {"eager": [], "compiled": ["train.compile=true"],
         "graphed": ["train.compile=true", "train.compile_mode=reduce-overhead"]}


@pytest.mark.gpu(1)
@pytest.mark.parametrize("kind, mode", [
    ("float8", "eager"), ("float8", "compiled"), ("experts", "eager"),
    pytest.param("experts", "compiled", marks=pytest.mark.xfail(reason="one H200, ec92e87: the third step's loss "
                                                                "1.28e-5 relative, over the 1e-5 fixed before the "
                                                                "run; within it on one H200 at 15790e9 (compiled "
                                                                "kernels vary by run)")),
    ("float8", "graphed"), ("experts", "graphed")])
def test_casts_once_a_step_train_as_every_micro_batch(kind, mode):
    """CUDA graphs: the casts kept at fixed addresses and cast into each step (no gradient carried), against
    each micro-batch casting inside the graph; losses within 1e-4 relative (fixed before the run: the graphs
    replay compiled kernels, whose sums may differ from the eager casts'), gradients as compiled."""
    if kind == "float8" and (torch.cuda.get_device_capability() < (8, 9) or _no_torchao()):
        pytest.skip("needs float8 tensor cores and torchao")
    once_losses, once_grads, model = _run(KINDS[kind] + MODES[mode], once=True)
    every_losses, every_grads, _ = _run(KINDS[kind] + MODES[mode], once=False)
    assert step_casts._RUNS.get(model) is not None
    if mode == "eager":
        assert once_losses == every_losses
        assert all(torch.equal(g, every_grads[n]) for n, g in once_grads.items())
        return
    assert once_losses == pytest.approx(every_losses, rel=1e-5 if mode == "compiled" else 1e-4)
    for name, grad in once_grads.items():
        ref = every_grads[name]
        assert (grad - ref).norm() <= 1e-3 * ref.norm() + 1e-12, name


@pytest.mark.gpu(1)
def test_the_stacks_cast_once_add_nothing_to_the_peak():
    """At the end of a forward every layer's stack copy is alive either way (saved for backward): the
    allocator's peak of a step with the casts once is within 1% of the per-micro-batch step's."""
    peaks = []
    for once in (True, False):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        _run(KINDS["experts"], once)
        peaks.append(torch.cuda.max_memory_allocated())
    assert peaks[0] <= 1.01 * peaks[1], peaks


def _no_torchao() -> bool:
    try:
        compat.torchao_float8()
    except ImportError:
        return True
    return False

