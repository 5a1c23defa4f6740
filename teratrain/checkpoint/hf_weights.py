"""Hugging Face weights <-> teratrain parameters: one name mapping, read by `model.init_from` (each
rank reads its slices) and written by `teratrain export`.

Each of our parameters is a block of rows of one HF tensor, possibly transposed:
    Llama   model.layers.{i}.self_attn.q_proj.weight -> layers.{i}.attention.wq.weight (same layout: HF's
            Llama checkpoints already hold q/k in the rotate-half RoPE order our Rotary uses); Qwen2's
            q/k/v biases and Qwen3's ....self_attn.q_norm.weight -> layers.{i}.attention.q_norm.weight alike
    Mixtral model.layers.{i}.block_sparse_moe.gate.weight -> layers.{i}.feed_forward.router.weight,
            ....block_sparse_moe.experts.{e}.w1.weight -> row e of layers.{i}.feed_forward.experts.w1 (w2,
            w3 alike): the layout transformers 4 and 5 both save (5 fuses the experts only in memory)
    Qwen2-MoE, Qwen3-MoE, OLMoE  ....mlp.gate.weight -> ....feed_forward.router.weight, ....mlp.experts.{e}.
            gate_proj / up_proj / down_proj -> row e of ....experts.w1 / w3 / w2; Qwen2-MoE's mlp.shared_expert.*
            -> feed_forward.shared_expert.* and mlp.shared_expert_gate -> feed_forward.shared_expert_gate
    GPT-2   transformer.h.{i}.attn.c_attn.weight (d, 3d), a Conv1D stored (in, out) -> transposed, rows
            [0, d) are wq, [d, 2d) wk, [2d, 3d) wv; the other Conv1D weights (c_proj, c_fc) are transposed;
            transformer.wpe.weight -> pos_embeddings.weight, its first model.seq_len rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from teratrain.checkpoint.format import CheckpointError
from teratrain.checkpoint.hf_families import moe_type
from teratrain.checkpoint.pieces import PieceSource

HF_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Source:
    key: str  # HF tensor name
    transpose: bool = False  # a GPT-2 Conv1D weight, stored (in, out)
    start: int = 0  # our tensor is rows [start, start + rows) of the (transposed) HF tensor
    experts: int = 0  # a stack of this many experts (models/moe.py): row e of dim 0 is HF tensor key.format(e=e)


def hf_names(m) -> dict[str, Source]:
    """Our global parameter name -> where it lives in a HF checkpoint of model config `m`."""
    out: dict[str, Source] = {}
    if m.arch == "gpt2":
        out["tok_embeddings.weight"] = Source("transformer.wte.weight")
        out["pos_embeddings.weight"] = Source("transformer.wpe.weight")
        d = m.d_model
        for i in range(m.n_layers):
            hf, ours = f"transformer.h.{i}", f"layers.{i}"
            for leaf in ("weight", "bias"):
                out[f"{ours}.attention_norm.{leaf}"] = Source(f"{hf}.ln_1.{leaf}")
                out[f"{ours}.ffn_norm.{leaf}"] = Source(f"{hf}.ln_2.{leaf}")
                for j, proj in enumerate(("wq", "wk", "wv")):
                    out[f"{ours}.attention.{proj}.{leaf}"] = Source(f"{hf}.attn.c_attn.{leaf}", leaf == "weight", j * d)
                for theirs, mine in (("attn.c_proj", "attention.wo"), ("mlp.c_fc", "feed_forward.w1"),
                                     ("mlp.c_proj", "feed_forward.w2")):
                    out[f"{ours}.{mine}.{leaf}"] = Source(f"{hf}.{theirs}.{leaf}", leaf == "weight")
        out["norm.weight"], out["norm.bias"] = Source("transformer.ln_f.weight"), Source("transformer.ln_f.bias")
    else:
        out["tok_embeddings.weight"] = Source("model.embed_tokens.weight")
        leaves = ("weight", "bias") if m.use_bias else ("weight",)
        for i in range(m.n_layers):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            out[f"{ours}.attention_norm.weight"] = Source(f"{hf}.input_layernorm.weight")
            out[f"{ours}.ffn_norm.weight"] = Source(f"{hf}.post_attention_layernorm.weight")
            pairs = [("self_attn.q_proj", "attention.wq"), ("self_attn.k_proj", "attention.wk"),
                     ("self_attn.v_proj", "attention.wv"), ("self_attn.o_proj", "attention.wo")]
            if m.moe.is_moe_layer(i):
                pairs += _moe_modules(m)
                out.update(_expert_stacks(m, hf, ours, leaves))
            else:
                pairs += [("mlp.gate_proj", "feed_forward.w1"), ("mlp.up_proj", "feed_forward.w3"),
                          ("mlp.down_proj", "feed_forward.w2")]
            for theirs, mine in pairs:
                qkv = m.qkv_bias and mine in ("attention.wq", "attention.wk", "attention.wv")
                for leaf in ("weight", "bias") if qkv else leaves:
                    out[f"{ours}.{mine}.{leaf}"] = Source(f"{hf}.{theirs}.{leaf}")
            if m.qk_norm != "none":  # Qwen3's per-head and OLMoE's whole-width norms: the same names
                for x in "qk":
                    out[f"{ours}.attention.{x}_norm.weight"] = Source(f"{hf}.self_attn.{x}_norm.weight")
        out["norm.weight"] = Source("model.norm.weight")
    if not m.tie_embeddings:
        out["output.weight"] = Source("lm_head.weight")
    return out


def _moe_modules(m) -> list[tuple[str, str]]:
    """(HF module, ours) of an MoE layer's router and shared experts: Mixtral's block_sparse_moe.gate, the
    others' mlp.gate, Qwen2-MoE's mlp.shared_expert (one MLP) and mlp.shared_expert_gate (d -> 1)."""
    if moe_type(m) == "mixtral":
        return [("block_sparse_moe.gate", "feed_forward.router")]
    pairs = [("mlp.gate", "feed_forward.router")]
    if m.moe.shared_experts:
        pairs += [(f"mlp.shared_expert.{theirs}", f"feed_forward.shared_expert.{w}") for theirs, w in _HF_MLP]
        pairs.append(("mlp.shared_expert_gate", "feed_forward.shared_expert_gate"))
    return pairs


_HF_MLP = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))


def _expert_stacks(m, hf: str, ours: str, leaves: tuple[str, ...]) -> dict[str, Source]:
    """Our stacks of the routed experts (weights w1 w3 w2, biases b1 b3 b2) -> HF's tensors, one an expert:
    Mixtral's block_sparse_moe.experts.{e}.w1 / w3 / w2, the others' mlp.experts.{e}.gate_proj / up_proj /
    down_proj (the layout transformers 4 and 5 both save)."""
    mixtral = moe_type(m) == "mixtral"
    prefix = f"{hf}.block_sparse_moe.experts" if mixtral else f"{hf}.mlp.experts"
    out = {}
    for theirs, w in ((w, w) for _, w in _HF_MLP) if mixtral else _HF_MLP:
        for leaf in leaves:
            mine = w if leaf == "weight" else "b" + w[1:]
            out[f"{ours}.feed_forward.experts.{mine}"] = Source(f"{prefix}.{{e}}.{theirs}.{leaf}",
                                                                experts=m.moe.num_experts)
    return out


class HFWeights:
    """The tensors of a HF model folder (one model.safetensors, or shards named by its index)."""

    def __init__(self, folder: str | Path):
        self.dir = Path(folder).expanduser()
        index = self.dir / HF_INDEX
        if index.is_file():
            files = json.loads(index.read_text())["weight_map"]
        else:
            files = {}
            for f in sorted(self.dir.glob("*.safetensors")):
                with _open(f) as h:
                    files.update({k: f.name for k in h.keys()})
        if not files:
            raise CheckpointError(f"model.init_from '{folder}' holds no *.safetensors weights; save the model with "
                                  "save_pretrained(..., safe_serialization=True).")
        self.files, self._open = files, {}

    def _resolve(self, key: str) -> str:
        """The stored name: as given, or without its `transformer.`/`model.` prefix (the original GPT-2 files)."""
        if key in self.files:
            return key
        short = key.split(".", 1)[1]
        if short in self.files:
            return short
        raise CheckpointError(f"model.init_from '{self.dir}' lacks the weight {key}; it is not a checkpoint of the "
                              "model its config.json describes.")

    def slice(self, key: str):
        key = self._resolve(key)
        name = self.files[key]
        if name not in self._open:
            self._open[name] = _open(self.dir / name)
        try:
            return self._open[name].get_slice(key)
        except SafetensorError as e:
            raise _unreadable(self.dir / name, e) from None

    def read(self, src: Source, lo: tuple[int, ...], hi: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """Region [lo, hi) of our tensor of global shape `shape` that `src` holds."""
        if src.experts:  # one HF tensor an expert: rows [lo[0], hi[0]) of the stack
            return torch.stack([self.read(replace(src, key=src.key.format(e=e), experts=0), lo[1:], hi[1:], shape[1:])
                                for e in range(lo[0], hi[0])])
        sl = self.slice(src.key)
        stored = tuple(sl.get_shape())
        want = shape[::-1] if src.transpose else shape
        rows_dim = 1 if src.transpose else 0
        fits = len(stored) == len(shape) and all(
            (s >= w + src.start) if d == rows_dim else s == w for d, (s, w) in enumerate(zip(stored, want)))
        if not fits:
            raise CheckpointError(f"model.init_from: {src.key} has shape {list(stored)}, which cannot hold a "
                                  f"{list(shape)} parameter; its config.json does not match its weights.")
        a, b = list(lo), list(hi)
        a[0], b[0] = a[0] + src.start, b[0] + src.start
        if src.transpose:
            return sl[slice(a[1], b[1]), slice(a[0], b[0])].T
        return sl[tuple(slice(x, y) for x, y in zip(a, b))]


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise _unreadable(path, e) from None


def _unreadable(path: Path, e: Exception) -> CheckpointError:
    return CheckpointError(f"model.init_from: {path} is not a readable safetensors file ({e}); it may be "
                           "truncated: download or save it again.")


class HFInit(PieceSource):
    """Initial values from a Hugging Face model folder: each rank reads just the pieces it holds."""

    def __init__(self, folder: str, model_cfg):
        self.weights, self.sources = HFWeights(folder), hf_names(model_cfg)

    def region(self, name, start, stop, shape):
        src = self.sources.get(name)
        if src is None:
            raise CheckpointError(f"model.init_from: no Hugging Face weight maps to parameter {name}.")
        return self.weights.read(src, start, stop, shape)
