"""Planner model states: the ZeRO paper's figures (sec. 3.1 and Figure 1), and byte-for-byte parity with
what LocalEngine and ZeroEngine count from their live tensors after a real CPU step."""

import pytest
import torch

from teratrain.config import load_config
from teratrain.mesh import Runtime
from teratrain.models.transformer import Transformer
from teratrain.parallel.parallelize import parallelize
from teratrain.planner.inputs import shape_of, training_of
from teratrain.planner.layout import Layout, ModelShape, Training
from teratrain.optim.engine import train_step
from teratrain.measure import build_engine, random_batch
from teratrain.planner.states import PlanError, model_states, zero_paper_bytes

GB = 1e9
MIXED_ADAM = Training(precision="bf16", master_weights=True, optimizer="adamw")


def states_total(shape, train, lay) -> int:
    st = model_states(shape, train, lay)
    return st["params"] + st["grads"] + st["optimizer"]


def test_mixed_precision_adam_costs_16_bytes_per_param():
    """ZeRO sec. 3.1: 2 (fp16 params) + 2 (grads) + 12 (fp32 master, m, v) bytes."""
    shape = ModelShape(cfg=None, bare_params=10**9)
    st = model_states(shape, MIXED_ADAM, Layout())
    assert (st["params"], st["grads"], st["optimizer"]) == (2 * 10**9, 2 * 10**9, 12 * 10**9)


def test_gpt2_1_5b_needs_about_24_gb_of_model_states():
    """ZeRO sec. 3.1: GPT-2 with 1.5B parameters needs at least 24 GB of model states."""
    assert states_total(ModelShape(cfg=None, bare_params=1_500_000_000), MIXED_ADAM, Layout()) == 24 * GB
    preset = shape_of(load_config(None, ["model.preset=gpt2-1.5b"]))
    total = states_total(preset, MIXED_ADAM, Layout())  # the real shape has 1.56 B params (tied embeddings)
    assert total == pytest.approx(24 * GB, rel=0.05)


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage, expected_gb):
    """Psi = 7.5B, N_d = 64, K = 12 (Rajbhandari et al. 2020, Figure 1)."""
    assert zero_paper_bytes(7.5e9, 64, stage) / GB == pytest.approx(expected_gb, abs=0.05)


@pytest.mark.parametrize("stage, extra_gb", [(0, 0.0), (1, 15.0), (2, 0.23), (3, 0.0)])
def test_zero_engine_differs_from_the_paper_only_where_documented(stage, extra_gb):
    """With the default parallel.grad_dtype=fp32 our ZeroEngine keeps 4-byte gradients, not 2: stage
    1's full buffer (reduce-scattered in place, Megatron-LM's distributed optimizer: 2 + 4 + 12/N)
    and stage 2's shard; stage 3 keeps no 2-byte parameter shard beside the fp32 master (gathers
    cast it), which evens out its fp32 gradient shard: the planner says so, to the byte."""
    shape = ModelShape(cfg=None, bare_params=7_500_000_000)
    ours = states_total(shape, MIXED_ADAM, Layout(dp=64, zero=stage))
    paper = zero_paper_bytes(7.5e9, 64, stage)
    assert (ours - paper) / GB == pytest.approx(extra_gb, abs=0.01)


# ZeRO paper (Rajbhandari et al. 2020), Table 1, the 7.5B-parameter model: GB per device by DP degree
# for P_os, P_os+g, P_os+g+p (mixed-precision Adam, K = 12).
TABLE_1_7_5B = {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
                256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)}


@pytest.mark.parametrize("dp", sorted(TABLE_1_7_5B))
def test_zero_paper_table_1_with_bf16_gradients(dp):
    """parallel.grad_dtype=bf16 gives the paper's 2-byte gradients: stages 1 and 2 plan (and hold:
    tests/dist/test_zero_bytes.py) its Table 1 exactly; stage 3 does with fp32 gradients (0 + 4 +
    12 bytes per parameter over N instead of 2 + 2 + 12), and 2 bytes/N below it with bf16 ones."""
    shape = ModelShape(cfg=None, bare_params=7_500_000_000)
    bf16_grads = Training(precision="bf16", optimizer="adamw", grad_bytes=2)
    for stage, printed in zip((1, 2, 3), TABLE_1_7_5B[dp]):
        train = MIXED_ADAM if stage == 3 else bf16_grads
        planned = states_total(shape, train, Layout(dp=dp, zero=stage)) / GB
        decimals = len(str(printed).partition(".")[2])  # as precise as the table prints it
        assert round(planned, decimals) == printed, (dp, stage, planned)
    lay = Layout(dp=dp, zero=3)
    below = states_total(shape, MIXED_ADAM, lay) - states_total(shape, bf16_grads, lay)
    assert below == pytest.approx(2 * 7.5e9 / dp, rel=1e-6)


