"""Every expert's matmuls as one grouped GEMM per weight (compiled, w1 and w3 one: `fuses_gate_up`) over
exactly the rows routed to it (MegaBlocks, Gale et al. 2023: dropless MoE as grouped matmuls over a
permutation of the tokens, instead of one matmul per expert or a padded (experts, capacity, d) batch).
The rows come laid out by expert (models/permute.py): group g's rows are [offsets[g-1], offsets[g]) of
the buffer.

Nothing here reads a device value back to the host (only the loop fallback reads the group offsets
back, once per call: free on a CPU), so the host can queue the next layers while the GPU works.

Rows the GEMM sees but nobody reads. Padding rows (between a group's last row and the next aligned
start) hold zeros: their outputs are never gathered, so their output gradient is zero and they add
nothing to any weight's gradient. Rows past offsets[-1] are not computed by the grouped GEMM (their
output memory is uninitialized, possibly NaN), and neither is their input gradient: permute.py's
gathers mask both out; biases are gathered per row from a table whose extra zero row serves them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from teratrain import compat
from teratrain.models.grouped_loop import grouped_mm_loop
from teratrain.models.layers import to_compute_dtype
from teratrain.models.swiglu_kernel import swiglu_joined


def row_align(grouped: bool) -> int:
    """Each group's rows start at a multiple of this: the grouped GEMM's alignment, 1 for the loop."""
    return compat.GROUPED_MM_ROW_ALIGN if grouped else 1


# ---------------------------------------------------------------- the experts on a laid-out buffer

def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's where it is on, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def use_grouped(experts: nn.Module, x: torch.Tensor, kernel: str) -> bool:
    """Whether `experts` (models/moe.py's Experts) run as grouped GEMMs: `kernel` "grouped" wherever torch
    has one (tests force it on the CPU), "loop" never, "auto" where it needs no read-back
    (compat.grouped_mm_without_sync) and the weights' rows are 16-byte aligned (8 bf16 values) as its
    kernel requires. Under torch.compile "auto" is grouped wherever torch has one: the loop's read-back
    of the offsets would end the graph there (a graph break: a Python round trip per layer, what
    compiling is meant to remove), while the grouped op is one node of the graph whatever kernel runs
    it (its own fallback off Hopper reads the offsets back inside the op)."""
    if kernel == "loop" or compat.grouped_mm is None:
        return False
    if kernel == "grouped" or torch.compiler.is_compiling():
        return True
    weights = [w for w in (experts.w1, experts.w3, experts.w2) if w is not None]
    aligned = all(s % compat.GROUPED_MM_ROW_ALIGN == 0 for w in weights for s in w.shape[1:])
    return aligned and compat.grouped_mm_without_sync(x.device, compute_dtype(x))


def fuses_gate_up(experts: nn.Module, dtype: torch.dtype) -> bool:
    """Whether w1 and w3 run as one grouped GEMM over their stacks side by side, (E, 2 d_ff, d): gated
    experts whose weights are cast to `dtype` anyway (the cast writes both into one buffer; stacks already in
    `dtype` would be copied for it), in a compiled forward (cast_stacks) or wherever the step's casts joined
    them (memory/step_casts.py, under train.compile). One GEMM reads the rows once and, in backward, gives
    their input gradient by one GEMM over 2 d_ff instead of two added (one H200, the Qwen3-30B-A3B-shaped
    step compiled: its grouped GEMMs 57.4 -> 54.3 ms, the GPU busy 181.9 -> 179.1 ms a step; bench/README.md);
    the SwiGLU between reads both halves and writes their joined gradient (models/swiglu_kernel.py). Eager
    runs them apart, as the planner's eager rates and activation bytes count them."""
    return experts.w3 is not None and experts.w1.dtype != dtype


def cast_stacks(experts: nn.Module, dtype: torch.dtype, take_acc: bool = False) -> dict:
    """Each (weight, bias) stack of the experts by leaf (w1, w3, w2), in `dtype`: one cast a stack; w1 and
    w3 as one stack "w13" (E, 2 d_ff, d) where the step's casts made them so or, compiling,
    `fuses_gate_up`. Made once per forward of a layer: a chunked exchange (parallel/expert.py) runs the
    experts once per chunk on the same casts. Where the step made its weight casts ahead
    (`experts.step_casts`, memory/step_casts.py: once for all its micro-batches), those stand for the
    weights' casts, and with `take_acc` (the one call of a forward whose casts the experts read:
    run_experts, MoE.stacked) each carries the gradient its weight had so far (`experts.grad_acc`) into
    its backward."""
    made, acc = experts.step_casts or {}, (experts.grad_acc or {}) if take_acc else {}
    if take_acc:
        experts.grad_acc = None  # the casts' backward holds them now, and frees each once summed
    leaves = {name: (w, b) for name, w, b in experts.leaves()}
    out = {}
    fused = made.get("w13")
    fused = fused if fused is not None and fused.dtype == dtype else None
    if fused is not None or (not made and torch.compiler.is_compiling() and fuses_gate_up(experts, dtype)):
        (w1, b1), (w3, b3) = leaves.pop("w1"), leaves.pop("w3")
        # cast, then joined: the backward hands each weight a contiguous gradient, not a slice of a joined one
        w = join_gate_up(w1, w3, dtype) if fused is None else \
            MadeCast.apply(fused, acc.get("w1"), acc.get("w3"), w1, w3)
        out["w13"] = (w, None if b1 is None else join_gate_up(b1, b3, dtype))
    for name, (w, b) in leaves.items():
        copy = made.get(name)
        w = MadeCast.apply(copy, acc.get(name), w) if copy is not None and copy.dtype == dtype else w.to(dtype)
        out[name] = (w, None if b is None else b.to(dtype))
    return out


def join_gate_up(w1: torch.Tensor, w3: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w1 and w3 (or b1 and b3) each cast to `dtype`, side by side along dim 1: the stack the one GEMM reads."""
    return torch.cat([w1.to(dtype), w3.to(dtype)], 1)


def join_gate_up_into(out: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor) -> None:
    """join_gate_up's stack written into `out` (an earlier join of them): compiled, one kernel reads both halves
    and stores the whole stack, where two copies into its halves would each write a strided half."""
    out.copy_(join_gate_up(w1, w3, out.dtype))


def split_gate_up(stacks: dict) -> dict:
    """`stacks` with a fused "w13" (cast_stacks) as its w1 and w3 again: views of its two halves."""
    if "w13" not in stacks:
        return stacks
    (w, b), rest = stacks["w13"], {k: v for k, v in stacks.items() if k != "w13"}
    w1, w3 = w.chunk(2, 1)
    b1, b3 = (None, None) if b is None else b.chunk(2, 1)
    return {"w1": (w1, b1), "w3": (w3, b3), **rest}


class MadeCast(torch.autograd.Function):
    """`copy`, the cast of params made before this forward (param.to(copy.dtype), detached; several params
    side by side along dim 1, as one stack), standing for their casts in the graph: backward hands each
    param its part of the gradient in param's dtype, as the cast's own backward does. With its `acc`, the
    gradient param had before this micro-batch (taken off it by memory/step_casts.py `take_grads`),
    backward hands acc + its gradient, which autograd then adopts as param's gradient: the cast and the
    accumulation one pass (10 bytes a parameter where the cast wrote 4 and read 2 and the accumulation
    read 8 and wrote 4). param.grad and its post-accumulate hooks see what they would have; a tensor hook
    on param sees the sum. Call: apply(copy, acc_1, ..., acc_n, param_1, ..., param_n), accs None where none;
    the params of one dtype (the stacks of one module). cast_stacks takes the accs off the layer, so that only
    this node holds them: eager it holds them itself (`held`, not saved: a replay under recomputation
    regenerates none of them) and drops them as it makes the sums; compiled, the backward graph's saved
    inputs do. The layer's reference, kept to the step's end before, held every carried weight's gradient
    so far beside its sum at the end of the last backward."""

    @staticmethod
    def forward(ctx, copy: torch.Tensor, *accs_params) -> torch.Tensor:
        n = len(accs_params) // 2
        ctx.dtype, ctx.sizes = accs_params[n].dtype, [p.shape[1] for p in accs_params[n:]]
        ctx.held = held_or_saved(ctx, accs_params[:n])
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad):
        accs = take_held(ctx)
        parts = grad.split(ctx.sizes, 1) if len(accs) > 1 else (grad,)
        out = [g.to(ctx.dtype) if acc is None else acc + g for acc, g in zip(accs, parts)]
        return None, *(None for _ in accs), *out


def held_or_saved(ctx, accs) -> list | None:
    """A cast's gradients so far (MadeCast, memory/fp8.py _CarriedGrad), for its backward: compiled, saved
    for backward (the graph's inputs); eager, returned for the node to hold (ctx.held) until `take_held`."""
    if torch.compiler.is_compiling():
        ctx.save_for_backward(*accs)
        return None
    return list(accs)


def take_held(ctx) -> list:
    """The gradients `held_or_saved` kept for this backward; the node holds them no more."""
    accs, ctx.held = (ctx.saved_tensors if ctx.held is None else ctx.held), None
    return accs


def run_experts(experts: nn.Module, x: torch.Tensor, offsets: torch.Tensor, grouped: bool,
                stacks: dict | None = None) -> torch.Tensor:
    """Expert g on rows [offsets[g-1], offsets[g]) of x (rows, d); outputs (rows, d_out), undefined
    past offsets[-1]. Every expert's weights enter the autograd graph, also on zero rows, so every
    rank builds the same graph (its gradient hooks, and the collectives they launch, fire in the same
    order). `stacks`: the grouped GEMMs' weights from `cast_stacks`, when several calls share them."""
    if grouped:
        return _grouped(experts, x, offsets, stacks or cast_stacks(experts, compute_dtype(x), take_acc=True))
    ends = offsets.tolist()  # the loop's one read-back
    sizes = [b - a for a, b in zip([0] + ends[:-1], ends)] + [x.shape[0] - ends[-1]]
    parts = x.split(sizes)  # backward: one concatenation (slices would each add a whole zero buffer)
    if stacks is None and experts.step_casts:  # cast once a step: this forward's cast, carrying the gradients
        stacks = cast_stacks(experts, compute_dtype(x), take_acc=True)
    elif stacks is None:
        stacks = {name: (w, b) for name, w, b in experts.leaves()}
    leaves = {name: (w.unbind(0), None if b is None else b.unbind(0)) for name, (w, b) in split_gate_up(stacks).items()}

    def linear(name: str, e: int, rows: torch.Tensor) -> torch.Tensor:
        w, b = leaves[name]
        return F.linear(rows, w[e], None if b is None else b[e])

    outs = []
    for e, rows in enumerate(parts[:-1]):
        if "w3" in leaves:
            rows = to_compute_dtype(rows)  # one cast for w1 and w3
            h = F.silu(linear("w1", e, rows)) * linear("w3", e, rows)
        else:
            h = F.gelu(linear("w1", e, rows), approximate="tanh")
        outs.append(linear("w2", e, experts.dropout(h)))
    return torch.cat(outs + [outs[0].new_zeros(sizes[-1], outs[0].shape[1])])


def _grouped(experts: nn.Module, x: torch.Tensor, offsets: torch.Tensor, stacks: dict) -> torch.Tensor:
    """The Expert MLP (models/moe.py) of every group at once: SwiGLU w2(silu(w1 x) * w3 x) or GELU
    w2(gelu(w1 x)), with the experts' dropout on the hidden activations."""
    x = x.to(compute_dtype(x))
    group = None
    if stacks["w2"][1] is not None:  # each row's expert, for its bias (len(experts): past the end)
        group = torch.searchsorted(offsets, torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype), right=True)
    if "w13" in stacks:  # w1 and w3 side by side: one GEMM (fuses_gate_up)
        h = swiglu_joined(_gmm(x, *stacks["w13"], offsets, group))
    elif "w3" in stacks:
        h = F.silu(_gmm(x, *stacks["w1"], offsets, group)) * _gmm(x, *stacks["w3"], offsets, group)
    else:
        h = F.gelu(_gmm(x, *stacks["w1"], offsets, group), approximate="tanh")
    return _gmm(experts.dropout(h), *stacks["w2"], offsets, group)


def _gmm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, offsets: torch.Tensor,
         group: torch.Tensor | None) -> torch.Tensor:
    """x W_g^T (+ b_g) for each row of group g: one grouped GEMM over the stacked (G, out, in) weights."""
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:  # torch's op traces in bf16 only
        y = grouped_mm_loop(x, w.transpose(-2, -1).contiguous(), offsets)
    else:
        y = compat.grouped_mm(x, w.transpose(-2, -1), offs=offsets)  # (rows, out)
    return y if b is None else _GroupBias.apply(y, b, group)


class _GroupBias(torch.autograd.Function):
    """y + b[g] on each row of group g (rows past the groups: + 0). Backward: b's gradient, the sum of
    its group's rows, as one (G, rows) x (rows, out) GEMM against the rows' one-hot groups (advanced
    indexing's backward would sort the row indices and walk each group's run serially; a segmented
    sum would accumulate in bf16). The rows past the groups, whose gradient the grouped GEMM leaves
    undefined, are zeroed first: their one-hot row is zero, but zero times NaN is not."""

    @staticmethod
    def forward(ctx, y, b, group):
        ctx.save_for_backward(group)
        ctx.groups = b.shape[0]
        return y + torch.cat([b, b.new_zeros(1, b.shape[1])]).index_select(0, group)

    @staticmethod
    def backward(ctx, grad):
        (group,) = ctx.saved_tensors
        past = (group == ctx.groups).unsqueeze(1)
        onehot = F.one_hot(group, ctx.groups + 1)[:, :ctx.groups].to(grad.dtype)  # (rows, G)
        return grad, onehot.t() @ grad.masked_fill(past, 0), None
