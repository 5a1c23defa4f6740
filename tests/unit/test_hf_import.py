"""model.init_from: a Hugging Face Llama or GPT-2 folder (saved here with save_pretrained from a random
init, no download) becomes a teratrain model whose logits equal transformers' within 1e-5 (fp32)."""

import json

import pytest
import torch

from teratrain.config import ConfigError
from teratrain.models.transformer import Transformer
from teratrain.parallel.parallelize import init_fn
from teratrain.parallel.placement import assign_defaults, materialize
from tests.helpers import make_config
from tests.hf_models import (LLAMA3_SCALING, save_gpt2, save_llama, save_mixtral, save_moe, save_qwen2,
                              save_qwen3)

pytest.importorskip("transformers")


def ours(folder, *sets) -> Transformer:
    cfg = make_config(f"model.init_from={str(folder)!r}", *sets)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    assign_defaults(model)
    materialize(model, "cpu", init_fn(cfg))
    return model.eval()


def assert_same_logits(model, hf, T=16, vocab=50) -> None:
    tokens = torch.randint(0, vocab, (3, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine, theirs = model(tokens), hf(tokens).logits
    err = float((mine - theirs).norm() / theirs.norm())
    assert err < 1e-5, f"logits differ by {err:.2e} (relative)"


@pytest.mark.parametrize("keys", [{}, {"tie_word_embeddings": True}, {"rope_scaling": LLAMA3_SCALING},
                                  {"attention_bias": True, "mlp_bias": True}])
def test_llama_logits_match_transformers(tmp_path, keys):
    hf = save_llama(tmp_path, **keys)
    model = ours(tmp_path, "model.seq_len=16")
    assert model.cfg.n_kv_heads == 2 and model.cfg.d_ff == 64 and model.cfg.tie_embeddings == keys.get("tie_word_embeddings", False)
    assert_same_logits(model, hf)


@pytest.mark.parametrize("save, tied, attention", [(save_qwen2, False, (True, "none")),
                                                   (save_qwen3, False, (False, "head")),
                                                   (save_qwen3, True, (False, "head"))], ids=["qwen2", "qwen3", "qwen3-tied"])
def test_qwen2_and_qwen3_logits_match_transformers(tmp_path, save, tied, attention):
    """Qwen2's q/k/v biases (model.qkv_bias) and Qwen3's per-head q/k RMSNorm (model.qk_norm=head),
    with GQA; their perturbed values (tests/hf_models.py) make a misplaced bias or norm visible."""
    hf = save(tmp_path, tie_word_embeddings=tied)
    model = ours(tmp_path, "model.seq_len=16")
    assert (model.cfg.qkv_bias, model.cfg.qk_norm, model.cfg.use_bias, model.cfg.tie_embeddings) == (*attention, False, tied)
    assert_same_logits(model, hf)


@pytest.mark.parametrize("save", [save_qwen3, lambda path, **keys: save_moe(path, "qwen3_moe", **keys)],
                         ids=["qwen3", "qwen3_moe"])
def test_qwen3_heads_wider_than_d_model_over_heads_match_transformers(tmp_path, save):
    """config.json's head_dim (12 here, d_model / heads = 8; Qwen3-MoE 30B-A3B: 128 at 2048 / 32) is
    model.head_dim: q, k and v of 4 x 12 and 2 x 12 rows, wo of 48 columns, per-head norms of 12, RoPE
    over 12; the logits equal transformers' and the export writes config.json back unchanged."""
    from teratrain.checkpoint.hf_config import to_hf

    hf = save(tmp_path, head_dim=12)
    model = ours(tmp_path, "model.seq_len=16")
    attention = model.layers["0"].attention
    assert (model.cfg.head_dim, model.cfg.head_width, model.cfg.d_model) == (12, 12, 32)
    assert (attention.wq.weight.shape, attention.wk.weight.shape, attention.wo.weight.shape) == ((48, 32), (24, 32),
                                                                                                 (32, 48))
    assert_same_logits(model, hf)
    source = json.loads((tmp_path / "config.json").read_text())
    assert to_hf(model.cfg, source) == source and to_hf(model.cfg)["head_dim"] == 12


def test_gpt2_logits_match_transformers_from_shards(tmp_path):
    """GPT-2's Conv1D weights are transposed and c_attn splits into q, k, v; the folder is sharded
    (model.safetensors.index.json); model.seq_len=16 takes the first 16 of 64 learned positions."""
    hf = save_gpt2(tmp_path, shard="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = ours(tmp_path, "model.seq_len=16")
    assert model.cfg.arch == "gpt2" and model.cfg.tie_embeddings and model.pos_embeddings.weight.shape == (16, 32)
    assert_same_logits(model, hf)


def test_mixtral_logits_match_transformers(tmp_path):
    """Mixtral's router (block_sparse_moe.gate) and experts (w1, w3, w2 each) become softmax-topk MoE
    layers without a capacity limit; the logits equal transformers' (which saves this layout in 4 and 5)."""
    hf = save_mixtral(tmp_path)
    model = ours(tmp_path, "model.seq_len=16")
    m = model.cfg.moe
    assert (m.num_experts, m.k, m.router, m.capacity, m.every) == (4, 2, "softmax-topk", 0, 1)
    assert_same_logits(model, hf)


MOE_FAMILIES = {  # model_type -> what model.moe and the attention take from it
    "qwen2_moe": dict(norm_topk=False, expert_d_ff=16, shared_experts=1, shared_d_ff=24, shared_gate=True,
                      first_dense_layers=1, qkv_bias=True, qk_norm="none"),
    "qwen3_moe": dict(norm_topk=True, expert_d_ff=16, shared_experts=0, first_dense_layers=0, qkv_bias=False,
                      qk_norm="head"),
    "olmoe": dict(norm_topk=False, expert_d_ff=64, shared_experts=0, first_dense_layers=0, qkv_bias=False,
                  qk_norm="full"),
}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_qwen_moe_and_olmoe_logits_match_transformers(tmp_path, family):
    """Softmax over all experts, top-2, the 2 scores normalised or not (norm_topk_prob), Qwen's experts
    of 16 rows beside a dense MLP of 64 (OLMoE's experts: intermediate_size, 64); Qwen2-MoE's
    sigmoid-gated shared expert and dense first layer (mlp_only_layers=[0]); the q/k/v biases and q/k
    norms of each family."""
    hf = save_moe(tmp_path, family)
    model = ours(tmp_path, "model.seq_len=16")
    m, want = model.cfg, MOE_FAMILIES[family]
    got = {k: getattr(m, k) if hasattr(m, k) else getattr(m.moe, k) for k in want}
    assert got == want and (m.moe.num_experts, m.moe.k, m.moe.router, m.moe.capacity) == (4, 2, "softmax-topk", 0)
    assert_same_logits(model, hf)


def test_a_dense_layer_teratrain_cannot_place_is_one_sentence(tmp_path):
    save_moe(tmp_path, "qwen2_moe", mlp_only_layers=[1])
    with pytest.raises(ConfigError, match="mlp_only_layers") as e:
        make_config(f"model.init_from={str(tmp_path)!r}")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("sets", [["model.moe.router=switch-top1"], ["model.moe.every=2"], ["model.bias=true"],
                                  ["model.arch=gpt2", "model.bias=true", "model.n_kv_heads=4"],
                                  ["model.moe.expert_groups=2", "model.moe.max_groups=1"]])
def test_export_of_an_moe_model_mixtral_cannot_hold_is_one_sentence(sets):
    from teratrain.checkpoint.hf_config import to_hf

    with pytest.raises(ConfigError) as e:
        to_hf(make_config("model.moe.num_experts=4", *sets).model)
    assert "export a" in str(e.value) and "\n" not in str(e.value)


def test_export_maps_the_aux_weight_to_router_aux_loss_coef():
    from teratrain.checkpoint.hf_config import to_hf

    ours = to_hf(make_config("model.moe.num_experts=4", "model.moe.aux_loss_weight=0.02").model)
    theirs = to_hf(make_config("model.moe.num_experts=4", "model.moe.aux_loss_weight=0.02",
                               "model.moe.aux_loss_convention=transformers").model)
    assert (ours["router_aux_loss_coef"], theirs["router_aux_loss_coef"]) == (0.01, 0.02)


def test_shape_comes_from_config_json_and_explicit_keys_override(tmp_path):
    save_llama(tmp_path)
    cfg = make_config(f"model.init_from={str(tmp_path)!r}", "model.seq_len=32", "model.dropout=0.1")
    m = cfg.model
    assert (m.arch, m.n_layers, m.d_model, m.n_heads, m.kv_heads, m.ffn_dim, m.vocab_size) == ("llama", 2, 32, 4, 2, 64, 50)
    assert (m.seq_len, m.dropout, m.rope_theta) == (32, 0.1, 500000.0)


@pytest.mark.parametrize("sets, words", [(["model.n_layers=3"], ["model.n_layers=3", "contradicts"]),
                                         (["model.seq_len=128"], ["model.seq_len=128", "64"]),
                                         (["model.preset=gpt2-124m"], ["model.preset=gpt2-124m", "give one of them"])])
def test_a_contradiction_is_one_sentence(tmp_path, sets, words):
    save_gpt2(tmp_path)
    with pytest.raises(ConfigError) as e:
        make_config(f"model.init_from={str(tmp_path)!r}", *sets)
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value)


def test_an_unsupported_model_or_missing_folder_is_one_sentence(tmp_path):
    save_llama(tmp_path, hidden_act="gelu")
    with pytest.raises(ConfigError, match="hidden_act gelu"):
        make_config(f"model.init_from={str(tmp_path)!r}")
    with pytest.raises(ConfigError, match="nowhere' does not exist"):
        make_config(f"model.init_from={str(tmp_path / 'nowhere')!r}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        make_config(f"model.init_from={str(tmp_path / 'empty')!r}")


def test_the_folder_tokenizer_is_used(tmp_path):
    save_llama(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert make_config(f"model.init_from={str(tmp_path)!r}").data.tokenizer == str(tmp_path / "tokenizer.json")
    assert make_config(f"model.init_from={str(tmp_path)!r}", "data.tokenizer=x.json").data.tokenizer == "x.json"


def test_the_loader_resolves_init_from_and_the_schema_reads_no_folder(tmp_path):
    """config.py's resolve_init_from reads the folder before validation; Config itself reads nothing,
    so a model.init_from given straight to the schema keeps the preset's shape."""
    from teratrain.config import Config, resolve_init_from

    save_llama(tmp_path)
    raw = {"model": {"init_from": str(tmp_path)}}
    assert Config.model_validate(raw).model.d_model == 128  # the tiny preset's
    resolved = resolve_init_from(raw)
    assert resolved["model"]["d_model"] == 32 and raw == {"model": {"init_from": str(tmp_path)}}
    assert Config.model_validate(resolved).model.d_model == 32


def test_a_model_moe_key_given_keeps_the_experts_of_config_json(tmp_path):
    """The Mixtral folder's moe table is filled in key by key under the keys given."""
    save_mixtral(tmp_path)
    m = make_config(f"model.init_from={str(tmp_path)!r}", "model.moe.aux_loss_weight=0.02").model.moe
    assert (m.num_experts, m.k, m.router, m.aux_loss_weight) == (4, 2, "softmax-topk", 0.02)


@pytest.mark.parametrize("keys, taken", [({}, (0.0, "ours")),
                                         ({"output_router_logits": True}, (0.001, "transformers")),
                                         ({"output_router_logits": True, "router_aux_loss_coef": 0.02},
                                          (0.02, "transformers"))])
def test_mixtral_aux_loss_follows_config_json(tmp_path, keys, taken):
    """transformers adds router_aux_loss_coef x its load-balancing loss only with output_router_logits
    true (its default: false, coef 0.001): the import trains with what transformers would."""
    save_mixtral(tmp_path, **keys)
    m = make_config(f"model.init_from={str(tmp_path)!r}").model.moe
    assert (m.aux_loss_weight, m.aux_loss_convention) == taken


def test_export_of_a_fine_tuned_model_changes_only_what_the_run_changed(tmp_path):
    """to_hf with the source config.json: its keys back as they came in (transformers 5's
    rope_parameters, a null head_dim, the 4096-token context), but those the run's settings change."""
    from teratrain.checkpoint.hf_config import to_hf

    save_llama(tmp_path, max_position_embeddings=4096, rope_scaling=LLAMA3_SCALING)
    source = json.loads((tmp_path / "config.json").read_text())
    run = make_config(f"model.init_from={str(tmp_path)!r}", "model.seq_len=16").model
    assert to_hf(run, source) == source
    theta = make_config(f"model.init_from={str(tmp_path)!r}", "model.rope_theta=1e6", "model.norm_eps=1e-6").model
    out = to_hf(theta, source)
    assert {k for k in source if out[k] != source[k]} == {"rope_parameters", "rms_norm_eps"}
    assert out["rope_parameters"] == {**source["rope_parameters"], "rope_theta": 1e6} and "rope_theta" not in out


@pytest.mark.parametrize("family", ["qwen2", "qwen3", *MOE_FAMILIES])
def test_export_of_each_family_gives_its_config_json_back_but_what_the_run_changed(tmp_path, family):
    """to_hf with the source config.json: every key as it came in (transformers 5's num_local_experts,
    mlp_only_layers, the family's attention keys) unless the run's settings change it."""
    from teratrain.checkpoint.hf_config import to_hf

    {"qwen2": save_qwen2, "qwen3": save_qwen3}.get(family, lambda path: save_moe(path, family))(tmp_path)
    source = json.loads((tmp_path / "config.json").read_text())
    run = make_config(f"model.init_from={str(tmp_path)!r}", "model.seq_len=16").model
    assert to_hf(run, source) == source
    changed = make_config(f"model.init_from={str(tmp_path)!r}", "model.norm_eps=1e-3").model
    assert {k for k in source if to_hf(changed, source)[k] != source[k]} == {"rms_norm_eps"}
