"""Activation compression (Jain et al. 2018, "Gist: Efficient Data Encoding for Deep Neural Network
Training"), through `torch.autograd.graph.saved_tensors_hooks` on the tensors autograd keeps for backward.

Gist's two classes of encoding, as they apply to our transformer (`memory.compress_activations`):
- lossless (every mode but none): dropout masks at 1 bit per element, exact. CUDA's fused dropout
  saves a bool mask (1 byte -> 1 bit); the CPU kernel saves a float mask of zeros and 1/(1-p) (4 bytes
  -> 1 bit plus that one value, verified exact before it is used). Gist's other lossless encodings
  (binarized ReLU->pool, sparse ReLU outputs) need ReLU; SiLU/GELU backward needs the input's value,
  so nothing else in our blocks has an exact smaller form.
- delayed precision reduction (int8, fp8): the forward computes at full precision, and only the copy
  stashed for backward is stored in 8 bits (int8, or fp8 e4m3), one fp32 scale per block of BLOCK
  consecutive elements (absmax / 127, or / 448), decoded when backward uses it. Applied to tensors
  saved inside the block stack (`model.layers`, the part that grows with depth); the head's fp32
  log-softmax (its backward is softmax - one_hot, sensitive to absolute log-probability errors) and
  the embedding side stay exact.

Never encoded: parameters, views of them, autocast's casts of them (weights, not activations), module
buffers (RoPE tables), integer tensors. ZeRO-3 frees a saved parameter's storage after forward and
re-gathers it before backward, so a saved parameter must stay the very tensor the engine refills.
Inside a recomputed region `torch.utils.checkpoint`'s own hooks take over (nothing is saved there);
the region's inputs, which it does save, are encoded like any other saved tensor.

Under pipeline parallelism a stage's forward starts from a leaf (the received activation, or the
embedding output cut off from the graph, parallel/pipeline/stage.py): `starts_from` marks it as the
activation it stands for, so it is encoded exactly as the same tensor is in one process, where it
is an intermediate; each chunk's blocks are watched like the model's block stack (`watch_blocks`),
and every forward of a micro-batch is one session.

A tensor saved several times (the norm output read by wq, wk and wv, as (B*T, d) views) is encoded
once: views are stored as (encoded root, size, stride, offset), the root in memory order.
Held bytes per element: bool mask 1 -> 1/8, CPU float mask 4 -> 1/8, block activation k -> 1 + 4/BLOCK
(each tensor padded up to whole blocks; bits to whole bytes). Tensors under BLOCK elements stay as
they are. planner/activations.py predicts these bytes per saved tensor.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from teratrain.compat import FLOAT8_E4M3
from teratrain.config_base import ConfigError

MODES = ("none", "lossless", "int8", "fp8")
BLOCK = 128  # elements per scale
_TOP = {"int8": 127.0, "fp8": 448.0}  # largest code magnitude: int8, and e4m3's largest finite value


@dataclass(eq=False)
class Encoded:
    """One root tensor's saved form, flattened in memory order."""

    kind: str  # "bits" (bool), "bits_value" (zeros and one value), "int8", "fp8"
    codes: torch.Tensor  # uint8 bits, int8 or fp8 codes
    scales: torch.Tensor | None  # (blocks,) fp32 scales, or the 0-d value of a bits_value mask
    numel: int
    dtype: torch.dtype

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes] + ([self.scales] if self.scales is not None else [])

    def decode(self) -> torch.Tensor:
        """The root's elements in memory order, 1-D, in its dtype."""
        if self.kind in ("bits", "bits_value"):
            bits = unpack_bits(self.codes, self.numel)
            return bits if self.kind == "bits" else torch.where(bits, self.scales, torch.zeros((), dtype=self.dtype,
                                                                                             device=bits.device))
        x = _kernel(_dequantize, self.codes.device)(self.codes.view(-1, BLOCK), self.scales, self.dtype)
        return x.view(-1)[:self.numel]


@dataclass(eq=False)
class SavedView:
    """What autograd holds for an encoded tensor: its root's encoding and where the tensor sits in it."""

    root: Encoded
    size: torch.Size
    stride: tuple[int, ...]
    offset: int

    def tensors(self) -> list[torch.Tensor]:
        return self.root.tensors()


