"""Which Hugging Face family holds a teratrain Llama-style model, and the config.json keys that tell
the families apart. All are the decoder of models/transformer.py (RMSNorm, RoPE, SwiGLU, GQA) with
these choices (hf_config.py maps the keys they share, hf_weights.py the tensor names):

| family (model_type) | attention                               | feed-forward                      |
| ------------------- | --------------------------------------- | --------------------------------- |
| llama, mistral      | model.bias (attention_bias = mlp_bias)  | dense                             |
| qwen2               | model.qkv_bias = true                   | dense                             |
| qwen3               | model.qk_norm = head                    | dense                             |
| mixtral             | no biases                               | experts (norm_topk) every layer   |
| qwen2_moe           | model.qkv_bias (its `qkv_bias`, true)   | experts, one gated shared expert  |
| qwen3_moe           | model.qk_norm = head                    | experts                           |
| olmoe               | model.qk_norm = full                    | experts every layer               |

The three MoE families route by softmax over all experts, then top-k, the k scores divided by their
sum only with `norm_topk_prob` (model.moe.norm_topk; Mixtral always does): model.moe's softmax-topk
router. Routed experts are `moe_intermediate_size` wide (OLMoE's: `intermediate_size`,
model.moe.expert_d_ff), Qwen2-MoE's shared expert `shared_expert_intermediate_size` (model.moe.
shared_experts=1, shared_d_ff, shared_gate=true). Qwen's MoE layers are those not in `mlp_only_layers`
with (i + 1) % `decoder_sparse_step` == 0: model.moe.every and first_dense_layers, where a list of
the first layers expresses it. A model whose choices no family holds (q/k norm over the whole width
in a dense model, q/k/v biases next to q/k norms, experts without a family) is refused at export in
one sentence.
"""

from __future__ import annotations

from teratrain.config_base import ConfigError

DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# transformers' default router_aux_loss_coef of each MoE family (used when config.json lacks the key)
AUX_COEF = {"mixtral": 0.001, "qwen2_moe": 0.001, "qwen3_moe": 0.001, "olmoe": 0.01}


def attention_keys(hf: dict) -> dict:
    """Our model.qkv_bias / model.qk_norm of a HF config (the attention of its family)."""
    kind = hf.get("model_type")
    if kind == "qwen2":
        return {"qkv_bias": True}  # transformers' Qwen2Attention: q, k, v biases always, none on o
    if kind == "qwen2_moe":
        return {"qkv_bias": bool(hf.get("qkv_bias", True))}
    if kind in ("qwen3", "qwen3_moe"):
        return {"qk_norm": "head"}
    if kind == "olmoe":
        return {"qk_norm": "full"}
    return {}


def moe_keys(hf: dict, path) -> dict:
    """model.moe of a Qwen2-MoE, Qwen3-MoE or OLMoE config (Mixtral's: hf_config.model_keys), less the
    aux loss (hf_config reads it alike for all)."""
    kind, n = hf.get("model_type"), hf["num_hidden_layers"]
    experts = hf.get("num_experts") or hf["num_local_experts"]  # transformers 5 saves Qwen3-MoE's as the latter
    out = {"num_experts": int(experts), "top_k": int(hf["num_experts_per_tok"]), "router": "softmax-topk",
           "norm_topk": bool(hf.get("norm_topk_prob", False))}
    if kind == "olmoe":
        return {**out, "expert_d_ff": hf["intermediate_size"]}
    out["expert_d_ff"] = hf["moe_intermediate_size"]
    if kind == "qwen2_moe" and hf.get("shared_expert_intermediate_size"):
        out.update(shared_experts=1, shared_d_ff=hf["shared_expert_intermediate_size"], shared_gate=True)
    step, dense = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or [])
    theirs = [i not in dense and (i + 1) % step == 0 for i in range(n)]
    for first in range(n):
        if theirs == [i >= first and (i + 1) % step == 0 for i in range(n)]:
            return {**out, "every": step, "first_dense_layers": first}
    raise ConfigError(f"model.init_from: {path} keeps the dense MLP in layers {sorted(dense)} (mlp_only_layers) with "
                      f"decoder_sparse_step {step}, which model.moe.every and first_dense_layers (the first layers "
                      "only) cannot express; start from a model whose dense layers come first.")


