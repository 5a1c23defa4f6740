"""What the planner is asked about: a Config (TOML, preset, --set), a HF config.json, or --params N.

Fields the user set explicitly (in the TOML or with --set) are fixed; the rest are searched.
"""

from __future__ import annotations

import json
from pathlib import Path

from teratrain.checkpoint.hf_config import model_keys, read_config_json
from teratrain.config import Config, load_config
from teratrain.config_toml import toml_value
from teratrain.config_model import model_label
from teratrain.parallel.pipeline.schedules import CONFIG_NAMES
from teratrain.planner.layout import Layout, ModelShape, Training


def hf_model(path: Path) -> tuple[dict, list[str]]:
    """A HF config.json -> (model section, notes for the user): the mapping `model.init_from` and
    `teratrain export` use too (checkpoint/hf_config.py); Mixtral's experts become model.moe."""
    return model_keys(read_config_json(path), path)


def load(path: str | None, preset: str | None, overrides: list[str]) -> tuple[Config, list[str]]:
    """Config from TOML / config.json / preset plus --set; returns (cfg, notes). A config.json's
    shape enters as `model.*` overrides placed before the user's own --set."""
    sets, notes = model_sets(path, preset)
    return load_config(None if path and path.endswith(".json") else path, sets + list(overrides)), notes


def model_sets(path: str | None, preset: str | None) -> tuple[list[str], list[str]]:
    """(--set items that give the model of a config.json or a preset, notes for the user)."""
    if path and path.endswith(".json"):
        model, notes = hf_model(Path(path))
        moe = model.pop("moe", {})
        shape_sets = [f"model.{k}={_literal(v)}" for k, v in model.items()]
        return shape_sets + [f"model.moe.{k}={_literal(v)}" for k, v in moe.items()], notes
    return ([f"model.preset={preset}"] if preset else []), []


def _literal(v) -> str:
    """A TOML literal for a JSON value (a table: RoPE scaling)."""
    return toml_value(v) if isinstance(v, (bool, dict)) else json.dumps(v)


def shape_of(cfg: Config, name: str = "") -> ModelShape:
    return ModelShape(cfg=cfg.model, name=name or model_label(cfg.model))


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
                    bucket_mb=cfg.parallel.bucket_mb, overlap_comm=cfg.parallel.overlap_comm,
                    reduce_bytes=bytes_of[cfg.parallel.reduce_dtype],
                    grad_bytes=bytes_of[cfg.parallel.grad_dtype],
                    dropout=cfg.model.dropout, compress=cfg.memory.compress_activations,
                    lora=_lora_of(cfg), graphed=cfg.train.cuda_graphs, compiled=cfg.train.compile,
                    compile_scope=cfg.train.compile_scope, fp8=cfg.memory.fp8, fp8_gather=cfg.memory.fp8_gather,
                    loss_chunks=cfg.memory.loss_chunks,
                    reduces_in_backward=cfg.parallel.overlap_comm and cfg.parallel.sync == "allreduce",
                    ep_dedup=cfg.parallel.ep_dedup, casts_per_micro_batch=not cfg.memory.cast_once,
                    torch_adamw=cfg.optim.kernel == "torch")


def _lora_of(cfg: Config) -> tuple:
    lc = cfg.lora
    return (lc.rank, lc.alpha, tuple(lc.targets), lc.dropout, lc.base_dtype) if lc.rank else ()


def fixed_of(cfg: Config) -> dict:
    """Layout fields the user set (TOML keys or --set), which the search must keep."""
    out = {}
    p, t, m = cfg.parallel, cfg.train, cfg.memory
    for key in ("dp", "tp", "pp", "ep", "cp", "cp_form", "zero", "offload", "num_microbatches", "virtual_stages"):
        if key in p.model_fields_set and getattr(p, key) is not None:
            out[key] = getattr(p, key)
    if "schedule" in p.model_fields_set:  # unset: the search tries 1F1B and interleaved 1F1B
        out["schedule"] = CONFIG_NAMES[p.schedule]
    if p.stage_layers is not None:
        out["stage_layers"] = tuple(p.stage_layers)
    out["tp_form"] = p.tp_form  # never searched: sequence parallelism follows it where tp > 1
    if p.sequence_parallel is not None or p.tp_form != "megatron":
        out["sequence_parallel"] = p.tp_form == "megatron" and p.sequence_parallel is not False
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
    dp = p.dp or max(1, gpus // (p.tp * p.pp * p.cp))
    per_replica = max(1, cfg.train.global_batch // dp)
    mb = min(cfg.train.micro_batch, per_replica)
    return Layout(dp=dp, tp=p.tp, pp=p.pp, ep=p.ep, zero=p.zero, micro_batch=mb,
                  num_microbatches=max(1, per_replica // mb), recompute=cfg.memory.recompute,
                  recompute_every=cfg.memory.recompute_every, offload=p.offload, sequence_parallel=p.use_sp, tp_form=p.tp_form,
                  schedule=CONFIG_NAMES[p.schedule], virtual_stages=p.virtual_stages, cp=p.cp, cp_form=p.cp_form,
                  stage_layers=tuple(p.stage_layers or ()))
