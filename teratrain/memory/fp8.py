"""FP8 training of the block linears, through torchao's float8 training GEMMs (Micikevicius et al. 2022,
"FP8 Formats for Deep Learning"; torchao.float8, as torchtitan uses it).

Each block linear y = x W^T + b runs its three GEMMs on float8 operands with dynamic scales computed
from each operand's absolute maximum in the same step (no history, nothing kept between steps):
- `tensorwise`: one scale per tensor; inputs and weights in e4m3, output gradients in e5m2 (wider range).
- `rowwise`: one scale per row of each operand, all e4m3, scales rounded down to powers of 2: closer to
  bf16's numerics, a little slower (each operand is cast twice, once per GEMM it enters along its rows).
The output GEMM accumulates with the tensor cores' fast accumulation, the two gradient GEMMs in full
fp32 (torchao's recipes). An MoE layer's shared experts (models/moe.py), a dense MLP every token passes
through, run in float8 as the dense MLP does. Everything else stays as bf16 training has it: the embedding,
the output head, norms, attention's softmax(QK^T)V, MoE routers, the shared experts' gate and the routed
experts (the start-up summary says so), fp32 master weights and optimizer state. The routed experts' grouped
GEMM would need torchao's float8 grouped GEMM (torchao.prototype.moe_training, rowwise), a prototype with no
emulated mode to check it on CPU, which ran an MoE layer's experts no faster than bf16's grouped GEMM on one
H100 (compiled 0.84-0.85x at 8 experts of width 2,816, 0.57-0.61x at 128 of 768, 1.00x at 8 of 14,336;
bench/fp8.py --experts-only). Checkpoints hold no float8 tensor: a run saved in bf16 resumes in fp8 and back.

Float8 pays where GEMMs are large: each cast is an amax reduction plus a scaled copy, memory traffic that
only torch.compile fuses into the neighbouring kernels. Eager FP8 is slower than eager bf16; run it with
train.compile (bench/README.md, "FP8 training").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from teratrain import compat
from teratrain.config_base import ConfigError
from teratrain.models.grouped import held_or_saved, take_held
from teratrain.models.layers import to_compute_dtype

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (sm89), Hopper (sm90) and later
ALIGN = 16  # torch._scaled_mm: a weight's both dimensions multiples of 16


def fp8_problem(recipe: str, emulate: bool, device: torch.device) -> str | None:
    """Why this run cannot train its block linears in float8 here (one sentence with the fix), or None."""
    if recipe == "none":
        return None
    try:
        compat.torchao_float8()
    except ImportError:
        return (f"memory.fp8={recipe} runs through torchao's float8 training, and torchao is not installed; "
                "install it (pip install 'teratrain[fp8]') or set memory.fp8=none.")
    if emulate:
        return None
    if device.type != "cuda":
        return (f"memory.fp8={recipe} needs a GPU with float8 tensor cores (compute capability 8.9 or higher: "
                f"L4/L40, H100, H200, B200) and this run is on {device.type}; set memory.fp8=none "
                "(memory.fp8_emulate=true emulates the float8 GEMMs in high precision, slowly, to check numerics).")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return (f"memory.fp8={recipe} needs float8 tensor cores (compute capability 8.9 or higher) and "
                f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}; set memory.fp8=none.")
    return None


class Fp8Gemm:
    """x W^T (+ b) with each of the linear's three GEMMs on float8 operands (torchao's autograd function
    `matmul_with_hp_or_float8_args`: the forward casts x and W, the backward the output gradient, and
    each GEMM runs torch._scaled_mm, or its high-precision emulation with `emulate`). x is cast to the
    autocast dtype first (bf16), as F.linear under autocast would; W is cast to float8 straight from its
    stored dtype (the fp32 master where parameters are fp32), in forward and again in backward for the
    input gradient: the function saves the weight itself, no copy of it (autocast would save a bf16 one).
    (Saving the forward's float8 weight for the backward instead, 1 byte a weight, measured no faster
    compiled on one H200: 414.0 against 411.6 ms a step, bench/fp8.py --recast's experiment.)
    The output is in x's compute dtype."""

    def __init__(self, recipe: str, emulate: bool):
        self.recipe = recipe
        self.matmul, self.config, self.mm_config = compat.float8_linear(recipe, emulate)
        _, _, self.float8_tensor, self.weight_role = compat.float8_weight_cast()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 float8: Float8Weight | None = None) -> torch.Tensor:
        """`float8`: the weight already in float8 (ZeRO-3's gather, parallel/zero_fp8.py, or the step's
        cast, memory/step_casts.py), used as it is (torchao casts no operand it finds in float8); `weight`
        then only receives the gradient."""
        x = to_compute_dtype(x)  # (.., d_in) bf16 under autocast
        if float8 is not None and float8.acc is not None:  # the step's cast carrying the gradient so far
            weight = _CarriedGrad.apply(weight, float8.acc)
            float8.acc = None  # the node holds it now, and frees it once summed
        w = weight if float8 is None else _Float8Operand.apply(weight, float8, self)
        y = self.matmul.apply(x, w.t(), self.mm_config, self.config)  # (.., d_out)
        return y if bias is None else y + bias.to(y.dtype)


