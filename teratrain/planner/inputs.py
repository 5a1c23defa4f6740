"""What the planner is asked about: a Config (TOML, preset, --set), a HF config.json, or --params N.

Fields the user set explicitly (in the TOML or with --set) are fixed; the rest are searched.
"""

from __future__ import annotations

import json
from pathlib import Path

from teratrain.config import Config, ConfigError, load_config
from teratrain.parallel.pipeline.schedules import CONFIG_NAMES
from teratrain.planner.layout import Layout, ModelShape, Training

HF_SEQ_CAP = 8192  # HF max_position_embeddings is the longest context, not the training length

# HF config.json keys per family -> our model keys (Llama/Mistral/Mixtral, GPT-2)
_HF_LLAMA = {"hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
             "num_key_value_heads": "n_kv_heads", "intermediate_size": "d_ff", "vocab_size": "vocab_size",
             "tie_word_embeddings": "tie_embeddings", "rope_theta": "rope_theta", "rms_norm_eps": "norm_eps"}
_HF_GPT2 = {"n_embd": "d_model", "n_layer": "n_layers", "n_head": "n_heads", "vocab_size": "vocab_size",
            "n_inner": "d_ff", "layer_norm_epsilon": "norm_eps", "tie_word_embeddings": "tie_embeddings"}


def hf_model(path: Path) -> tuple[dict, list[str]]:
    """A HF config.json -> (model section, notes for the user); Mixtral's experts become model.moe."""
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"'{path}' is not a readable JSON file ({e}); pass a HF config.json or a TOML config.") from None
    kind = str(hf.get("model_type", ""))
    notes: list[str] = []
    if kind == "gpt2" or "n_embd" in hf:
        keys = _HF_GPT2
        seq = hf.get("n_positions") or hf.get("n_ctx") or 1024
        model = {"arch": "gpt2", "bias": True, "tie_embeddings": hf.get("tie_word_embeddings", True)}
    elif "hidden_size" in hf and "num_hidden_layers" in hf:
        keys = _HF_LLAMA
        seq = hf.get("max_position_embeddings", 4096)
        model = {"arch": "llama", "bias": bool(hf.get("attention_bias", False)),
                 "tie_embeddings": hf.get("tie_word_embeddings", False)}
    else:
        raise ConfigError(f"'{path}' has neither Llama (hidden_size, num_hidden_layers) nor GPT-2 (n_embd, n_layer) "
                          "keys; pass a Llama, Mistral, Mixtral or GPT-2 config.json.")
    model.update({ours: hf[theirs] for theirs, ours in keys.items() if hf.get(theirs) is not None})
    if seq > HF_SEQ_CAP:
        notes.append(f"model.seq_len={HF_SEQ_CAP} (config.json allows {seq}; set --set model.seq_len=N to plan longer)")
        seq = HF_SEQ_CAP
    model["seq_len"] = seq
    experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 1)
    if experts > 1:  # Mixtral: softmax over the top-k router logits, every layer (models/moe.py softmax-topk)
        model["moe"] = {"num_experts": experts, "top_k": int(hf.get("num_experts_per_tok") or 2),
                        "router": "softmax-topk"}
    return model, notes


def load(path: str | None, preset: str | None, overrides: list[str]) -> tuple[Config, list[str]]:
    """Config from TOML / config.json / preset plus --set; returns (cfg, notes). A config.json's
    shape enters as `model.*` overrides placed before the user's own --set."""
    notes: list[str] = []
    if path and path.endswith(".json"):
        model, notes = hf_model(Path(path))
        moe = model.pop("moe", {})
        shape_sets = [f"model.{k}={_literal(v)}" for k, v in model.items()]
        shape_sets += [f"model.moe.{k}={_literal(v)}" for k, v in moe.items()]
        return load_config(None, shape_sets + list(overrides)), notes
    if preset:
        overrides = [f"model.preset={preset}"] + list(overrides)
    return load_config(path, overrides), notes


def _literal(v) -> str:
    """A TOML literal for a JSON scalar."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)


def shape_of(cfg: Config, name: str = "") -> ModelShape:
    return ModelShape(cfg=cfg.model, name=name or cfg.model.preset)


PLAN_PRECISION = "bf16"  # GPUs train in bf16; the config's fp32 default is for CPU runs


def training_of(cfg: Config, notes: list[str] | None = None) -> Training:
    """Run settings of `cfg`. An unset memory.precision plans for bf16 (said in `notes`)."""
    bytes_of = {"fp32": 4, "bf16": 2, "fp16": 2}
    precision = cfg.memory.precision
    if "precision" not in cfg.memory.model_fields_set and notes is not None:
        precision = PLAN_PRECISION
        notes.append(f"memory.precision unset: planned for {PLAN_PRECISION} (set --set memory.precision=fp32 to plan fp32)")
    return Training(precision=precision, master_weights=cfg.memory.master_weights,
                    optimizer=cfg.optim.name, momentum=cfg.optim.momentum, global_batch=cfg.train.global_batch,
                    bucket_mb=cfg.parallel.bucket_mb, reduce_bytes=bytes_of[cfg.parallel.reduce_dtype],
                    dropout=cfg.model.dropout)


def fixed_of(cfg: Config) -> dict:
    """Layout fields the user set (TOML keys or --set), which the search must keep."""
    out = {}
    p, t, m = cfg.parallel, cfg.train, cfg.memory
    for key in ("dp", "tp", "pp", "ep", "zero", "offload", "num_microbatches", "virtual_stages"):
        if key in p.model_fields_set and getattr(p, key) is not None:
            out[key] = getattr(p, key)
    out["schedule"] = CONFIG_NAMES[p.schedule]  # never searched: the default is 1F1B
    if "micro_batch" in t.model_fields_set:
        out["micro_batch"] = t.micro_batch
    if "recompute" in m.model_fields_set:
        out["recompute"] = m.recompute
    if "recompute_every" in m.model_fields_set or m.recompute == "every-k":
        out["recompute_every"] = m.recompute_every
    return out


def layout_of(cfg: Config, gpus: int = 1) -> Layout:
    """The layout a config describes when nothing is searched (defaults for unset degrees)."""
    p = cfg.parallel
    dp = p.dp or max(1, gpus // (p.tp * p.pp))
    per_replica = max(1, cfg.train.global_batch // dp)
    mb = min(cfg.train.micro_batch, per_replica)
    return Layout(dp=dp, tp=p.tp, pp=p.pp, ep=p.ep, zero=p.zero, micro_batch=mb,
                  num_microbatches=max(1, per_replica // mb), recompute=cfg.memory.recompute,
                  recompute_every=cfg.memory.recompute_every, offload=p.offload, sequence_parallel=p.tp > 1,
                  schedule=CONFIG_NAMES[p.schedule], virtual_stages=p.virtual_stages)
