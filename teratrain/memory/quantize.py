"""Weight-only post-training quantization: the grid, round-to-nearest (RTN), 4-bit packing, the
QuantLinear that runs a quantized layer, and the on-disk format. GPTQ lives in gptq.py, the
`teratrain quantize` command in teratrain/quantize.py.

Scheme: asymmetric (min-max) uniform quantization with b bits, the grid GPTQ (Frantar et al. 2022)
uses. Each group (one output row of `group_size` consecutive input columns; group_size <= 0: the
whole row, i.e. per output channel; the last group of a row may be shorter) gets

    lo = min(min(w), 0), hi = max(max(w), 0)
    s  = (hi - lo) / (2^b - 1), rounded *up* to fp16 (what is stored)
    z  = round(-lo / s) in [0, 2^b - 1] (uint8)
    q  = clamp(round(w / s) + z, 0, 2^b - 1),      w ~= (q - z) * s

The grid's lowest point is within s/2 of lo and its highest within s/2 of hi (rounding s up only
widens it), so every weight is within s/2 of a grid point: RTN promises |w - dq(q(w))| <= s/2.
Asymmetric rather than symmetric: a symmetric 4-bit grid spends one of its 16 levels on a value the
row never reaches whenever its range is lopsided; the zero point costs one byte per group.

Stored per quantized linear (out, in): `qweight` uint8, (out, in) at 8 bits or (out, ceil(in/2)) at
4 bits (two codes per byte: column 2j in the low nibble, 2j+1 in the high one), `scales` fp16 and
`zeros` uint8, both (out, groups). Bytes per weight at group 128: 8 bits 1.023, 4 bits 0.523.

On disk, a quantized model is a folder: `model.safetensors` (the quantized model's state dict: codes,
scales, zero points, and every other tensor as trained), `quant.json` (format, bits, group size,
method, each quantized layer's shape, the safetensors file's sha256, the command's report),
`config.toml` and `tokenizer.json` of the run. Written into `<folder>.tmp`, fsynced, renamed.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from teratrain.checkpoint.format import CheckpointError
from teratrain.checkpoint.io import sha256, write_safetensors
from teratrain.config import Config, load_config
from teratrain.config_toml import to_toml
from teratrain.fsio import atomic_write_bytes, fsync_dir, fsync_file, make_dir
from teratrain.models.transformer import Transformer

QUANT_META = "quant.json"
FORMAT = "teratrain-quantized-v1"


def is_quantized(path: str | Path) -> bool:
    """Whether `path` is a `teratrain quantize` output folder (its quant.json, written last)."""
    return (Path(path) / QUANT_META).exists()


@dataclass
class QuantizedWeight:
    """One linear layer's weight on the grid: codes (out, in) uint8 (unpacked), scales fp16 and zeros
    uint8 (out, groups), `group_size` columns per group (in_features when per channel)."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.codes, self.scales, self.zeros, self.group_size).to(dtype)


def columns_per_group(group_size: int, in_features: int) -> int:
    return in_features if group_size <= 0 else min(group_size, in_features)