@dataclass
class Float8Weight:
    """A float8 linear's weight cast before its forward: as ZeRO-3 gathered it (parallel/zero_fp8.py: its
    e4m3 elements a view of the gathered block's bytes, empty between gathers; its scale a 0-d view), or
    as the step cast it for all its micro-batches (memory/step_casts.py)."""

    data: torch.Tensor  # (d_out, d_in) float8_e4m3fn
    scale: torch.Tensor  # () float32: data = saturate(weight * scale)
    acc: torch.Tensor | None = None  # the step's cast: the weight's gradient so far (step_casts.py take_grads)


class TensorwiseCast:
    """torchao's tensorwise float8 cast (its amax_to_scale and to_fp8_saturated), looked up once, so that a
    cast through it holds no lookup torch.compile would break its graph on. ZeRO-3 casts its weight shards
    with it (parallel/zero_fp8.py), the step its whole weights (memory/step_casts.py)."""

    def __init__(self):
        self.to_scale, self.saturate, _, _ = compat.float8_weight_cast()

    def scale(self, amax: torch.Tensor) -> torch.Tensor:
        """The scale of a tensor whose absolute maximum is `amax`."""
        return self.to_scale(amax, compat.FLOAT8_E4M3)

    def e4m3(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """values in e4m3 at `scale`, saturated: torchao's _ToFloat8ConstrFunc (the values in fp32 times it)."""
        return self.saturate(values.to(torch.float32) * scale, compat.FLOAT8_E4M3)

    def __call__(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight's e4m3 bytes, its scale): the bytes torchao's own cast of it makes (its amax in the
        weight's dtype, as torchao's tensor_to_amax)."""
        scale = self.scale(weight.abs().max().to(torch.float32))
        return self.e4m3(weight, scale), scale

    def many(self, weights: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each weight's cast, as `__call__`: compiled, one call for all of them (memory/step_casts.py)."""
        return [self(w) for w in weights]

    def many_into(self, weights: list[torch.Tensor], held: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """`many`'s casts written into `held`, each weight's (bytes, scale) as an earlier cast made them: compiled,
        the cast's kernels store into them, with no new tensors to copy from (memory/step_casts.py, under CUDA
        graphs)."""
        for w, (data, scale) in zip(weights, held):
            made, s = self(w)
            data.copy_(made)
            scale.copy_(s)


class _Float8Operand(torch.autograd.Function):
    """The float8 weight made before the forward as torchao's Float8TrainingTensor, standing for `weight`:
    forward reads nothing of `weight` (under ZeRO-3 its storage is empty), backward hands the weight's
    gradient to it unchanged, as torchao's own cast does (`_ToFloat8ConstrFunc`)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, float8: Float8Weight, gemm: Fp8Gemm):
        return gemm.float8_tensor(float8.data, float8.scale, weight.dtype, linear_mm_config=gemm.mm_config,
                                  gemm_input_role=gemm.weight_role)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _CarriedGrad(torch.autograd.Function):
    """`weight` itself forward; backward hands it `acc` (the gradient the weight had before this
    micro-batch, taken off it by memory/step_casts.py `take_grads`) plus the micro-batch's, which autograd
    adopts as the weight's gradient: the cast of the bf16 gradient to the weight's dtype and the accumulation
    one pass (10 bytes a weight where they moved 18), as for the stacked experts (models/grouped.py
    MadeCast). Apart from _Float8Operand, whose output is a float8 tensor: tracing its backward, torch.compile
    stands a float8 tensor for the gradient, which an addition does not take. Eager, the node holds `acc`
    and drops it as it makes the sum (models/grouped.py held_or_saved)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, acc: torch.Tensor):
        ctx.held = held_or_saved(ctx, [acc])
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        (acc,) = take_held(ctx)
        return acc + grad, None


class Fp8Linear(nn.Module):
    """An nn.Linear whose GEMMs run in float8 (Fp8Gemm). It holds the very parameters of the layer it
    replaces, under the same names, so placements, checkpoints and engines see no difference."""

    def __init__(self, linear: nn.Module, gemm: Fp8Gemm):
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape  # the local (out, in)
        self.weight, self.bias, self.gemm = linear.weight, linear.bias, gemm

    float8_weight: Float8Weight | None = None  # set by ZeRO-3's float8 gathers and the step's casts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight, self.bias, self.float8_weight)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, fp8={self.gemm.recipe}"


def aligned(weight_shape: tuple[int, ...]) -> bool:
    """Can torch._scaled_mm take this (local) weight: both dimensions multiples of 16?"""
    return all(n % ALIGN == 0 for n in weight_shape[-2:])


def apply_fp8(model: nn.Module, cfg, device: torch.device) -> None:
    """Run the block linears of `model` (attention q/k/v/o, the dense MLP and an MoE layer's shared experts;
    tensor-parallel pieces included, after parallel/tensor.py swapped them in) in float8. Routers, the
    shared experts' gate and the routed experts keep bf16. A linear whose local weight torch._scaled_mm
    cannot take (a dimension not a multiple of 16) keeps bf16 too, emulated or not, so a CPU check runs
    what a GPU runs (`note` counts each kind for the start-up summary; planner/weight_casts.py
    `fp8_linears` applies the same rule to a shape)."""
    m = cfg.memory
    why = fp8_problem(m.fp8, m.fp8_emulate, device)
    if why:
        raise ConfigError(why)
    gemm = Fp8Gemm(m.fp8, m.fp8_emulate)
    for parent, name, child, routed in list(_block_linears(model)):
        if routed or not aligned(tuple(child.weight.shape)):
            continue
        if type(child) is nn.Linear:
            setattr(parent, name, Fp8Linear(child, gemm))
        else:
            child.gemm = gemm  # a tensor-parallel piece (parallel/tp_layers.py) calls it itself


def note(model: nn.Module, recipe: str, compiled: bool) -> str:
    """The start-up summary's line: how many block linears run in float8 and what stays in bf16, and
    that an eager run pays for its casts (each is several unfused kernels: on one H200 an eager fp8 step
    took 1.8x the eager bf16 step, a compiled one 0.89x the compiled bf16 step; bench/README.md,
    "FP8 training")."""
    from teratrain.models.moe import moe_layers

    fp8 = other = 0
    for _, _, child, routed in _block_linears(model):
        if not routed and getattr(child, "gemm", None) is not None:
            fp8 += 1
        elif not routed:
            other += 1
    layers = [moe for _, moe in moe_layers(model)]
    gates = ", shared-expert gates" if any(moe.shared_expert_gate is not None for moe in layers) else ""
    moe = f"{len(layers)} MoE layer" + ("s" if len(layers) > 1 else "")
    kept = [f"the routers{gates} and routed experts of {moe}" if layers else "",
            f"{other} linears with a dimension not a multiple of {ALIGN}" if other else ""]
    kept = ", ".join(k for k in kept if k)
    line = (f"fp8: {fp8} block linears in float8 ({recipe} scales, torchao); " + (f"{kept}, " if kept else "")
            + "the embedding, the head, norms and attention's softmax(QK^T)V in bf16")
    if not compiled:
        line += ("; eager, each float8 cast runs as several kernels and the step is slower than bf16's: "
                 "set train.compile=true")
    return line


def gathers_in_float8(zero: int, recipe: str, gather: bool) -> bool:
    """Does ZeRO-3 gather the float8 linears' weights in float8 (memory.fp8_gather; parallel/zero_fp8.py)?
    Only under tensorwise scales: rowwise casts each weight two ways, which no single float8 copy serves."""
    return zero == 3 and recipe == "tensorwise" and gather


def float8_linears(model: nn.Module) -> list[nn.Module]:
    """The block linears whose GEMMs run in float8 (Fp8Linear, or a tensor-parallel piece given a gemm)."""
    return [child for _, _, child, routed in _block_linears(model)
            if not routed and getattr(child, "gemm", None) is not None]


def float8_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights `apply_fp8` runs in float8 where their local shape is `aligned`: the block linears' but
    the routers', the shared experts' gate's and the routed experts' (the planner reads them off its meta
    model, planner/local.py)."""
    return [child.weight for _, _, child, routed in _block_linears(model) if not routed]


def _block_linears(model: nn.Module):
    """(parent, name, linear, routed?) for every linear layer of every block: nn.Linear, Fp8Linear, or a
    tensor-parallel piece that takes a `gemm` (parallel/tp_layers.py; the shared experts' partial row-parallel
    w2 among them). routed: inside an MoE layer but outside its shared experts' MLP (the router, the
    shared experts' gate), kept in bf16 as the routed experts are."""
    from teratrain.models.moe import MoE
    from teratrain.models.protocol import blocks

    for _, block in blocks(model):
        routed = set()
        for moe in (m for m in block.modules() if isinstance(m, MoE)):
            shared = set() if moe.shared_expert is None else {id(x) for x in moe.shared_expert.modules()}
            routed |= {id(x) for x in moe.modules() if id(x) not in shared}
        for parent in block.modules():
            for name, child in parent.named_children():
                if type(child) in (nn.Linear, Fp8Linear) or hasattr(child, "gemm"):
                    yield parent, name, child, id(child) in routed