def held_tensors(packed) -> list[torch.Tensor]:
    """The tensors a packed object keeps alive (for byte counts); a tensor subclass that wraps others
    (torchao's float8 tensor: its bytes and its scale) by the tensors inside it."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    out = []
    for t in packed.tensors() if isinstance(packed, SavedView) else [packed]:
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                out += held_tensors(getattr(t, name))
        else:
            out.append(t)
    return out


class ActivationCodec:
    """Encodes saved tensors in one of MODES; `session()` wraps one forward pass."""

    def __init__(self, mode: str, model: nn.Module):
        if mode not in MODES or mode == "none":
            raise ValueError(f"compression mode {mode!r} is not one of {MODES[1:]}")
        if mode == "fp8" and FLOAT8_E4M3 is None:
            raise ConfigError("memory.compress_activations=fp8 needs torch.float8_e4m3fn, which this torch build "
                              "lacks; use memory.compress_activations=int8.")
        self.mode, self.lossy = mode, mode in _TOP
        self.model = weakref.ref(model)  # the model holds the codec: no cycle
        self.depth = 0  # > 0 while the block stack runs
        self._cache: dict[int, tuple] = {}
        self._state_ptrs: set[int] = set()
        self._inputs: list[torch.Tensor] = []  # leaves this forward starts from (pipeline stages)
        layers = getattr(model, "layers", None)
        if layers is not None:
            self.watch(layers)

    def watch(self, blocks: nn.Module) -> None:
        """Count `blocks` (a block stack, or a pipeline chunk's part of it) as the inside of the stack."""
        blocks.register_forward_pre_hook(lambda *_: self._blocks(+1))
        blocks.register_forward_hook(lambda *_: self._blocks(-1))

    def _blocks(self, delta: int) -> None:
        self.depth += delta

    def starts_from(self, x: torch.Tensor) -> None:
        """The forward under way starts from the leaf `x`, an activation (not model state)."""
        self._inputs.append(x)

    def _is_input(self, root: torch.Tensor) -> bool:
        return any(root is x for x in self._inputs)

    @contextlib.contextmanager
    def session(self):
        """Encode what this forward saves (enter around forward and loss, not backward)."""
        model = self.model()
        self._state_ptrs = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]} - {0}
        self._cache, self.depth, self._inputs = {}, 0, []
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield self
        finally:
            self._cache, self._state_ptrs, self._inputs = {}, set(), []

    # ---- the hooks
    def pack(self, t: torch.Tensor):
        root = t._base if t._base is not None else t
        if root.numel() < BLOCK or not (root.is_floating_point() or root.dtype == torch.bool):
            return t  # small tensors (the loss, per-row statistics of tiny batches) are not worth a code
        if not self._is_input(root) and _is_model_state(root, self._state_ptrs):
            return t
        if not _dense(root) or not _inside(t, root):
            return t
        hit = self._cache.get(id(root))
        if hit is not None and hit[0]() is root and hit[1] == root._version:
            enc = hit[2]
        else:
            enc = self._encode(root)
            self._cache[id(root)] = (weakref.ref(root), root._version, enc)
        if enc is None:
            return t
        return SavedView(enc, t.size(), t.stride(), t.storage_offset() - root.storage_offset())

    @staticmethod
    def unpack(packed):
        if not isinstance(packed, SavedView):
            return packed
        flat = packed.root.decode()
        return flat.as_strided(packed.size, packed.stride, packed.offset)

    def _encode(self, root: torch.Tensor) -> Encoded | None:
        flat = torch.as_strided(root, (root.numel(),), (1,), root.storage_offset())  # memory order
        if root.dtype == torch.bool:
            return Encoded("bits", pack_bits(flat), None, flat.numel(), root.dtype)
        if root.grad_fn is None and not self._is_input(root):  # not differentiable: a mask or a statistic
            value = _mask_value(flat) if root.device.type == "cpu" else None
            if value is None:
                return None
            return Encoded("bits_value", pack_bits(flat != 0), value, flat.numel(), root.dtype)
        if self.lossy and self.depth > 0:
            codes, scales = quantize_blocks(flat, self.mode)
            return Encoded(self.mode, codes, scales, flat.numel(), root.dtype)
        return None


# ---------------------------------------------------------------- encodings