def grid(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (fp16 values, as fp32) and zero point (integers, as fp32) of each row of `w` (..., g),
    reduced over the last dim; shapes (..., 1)."""
    top = 2**bits - 1
    lo = w.amin(-1, keepdim=True).clamp(max=0)
    hi = w.amax(-1, keepdim=True).clamp(min=0)
    s = ((hi - lo) / top).clamp(min=2.0**-14)  # fp16's smallest normal: an all-zero row still gets a scale
    s16 = s.to(torch.float16)
    s16 = torch.where(s16.float() < s, torch.nextafter(s16, torch.full_like(s16, math.inf)), s16)  # round up
    s = s16.float()
    z = (-lo / s).round().clamp(0, top)
    return s, z


def quantize_with(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of `w` on a given grid (broadcasting scale/zero), as fp32 integers in [0, 2^b - 1]."""
    return (torch.round(w / scale) + zero).clamp(0, 2**bits - 1)


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int) -> QuantizedWeight:
    """Round-to-nearest of a (out, in) weight, group by group."""
    out, inp = w.shape
    g = columns_per_group(group_size, inp)
    groups = math.ceil(inp / g)
    wp = F.pad(w.float(), (0, groups * g - inp)).view(out, groups, g)  # zero padding: inside [lo, hi]
    s, z = grid(wp, bits)  # (out, groups, 1)
    codes = quantize_with(wp, s, z, bits).view(out, groups * g)[:, :inp]
    return QuantizedWeight(codes.to(torch.uint8), s.view(out, groups).half(), z.view(out, groups).to(torch.uint8),
                           bits, g)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """(codes - zero) * scale, fp32 (out, in)."""
    inp = codes.shape[1]
    s = scales.float().repeat_interleave(group_size, dim=1)[:, :inp]
    z = zeros.float().repeat_interleave(group_size, dim=1)[:, :inp]
    return (codes.float() - z) * s


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(out, in) uint8 codes < 16 -> (out, ceil(in/2)) uint8: even columns low nibble, odd high."""
    c = F.pad(codes, (0, codes.shape[1] % 2))
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    both = torch.stack([packed & 0x0F, packed >> 4], dim=-1)  # (out, in/2, 2)
    return both.view(packed.shape[0], -1)[:, :in_features]


class QuantLinear(nn.Module):
    """A linear layer holding its weight quantized; forward dequantizes it on the fly (one layer's
    full weight exists at a time, in the input's dtype) and calls F.linear."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, bias: bool):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.group_size = columns_per_group(group_size, in_features)
        groups = math.ceil(in_features / self.group_size)
        width = in_features if bits == 8 else math.ceil(in_features / 2)
        self.register_buffer("qweight", torch.empty(out_features, width, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=torch.float16))
        self.register_buffer("zeros", torch.empty(out_features, groups, dtype=torch.uint8))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)

    @classmethod
    def from_quantized(cls, q: QuantizedWeight, bias: torch.Tensor | None) -> "QuantLinear":
        out, inp = q.codes.shape
        with torch.device(q.codes.device):
            m = cls(inp, out, q.bits, q.group_size, bias is not None)
        m.qweight.copy_(q.codes if q.bits == 8 else pack_int4(q.codes))
        m.scales.copy_(q.scales)
        m.zeros.copy_(q.zeros)
        if bias is not None:
            m.bias.copy_(bias.detach())
        return m

    def codes(self) -> torch.Tensor:
        return self.qweight if self.bits == 8 else unpack_int4(self.qweight, self.in_features)

    def weight_fp32(self) -> torch.Tensor:
        return dequantize(self.codes(), self.scales, self.zeros, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.weight_fp32().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group_size={self.group_size}"


def block_linears(model: nn.Module) -> list[str]:
    """Names of the linear layers quantized: every nn.Linear inside the blocks (`layers.*`). The
    embedding and the output head stay as trained, as in GPTQ's experiments, and so do the routed
    experts of MoE layers (stacks, not linear layers: models/moe.py Experts)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("layers.")]


def swap_in(model: nn.Module, name: str, q: QuantizedWeight) -> QuantLinear:
    """Replace the nn.Linear at `name` by a QuantLinear holding `q` (the bias kept as it was)."""
    owner, _, leaf = name.rpartition(".")
    parent = model.get_submodule(owner)
    layer = QuantLinear.from_quantized(q, getattr(parent, leaf).bias)
    setattr(parent, leaf, layer)
    return layer


def tensor_nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------- on disk

def save_quantized(out: Path, model: nn.Module, cfg: Config, tokenizer: Path | None, meta: dict) -> Path:
    """Write the quantized `model` as a folder (module docstring), atomically; `out` must not exist."""
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"--out {out} already exists; choose a new folder (a quantized model is never "
                              "written over another).")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_dir(tmp, "--out", out)
    digest = write_safetensors(tmp / "model.safetensors", model.state_dict())
    fsync_file(tmp / "model.safetensors")
    layers = {n: {"in_features": m.in_features, "out_features": m.out_features, "bias": m.bias is not None}
              for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    atomic_write_bytes(tmp / "config.toml", to_toml(cfg).encode())
    if tokenizer is not None and tokenizer.exists():
        shutil.copy(tokenizer, tmp / "tokenizer.json")
        fsync_file(tmp / "tokenizer.json")
    info = {"format": FORMAT, **meta, "layers": layers, "sha256": digest}
    atomic_write_bytes(tmp / QUANT_META, json.dumps(info, indent=1).encode())  # written last
    tmp.rename(out)
    fsync_dir(out.parent)
    return out


def load_quantized(path: Path, device: torch.device | str = "cpu") -> tuple[Config, Transformer]:
    """The config and the model (QuantLinear layers in place) of a folder written by save_quantized."""
    path = Path(path)
    try:
        info = json.loads((path / QUANT_META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / QUANT_META} is unreadable ({e}); quantize the run again.") from None
    if info.get("format") != FORMAT:
        raise CheckpointError(f"{path} holds format {info.get('format')!r}, not {FORMAT}; quantize the run again.")
    weights = path / "model.safetensors"
    if not weights.exists() or sha256(weights) != info["sha256"]:
        raise CheckpointError(f"{weights} is missing or fails its sha256 digest; quantize the run again.")
    cfg = load_config(path / "config.toml")
    with torch.device("meta"):
        model = Transformer(cfg.model)
        for name, layer in info["layers"].items():
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, QuantLinear(layer["in_features"], layer["out_features"],
                                                                  info["bits"], info["group_size"], layer["bias"]))
    model.to_empty(device=device)
    try:
        model.load_state_dict(load_file(str(weights), device=str(device)), strict=True)
    except (SafetensorError, RuntimeError) as e:
        raise CheckpointError(f"{weights} does not fit its config.toml ({str(e).splitlines()[0]}); "
                              "quantize the run again.") from None
    if model.rope is not None:
        model.rope.reset()
    return cfg, model.eval()
