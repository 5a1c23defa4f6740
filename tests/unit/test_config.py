"""Config validation: every bad input is a ConfigError whose one sentence names the key and the fix."""

import math

import pytest
import torch

from teratrain.config import Config, ConfigError, load_config
from teratrain.config_toml import to_toml
from teratrain.models.presets import PRESETS
from tests.helpers import make_config


def config_error(*overrides: str, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    msg = str(info.value)
    assert "\n" not in msg, "a config error is one sentence on one line"
    return msg


def test_defaults_validate_to_the_tiny_preset():
    cfg = make_config()
    for key, value in PRESETS["tiny"].items():
        assert getattr(cfg.model, key) == value


def test_unknown_key_suggests_the_close_one():
    msg = config_error("model.d_modle=64")
    assert "model.d_modle" in msg and "did you mean 'model.d_model'" in msg


def test_unknown_key_without_close_match_lists_known_keys():
    msg = config_error("train.zzzzzz=1")
    assert "train.zzzzzz" in msg and "global_batch" in msg


def test_unknown_section_in_toml_suggests_the_close_one(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[modle]\nn_layers = 2\n")
    assert "did you mean 'model'" in config_error(path=f)


@pytest.mark.parametrize("override, key, word", [
    ("train.steps=abc", "train.steps", "integer"),
    ("train.steps=2.5", "train.steps", "integer"),
    ("optim.lr=fast", "optim.lr", "number"),
    ("model.tie_embeddings=maybe", "model.tie_embeddings", "true or false"),
    ("memory.precision=fp8", "memory.precision", "fp16"),
    ("parallel.ep_overlap_chunks=0", "parallel.ep_overlap_chunks", "greater than or equal to 1"),
])
def test_wrong_type_names_the_key_and_what_it_must_be(override, key, word):
    msg = config_error(override)
    assert key in msg and word in msg


def test_section_given_as_a_value_is_rejected(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("model = 3\n")
    msg = config_error(path=f)
    assert "model" in msg and "table" in msg


def test_n_heads_must_divide_d_model_and_a_divisor_is_suggested():
    msg = config_error("model.d_model=128", "model.n_heads=5", "model.n_kv_heads=5")
    assert "model.n_heads" in msg and "model.d_model" in msg
    suggested = int(msg.rstrip(".").split()[-1])
    assert 128 % suggested == 0


def test_n_kv_heads_must_divide_n_heads():
    msg = config_error("model.n_heads=4", "model.n_kv_heads=3")
    assert "model.n_kv_heads" in msg and "model.n_heads" in msg


def test_llama_head_dim_must_be_even_for_rope():
    assert "RoPE" in config_error("model.d_model=60", "model.n_heads=4", "model.n_kv_heads=4")
    make_config("model.arch=gpt2", "model.d_model=60", "model.n_heads=4", "model.n_kv_heads=4")  # no RoPE, fine


def test_head_dim_frees_the_heads_from_dividing_d_model_and_must_be_even_for_rope():
    """model.head_dim sets the width of each head (Qwen3-MoE 30B-A3B: 128 at d_model 2048, 32 heads)."""
    m = make_config("model.d_model=60", "model.n_heads=7", "model.n_kv_heads=7", "model.head_dim=16").model
    assert (m.head_dim, m.head_width) == (16, 16)
    assert make_config("model.d_model=64", "model.n_heads=4").model.head_width == 16  # unset: d_model / n_heads
    msg = config_error("model.head_dim=15")
    assert "model.head_dim = 15" in msg and "RoPE" in msg


def test_unknown_preset_suggests_the_close_one():
    msg = config_error("model.preset=gpt2-125m")
    assert "model.preset" in msg and "did you mean 'gpt2-124m'" in msg


def test_preset_fills_keys_and_given_keys_override_it():
    cfg = make_config("model.preset=gpt2-124m", "model.n_layers=2")
    assert (cfg.model.arch, cfg.model.d_model, cfg.model.n_heads, cfg.model.vocab_size) == ("gpt2", 768, 12, 50257)
    assert cfg.model.n_layers == 2


def test_a_preset_gives_way_to_a_conflicting_choice_of_the_user():
    """moe-tiny's top_k=2 is its router's setting: choosing switch-top1 takes switch's 1 (not an exit 2
    blaming a key the user never set); a top_k the user gives still conflicts."""
    moe = make_config("model.preset=moe-tiny", "model.moe.router=switch-top1").model.moe
    assert (moe.router, moe.k, moe.num_experts, moe.capacity) == ("switch-top1", 1, 8, 1.25)
    assert make_config("model.preset=moe-tiny").model.moe.k == 2  # the preset's own router keeps its top_k
    base8 = make_config("model.preset=switch-base-8", "model.moe.router=gshard-top2").model.moe
    assert (base8.capacity, base8.every) == (1.0, 2)  # gshard's own capacity; the layer pattern stays
    assert "model.moe.top_k=2" in config_error("model.preset=moe-tiny", "model.moe.router=switch-top1",
                                               "model.moe.top_k=2")
    # tiny's grouped heads (2) give way to a head count they do not divide; one they divide keeps them
    assert make_config("model.d_model=96", "model.n_heads=3").model.kv_heads == 3
    assert make_config("model.n_heads=8").model.kv_heads == 2


def test_missing_file(tmp_path):
    msg = config_error(path=tmp_path / "nope.toml")
    assert "nope.toml" in msg and "does not exist" in msg


def test_broken_toml(tmp_path):
    f = tmp_path / "broken.toml"
    f.write_text("[model]\nn_layers = = 2\n")
    msg = config_error(path=f)
    assert "broken.toml" in msg and "TOML" in msg


def test_lr_scaling_needs_base_batch():
    msg = config_error("optim.lr_scaling=sqrt")
    assert "optim.base_batch" in msg
    assert make_config("optim.lr_scaling=sqrt", "optim.base_batch=8").optim.base_batch == 8


def test_master_weights_need_low_precision():
    assert "memory.master_weights" in config_error("memory.master_weights=true")
    assert make_config("memory.precision=fp16").use_master_weights
    assert not make_config("memory.precision=bf16").use_master_weights


@pytest.mark.parametrize("override, section, key, value", [
    ("optim.lr=3e-4", "optim", "lr", 3e-4),
    ("train.steps=7", "train", "steps", 7),
    ("optim.lr=1", "optim", "lr", 1.0),  # an integer literal is coerced to the field's float
    ("model.tie_embeddings=true", "model", "tie_embeddings", True),
    ("memory.precision=bf16", "memory", "precision", "bf16"),  # bare word: kept as a string
    ('data.path="a b/c=d.txt"', "data", "path", "a b/c=d.txt"),  # quoted TOML string, '=' inside
    (" train.seed = 5 ", "train", "seed", 5),  # spaces around key and value
])
def test_set_parses_toml_literals_and_coerces(override, section, key, value):
    got = getattr(getattr(make_config(override), section), key)
    assert got == value and type(got) is type(value)


def test_later_set_wins():
    assert make_config("train.steps=3", "train.steps=9").train.steps == 9


def test_set_overrides_the_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[train]\nsteps = 3\nseed = 11\n")
    cfg = load_config(f, ["train.steps=9"])
    assert (cfg.train.steps, cfg.train.seed) == (9, 11)


@pytest.mark.parametrize("override", ["train.steps", "steps=3", "a.b.c=1", ".steps=3"])
def test_malformed_set(override):
    assert "section.key=value" in config_error(override)


def test_set_with_unknown_section():
    msg = config_error("trian.steps=3")
    assert "trian" in msg and "train" in msg


def test_toml_round_trip_gives_an_equal_config(tmp_path):
    cfg = make_config("model.preset=gpt2-124m", "model.n_layers=3", "model.dropout=0.1",
                      "optim.lr_scaling=sqrt", "optim.base_batch=16", "optim.lr=6e-4", "memory.precision=fp16",
                      "memory.recompute=every-k", 'data.path="C:\\\\x \\"quoted\\".txt"', "metrics.peak_tflops=123.5")
    assert cfg.data.path == 'C:\\x "quoted".txt'
    f = tmp_path / "config.toml"
    f.write_text(to_toml(cfg))
    again = load_config(f)
    assert again == cfg
    assert to_toml(again) == to_toml(cfg)


def test_toml_round_trip_of_defaults(tmp_path):
    f = tmp_path / "config.toml"
    f.write_text(to_toml(Config()))
    assert load_config(f) == Config()


def test_to_toml_writes_non_finite_floats_as_toml():
    cfg = make_config("metrics.peak_tflops=inf")
    assert math.isinf(cfg.metrics.peak_tflops)
    assert "peak_tflops = inf" in to_toml(cfg)


@pytest.mark.parametrize("sets, words", [
    (["parallel.pp=4", "parallel.schedule=interleaved-1f1b"], "parallel.virtual_stages >= 2"),
    (["parallel.virtual_stages=2"], "needs parallel.schedule=interleaved-1f1b"),
    (["parallel.pp=4", "parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2", "parallel.num_microbatches=6",
      "train.global_batch=12", "train.micro_batch=2", "model.n_layers=8"], "multiple of parallel.pp=4"),
    (["parallel.pp=4", "parallel.schedule=pipedream-2bw", "parallel.weight_version_every=2"], "at least 4"),
    (["parallel.weight_version_every=4"], "only applies to parallel.schedule=pipedream-2bw"),
    (["parallel.vertical_sync=true"], "only applies to parallel.schedule=pipedream"),
    (["parallel.pp=8"], "model.n_layers (4) is fewer than"),
    (["parallel.num_microbatches=4", "train.global_batch=32", "train.micro_batch=16"], "parallel.num_microbatches"),
    (["parallel.schedule=zb-h2"], "parallel.schedule"),
])
def test_pipeline_settings_fail_with_one_sentence(sets, words):
    msg = config_error(*sets)
    assert words in msg and msg.endswith(".")


def test_microbatches_at_launch_follow_dp_and_the_schedule():
    cfg = load_config(None, ["parallel.pp=2", "parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2",
                             "train.global_batch=32", "train.micro_batch=4"])
    assert cfg.microbatches(dp=2) == 4 and cfg.microbatches(dp=1) == 8
    with pytest.raises(ConfigError, match="multiple of parallel.pp=2"):
        cfg.microbatches(dp=8)  # one micro-batch per step on each pipeline
    with pytest.raises(ConfigError, match="train.global_batch"):
        cfg.microbatches(dp=3)


@pytest.mark.parametrize("sets, words", [
    (["parallel.tp_form=all-gather", "parallel.sequence_parallel=false"], "parallel.tp_form=megatron"),
    (["model.seq_len=12", "parallel.tp_overlap_chunks=4"], "must divide model.seq_len (12)"),
    (["parallel.sequence_parallel=false", "model.seq_len=12", "parallel.tp_overlap_chunks=8"],
     "parallel.tp_overlap_chunks (8) must divide"),
    (["parallel.pp=2", "parallel.schedule=zb-h1"], "parallel.schedule=zb-h1 splits"),
    (["parallel.tp_overlap=async"], "set train.compile=true and parallel.sequence_parallel=true"),
    (["parallel.tp_overlap=async", "train.compile=true", "parallel.sequence_parallel=false"],
     "set train.compile=true and parallel.sequence_parallel=true"),
    (["parallel.tp_overlap=async", "train.compile=true", "parallel.tp_form=all-reduce",
      "parallel.sequence_parallel=false"], "parallel.tp_overlap=async overlaps the megatron form"),
])
def test_tp_overlap_settings_fail_with_one_sentence(sets, words):
    from teratrain.parallel.support import check_supported

    with pytest.raises(ConfigError) as info:
        check_supported(load_config(None, ["parallel.tp=2", "parallel.tp_overlap=chunked"] + sets))
    msg = str(info.value)
    assert words in msg and msg.endswith(".") and "\n" not in msg


@pytest.mark.parametrize("sets, words", [
    (["model.qkv_bias=true", "model.bias=true"], "model.qkv_bias adds biases to q, k and v only"),
    (["model.arch=gpt2", "model.qk_norm=head"], "belong to the llama decoder"),
    (["model.qk_norm=full", "parallel.tp=2"], "model.qk_norm=full normalises over the whole q and k widths"),
])
def test_attention_options_fail_with_one_sentence(sets, words):
    """q/k/v-only biases beside biases everywhere, q/k norms outside the llama decoder, and whole-width
    q/k norms under the megatron form's split heads (the all-gather form is accepted)."""
    from teratrain.parallel.support import check_supported

    with pytest.raises(ConfigError) as info:
        check_supported(load_config(None, sets))
    msg = str(info.value)
    assert words in msg and msg.endswith(".") and "\n" not in msg
    check_supported(load_config(None, ["model.qk_norm=full", "parallel.tp=2", "parallel.tp_form=all-gather",
                                       "parallel.sequence_parallel=false"]))


def test_async_tp_refuses_a_run_off_cuda():
    """parallel.tp_overlap=async moves its pieces through CUDA symmetric memory: on another device,
    parallelize refuses before it changes the model (one sentence with the fix)."""
    from types import SimpleNamespace

    from teratrain.parallel.parallelize import async_tp_group

    cfg = load_config(None, ["parallel.tp=2", "parallel.tp_overlap=async", "train.compile=true"])
    rt = SimpleNamespace(dims=SimpleNamespace(tp=2), device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="set parallel.tp_overlap=none"):
        async_tp_group(rt, cfg)
    assert async_tp_group(rt, load_config(None, ["parallel.tp=2", "train.compile=true"])) is None


@pytest.mark.parametrize("sets, words", [
    (["parallel.grad_dtype=bf16", "memory.precision=bf16"], ("parallel.grad_dtype=bf16", "parallel.zero>=1")),
    (["parallel.grad_dtype=bf16", "parallel.zero=1"], ("parallel.grad_dtype=bf16", "memory.precision=bf16")),
    (["parallel.grad_dtype=bf16", "parallel.zero=2", "memory.precision=bf16", "memory.master_weights=false"],
     ("fp32", "parallel.grad_dtype=fp32")),
])
def test_bf16_gradients_need_zero_and_low_precision_parameters(sets, words):
    """parallel.grad_dtype=bf16 needs a ZeRO engine and bf16/fp16 parameters: one sentence with the fix."""
    from teratrain.parallel.support import check_supported

    with pytest.raises(ConfigError) as info:
        check_supported(load_config(None, sets))
    assert "\n" not in str(info.value) and all(w in str(info.value) for w in words), str(info.value)
    check_supported(load_config(None, ["parallel.grad_dtype=bf16", "parallel.zero=1", "memory.precision=fp16"]))


def test_graphed_experts_refused_where_their_gemm_reads_back(monkeypatch):
    """MoE under CUDA graphs needs the grouped GEMM that reads no offsets back: torch's kernel in bf16 on
    sm90/sm100. Elsewhere the offsets go to the host, which a capture refuses (on 2 x H200 an fp32 run
    failed at its first capture). check_supported refuses other precisions before anything starts (the
    CLI calls it first), and parallelize other devices; each with one sentence and its fix."""
    from types import SimpleNamespace

    from teratrain import compat
    from teratrain.parallel import parallelize, support

    graphed = ["train.compile=true", "train.compile_mode=reduce-overhead", "model.moe.num_experts=4"]
    for precision in ("fp32", "fp16"):
        with pytest.raises(ConfigError, match=f"in {precision} the experts' .* set memory.precision=bf16 or "
                                              "train.compile_mode=default"):
            support.check_supported(load_config(None, graphed + [f"memory.precision={precision}"]))
    cfg = load_config(None, graphed + ["memory.precision=bf16"])
    support.check_supported(cfg)
    asked = []
    monkeypatch.setattr(compat, "grouped_mm_without_sync", lambda device, dtype: asked.append(dtype) or True)
    parallelize.check_graphed_experts(SimpleNamespace(device=torch.device("cpu")), cfg)  # a GPU that has the kernel
    assert asked == [torch.bfloat16]
    monkeypatch.setattr(compat, "grouped_mm_without_sync", lambda device, dtype: False)
    with pytest.raises(ConfigError, match="on an sm90 or sm100 GPU .* this run is on cpu; set train.compile_mode=default"):
        parallelize.check_graphed_experts(SimpleNamespace(device=torch.device("cpu")), cfg)
    dense = load_config(None, ["train.compile=true", "train.compile_mode=reduce-overhead", "memory.precision=bf16"])
    parallelize.check_graphed_experts(SimpleNamespace(device=torch.device("cpu")), dense)  # nothing to refuse
    support.check_supported(load_config(None, ["train.compile=true", "model.moe.num_experts=4"]))  # no graphs


def test_selective_ops_refuses_the_chunked_tp_overlap():
    """memory.recompute=selective-ops keeps GEMM outputs; the chunked overlap writes its GEMMs into its own
    buffers: one sentence naming both keys and the fix."""
    with pytest.raises(ConfigError, match="memory.recompute=selective-ops .* set parallel.tp_overlap=none or "
                                          "memory.recompute=selective"):
        load_config(None, ["parallel.tp=2", "parallel.tp_overlap=chunked", "memory.recompute=selective-ops"])
    assert load_config(None, ["parallel.tp=2", "memory.recompute=selective-ops"]).memory.recompute == "selective-ops"
    with pytest.raises(ConfigError, match="memory.recompute=selective-ops-alternate .* set parallel.tp_overlap=none"):
        load_config(None, ["parallel.tp=2", "parallel.tp_overlap=chunked", "memory.recompute=selective-ops-alternate"])


def test_selective_ops_alternate_refuses_experts():
    """The alternate policy counts a dense block's GEMMs; an MoE layer's are not a fixed sequence."""
    with pytest.raises(ConfigError, match="an MoE layer's GEMMs .* set memory.recompute=selective-ops"):
        load_config(None, ["model.moe.num_experts=4", "memory.recompute=selective-ops-alternate"])
    assert load_config(None, ["memory.recompute=selective-ops-alternate"]).memory.recompute == "selective-ops-alternate"


@pytest.mark.parametrize("sets, names", [
    (["parallel.pp=2", "parallel.schedule=zb-h1"],
     "parallel.schedule=zb-h1's split backward .* set memory.recompute=full"),
    (["train.compile=true", "parallel.zero=3"],
     "ZeRO-3 compiles each block apart, hiding them; set memory.recompute=full"),
    (["train.compile=true", "parallel.pp=2"], "a pipeline stage compiles each block apart, hiding them; set memory"),
    (["train.compile=true", "train.compile_scope=block"], "compile_scope=block compiles each block apart, hiding them; "
                                                          "set train.compile_scope=model"),
])
@pytest.mark.parametrize("policy", ["selective-ops", "selective-ops-alternate"])
def test_per_op_recomputation_refuses_what_hides_or_replaces_its_policy(policy, sets, names):
    """A per-op policy chooses by the ops a block dispatches: a block compiled apart hides them (nothing would be
    kept), and ZB-H1's split backward replays each block whole. One sentence each, naming the fix; the planner
    refuses the same layouts."""
    from teratrain.config_schema import per_op_problem

    with pytest.raises(ConfigError, match=f"memory.recompute={policy} .*{names}"):
        load_config(None, [f"memory.recompute={policy}", "model.n_layers=4", *sets])
    assert per_op_problem("full", "zb-h1", 2, True, "block", 3) is None
    assert load_config(None, [f"memory.recompute={policy}", "train.compile=true", "parallel.dp=2"]).memory.recompute


def test_per_op_recomputation_compiles_the_whole_model_by_default():
    """train.compile_scope=auto compiles the whole model (its checkpoints traced, the policy applied) under a per-op
    policy, as under the replaying ones, where data-parallel reductions in backward would take each block apart."""
    from teratrain.config_schema import resolved_compile_scope

    assert resolved_compile_scope("auto", 0, True, False, "none") == "block"
    for policy in ("selective-ops", "selective-ops-alternate", "full"):
        assert resolved_compile_scope("auto", 0, True, False, policy) == "model"
