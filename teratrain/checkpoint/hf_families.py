"""Which Hugging Face family holds a teratrain Llama-style model, and the config.json keys that tell
the families apart. All are the decoder of models/transformer.py (RMSNorm, RoPE, SwiGLU, GQA) with
these choices (hf_config.py maps the keys they share, hf_weights.py the tensor names):

| family (model_type) | attention                               | feed-forward                      |
| ------------------- | --------------------------------------- | --------------------------------- |
| llama, mistral      | model.bias (attention_bias = mlp_bias)  | dense                             |
| qwen2               | model.qkv_bias = true                   | dense                             |
| qwen3               | model.qk_norm = head                    | dense                             |

A model whose choices no family holds (q/k norm over the whole width in a dense model, q/k/v biases
next to q/k norms) is refused at export in one sentence.
"""

from __future__ import annotations

from teratrain.config_base import ConfigError

DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def attention_keys(hf: dict) -> dict:
    """Our model.qkv_bias / model.qk_norm of a HF config (the attention of its family)."""
    kind = hf.get("model_type")
    if kind == "qwen2":
        return {"qkv_bias": True}  # transformers' Qwen2Attention: q, k, v biases always, none on o
    if kind == "qwen3":
        return {"qk_norm": "head"}
    return {}


def sliding_window(hf: dict) -> int | None:
    """The attention window a HF config uses, if any: Qwen's configs carry `sliding_window` also when
    `use_sliding_window` is false (then transformers attends to everything)."""
    if hf.get("model_type", "").startswith("qwen") and not hf.get("use_sliding_window"):
        return None
    return hf.get("sliding_window") or None


def dense_family(m) -> dict:
    """architectures, model_type and the attention keys of the config.json of dense model config `m`."""
    if m.qk_norm == "full":
        raise ConfigError("model.qk_norm=full (q and k normalised over their whole width) has no dense Hugging Face "
                          "layout here (OLMoE's is a mixture of experts); export with model.qk_norm=none or head.")
    if m.qk_norm == "head":
        if m.use_bias or m.qkv_bias:
            raise ConfigError("Qwen3, the Hugging Face layout of model.qk_norm=head, has no MLP biases and no "
                              "q/k/v-only biases; export a model with model.bias=false and model.qkv_bias=false.")
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
                "use_sliding_window": False}
    if m.qkv_bias:
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": m.use_bias,
            "mlp_bias": m.use_bias}
