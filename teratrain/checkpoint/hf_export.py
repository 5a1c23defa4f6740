"""`teratrain export --ckpt RUN --to DIR`: a trained run as a Hugging Face model folder that
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads (the family that holds the model:
Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE or GPT-2, hf_families.py) and that gives the
same logits (their MoE layers route without a capacity limit: a model trained with one gives the same
logits where no choice overflows).

Written: config.json (hf_config.py: for a run started from a Hugging Face model, that model's
config.json with the keys the run changed; the run keeps a copy of it, SOURCE_CONFIG),
model.safetensors, or `model-0000i-of-0000n.safetensors` shards of at most --max-shard-gb with
model.safetensors.index.json, the run's tokenizer.json (and the
tokenizer_config.json of the model it was fine-tuned from, else a minimal one). The weights are read
from the logical checkpoint one HF tensor at a time (hf_weights.py maps names; GPT-2's q, k, v are
fused back into c_attn and its Conv1D weights transposed), so host memory holds one shard at most and
never the optimizer state. The folder is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch

from teratrain.checkpoint.format import CheckpointError
from teratrain.checkpoint.hf_config import source_config, to_hf
from teratrain.checkpoint.hf_weights import HF_INDEX, hf_names
from teratrain.checkpoint.holdings import PARAM
from teratrain.checkpoint.index import Index, Reader
from teratrain.checkpoint.io import find_valid, write_safetensors
from teratrain.config import ConfigError, load_config
from teratrain.data.tokenizer import EOT
from teratrain.fsio import atomic_write_bytes, make_dir
from teratrain.memory.lora import fold
from teratrain.memory.precision import DTYPES

HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def add_export_parser(sub) -> None:
    e = sub.add_parser("export", help="write a trained run as a Hugging Face model folder (transformers loads it)")
    e.add_argument("--ckpt", required=True, help="run directory (or one of its checkpoint folders)")
    e.add_argument("--to", required=True, help="folder to create")
    e.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="weight dtype (default fp32: the masters)")
    e.add_argument("--max-shard-gb", type=float, default=5.0, help="split model.safetensors above this size (GB)")
    e.add_argument("--merge", action="store_true", help="fold a LoRA run's adapters into the weights "
                   "(W + alpha/r B A); required for such a run")
    e.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    if args.max_shard_gb <= 0:
        raise ConfigError(f"--max-shard-gb must be positive, got {args.max_shard_gb}; pass e.g. --max-shard-gb 5.")
    out = export(args.ckpt, args.to, args.dtype, int(args.max_shard_gb * 1e9), args.merge)
    size = f"{out['bytes'] / 1e9:.2f} GB" if out["bytes"] >= 1e8 else f"{out['bytes'] / 1e6:.1f} MB"
    print(f"exported {out['checkpoint']} -> {out['folder']} ({out['shards']} shard(s), {size}, "
          f"{out['architecture']})")
    return 0


def export(ckpt: str | Path, to: str | Path, dtype: str = "fp32", max_shard_bytes: int = 5 * 10**9,
           merge_lora: bool = False) -> dict:
    from teratrain.generate import _locate  # a run folder or one of its checkpoint folders
    from teratrain.memory.quantize import is_quantized

    if is_quantized(ckpt):
        raise ConfigError(f"--ckpt {ckpt} is a quantized model (teratrain quantize), which a Hugging Face folder "
                          "does not hold; export the run it was made from, or sample from it "
                          "with teratrain generate.")
    run_dir, ckpt_dir = _locate(Path(ckpt))
    cfg = load_config(run_dir / "config.toml")
    if cfg.lora.rank and not merge_lora:
        raise ConfigError(f"{run_dir} trained LoRA adapters (lora.rank={cfg.lora.rank}), which a Hugging Face "
                          "folder holds only folded into the weights; pass --merge to fold them in.")
    if merge_lora and not cfg.lora.rank:
        raise ConfigError(f"--merge folds LoRA adapters into the weights, and {run_dir} trained none (lora.rank=0); "
                          "export without --merge.")
    if ckpt_dir is None:
        ckpt_dir, _ = find_valid(run_dir / "checkpoints")
    dest = Path(to)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigError(f"--to {dest} already exists and is not an empty folder; choose a new folder.")
    source = source_config(run_dir, cfg.model.init_from)
    config = to_hf(cfg.model, source)
    config["dtype" if "dtype" in config and "torch_dtype" not in config else "torch_dtype"] = HF_DTYPE_NAMES[dtype]
    groups = _by_hf_key(cfg.model)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    make_dir(tmp, "--to", dest)
    with Reader(Index(ckpt_dir)) as reader:
        shards = _plan_shards(reader.index, groups, DTYPES[dtype].itemsize, max_shard_bytes)
        weight_map, total = {}, 0
        for i, keys in enumerate(shards):
            name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {key: _hf_tensor(reader, groups[key], DTYPES[dtype], cfg.lora.alpha) for key in keys}
            write_safetensors(tmp / name, tensors, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(keys, name))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(shards) > 1:
        (tmp / HF_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    _tokenizer(run_dir, cfg, tmp)
    if dest.exists():
        dest.rmdir()
    tmp.rename(dest)
    return {"checkpoint": str(ckpt_dir), "folder": str(dest), "shards": len(shards), "bytes": total,
            "architecture": config["architectures"][0]}


def _by_hf_key(model_cfg) -> dict[str, list]:
    """HF tensor -> [(our name, Source, our row or None)] in row order (c_attn: q, k, v); a stack of
    experts' row e is HF's tensor of expert e."""
    groups: dict[str, list] = {}
    for name, src in hf_names(model_cfg).items():
        for e in range(src.experts):
            groups[src.key.format(e=e)] = [(name, src, e)]
        if not src.experts:
            groups.setdefault(src.key, []).append((name, src, None))
    return {k: sorted(v, key=lambda x: x[1].start) for k, v in groups.items()}


def _plan_shards(index: Index, groups: dict, itemsize: int, max_bytes: int) -> list[list[str]]:
    """HF keys per shard, in name order, each shard at most `max_bytes` (a larger tensor alone)."""
    shards, size = [[]], 0
    for key in sorted(groups):
        info = [index.info(PARAM, name) for name, _, _ in groups[key]]
        missing = [name for (name, _, _), i in zip(groups[key], info) if i is None]
        if missing:
            raise CheckpointError(f"{index.dir} lacks parameter {missing[0]}; {index.why_missing(missing[0])}")
        nbytes = sum(itemsize * int(torch.Size(i["shape"][1:] if row is not None else i["shape"]).numel())
                     for (_, _, row), i in zip(groups[key], info))
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _hf_tensor(reader: Reader, members: list, dtype: torch.dtype, lora_alpha: float) -> torch.Tensor:
    parts = [(_merged(reader, name, lora_alpha) if row is None else reader.read(PARAM, name, row=row)).to(dtype)
             for name, _, row in members]
    t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return t.T.contiguous() if members[0][1].transpose else t


def _merged(reader: Reader, name: str, lora_alpha: float) -> torch.Tensor:
    """A parameter's values, with its LoRA adapters folded in where the checkpoint has them
    (W + (alpha / r) B A, in fp32: a Hugging Face folder has no adapters)."""
    w = reader.read(PARAM, name)
    stem = name[: -len("weight")]
    if not name.endswith(".weight") or reader.index.info(PARAM, stem + "lora_a") is None:
        return w
    return fold(w.float(), reader.read(PARAM, stem + "lora_a"), reader.read(PARAM, stem + "lora_b"), lora_alpha)


def _tokenizer(run_dir: Path, cfg, out: Path) -> None:
    """The run's tokenizer.json; the tokenizer config of the model it started from, else a minimal one."""
    tok = run_dir / "tokenizer.json"
    if not tok.exists():
        return  # trained on pre-tokenized ids: no tokenizer to hand over
    shutil.copy(tok, out / "tokenizer.json")
    source = Path(cfg.model.init_from).expanduser() if cfg.model.init_from else None
    copied = False
    for name in TOKENIZER_FILES:
        if source is not None and (source / name).is_file():
            shutil.copy(source / name, out / name)
            copied = True
    if not copied:
        eot = EOT if EOT in json.loads(tok.read_text()).get("model", {}).get("vocab", {}) else None
        atomic_write_bytes(out / "tokenizer_config.json", json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.model.seq_len,
             **({"eos_token": eot, "bos_token": eot} if eot else {})}, indent=1).encode())
