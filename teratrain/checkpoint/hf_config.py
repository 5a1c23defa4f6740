"""Hugging Face config.json <-> teratrain's model section: the one mapping that `teratrain plan`,
`model.init_from` and `teratrain export` share.

Families: Llama (and Mistral, the same layout), Qwen2 and Qwen3 (Llama's layers with q/k/v biases,
with per-head q/k norms: hf_families.py), their MoE forms and OLMoE, Mixtral (Mistral's layers with an 8-expert top-2
feed-forward: model.moe with the softmax-topk router, no capacity limit) and GPT-2. All read
`rope_theta`/`rope_scaling` as transformers 4 writes them and `rope_parameters` as transformers 5 does.

Mixtral's aux loss follows its config.json: transformers adds `router_aux_loss_coef` x its load-balancing
loss only when `output_router_logits` is true, so an import takes aux_loss_convention=transformers with
that weight when it is, and aux_loss_weight=0 when it is not (transformers trains with none).

Export of a run started from a Hugging Face model writes that model's config.json back with only the
keys the run changed (`to_hf` with `source`): a key whose mapping is the same for the source's model
section and the run's comes back as it came in, `max_position_embeddings` (the model's context, not
the training length model.seq_len) always. Without a source it writes the transformers 4 form, which
5 reads too, with the training length as the context.

Qwen2-MoE, Qwen3-MoE and OLMoE (hf_families.py) read their experts, shared expert and dense layers into
model.moe; their aux loss is read and written as Mixtral's.
"""

from __future__ import annotations

import json
from pathlib import Path

from teratrain.config_base import ConfigError
from teratrain.checkpoint.hf_families import (AUX_COEF, DENSE_TYPES, MOE_TYPES, attention_keys, family_keys, moe_keys,
                                              sliding_window)
from teratrain.config_model import ROPE_SCALING_KEYS, ModelConfig

SOURCE_CONFIG = "init_from_config.json"  # a run's copy of its model.init_from's config.json (train.py)
HF_SEQ_CAP = 8192  # HF max_position_embeddings is the longest context, not the training length
LLAMA_TYPES = (*DENSE_TYPES, *MOE_TYPES)  # the decoder of models/transformer.py, arch = llama

# HF config.json keys per family -> our model keys
_HF_LLAMA = {"hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
             "num_key_value_heads": "n_kv_heads", "intermediate_size": "d_ff", "vocab_size": "vocab_size",
             "tie_word_embeddings": "tie_embeddings", "rms_norm_eps": "norm_eps", "head_dim": "head_dim"}
_HF_GPT2 = {"n_embd": "d_model", "n_layer": "n_layers", "n_head": "n_heads", "vocab_size": "vocab_size",
            "n_inner": "d_ff", "layer_norm_epsilon": "norm_eps", "tie_word_embeddings": "tie_embeddings"}
# keys that fix the weights' shapes: a value given next to model.init_from must agree with config.json
SHAPE_KEYS = ("arch", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size", "bias",
              "tie_embeddings", "qkv_bias", "qk_norm")


def read_config_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"'{path}' is not a readable JSON file ({e}); pass a HF config.json or a TOML config.") from None


def is_gpt2(hf: dict) -> bool:
    return hf.get("model_type") == "gpt2" or "n_embd" in hf


def model_keys(hf: dict, path: Path) -> tuple[dict, list[str]]:
    """A HF config -> (our model section, notes for the user); Mixtral's experts become `moe`."""
    notes: list[str] = []
    if is_gpt2(hf):
        keys, seq = _HF_GPT2, hf.get("n_positions") or hf.get("n_ctx") or 1024
        model = {"arch": "gpt2", "bias": True, "tie_embeddings": hf.get("tie_word_embeddings", True)}
    elif "hidden_size" in hf and "num_hidden_layers" in hf:
        keys, seq = _HF_LLAMA, hf.get("max_position_embeddings", 4096)
        model = {"arch": "llama", "bias": bool(hf.get("attention_bias", False)),
                 "tie_embeddings": hf.get("tie_word_embeddings", False), **attention_keys(hf)}
        rope = _rope(hf)
        if rope.get("rope_theta"):
            model["rope_theta"] = float(rope["rope_theta"])
        if rope.get("rope_type", "default") == "llama3":
            model["rope_scaling"] = {k: float(rope[k]) for k in ROPE_SCALING_KEYS}
    else:
        raise ConfigError(f"'{path}' has neither Llama (hidden_size, num_hidden_layers) nor GPT-2 (n_embd, n_layer) "
                     "keys; pass a config.json of a Llama, Mistral, Qwen or GPT-2 family.")
    model.update({ours: hf[theirs] for theirs, ours in keys.items() if hf.get(theirs) is not None})
    model.setdefault("n_kv_heads", model["n_heads"])  # every key given: none is left to a preset's value
    model.setdefault("d_ff", 4 * model["d_model"])  # GPT-2's n_inner = null
    model.setdefault("head_dim", model["d_model"] // model["n_heads"])  # Llama's head_dim = null
    if seq > HF_SEQ_CAP:
        notes.append(f"model.seq_len={HF_SEQ_CAP} (config.json allows {seq}; set --set model.seq_len=N to plan longer)")
        seq = HF_SEQ_CAP
    model["seq_len"] = seq
    experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 1)
    if experts > 1 and hf.get("model_type", "mixtral") == "mixtral":  # softmax over the top-k logits, every layer
        model["moe"] = {"num_experts": experts, "top_k": int(hf.get("num_experts_per_tok") or 2),
                        "router": "softmax-topk", **_aux_of(hf)}
    elif experts > 1:
        model["moe"] = {**moe_keys(hf, path), **_aux_of(hf)}
    return model, notes