def sliding_window(hf: dict) -> int | None:
    """The attention window a HF config uses, if any: Qwen's configs carry `sliding_window` also when
    `use_sliding_window` is false (then transformers attends to everything)."""
    if hf.get("model_type", "").startswith("qwen") and not hf.get("use_sliding_window"):
        return None
    return hf.get("sliding_window") or None


def family_keys(m) -> dict:
    """architectures, model_type and the family's own keys of the config.json of llama-arch model `m`."""
    return moe_family(m) if m.moe.enabled else dense_family(m)


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


def moe_type(m) -> str:
    """The model_type of the MoE family that holds model config `m`, or ConfigError with the fix."""
    e = m.moe
    if e.router != "softmax-topk" or e.score != "softmax" or e.balance != "aux" or e.group_limited or m.use_bias:
        raise ConfigError(f"the Hugging Face MoE families route by softmax-topk over all experts without expert "
                          f"biases and have no MLP biases (this model: model.moe.router={e.router}, score={e.score}, "
                          f"balance={e.balance}, max_groups={e.groups_per_token} of {e.expert_groups}, "
                          f"model.bias={str(m.use_bias).lower()}); export a model with those.")
    every_layer = e.every == 1 and e.first_dense_layers == 0
    if e.shared_experts:
        ok, kind = e.shared_gate and m.qk_norm == "none", "qwen2_moe"
    elif m.qk_norm == "head":
        ok, kind = not m.qkv_bias, "qwen3_moe"
    elif m.qk_norm == "full":
        ok, kind = not m.qkv_bias and every_layer, "olmoe"
    else:
        ok, kind = not m.qkv_bias and every_layer and e.normalize_topk and e.expert_d_ff in (None, m.ffn_dim), "mixtral"
    if not ok:
        raise ConfigError("no Hugging Face MoE family holds these choices (Mixtral: norm_topk, every layer, plain "
                          "attention; Qwen2-MoE: a gated shared expert; Qwen3-MoE: model.qk_norm=head; OLMoE: "
                          "qk_norm=full, every layer; docs/checkpoints.md); export a model of one of them.")
    return kind


def moe_family(m) -> dict:
    """The MoE keys of the config.json of model config `m`. The aux weight becomes router_aux_loss_coef:
    exactly under the transformers convention; under ours divided by top_k, the same weight per layer
    (transformers then pools the layers' tokens: docs/moe.md, "Auxiliary loss: two conventions"); with
    output_router_logits true, without which transformers trains with none. No aux loss: 0 and false."""
    e, kind = m.moe, moe_type(m)
    coef = e.aux_loss_weight if e.aux_loss_convention == "transformers" else e.aux_loss_weight / e.k
    arch = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "olmoe": "OlmoeForCausalLM"}[kind]
    out = {"architectures": [arch], "model_type": kind, "num_experts_per_tok": e.k, "router_aux_loss_coef": coef,
           "output_router_logits": coef > 0}
    if kind == "mixtral":
        return {**out, "num_local_experts": e.num_experts, "router_jitter_noise": 0.0, "sliding_window": None}
    out.update(num_experts=e.num_experts, norm_topk_prob=e.normalize_topk)
    if kind == "olmoe":
        return {**out, "intermediate_size": m.expert_ffn_dim, "attention_bias": False, "clip_qkv": None}
    out.update(moe_intermediate_size=m.expert_ffn_dim, decoder_sparse_step=e.every, use_sliding_window=False,
               mlp_only_layers=list(range(e.first_dense_layers)))
    if kind == "qwen3_moe":
        return {**out, "attention_bias": False}
    return {**out, "qkv_bias": m.qkv_bias, "shared_expert_intermediate_size": m.shared_ffn_dim}