def test_zero_1_states_megatron_and_paper():
    """The issue's figures for Psi = 7.5B at dp=4 (fp16, ZeRO-1): 67.5 GB with fp32 gradients
    (2 + 4 + 12/4 bytes per parameter, Megatron-LM's distributed optimizer), 52.5 GB with bf16."""
    shape = ModelShape(cfg=None, bare_params=7_500_000_000)
    for grad_bytes, want in ((4, 67.5), (2, 52.5)):
        train = Training(precision="fp16", optimizer="adamw", grad_bytes=grad_bytes)
        assert states_total(shape, train, Layout(dp=4, zero=1)) / GB == pytest.approx(want, abs=1e-3)


def test_bf16_gradients_need_zero_and_low_precision_parameters():
    shape = ModelShape(cfg=None, bare_params=10**6)
    for train, lay in ((Training(precision="bf16", grad_bytes=2), Layout(zero=0)),
                       (Training(precision="fp32", grad_bytes=2), Layout(zero=1)),
                       (Training(precision="bf16", master_weights=False, grad_bytes=2), Layout(zero=2))):
        with pytest.raises(PlanError, match="grad_dtype"):
            model_states(shape, train, lay)


def _cfg(arch, precision, optim, *extra):
    sets = ["model.preset=tiny", f"model.arch={arch}", "model.n_layers=3", "model.seq_len=32",
            f"memory.precision={precision}", f"optim.name={optim}", "memory.loss_scale_init=1.0", *extra]
    return load_config(None, sets)


CASES = [(a, p, o, extra) for a in ("llama", "gpt2") for o in ("adamw", "sgd", "adafactor", "sm3")
         for p, extra in (("fp32", ()), ("bf16", ()), ("fp16", ()), ("bf16", ("memory.master_weights=true",)))]
CASES += [(a, "fp32", o, ("optim.momentum=0",)) for a in ("llama", "gpt2") for o in ("sgd", "sm3")]


@pytest.mark.parametrize("arch, precision, optim, extra", CASES)
def test_states_equal_local_engine_live_bytes(arch, precision, optim, extra):
    cfg = _cfg(arch, precision, optim, *extra)
    model, engine = build_engine(cfg)
    train_step(model, engine, [random_batch(cfg, 2)], precision, 1e-4)
    pred = model_states(shape_of(cfg), training_of(cfg), Layout(), device="cpu")
    assert _live(engine) == {k: pred[k] for k in ("params", "grads", "optimizer")}


def _live(engine) -> dict:
    """params and grads as held between backward and the step (the engine's first count), optimizer
    state after the step (torch's Adafactor creates its state lazily, in the first step)."""
    held = engine.last_state_bytes
    return {"params": held["params"], "grads": held["grads"], "optimizer": engine.state_bytes()["optimizer"]}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("zero, offload, grads", [(1, "none", "fp32"), (2, "none", "fp32"), (3, "none", "fp32"),
                                                  (2, "optimizer", "fp32"), (3, "params", "fp32"),
                                                  (1, "none", "bf16"), (3, "params", "bf16")])
def test_states_equal_zero_engine_live_bytes(arch, zero, offload, grads):
    """One process (dp = 1, no process group): every stage's buffers and dtypes, byte for byte.
    dp > 1 (flat.py's ceil(numel/dp) padding per group) is checked on 2 and 4 gloo ranks in
    tests/dist/test_zero_bytes.py."""
    cfg = _cfg(arch, "bf16", "adamw", f"parallel.zero={zero}", f"parallel.offload={offload}", "parallel.bucket_mb=0.05",
               f"parallel.grad_dtype={grads}")
    with torch.device("meta"):
        model = Transformer(cfg.model)
    engine = parallelize(model, Runtime.single("cpu"), cfg)
    train_step(model, engine, [random_batch(cfg, 2)], "bf16", 1e-4)
    lay = Layout(zero=zero, offload=offload)
    pred = model_states(shape_of(cfg), training_of(cfg), lay, device="cpu")
    assert _live(engine) == {k: pred[k] for k in ("params", "grads", "optimizer")}