def _shifts(device) -> torch.Tensor:
    return torch.arange(8, dtype=torch.uint8, device=device)


def pack_bits(flat: torch.Tensor) -> torch.Tensor:
    """(n,) bool -> (ceil(n/8),) uint8, element 8i+j in bit j of byte i."""
    b = F.pad(flat.to(torch.uint8), (0, -flat.numel() % 8)).view(-1, 8)
    return (b << _shifts(flat.device)).sum(1, dtype=torch.uint8)


def unpack_bits(codes: torch.Tensor, numel: int) -> torch.Tensor:
    return ((codes[:, None] >> _shifts(codes.device)) & 1).view(-1)[:numel].bool()


def quantize_blocks(flat: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(n,) float -> codes (ceil(n/BLOCK)*BLOCK,) int8 or fp8, scales (ceil(n/BLOCK),) fp32 with
    x ~= code * scale; scale = absmax/127 (int8: |error| <= scale/2) or absmax/448 (e4m3: 3 mantissa
    bits, relative error <= 2^-4 above e4m3's subnormal range)."""
    x = flat if flat.numel() % BLOCK == 0 else F.pad(flat, (0, -flat.numel() % BLOCK))
    with torch.no_grad():
        codes, scale = _kernel(_quantize, flat.device)(x.view(-1, BLOCK), _TOP[fmt], fmt == "int8")
    return codes.view(-1), scale.view(-1)


def _quantize(x: torch.Tensor, top: float, int8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, BLOCK) -> codes, (blocks, 1) scales: absmax per block, scaled, rounded (int8) or cast (e4m3)."""
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    y = (xf / scale).clamp(-top, top)
    return (y.round().to(torch.int8) if int8 else y.to(FLOAT8_E4M3)), scale


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scales.view(-1, 1)).to(dtype)


_COMPILED: dict = {}


def _kernel(fn, device: torch.device):
    """`fn` itself on CPU; on a GPU, compiled once (dynamic shapes) into a fused kernel: the eager
    version makes ~6 passes over fp32 temporaries of each saved activation, which doubled a llama-1b
    step on an H200."""
    if device.type != "cuda":
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


def _mask_value(flat: torch.Tensor) -> torch.Tensor | None:
    """The c of a tensor holding only 0 and one value c (a CPU dropout mask), or None."""
    c = flat.max()
    if not torch.equal(torch.where(flat != 0, c, torch.zeros_like(c)), flat):
        return None
    return c.clone()


# ---------------------------------------------------------------- what is never encoded

def _is_model_state(root: torch.Tensor, state_ptrs: set[int]) -> bool:
    """Parameters (also ZeRO-3's, whose storage comes and goes), autocast's casts of them, buffers."""
    if isinstance(root, nn.Parameter) or (root.requires_grad and root.grad_fn is None):
        return True
    fn = root.grad_fn
    if fn is not None and type(fn).__name__ == "ToCopyBackward0":
        src = fn.next_functions[0][0]
        if src is not None and type(src).__name__ == "AccumulateGrad":
            return True
    return root.untyped_storage().data_ptr() in state_ptrs


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: t's elements are exactly storage[offset : offset + numel]."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _inside(t: torch.Tensor, root: torch.Tensor) -> bool:
    lo = t.storage_offset() - root.storage_offset()
    hi = lo + sum((sz - 1) * st for sz, st in zip(t.shape, t.stride()) if sz > 0)
    return t.numel() > 0 and lo >= 0 and hi < root.numel()


# ---------------------------------------------------------------- applying it

def apply_compression(model: nn.Module, mode: str) -> nn.Module:
    """Attach a codec for `mode` (a no-op for none); the training step enters `compressed_saves`."""
    if mode != "none":
        model.activation_codec = ActivationCodec(mode, model)
    return model


def compressed_saves(model: nn.Module):
    """Context for one forward pass (+ loss): encodes what autograd saves, if the model has a codec.
    Gives the codec (None without one)."""
    codec = getattr(model, "activation_codec", None)
    return codec.session() if codec is not None else contextlib.nullcontext()


def watch_blocks(model: nn.Module, blocks: nn.Module) -> None:
    """A pipeline chunk's blocks run instead of `model.layers`: encode inside them as inside the stack."""
    codec = getattr(model, "activation_codec", None)
    if codec is not None:
        codec.watch(blocks)
