"""memory.fp8: the settings it refuses, what it swaps (block linears, the shared experts' included, the same
parameters) and the planner's count of it, the float8 GEMMs themselves through torchao's emulation on CPU (no
float8 tensor cores here), and an MoE model trained with them against bf16."""

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
    _, model, _, names = _model(FP8)
    assert [n for n, _ in model.named_parameters()] == names
    swapped = {n for n, m in model.named_modules() if isinstance(m, fp8.Fp8Linear)}
    assert swapped == {f"layers.{i}.{m}" for i in range(2) for m in
                       ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                        "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}
    assert not isinstance(model.output, fp8.Fp8Linear)  # the head stays bf16
    assert fp8.note(model, "tensorwise", True).startswith("fp8: 14 block linears in float8")
    assert fp8.note(model, "tensorwise", False).endswith("set train.compile=true")


MOE_SHARED = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.shared_experts=1",
              "model.moe.shared_gate=true"]


def test_shared_experts_run_in_float8_and_routers_gates_and_routed_experts_stay_bf16():
    """Layer 0 dense, layer 1 MoE with a gated shared expert: its w1/w3/w2 are swapped like the dense MLP's,
    the router, the gate (d_model -> 1) and the expert stacks are not; the note counts 14 float8 linears."""
    _, model, _, _ = _model(FP8 + MOE_SHARED + ["model.moe.first_dense_layers=1"])
    swapped = {n for n, m in model.named_modules() if isinstance(m, fp8.Fp8Linear)}
    attention = {f"layers.{i}.attention.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")}
    assert swapped == attention | {f"layers.0.feed_forward.{w}" for w in ("w1", "w2", "w3")} | {
        f"layers.1.feed_forward.shared_expert.{w}" for w in ("w1", "w2", "w3")}
    moe = model.layers["1"].feed_forward
    assert isinstance(moe, MoE) and type(moe.shared_expert_gate) is torch.nn.Linear
    assert not any(isinstance(m, fp8.Fp8Linear) for m in moe.router.modules())
    line = fp8.note(model, "tensorwise", True)
    assert line.startswith("fp8: 14 block linears in float8")
    assert "the routers, shared-expert gates and routed experts of 1 MoE layer," in line


@pytest.mark.parametrize("add_bias", [True, False])
def test_the_shared_experts_partial_row_piece_runs_in_float8(add_bias):
    """Under megatron tensor parallelism the shared experts' w2 is a PartialRowParallel (parallel/tensor.py):
    apply_fp8 gives it the float8 gemm, as the other tensor-parallel pieces, keeping its weight and bias; its
    output is the float8 GEMM's, the bias added on the one tp rank that adds it (add_bias) and times 0 on the others, as the piece's own."""
    from teratrain.parallel.tp_layers import PartialRowParallel

    cfg = make_config(*SMALL, *FP8, *MOE_SHARED, "model.bias=true", "model.arch=gpt2", "model.n_kv_heads=4")
    model = Transformer(cfg.model)
    shared = model.layers["0"].feed_forward.shared_expert
    w2, g = shared.w2, torch.Generator().manual_seed(0)
    with torch.no_grad():  # the module's values are not initialized: parallelize does that
        w2.weight.copy_(0.05 * torch.randn(w2.weight.shape, generator=g))
        w2.bias.copy_(torch.randn(w2.bias.shape, generator=g))
    shared.w2 = PartialRowParallel(w2.weight, w2.bias, add_bias)
    fp8.apply_fp8(model, cfg, torch.device("cpu"))
    piece = shared.w2
    assert type(piece) is PartialRowParallel and piece.weight is w2.weight and piece.bias is w2.bias
    assert isinstance(piece.gemm, fp8.Fp8Gemm)
    x = torch.randn(8, w2.in_features, generator=g)
    with autocast("bf16", torch.device("cpu")):
        got, gemm = piece(x), piece.gemm(x, w2.weight)
    torch.testing.assert_close(got, gemm + w2.bias * (1.0 if add_bias else 0.0), rtol=0, atol=0)


def test_routed_experts_stay_bf16_and_the_note_says_so():
    _, model, _, _ = _model(FP8 + ["model.moe.num_experts=4", "model.moe.top_k=2"])
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers and not any(isinstance(m, fp8.Fp8Linear) for layer in layers for m in layer.modules())
    line = fp8.note(model, "tensorwise", True)
    assert line.startswith("fp8: 8 block linears") and f"routed experts of {len(layers)} MoE layers" in line


