"""The model's config sections: `[model]` and its `[model.moe]` (config.py re-exports both). Pure:
what `model.init_from` fills in is resolved before validation (config.py `resolve_init_from`)."""

from __future__ import annotations

import difflib
import functools
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from teratrain.config_base import ConfigError, Section
from teratrain.models.presets import PRESETS, give_way

ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


ROUTERS = ("softmax-topk", "noisy-topk", "gshard-top2", "switch-top1", "hierarchical")


class MoEConfig(Section):
    """Mixture-of-experts feed-forward layers (models/moe.py); num_experts=1 keeps the dense MLP."""

    num_experts: int = Field(1, ge=1, description="experts per MoE layer (1 = dense MLP, no MoE)")
    top_k: int | None = Field(None, ge=1, description="experts per token (hierarchical: per level, top_k^2 in all); "
                                                      "unset = 1 for switch-top1, else 2")
    router: Literal[ROUTERS] = Field("softmax-topk", description="gating: softmax-topk (Mixtral), noisy-topk and "
                                     "hierarchical (Shazeer et al. 2017), gshard-top2 (Lepikhin et al. 2020), "
                                     "switch-top1 (Fedus et al. 2021)")
    capacity_factor: float | None = Field(None, ge=0.0, description="expert capacity per group = ceil(factor x experts per token "
                                          "x tokens / num_experts); overflow passes through the residual; 0 = no "
                                          "limit; unset = 1.0 for gshard-top2 (the paper's 2S/E), 1.25 for "
                                          "switch-top1, no limit otherwise")
    aux_loss_weight: float = Field(0.01, ge=0.0, description="weight of each MoE layer's auxiliary load-balancing "
                                                             "loss in the training loss")
    aux_loss_convention: Literal["ours", "transformers"] = Field(
        "ours", description="ours: each layer's router loss (models/moe.py) times aux_loss_weight, summed over the "
        "layers; transformers: Mixtral's load_balancing_loss_func, one loss over all layers' tokens together (per "
        "layer top_k times ours), times aux_loss_weight = transformers' router_aux_loss_coef (softmax-topk only)")
    every: int = Field(1, ge=1, description="layer i is an MoE layer when (i + 1) % every == 0 (2 = GShard's "
                                            "every other layer)")
    expert_dropout: float | None = Field(None, ge=0.0, lt=1.0, description="dropout on the experts' hidden "
                                         "activations (Switch's expert dropout); unset = model.dropout")
    router_dtype: Literal["fp32", "compute"] = Field("fp32", description="router logits and softmax in fp32 "
                                                     "(Switch's selective precision) or in the compute dtype")
    groups: int | None = Field(None, ge=1, description="hierarchical: expert groups of the primary gate "
                               "(num_experts/groups experts each; unset = the divisor nearest sqrt(num_experts)); "
                               "other routers: local groups each micro-batch's tokens are split into, each with "
                               "its own capacity (GShard's local group dispatching; unset = 1)")
    noise: float | None = Field(None, ge=0.0, description="noisy-topk and hierarchical: multiplier of the trainable "
                                "noise std Softplus(x W_noise) (Shazeer eq. 4; 0 = no noise); unset = 1")
    expert_d_ff: int | None = Field(None, ge=1, description="inner width of each routed expert (fine-grained experts, "
                                    "DeepSeek-MoE); unset = model.d_ff")
    shared_experts: int = Field(0, ge=0, description="shared experts every token passes through, their output added "
                                "to the routed output (DeepSeek-MoE; Qwen2-MoE: 1)")
    shared_d_ff: int | None = Field(None, ge=1, description="inner width of each shared expert; unset = the routed "
                                    "experts' width (model.moe.expert_d_ff)")
    shared_gate: bool = Field(False, description="scale the shared experts' output by sigmoid(x w_g), w_g a learned "
                              "(d_model -> 1) gate (Qwen2-MoE); false = ungated (DeepSeek-MoE)")
    score: Literal["softmax", "sigmoid"] = Field("softmax", description="softmax-topk: router score of each expert, "
                                                 "softmax over the experts (Mixtral, Qwen) or per-expert sigmoid "
                                                 "(DeepSeek-V3)")
    norm_topk: bool | None = Field(None, description="softmax-topk: divide the k chosen scores by their sum (Mixtral, "
                                   "Qwen3-MoE, DeepSeek-V3); false = the raw scores (Qwen2-MoE, OLMoE); unset = true")
    z_loss_weight: float = Field(0.0, ge=0.0, description="weight of the router z-loss, mean over tokens of "
                                 "logsumexp(logits)^2 (ST-MoE eq. 5), summed over MoE layers into the loss")
    first_dense_layers: int = Field(0, ge=0, description="the first k layers keep the dense MLP (DeepSeek's "
                                    "first-k-dense); the others follow model.moe.every")
    balance: Literal["aux", "bias"] = Field("aux", description="aux: the aux loss balances the experts; bias: a "
                                            "per-expert bias on the scores for the top-k choice only, moved by "
                                            "bias_rate after every step (DeepSeek-V3 auxiliary-loss-free); "
                                            "aux_loss_weight then defaults to 0")
    bias_rate: float = Field(1e-3, gt=0.0, description="balance=bias: the bias step per optimizer step, "
                             "bias_e += rate * sign(mean load - load_e) (DeepSeek-V3's gamma)")
    aux_loss_kind: Literal["batch", "sequence"] = Field("batch", description="softmax-topk: the balance loss over all "
                                                        "tokens of a forward (batch), or per sequence and averaged "
                                                        "over the sequences (DeepSeek-V3 eq. 17-20)")
    expert_groups: int = Field(1, ge=1, description="softmax-topk: the experts cut into this many equal consecutive "
                               "groups for group-limited routing (DeepSeek-V3's n_group); 1 = off")
    max_groups: int | None = Field(None, ge=1, description="softmax-topk: each token chooses its top_k experts "
                                   "within its max_groups best expert groups, a group scored by the sum of its 2 "
                                   "best choice scores (DeepSeek-V3's topk_group); unset = expert_groups (no limit)")

    @model_validator(mode="before")
    @classmethod
    def _bias_means_no_aux(cls, data: Any) -> Any:
        """balance=bias balances without the aux loss: its weight is 0 unless the user gives one."""
        if isinstance(data, dict) and data.get("balance") == "bias" and "aux_loss_weight" not in data:
            data = {**data, "aux_loss_weight": 0.0}
        return data

    @model_validator(mode="after")
    def _check(self) -> "MoEConfig":
        n, k, r = self.num_experts, self.k, self.router
        fixed = {"switch-top1": 1, "gshard-top2": 2}.get(r)
        if fixed is not None and k != fixed:
            raise ConfigError(f"model.moe.router={r} routes each token to {fixed} expert(s) but model.moe.top_k={k}; "
                              f"unset model.moe.top_k or set it to {fixed}.")
        if self.noise is not None and r not in ("noisy-topk", "hierarchical"):
            raise ConfigError(f"model.moe.noise only applies to the noisy-topk and hierarchical routers (this one is "
                              f"{r}); unset it or choose one of those routers.")
        if self.aux_loss_convention == "transformers" and r != "softmax-topk":
            raise ConfigError(f"model.moe.aux_loss_convention=transformers is Mixtral's loss, defined for the softmax-topk "
                              f"router (this one is {r}); set model.moe.router=softmax-topk or aux_loss_convention=ours.")
        self._check_modern()
        if n == 1:
            return self
        if r == "hierarchical":
            a = self.num_groups
            if n % a or a < 2 or a == n:
                raise ConfigError(f"model.moe.groups ({a}) must divide model.moe.num_experts ({n}) into at least 2 "
                                  f"groups of at least 2 experts; choose another divisor of {n}.")
            if k > a or k > n // a:
                raise ConfigError(f"model.moe.top_k ({k}) exceeds the {a} groups or the {n // a} experts per group of "
                                  "the hierarchical router; lower model.moe.top_k or change model.moe.groups.")
        elif k > n:
            raise ConfigError(f"model.moe.top_k ({k}) exceeds model.moe.num_experts ({n}); lower it.")
        self._check_expert_groups()
        return self

    def _check_expert_groups(self) -> None:
        """Group-limited routing: equal groups, at most all of them kept, room for top_k in the kept ones."""
        n, g, m, k = self.num_experts, self.expert_groups, self.groups_per_token, self.k
        if n % g:
            raise ConfigError(f"model.moe.expert_groups ({g}) must divide model.moe.num_experts ({n}) into equal "
                              f"groups; choose a divisor of {n}.")
        if m > g:
            raise ConfigError(f"model.moe.max_groups ({m}) exceeds model.moe.expert_groups ({g}); lower it or "
                              "unset it.")
        if k > m * (n // g):
            raise ConfigError(f"model.moe.top_k ({k}) exceeds the {m * (n // g)} experts of model.moe.max_groups "
                              f"({m}) groups of {n // g}; raise max_groups or lower top_k.")

    def _check_modern(self) -> None:
        """Modern routers' options (score, norm_topk, balance, expert groups, z-loss, shared experts) vs the router."""
        r = self.router
        only_topk = [("score", self.score != "softmax"), ("norm_topk", self.norm_topk is not None),
                     ("balance", self.balance != "aux"), ("aux_loss_kind", self.aux_loss_kind != "batch"),
                     ("expert_groups", self.expert_groups != 1), ("max_groups", self.max_groups is not None)]
        for key, used in only_topk:
            if used and r != "softmax-topk":
                raise ConfigError(f"model.moe.{key}={getattr(self, key)} is defined for the softmax-topk router (this "
                                  f"one is {r}); set model.moe.router=softmax-topk or unset model.moe.{key}.")
        if self.z_loss_weight and r == "hierarchical":
            raise ConfigError("model.moe.z_loss_weight needs one row of router logits per expert, which the "
                              "hierarchical router does not have; set it to 0 or choose another model.moe.router.")
        if self.aux_loss_convention == "transformers" and (self.score, self.aux_loss_kind) != ("softmax", "batch"):
            raise ConfigError("model.moe.aux_loss_convention=transformers is Mixtral's softmax loss over the batch; "
                              "set aux_loss_convention=ours with score=sigmoid or aux_loss_kind=sequence.")
        if not self.shared_experts and (self.shared_d_ff is not None or self.shared_gate):
            raise ConfigError("model.moe.shared_d_ff and shared_gate describe shared experts, but "
                              "model.moe.shared_experts is 0; set shared_experts >= 1 or unset them.")

    @property
    def enabled(self) -> bool:
        return self.num_experts > 1

    @property
    def normalize_topk(self) -> bool:
        """Whether the chosen k scores are divided by their sum (the resolved norm_topk)."""
        return True if self.norm_topk is None else self.norm_topk

    @property
    def k(self) -> int:
        """Choices per gate (the resolved top_k)."""
        return self.top_k if self.top_k is not None else (1 if self.router == "switch-top1" else 2)

    @property
    def experts_per_token(self) -> int:
        """Experts each token visits (before drops): k, or k at each of the hierarchical router's two levels."""
        return self.k * self.k if self.router == "hierarchical" else self.k

    @property
    def capacity(self) -> float:
        """The resolved capacity factor (0 = unlimited)."""
        if self.capacity_factor is not None:
            return self.capacity_factor
        return {"gshard-top2": 1.0, "switch-top1": 1.25}.get(self.router, 0.0)

    @property
    def num_groups(self) -> int:
        if self.groups is not None:
            return self.groups
        if self.router == "hierarchical":
            return _divisor_near(self.num_experts, round(math.sqrt(self.num_experts)))
        return 1

    @property
    def groups_per_token(self) -> int:
        """The expert groups each token may choose from (the resolved max_groups)."""
        return self.expert_groups if self.max_groups is None else self.max_groups

    @property
    def group_limited(self) -> bool:
        """Whether group-limited routing excludes any group from a token's choice."""
        return self.groups_per_token < self.expert_groups

    @property
    def noise_scale(self) -> float:
        return 1.0 if self.noise is None else self.noise

    def is_moe_layer(self, index: int) -> bool:
        """Whether global layer `index` holds an MoE feed-forward layer: past the first dense layers,
        every `every`-th."""
        return self.enabled and index >= self.first_dense_layers and (index + 1) % self.every == 0


def _refuse_moe_keys_on_a_dense_model(given: Any, merged: Any) -> None:
    """A model.moe key the user set away from its default while model.moe.num_experts is 1 (a dense model, where
    it does nothing) is a mistake, not a no-op. The keys a preset set are not the user's (turning a preset's MoE
    off keeps them), nor are defaults written out (a run's saved config.toml)."""
    if not isinstance(given, dict) or (merged or {}).get("num_experts", 1) != 1:
        return
    fields = MoEConfig.model_fields
    moved = [k for k, v in given.items() if k in fields and k != "num_experts" and v != fields[k].default]
    if moved:
        raise ConfigError(f"model.moe.{moved[0]} is set but model.moe.num_experts is 1 (a dense model, where it does "
                          "nothing); set model.moe.num_experts to the expert count, or remove "
                          f"model.moe.{moved[0]}.")


class ModelConfig(Section):
    preset: str = Field("tiny", description="named shape (see `teratrain.models.presets`); other keys override it")
    arch: Literal["llama", "gpt2"] = Field("llama", description="llama: RMSNorm/RoPE/SwiGLU/GQA; gpt2: LayerNorm/learned positions/GELU")
    n_layers: int = Field(4, ge=1, description="transformer blocks")
    d_model: int = Field(128, ge=1, description="hidden width")
    n_heads: int = Field(4, ge=1, description="query heads")
    n_kv_heads: int | None = Field(None, ge=1, description="key/value heads (grouped-query attention); unset = n_heads")
    head_dim: int | None = Field(None, ge=1, description="width of each query/key/value head; unset = d_model / "
                                 "n_heads (Qwen3-MoE 30B-A3B: 128 at d_model 2048 and 32 heads)")
    d_ff: int | None = Field(None, ge=1, description="MLP inner width; unset = 4*d_model (gpt2) or 8/3*d_model rounded to 64 (llama)")
    vocab_size: int = Field(4096, ge=2, description="embedding rows; the default corpus's BPE is trained to this size")
    seq_len: int = Field(128, ge=1, description="training context length in tokens")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability on embeddings, attention and residuals")
    bias: bool | None = Field(None, description="biases in linear layers; unset = true for gpt2, false for llama")
    qkv_bias: bool = Field(False, description="biases on the query, key and value projections only (Qwen2, "
                           "Qwen2-MoE); llama only, and redundant with model.bias=true")
    qk_norm: Literal["none", "head", "full"] = Field("none", description="RMSNorm of queries and keys before RoPE: "
                                                     "head = per head over head_dim (Qwen3), full = over the whole "
                                                     "q and k projection widths (OLMoE); llama only")
    tie_embeddings: bool = Field(False, description="share the input embedding with the output projection")
    norm_eps: float = Field(1e-5, gt=0.0, description="epsilon of RMSNorm/LayerNorm")
    rope_theta: float = Field(10000.0, gt=0.0, description="RoPE base (llama only)")
    rope_scaling: dict[str, float] | None = Field(None, description="Llama 3 RoPE frequency scaling {factor, "
                                                  "low_freq_factor, high_freq_factor, original_max_position_embeddings}; "
                                                  "unset = none")
    init_from: str | None = Field(None, description="Hugging Face model folder (config.json + *.safetensors of a "
                                  "Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE or GPT-2 model) "
                                  "to start from: its config fills the model keys not given here, its weights the "
                                  "parameters, its tokenizer.json the tokenizer")
    init_std: float = Field(0.02, gt=0.0, description="std of the normal init; residual output projections get std/sqrt(2*n_layers)")
    moe: MoEConfig = Field(default_factory=MoEConfig, description="mixture of experts ([model.moe] table)")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        """Fill keys the user did not give from the named preset (but those that give way to a choice
        of the user's: presets.give_way)."""
        if not isinstance(data, dict):
            return data
        name = data.get("preset", "tiny")
        if name not in PRESETS:
            close = difflib.get_close_matches(str(name), PRESETS, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(f"model.preset '{name}' is unknown; {hint}choose one of {', '.join(PRESETS)}.")
        preset = give_way(PRESETS[name], data)
        merged = {**preset, **data}  # model.init_from's keys are among `data` (config.py resolve_init_from)
        if isinstance(preset.get("moe"), dict) and isinstance(data.get("moe"), dict):
            merged["moe"] = {**preset["moe"], **data["moe"]}  # keys given next to the preset override its own
        _refuse_moe_keys_on_a_dense_model(data.get("moe"), merged.get("moe"))
        return merged

    @model_validator(mode="after")
    def _check_shape(self) -> "ModelConfig":
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(f"model.n_heads ({self.n_heads}) does not divide model.d_model ({self.d_model}); "
                              f"set model.head_dim, or pick a head count that divides it, e.g. "
                              f"{_divisor_near(self.d_model, self.n_heads)}.")
        if self.n_heads % self.kv_heads:
            raise ConfigError(f"model.n_kv_heads ({self.kv_heads}) must divide model.n_heads ({self.n_heads}); "
                              f"set it to a divisor of {self.n_heads}.")
        if self.arch == "llama" and self.head_width % 2:
            what = "model.head_dim" if self.head_dim else "model.d_model / model.n_heads"
            raise ConfigError(f"{what} = {self.head_width} must be even for RoPE; change model.n_heads or "
                              f"model.head_dim.")
        if self.rope_scaling is not None and set(self.rope_scaling) != set(ROPE_SCALING_KEYS):
            raise ConfigError(f"model.rope_scaling has keys {sorted(self.rope_scaling)}; give exactly "
                              f"{', '.join(ROPE_SCALING_KEYS)} (Llama 3 scaling).")
        if self.arch != "llama" and (self.qkv_bias or self.qk_norm != "none"):
            raise ConfigError(f"model.qkv_bias and model.qk_norm belong to the llama decoder (this model has "
                              f"model.arch={self.arch}); set model.arch=llama or leave them at false and none.")
        if self.qkv_bias and self.use_bias:
            raise ConfigError("model.qkv_bias adds biases to q, k and v only, while model.bias=true gives every "
                              "linear layer one already; set one of them to false.")
        if self.moe.enabled and self.moe.every > self.n_layers:
            raise ConfigError(f"model.moe.every ({self.moe.every}) exceeds model.n_layers ({self.n_layers}), so no "
                              f"layer would hold experts; lower model.moe.every.")
        if self.moe.enabled and not any(self.moe.is_moe_layer(i) for i in range(self.n_layers)):
            raise ConfigError(f"model.moe.first_dense_layers ({self.moe.first_dense_layers}) leaves none of the "
                              f"{self.n_layers} layers an MoE layer; lower model.moe.first_dense_layers.")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_width(self) -> int:
        """Width of each attention head: model.head_dim, else d_model / n_heads."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.d_ff:
            return self.d_ff
        if self.arch == "gpt2":
            return 4 * self.d_model
        return 64 * math.ceil(8 * self.d_model / 3 / 64)  # SwiGLU keeps ~the 4d MLP's parameter count

    @property
    def expert_ffn_dim(self) -> int:
        """Inner width of each routed expert (model.moe.expert_d_ff, else the MLP's)."""
        return self.moe.expert_d_ff or self.ffn_dim

    @property
    def shared_ffn_dim(self) -> int:
        """Inner width of all shared experts together (0 without): shared_experts x each one's width."""
        return self.moe.shared_experts * (self.moe.shared_d_ff or self.expert_ffn_dim)

    @property
    def use_bias(self) -> bool:
        return self.arch == "gpt2" if self.bias is None else self.bias


def _divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - k))


# what model_label compares against the preset: the keys that change the shape or the parameter count
SHAPE_KEYS = ("arch", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size",
              "tie_embeddings")
MOE_SHAPE_KEYS = ("num_experts", "top_k", "every", "expert_d_ff", "shared_experts", "shared_d_ff")


def model_label(m) -> str:
    """What a model config trains, in a few words: a Hugging Face start by its folder, else its preset by name
    and which of the preset's shape keys the config changed (`tiny preset with d_model, d_ff changed`: a shape
    given key by key over the default preset says so rather than the preset's name)."""
    if m.init_from:
        return f"{Path(m.init_from).expanduser().name} from model.init_from"
    if m.preset not in PRESETS:
        return m.preset
    own = _preset_config(m.preset)
    changed = [k for k in SHAPE_KEYS if getattr(m, k) != getattr(own, k)]
    changed += [f"moe.{k}" for k in MOE_SHAPE_KEYS if getattr(m.moe, k) != getattr(own.moe, k)]
    return f"{m.preset} preset with {', '.join(changed)} changed" if changed else m.preset


@functools.lru_cache(maxsize=None)
def _preset_config(name: str) -> ModelConfig:
    """The preset's own config, built once (plans name their model for every row of a refit)."""
    return ModelConfig(preset=name)