@pytest.mark.parametrize("offload", ["none", "params"])
def test_float8_gathered_shard_equals_zero_engine_live_bytes(offload):
    """ZeRO-3 gathering float8 weights keeps each float8 group's 1-byte shard, its scales and piece
    index on the device (parallel/zero_fp8.py): live bytes equal the planner's, which exceed the
    memory.fp8_gather=false plan's by exactly those."""
    fp8 = ["memory.fp8=tensorwise", "memory.fp8_emulate=true", "parallel.zero=3", f"parallel.offload={offload}"]
    plans = {}
    for gather in ("true", "false"):
        cfg = _cfg("llama", "bf16", "adamw", *fp8, f"memory.fp8_gather={gather}")
        with torch.device("meta"):
            model = Transformer(cfg.model)
        engine = parallelize(model, Runtime.single("cpu"), cfg)
        train_step(model, engine, [random_batch(cfg, 2)], "bf16", 1e-4)
        plans[gather] = model_states(shape_of(cfg), training_of(cfg), Layout(zero=3, offload=offload), device="cpu")
        assert _live(engine) == {k: plans[gather][k] for k in ("params", "grads", "optimizer")}
    n_float8 = 3 * 7  # q, k, v, o and the MLP's three in each of the 3 blocks
    shard = plans["true"]["params"] - plans["false"]["params"]
    assert shard > 4 * n_float8 and plans["true"]["gpu_params"] - plans["false"]["gpu_params"] == shard


def test_sharding_divides_model_states():
    shape = ModelShape(cfg=None, bare_params=8 * 10**9)
    one = model_states(shape, MIXED_ADAM, Layout(dp=8, zero=1))
    three = model_states(shape, MIXED_ADAM, Layout(dp=8, zero=3))
    assert three["params"] == 0  # no 2-byte copy beside the fp32 master shard: gathers cast the master
    assert model_states(shape, Training(precision="fp32"), Layout(dp=8, zero=3))["params"] == 4 * 8 * 10**9 // 8
    assert three["optimizer"] == one["optimizer"]
    off = model_states(shape, MIXED_ADAM, Layout(dp=8, zero=3, offload="params"))
    assert off["gpu_params"] == off["gpu_optimizer"] == 0
    assert off["host"] == off["params"] + off["optimizer"] + 8 * 10**9 // 8 * 4  # + pinned fp32 grad shard


def test_optimizer_states_by_kind():
    cfg = load_config(None, ["model.preset=tiny"])
    shape = shape_of(cfg)
    n = shape.counts()["total"]
    fp32 = {name: model_states(shape, Training(precision="fp32", optimizer=name), Layout())["optimizer"]
            for name in ("adamw", "sgd", "adafactor", "sm3")}
    assert fp32["adamw"] == 8 * n + 4 * len(shape.param_shapes())
    assert fp32["sgd"] == 4 * n
    assert fp32["adafactor"] < n  # factored: rows + columns per matrix
    assert fp32["adafactor"] < fp32["sm3"] < fp32["adafactor"] + 4 * n + 4  # SM3 adds momentum


def test_engines_refusals_are_mirrored():
    shape = ModelShape(cfg=None, bare_params=10**6)
    with pytest.raises(PlanError):
        model_states(shape, Training(optimizer="adamw"), Layout(zero=0, offload="optimizer"))
    with pytest.raises(PlanError):
        model_states(shape, Training(optimizer="adamw"), Layout(zero=2, offload="params"))
    with pytest.raises(PlanError, match="bare parameter count"):  # factored state needs the matrices' shapes
        model_states(shape, Training(optimizer="adafactor"), Layout(zero=1))
    with pytest.raises(PlanError, match="bare parameter count"):
        model_states(shape, Training(optimizer="sm3"), Layout(zero=2))


@pytest.mark.parametrize("optim", ["adafactor", "sm3"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_factored_states_of_higher_rank_tensors_equal_live_bytes(optim, momentum):
    """Rank-3 and rank-1 tensors next to a matrix: torch's Adafactor factors over the last two
    dims, SM3 keeps one accumulator per index of every dim (our model has only rank <= 2)."""
    from teratrain.optim.build import build_optimizer
    from teratrain.optim.engine import tensor_bytes
    from teratrain.planner.states import optimizer_elems

    shapes = [(6, 5, 4), (7, 3), (9,)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    cfg = load_config(None, [f"optim.name={optim}", f"optim.momentum={momentum}"])
    opt = build_optimizer([(str(i), p) for i, p in enumerate(params)], cfg.optim)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # Adafactor creates its state here
    live = tensor_bytes(t for st in opt.state.values() for k, t in st.items() if torch.is_tensor(t) and k != "step")
    train = Training(precision="fp32", optimizer=optim, momentum=momentum)
    assert live == 4 * optimizer_elems(train, shapes, sum(p.numel() for p in params), False)
