"""Small randomly initialized Hugging Face models saved with save_pretrained (made here, no download),
shared by the unit, dist and CLI tests of model.init_from and export."""

from __future__ import annotations

from pathlib import Path

import torch

# The shape of tests/dist/layout_workers.py BASE: GQA (4 query / 2 key-value heads), vocabulary 50.
LLAMA = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500000.0,
             tie_word_embeddings=False)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}
MIXTRAL = {**LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2}
# 4 experts of width 16 (not the dense MLP's 64), 2 per token; Qwen2-MoE's layer 0 keeps the dense MLP
QWEN2_MOE = {**LLAMA, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
             "shared_expert_intermediate_size": 24, "mlp_only_layers": [0], "norm_topk_prob": False}
QWEN3_MOE = {**LLAMA, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8,
             "norm_topk_prob": True}
# OLMoE's experts are intermediate_size wide. Its default pad_token_id (1) makes transformers' embedding
# keep that row's gradient at zero, which teratrain's does not: these models have no padding token.
OLMOE = {**LLAMA, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False, "pad_token_id": None,
         "eos_token_id": 0}
GPT2 = dict(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)


def save_llama(path: Path, seed: int = 0, shard: str | None = None, **keys) -> "torch.nn.Module":
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save(path, LlamaForCausalLM, LlamaConfig(**{**LLAMA, **keys}), seed, shard)


def save_mixtral(path: Path, seed: int = 0, **keys) -> "torch.nn.Module":
    """A Mixtral of LLAMA's shape with 4 experts of which each token takes 2."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return _save(path, MixtralForCausalLM, MixtralConfig(**{**MIXTRAL, **keys}), seed, None)


def save_qwen2(path: Path, seed: int = 0, **keys) -> "torch.nn.Module":
    """A Qwen2 of LLAMA's shape: biases on q, k, v (none on o or the MLP)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _save(path, Qwen2ForCausalLM, Qwen2Config(**{**LLAMA, **keys}), seed, None)


def save_qwen3(path: Path, seed: int = 0, **keys) -> "torch.nn.Module":
    """A Qwen3 of LLAMA's shape (head_dim = hidden_size / heads): RMSNorm of each q and k head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _save(path, Qwen3ForCausalLM, Qwen3Config(**{**LLAMA, "head_dim": 8, **keys}), seed, None)


def save_moe(path: Path, family: str, seed: int = 0, **keys) -> "torch.nn.Module":
    """A Qwen2-MoE (shared expert, q/k/v biases), Qwen3-MoE (per-head q/k norms) or OLMoE (whole-width
    q/k norms) of LLAMA's attention shape: `family` is its model_type."""
    import transformers

    names, base = {"qwen2_moe": ("Qwen2Moe", QWEN2_MOE), "qwen3_moe": ("Qwen3Moe", QWEN3_MOE),
                   "olmoe": ("Olmoe", OLMOE)}[family]
    config = getattr(transformers, f"{names}Config")(**{**base, **keys})
    return _save(path, getattr(transformers, f"{names}ForCausalLM"), config, seed, None)


def save_gpt2(path: Path, seed: int = 0, shard: str | None = None, **keys) -> "torch.nn.Module":
    from transformers import GPT2Config, GPT2LMHeadModel

    return _save(path, GPT2LMHeadModel, GPT2Config(**{**GPT2, **keys}), seed, shard)


def _save(path: Path, model_class, config, seed: int, shard: str | None) -> "torch.nn.Module":
    """A model of `config` initialized from `seed`, its norms and biases perturbed, saved at `path`
    (in shards of at most `shard`, e.g. "20KB", where given)."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    _perturb_norms(model)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return model


def _perturb_norms(model) -> None:
    """HF initializes norms to 1 and biases to 0; random values make a wrong mapping of them visible."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