def test_planner_counts_the_linears_apply_fp8_swaps_shared_experts_included():
    """planner/weight_casts.py fp8_linears, the rule on a shape, against the weights apply_fp8 put in float8
    (one dense block, one MoE block whose shared experts are 2 x 64 wide); and planner/time.py fp8_terms
    counts the shared experts' GEMMs, 6 FLOPs a weight and token, among the float8 ones."""
    from teratrain.planner.weight_casts import fp8_linears
    from teratrain.planner.hardware import GPUS
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.time import fp8_terms

    sets = [*FP8, *MOE_SHARED, "model.moe.first_dense_layers=1", "model.moe.shared_experts=2",
            "model.moe.expert_d_ff=64"]
    cfg, model, _, _ = _model(sets)
    swapped = sum(m.weight.numel() for m in fp8.float8_linears(model))
    shape = shape_of(cfg)
    assert cfg.model.n_layers * sum(r * k * share for r, k, share in fp8_linears(shape)) == swapped
    plain = make_config(*SMALL, *FP8, "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.first_dense_layers=1",
                        "model.moe.expert_d_ff=64")
    tokens, gpu = 1024, GPUS["h200"]
    with_shared = fp8_terms(shape, training_of(cfg), layout_of(cfg, 1), gpu, tokens)[0]
    without = fp8_terms(shape_of(plain), training_of(plain), layout_of(plain, 1), gpu, tokens)[0]
    assert with_shared - without == 6 * tokens * 1 * 3 * 64 * 128  # 1 MoE layer, w1/w3/w2 of 64 x 128
    assert (64, 64, 0.5) in fp8_linears(shape, 2)  # tp=2: the shared w1/w3 split by rows, w2 by columns


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_moe_with_shared_experts_trains_in_float8_close_to_bf16(recipe):
    """16 AdamW steps (lr 3e-3) on a learnable map (target = token + 1), the same data and initial weights in
    bf16 and in emulated fp8. At this rate bf16 tracks fp32 within 1.3e-3 a step; at 1e-2 the loss bounced
    and bf16 itself strayed 3% from fp32, a trajectory too chaotic to compare roundings on. Checked: every
    step's loss within 2e-2 of bf16's, relative (500 steps at the llama-1b width ended 1.55% above bf16
    tensorwise, 0.73% rowwise; docs/memory.md), not equal to it (float8 ran); each shared-expert weight's
    update within 0.25 of bf16's, as tests/dist/test_fp8.py bounds two float8 runs (one here); both losses
    fall by over 10%, so the comparison is over training, not only the initial loss."""
    from teratrain import measure
    from teratrain.optim.engine import train_step

    losses, updates = {}, {}
    for name, sets in (("bf16", ["memory.precision=bf16"]), ("fp8", [*FP8, f"memory.fp8={recipe}"])):
        cfg = make_config(*SMALL, *sets, *MOE_SHARED, "train.global_batch=4", "train.micro_batch=2",
                          "optim.warmup_steps=0")
        torch.manual_seed(0)
        model, engine = measure.build_engine(cfg)
        shared = {n: p for n, p in model.named_parameters() if ".shared_expert." in n}
        start = {n: p.detach().float().clone() for n, p in shared.items()}
        g = torch.Generator().manual_seed(1)
        losses[name] = []
        for _ in range(16):
            x = torch.randint(0, 50, (2, 2, 16), generator=g)
            _, loss = train_step(model, engine, [(xi, (xi + 1) % 50) for xi in x], "bf16", 3e-3)
            losses[name].append(loss.item())
        updates[name] = {n: p.detach().float() - start[n] for n, p in shared.items()}
    errs = [abs(a - b) / b for a, b in zip(losses["fp8"], losses["bf16"])]
    assert 0 < max(errs) < 2e-2, (losses, errs)
    assert all(run[-1] < 0.9 * run[0] for run in losses.values()), losses
    assert len(updates["bf16"]) == 6  # w1, w3, w2 of both layers' shared experts
    for n, ref in updates["bf16"].items():
        err = float((updates["fp8"][n] - ref).norm() / ref.norm())
        assert err < 0.25, f"{n}: update {err:.3f} off bf16's"