def _aux_coef(hf: dict) -> float:
    """router_aux_loss_coef of config `hf`, else transformers' default of its family."""
    return float(hf.get("router_aux_loss_coef", AUX_COEF.get(hf.get("model_type"), AUX_COEF["mixtral"])))


def _aux_of(hf: dict) -> dict:
    """The aux loss transformers trains an MoE model of config `hf` with (module docstring)."""
    if hf.get("output_router_logits"):
        return {"aux_loss_weight": _aux_coef(hf),
                "aux_loss_convention": "transformers"}
    return {"aux_loss_weight": 0.0}


def aux_note(hf: dict, moe) -> str:
    """The start-up line on the aux loss of a run started from Mixtral config `hf` (`moe`: the run's
    model.moe): where its weight came from."""
    coef, logits = _aux_coef(hf), bool(hf.get("output_router_logits"))
    source = f"router_aux_loss_coef {coef:g}, output_router_logits {str(logits).lower()}"
    taken = {"aux_loss_convention": "ours", **_aux_of(hf)}
    if (moe.aux_loss_weight, moe.aux_loss_convention) != (taken["aux_loss_weight"], taken["aux_loss_convention"]):
        return (f"aux loss {moe.aux_loss_weight:g} ({moe.aux_loss_convention} convention) from model.moe, not "
                f"config.json's ({source})")
    if logits:
        return (f"aux loss {coef:g} from config.json (router_aux_loss_coef; output_router_logits true: "
                "transformers' loss)")
    return (f"aux loss 0 from config.json (output_router_logits false: transformers trains with none; its "
            f"router_aux_loss_coef {coef:g} applies only when that is true)")


def _rope(hf: dict) -> dict:
    """RoPE settings in one form: transformers 5's `rope_parameters`, else 4's `rope_theta` + `rope_scaling`."""
    if isinstance(hf.get("rope_parameters"), dict):
        return hf["rope_parameters"]
    scaling = dict(hf.get("rope_scaling") or {})
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    return {"rope_theta": hf.get("rope_theta", 10000.0), **scaling}


def check_importable(hf: dict, path: Path) -> None:
    """Refuse, in one sentence, a model whose weights or math teratrain's decoder does not reproduce."""
    kind = hf.get("model_type")
    if kind != "gpt2" and kind not in LLAMA_TYPES:
        raise ConfigError(f"model.init_from: {path} holds a '{kind}' model; teratrain maps Llama, Mistral, Qwen2, "
                          "Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and GPT-2 weights only.")
    if kind == "gpt2":
        checks = [(hf.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
                   f"activation {hf.get('activation_function')} (teratrain's GPT-2 uses tanh GELU)"),
                  (not hf.get("scale_attn_by_inverse_layer_idx"), "scale_attn_by_inverse_layer_idx"),
                  (not hf.get("add_cross_attention"), "cross-attention layers")]
    else:
        rope = _rope(hf).get("rope_type", "default")
        checks = [(hf.get("hidden_act", "silu") == "silu", f"hidden_act {hf.get('hidden_act')} (SwiGLU needs silu)"),
                  (bool(hf.get("attention_bias")) == bool(hf.get("mlp_bias")), "biases in attention but not the MLP"),
                  (rope in ("default", "llama3"), f"rope type {rope} (teratrain implements default and llama3)"),
                  (hf.get("clip_qkv") is None, f"clip_qkv {hf.get('clip_qkv')} (q, k, v clamped)")]
    for ok, what in checks:
        if not ok:
            raise ConfigError(f"model.init_from: {path} uses {what}, which teratrain's decoder does not implement; "
                         "start from a standard Llama or GPT-2 model.")


