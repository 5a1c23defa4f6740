"""memory.fp8: the settings it refuses, what it swaps (block linears only, the same parameters), and the
float8 GEMMs themselves through torchao's emulation on CPU (no float8 tensor cores here)."""

import pytest
import torch
import torch.nn.functional as F

from teratrain import compat
from teratrain.config import ConfigError
from teratrain.memory import fp8
from teratrain.memory.precision import autocast
from teratrain.mesh import Runtime
from teratrain.models.moe import MoE
from teratrain.models.transformer import Transformer
from teratrain.parallel.parallelize import parallelize
from tests.helpers import make_config

try:  # torchao is the optional `fp8` extra; setup.sh installs it
    compat.torchao_float8()
except ImportError:
    pytest.skip("torchao is not installed", allow_module_level=True)

FP8 = ["memory.precision=bf16", "memory.fp8=tensorwise", "memory.fp8_emulate=true"]
SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
         "model.vocab_size=50", "model.seq_len=16", "train.device=cpu"]


@pytest.mark.parametrize("sets, words", [
    (["memory.fp8=tensorwise"], "memory.precision=bf16"),
    (["memory.precision=fp16", "memory.fp8=rowwise"], "memory.precision=bf16"),
    (["memory.fp8_emulate=true"], "memory.fp8=tensorwise"),
    (FP8 + ["lora.rank=4"], "memory.fp8=none"),
    (FP8 + ["parallel.tp=2", "parallel.tp_overlap=chunked"], "parallel.tp_overlap=none"),
    (FP8 + ["train.micro_batch=1", "model.seq_len=100"], "change train.micro_batch or model.seq_len"),
])
def test_config_refuses_what_fp8_cannot_run_with_one_sentence(sets, words):
    with pytest.raises(ConfigError) as e:
        make_config(*sets)
    msg = str(e.value)
    assert words in msg and msg.count(". ") == 0 and msg.endswith(".")


def test_cpu_without_emulation_is_refused_naming_the_hardware():
    why = fp8.fp8_problem("tensorwise", False, torch.device("cpu"))
    assert "compute capability 8.9" in why and "memory.fp8=none" in why
    assert fp8.fp8_problem("tensorwise", True, torch.device("cpu")) is None
    assert fp8.fp8_problem("none", False, torch.device("cpu")) is None


def test_missing_torchao_names_the_extra(monkeypatch):


    def missing():
        raise ImportError("No module named 'torchao'")

    monkeypatch.setattr(compat, "torchao_float8", missing)
    assert "pip install 'teratrain[fp8]'" in fp8.fp8_problem("rowwise", True, torch.device("cpu"))


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_gemm_is_float8_rounding_of_the_bf16_linear(recipe):
    """Forward and both gradients within float8's rounding of bf16 autocast's, and not equal to them:
    e4m3 keeps 3 mantissa bits (relative spacing 1/8 to 1/16), so a GEMM of 64-term dot products lands
    a few percent off; the tolerance, 10%, leaves room and still fails a wrong scale (any factor of 2)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g, requires_grad=True)
    w = (0.05 * torch.randn(48, 64, generator=g)).requires_grad_()
    b = torch.randn(48, generator=g, requires_grad=True)
    dy = torch.randn(32, 48, generator=g)
    got, ref = {}, {}
    for out, fn in ((got, fp8.Fp8Gemm(recipe, emulate=True)), (ref, F.linear)):
        with autocast("bf16", torch.device("cpu")):
            y = fn(x, w, b)
        y.backward(dy)
        out.update(y=y.detach().float(), dx=x.grad.clone(), dw=w.grad.clone(), db=b.grad.clone())
        assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
        x.grad = w.grad = b.grad = None
    for key in ("y", "dx", "dw"):
        err = float((got[key] - ref[key]).norm() / ref[key].norm())
        assert 1e-4 < err < 0.1, f"{recipe} {key}: relative error {err:.3g}"
    torch.testing.assert_close(got["db"], ref["db"])  # the bias is added in bf16, not cast


def _model(sets):
    cfg = make_config(*SMALL, *sets)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    names = [n for n, _ in model.named_parameters()]
    engine = parallelize(model, Runtime.single("cpu"), cfg)
    return cfg, model, engine, names


def test_block_linears_swapped_keeping_parameters_and_names():
    cfg, model, _, names = _model(FP8)
    assert [n for n, _ in model.named_parameters()] == names
    swapped = {n for n, m in model.named_modules() if isinstance(m, fp8.Fp8Linear)}
    assert swapped == {f"layers.{i}.{m}" for i in range(2) for m in
                       ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                        "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}
    assert not isinstance(model.output, fp8.Fp8Linear)  # the head stays bf16
    assert fp8.note(model, "tensorwise", True).startswith("fp8: 14 block linears in float8")
    assert fp8.note(model, "tensorwise", False).endswith("set train.compile=true")


def test_experts_stay_bf16_and_the_note_says_so():
    moe = ["model.moe.num_experts=4", "model.moe.top_k=2"]
    _, model, _, _ = _model(FP8 + moe)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers and not any(isinstance(m, fp8.Fp8Linear) for layer in layers for m in layer.modules())
    assert f"the experts of {len(layers)} MoE layers" in fp8.note(model, "tensorwise", True)


def test_unaligned_linears_stay_bf16():
    assert fp8.aligned((64, 128)) and not fp8.aligned((40, 128)) and not fp8.aligned((64, 24))
