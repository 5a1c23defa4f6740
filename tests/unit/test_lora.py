"""LoRA (memory/lora.py): the B = 0 start is the base model, only adapters train, merging folds
them in exactly, the frozen base can be stored in bf16, and the planner counts the bytes."""

import pytest
import torch

from teratrain.config import ConfigError, load_config
from teratrain.memory.lora import merge
from teratrain.mesh import Runtime
from teratrain.models.transformer import Transformer
from teratrain.optim.engine import train_step
from teratrain.parallel.parallelize import parallelize
from teratrain.planner.inputs import layout_of, shape_of, training_of
from teratrain.planner.states import model_states

SMALL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
         "model.vocab_size=50", "model.seq_len=16", "optim.lr=0.01"]
LORA = ["lora.rank=4", "lora.alpha=8", "lora.targets=[\"wq\", \"wv\", \"w2\"]"]


def built(*sets):
    cfg = load_config(None, SMALL + list(sets))
    with torch.device("meta"):
        model = Transformer(cfg.model)
    return cfg, model, parallelize(model, Runtime.single("cpu"), cfg)


def tokens(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (4, 17), generator=g) for _ in range(n)]


def test_zero_b_starts_from_the_base_model_and_only_adapters_train():
    _, base, _ = built()
    cfg, model, engine = built(*LORA)
    x = tokens(1)[0][:, :-1]
    with torch.no_grad():
        assert torch.equal(model(x), base(x))  # same names and seed: same base weights; B = 0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"layers.{i}.{m}.{ab}" for i in (0, 1) for m in ("attention.wq", "attention.wv", "feed_forward.w2")
                         for ab in ("lora_a", "lora_b")}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for b in tokens():
        train_step(model, engine, [(b[:, :-1], b[:, 1:])], "fp32", 0.01)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == trainable


def test_merge_equals_the_unmerged_model():
    cfg, model, engine = built(*LORA)
    for b in tokens():
        train_step(model, engine, [(b[:, :-1], b[:, 1:])], "fp32", 0.01)
    merged_weights = merge(dict(model.named_parameters()), cfg.lora.alpha)
    plain = Transformer(cfg.model)
    plain.load_state_dict({k: v.detach() for k, v in merged_weights.items()}, strict=False)
    plain.init_buffers("cpu")
    x = tokens(1, seed=5)[0][:, :-1]
    with torch.no_grad():
        assert torch.allclose(plain(x), model(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("sets", [[], ["memory.precision=bf16", "lora.base_dtype=bf16"], ["parallel.zero=1"],
                                  ["parallel.zero=3", "memory.precision=bf16"]], ids=str)
def test_planner_counts_lora_states(sets):
    cfg, model, engine = built(*LORA, *sets)
    b = tokens(1)[0]
    train_step(model, engine, [(b[:, :-1], b[:, 1:])], cfg.memory.precision, 0.01)
    planned = model_states(shape_of(cfg), training_of(cfg), layout_of(cfg, 1), device="cpu")
    live = engine.last_state_bytes
    assert {k: live[k] for k in ("params", "grads", "optimizer")} == {k: planned[k] for k in ("params", "grads", "optimizer")}
    if "lora.base_dtype=bf16" in sets:
        assert all(p.dtype == torch.bfloat16 for p in model.parameters() if not p.requires_grad)
    unadapted = SMALL + [s for s in sets if "lora" not in s]
    full = model_states(shape_of(cfg), training_of(load_config(None, unadapted)),
                        layout_of(cfg, 1), device="cpu")
    assert planned["optimizer"] < full["optimizer"] / 10  # model states shrink to the adapters


def test_a_lora_setting_while_lora_is_off_is_refused():
    for item in ['lora.targets=["wq"]', "lora.alpha=32", "lora.dropout=0.1"]:
        with pytest.raises(ConfigError, match=f"lora.{item.split('=')[0][5:]} is set but lora.rank=0 leaves LoRA off"):
            load_config(None, SMALL + [item])
    load_config(None, SMALL + ['lora.targets=["wq", "wk", "wv", "wo"]'])  # the default, as a saved config.toml has it


def test_an_adapter_on_the_shared_experts_w2_under_tensor_parallelism_is_refused():
    """The shared experts' w2 under the megatron form is a partial row-parallel product (tp_plan.py) that
    carries no adapter: the layout is refused in one sentence instead of dropping the adapter. The routed
    experts take no adapters at all (stacks, not linear layers), so without shared experts it runs."""
    from teratrain.config import ConfigError
    from teratrain.parallel.support import check_supported

    sets = ["model.preset=moe-tiny", "model.moe.shared_experts=1", "parallel.tp=2", *LORA]
    with pytest.raises(ConfigError, match="w2") as e:
        check_supported(load_config(None, sets))
    assert "\n" not in str(e.value)
    check_supported(load_config(None, sets[:3] + ["lora.rank=4", "lora.targets=[\"wq\", \"w1\"]"]))
    check_supported(load_config(None, sets[:2] + LORA))  # tp=1
    check_supported(load_config(None, sets[:1] + sets[2:]))  # no shared experts


def test_targets_that_name_only_the_routed_experts_are_refused():
    """An MoE model's routed experts are stacks, not linear layers: targets naming only their w1 w2 w3, in a
    model whose every MLP is MoE, would train nothing, and are refused with the fix."""
    from teratrain.config import ConfigError
    from teratrain.memory.lora import apply_lora

    cfg = load_config(None, ["model.preset=moe-tiny", "lora.rank=4", "lora.targets=[\"w1\", \"w2\", \"w3\"]"])
    with torch.device("meta"):
        model = Transformer(cfg.model)
    with pytest.raises(ConfigError, match="name no linear layer.*wq wk wv wo"):
        apply_lora(model, cfg)


def test_the_start_up_summary_counts_the_parameters_the_adapters_train():
    from pathlib import Path

    from teratrain.startup import summary

    cfg, model, _ = built(*LORA)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    text = summary(cfg, Runtime.single("cpu"), Path("runs/x"), 0)
    assert f"LoRA rank 4 on wq wv w2: {trained:,} of them trained" in text
    assert "model: tiny preset with n_layers, d_model, d_ff, vocab_size changed (llama, 2 layers" in text