def init_shape(folder: str, given: dict) -> dict:
    """The model keys that `model.init_from = folder` fills in (those `given` explicitly override;
    a given weight-shape key that contradicts config.json is refused). A folder that is gone is
    fine when every shape key is given (a finished run's own config.toml)."""
    path = Path(folder).expanduser() / "config.json"
    if not path.is_file():
        if all(k in given for k in SHAPE_KEYS):
            return {}
        what = "has no config.json" if path.parent.is_dir() else "does not exist"
        raise ConfigError(f"model.init_from '{folder}' {what}; point it at a Hugging Face model folder "
                          "(config.json + *.safetensors).")
    hf = read_config_json(path)
    check_importable(hf, Path(folder))
    model, _ = model_keys(hf, path)
    for key in SHAPE_KEYS:
        if key in given and key in model and given[key] != model[key]:
            raise ConfigError(f"model.{key}={given[key]!r} contradicts {path} ({model[key]!r}); leave model.{key} unset "
                         "to take the model's, or start from a model of that shape.")
    limit = hf.get("n_positions") if model["arch"] == "gpt2" else sliding_window(hf)
    seq = given.get("seq_len", model["seq_len"])
    if limit and seq > limit:
        what = "learned positions" if model["arch"] == "gpt2" else "sliding attention window (not implemented here)"
        raise ConfigError(f"model.seq_len={seq} exceeds the {limit} {what} of {path}; set model.seq_len <= {limit}.")
    return model


def to_hf(m, source: dict | None = None) -> dict:
    """config.json of a teratrain model config `m`; of a run started from a Hugging Face model, its
    config.json `source` with the keys the run changed (module docstring)."""
    ours = _mapped(m)
    if not source:
        return ours
    base = _mapped(ModelConfig.model_validate(model_keys(source, Path("config.json"))[0]))
    changed = {k: ours.get(k) for k in {*ours, *base} if ours.get(k) != base.get(k) and k not in CONTEXT_KEYS}
    out = dict(source)
    rope = {k: changed.pop(k) for k in ("rope_theta", "rope_scaling") if k in changed}
    if rope and isinstance(source.get("rope_parameters"), dict):  # transformers 5's one table
        params = {**source["rope_parameters"], "rope_theta": m.rope_theta}
        if "rope_scaling" in rope:
            params = {k: v for k, v in params.items() if k not in ROPE_SCALING_KEYS}
            params.update({"rope_type": "llama3", **m.rope_scaling} if m.rope_scaling else {"rope_type": "default"})
        out["rope_parameters"] = params
    else:
        out.update(rope)
    out.update(changed)
    return out


# the longest context of a Llama-family model: the source's, whatever length the run trained at (GPT-2's
# n_positions is the size of its learned position table, which model.seq_len cuts: it changes with it)
CONTEXT_KEYS = ("max_position_embeddings",)


def _mapped(m) -> dict:
    """config.json of a teratrain model config (transformers 4 keys; 5 reads them too)."""
    common = {"vocab_size": m.vocab_size, "tie_word_embeddings": m.tie_embeddings}
    if m.arch == "gpt2":
        if m.moe.enabled:
            raise ConfigError("a GPT-2 model with experts has no Hugging Face layout (Mixtral's is Llama-style); "
                              "export a model with model.arch=llama, or a dense GPT-2.")
        if not m.use_bias or m.kv_heads != m.n_heads or m.head_width * m.n_heads != m.d_model:
            raise ConfigError("a GPT-2 model without biases, with grouped key/value heads or with heads not d_model / "
                              "n_heads wide has no Hugging Face GPT-2 layout; export a model with model.bias=true, "
                              "n_kv_heads = n_heads and model.head_dim = d_model / n_heads.")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": m.d_model, "n_layer": m.n_layers,
                "n_head": m.n_heads, "n_inner": m.ffn_dim, "n_positions": m.seq_len, "n_ctx": m.seq_len,
                "layer_norm_epsilon": m.norm_eps, "activation_function": "gelu_new", "resid_pdrop": m.dropout,
                "embd_pdrop": m.dropout, "attn_pdrop": m.dropout, **common}
    rope = {"rope_scaling": {"rope_type": "llama3", **m.rope_scaling}} if m.rope_scaling else {}
    layers = {"hidden_size": m.d_model, "intermediate_size": m.ffn_dim, "num_hidden_layers": m.n_layers,
              "num_attention_heads": m.n_heads, "num_key_value_heads": m.kv_heads, "head_dim": m.head_width,
              "hidden_act": "silu", "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps,
              "rope_theta": m.rope_theta, "attention_dropout": m.dropout, **rope, **common}
    return {**layers, **family_keys(m)}


def source_config(run_dir: Path, init_from: str | None) -> dict | None:
    """The config.json of the Hugging Face model a run started from: the run's copy (SOURCE_CONFIG,
    what it really started from), else the model.init_from folder's (a run made before copies were
    kept); None for a run from scratch. A file there that is not a config.json raises ConfigError."""
    folder = Path(init_from).expanduser() if init_from else None
    for path in [run_dir / SOURCE_CONFIG] + ([folder / "config.json"] if folder else []):
        if path.is_file():
            return read_config_json(path)
    return None
