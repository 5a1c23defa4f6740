"""Weight casts made once a step instead of once a micro-batch.

Under gradient accumulation every micro-batch's forward casts the same weights again: each forward
casts the routed experts' fp32 weight stacks to bf16 for the grouped GEMMs (models/grouped.py), and
torchao's float8 GEMM casts each weight to e4m3 in forward and again for the input gradient in backward
(an amax reduction and a scaled copy each time). The weights do not change within a step, so one cast
serves all of its micro-batches (one H200, 4 micro-batches, compiled: float8 at the llama-8b width, the
casts 43 ms of a 392 ms step cast per micro-batch, 29 of 387 cast once; Qwen3-30B-A3B-shaped experts,
the stacks' casts 23 ms of 241, 6.6 of 219; bench/README.md):
- the float8 linears under tensorwise scales (memory/fp8.py): each weight's amax, scale and e4m3 bytes,
  handed to the linear as its `float8_weight`, which torchao uses as it is (it casts no operand it finds
  in float8, neither forward nor for the input gradient), as ZeRO-3's float8 gathers do; rowwise scales
  cast each weight along two axes, which no single copy serves;
- the experts' weight stacks held wider than the compute dtype (fp32 parameters under autocast):
  their bf16 copies (`Experts.step_casts`; compiled, w1 and w3 written side by side into one, for one
  grouped GEMM: models/grouped.py fuses_gate_up), which each micro-batch's grouped GEMMs read and save for
  backward (eager, every layer's copy is alive at the end of a forward either way; compiled, the
  partition recast them in backward instead: the step's copies add their bytes to the peak).
Each parameter receives its gradient in its own dtype through the graph, as through the casts of each
micro-batch (models/grouped.py MadeCast, memory/fp8.py _Float8Operand), so accumulation, gradient hooks
(post-accumulate; below, a tensor hook on a weight cast once sees the sum) and data-parallel reductions see no
difference; the bytes are those the per-micro-batch casts make (the same elementwise casts of the same
weights), so the losses and gradients are too. A weight's gradient from the earlier micro-batches rides
along (`take_grads`): the backward of its cast adds it to the micro-batch's in the same pass (one H200,
compiled: a Qwen3-30B-A3B-shaped MoE, 2 micro-batches, the gradients' casts and the accumulation 28 ms of
192 a step before, 18 of 184 since; float8 at the llama-8b width, 4 micro-batches, 381.6 -> 372.3 ms a step;
compiled, the forward with the gradients carried is a second graph, compiled at the second micro-batch;
bench/README.md).

The casts exist from the step's first forward to its last backward (1 byte a float8 weight, the compute
dtype's width a stacked expert weight; planner/memory.py counts them there): evaluation and any other
forward cast as before, and so does every step under memory.cast_once=false. `applies` says where: the step without a pipeline (`train_step`; the pipeline
executor's asynchronous schedules run micro-batches on different weight versions), an engine that keeps
each parameter whole through the step (not ZeRO-3, which gathers its parameters per use and casts its
float8 weights once a step itself; not a parameter server's worker, whose pulls may land mid-step).
Under CUDA graphs (train.compile_mode=reduce-overhead) a graph reads its inputs at the addresses it was
recorded with, and copies any other input into them at each replay: there the casts are made once, at the
first step, marked as static inputs (as parameters are), and every later step casts into them in place. No
gradient rides along there: the engine keeps each gradient in a buffer of its own, which the graph's output
is added into (optim/engine.py LocalEngine), and the casts' backward hands each weight its micro-batch's.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from teratrain.memory.fp8 import Float8Weight, TensorwiseCast, float8_linears
from teratrain.models.grouped import fuses_gate_up, join_gate_up, join_gate_up_into
from teratrain.models.moe import moe_layers

_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its StepCasts


def applies(zero: int, pp: int, sync: str) -> bool:
    """Does a run of this layout cast its weights once a step (when a step has several micro-batches)?"""
    return pp == 1 and zero < 3 and sync != "param-server"


class StepCasts:
    """What `model`'s step casts once for all its micro-batches: its float8 linears under tensorwise
    scales and its experts' weight stacks."""

    def __init__(self, model: nn.Module, compiled: bool = False, graphed: bool = False):
        self.graphed = graphed
        # graphed: each cast's tensors as the first step made them, which later steps cast into (module docstring)
        self.held: dict[int, tuple | dict] = {}
        self.linears = [linear for linear in float8_linears(model) if linear.gemm.recipe == "tensorwise"]
        self.experts = [layer.experts for _, layer in moe_layers(model)]
        # compiled, w1 and w3 are cast into one stack (models/grouped.py fuses_gate_up) by one kernel: torch's
        # copy into each half, strided, took 0.50 ms a Qwen3-shaped stack on one H200, a contiguous cast 0.27
        self.join = torch.compile(join_gate_up, dynamic=False) if compiled and self.experts else None
        self.join_into = torch.compile(join_gate_up_into, dynamic=False) if compiled and graphed and self.experts \
            else None
        # compiled, a weight's amax and its cast are two passes over it (eager: abs, max, the scaling, the
        # clamp and the cast each read the weight or a temporary of its size), and one call casts every weight:
        # the casts open the step on an idle GPU, which a compiled call a weight kept waiting on the host (one
        # H200, the llama-8b width's 56 linears, 4 micro-batches: 375.1 -> 370.4 ms a step; bench/README.md)
        # graphed, every step after the first casts into the first one's tensors (`float8_into`): compiled, the
        # casts' kernels store into them (allocated and then copied in, a float8 weight's bytes were written twice)
        caster = TensorwiseCast() if self.linears else None
        self.float8 = self.float8_into = None
        if caster is not None:
            self.float8 = torch.compile(caster.many, dynamic=False) if compiled else caster.many
            self.float8_into = torch.compile(caster.many_into, dynamic=False) if compiled else caster.many_into

    @contextlib.contextmanager
    def step(self, dtype: torch.dtype):
        """Around a step's micro-batches: cast each weight in the compute `dtype` (bf16, float8) once."""
        try:
            with torch.no_grad():
                weights = [linear.weight for linear in self.linears]
                held = [self.held.get(id(linear)) for linear in self.linears]
                if weights and self.graphed and None not in held:
                    self.float8_into(weights, held)
                elif weights:
                    held = [self._kept(linear, cast) for linear, cast in zip(self.linears, self.float8(weights))]
                for linear, cast in zip(self.linears, held):
                    linear.float8_weight = Float8Weight(*cast)
                for experts in self.experts:
                    kept = self.held.get(id(experts))
                    experts.step_casts = (self._kept(experts, stack_casts(experts, dtype, self.join))
                                          if kept is None else cast_into(kept, experts, self.join_into)) or None
            yield self
        finally:
            for linear in self.linears:
                linear.float8_weight = None
            for experts in self.experts:
                experts.step_casts = experts.grad_acc = None

    def _kept(self, owner: nn.Module, made):
        """`made`, `owner`'s casts at a step's start: as they are, or under CUDA graphs, at the first step,
        marked static (the graph reads them in place) and kept, which later steps cast into (float8: a byte a
        weight and its scale, `float8_into`; the experts' stacks, `cast_into`)."""
        if self.graphed:
            for t in (made.values() if isinstance(made, dict) else made):
                torch._dynamo.mark_static_address(t)
            self.held[id(owner)] = made
        return made

    def take_grads(self) -> None:
        """Before a micro-batch's forward: each weight cast this step (float8 linears, stacked experts)
        moves the gradient it has so far, where autograd owns it (not a view of an engine's buffer, into
        which autograd adds in place), to its cast (`Float8Weight.acc`, its layer's `grad_acc`); the
        backward of the weight's cast hands back that gradient plus the micro-batch's (memory/fp8.py
        _CarriedGrad, models/grouped.py MadeCast), which autograd adopts as the weight's gradient. The
        forward that reads it takes it off the layer: the cast's node alone holds it, until the sum is made.
        Under CUDA graphs nothing is taken (module docstring)."""
        if self.graphed:
            return
        for linear in self.linears:
            if linear.float8_weight is not None:  # None where not taken: no earlier micro-batch's sum left over
                linear.float8_weight.acc = _take_grad(linear.weight)
        for experts in self.experts:
            made = set(experts.step_casts or {})
            made |= {"w1", "w3"} if "w13" in made else set()
            acc = {name: _take_grad(w) for name, w, _ in experts.leaves() if name in made}
            experts.grad_acc = {name: g for name, g in acc.items() if g is not None} or None


def _take_grad(w: torch.Tensor) -> torch.Tensor | None:
    """w's gradient so far, taken off it, where autograd owns it; else None (none yet, or a view of an
    engine's buffer, which autograd adds into in place)."""
    g = w.grad
    if g is None or g._base is not None:
        return None
    w.grad = None
    return g


def stack_casts(experts: nn.Module, dtype: torch.dtype, join=None) -> dict:
    """{leaf: its stack cast to `dtype`} for the stacks wider than it; with `join` (join_gate_up, compiled
    under train.compile), w1 and w3 as one stack "w13" (models/grouped.py fuses_gate_up)."""
    wide = {name: w for name, w, _ in experts.leaves() if w.dtype != dtype}
    out = {}
    if join is not None and "w1" in wide and fuses_gate_up(experts, dtype):
        out["w13"] = join(wide.pop("w1"), wide.pop("w3"), dtype)
    return out | {name: w.to(dtype) for name, w in wide.items()}


def cast_into(held: dict, experts: nn.Module, join_into=None) -> dict:
    """The experts' stacks cast into `held` (an earlier `stack_casts` of them) in place: each leaf's copy
    casts it, and w1 and w3 into a joined "w13": by `join_into` (compiled join_gate_up_into) where given, else
    each into its half."""
    leaves = {name: w for name, w, _ in experts.leaves()}
    for name, buf in held.items():
        if name == "w13" and join_into is not None:
            join_into(buf, leaves["w1"], leaves["w3"])
        elif name == "w13":
            half = leaves["w1"].shape[1]
            buf[:, :half].copy_(leaves["w1"])
            buf[:, half:].copy_(leaves["w3"])
        else:
            buf.copy_(leaves[name])
    return held


def enable(model: nn.Module, compiled: bool = False, graphed: bool = False) -> None:
    """Let `train_step` cast `model`'s weights once a step (parallelize does, where `applies`; `compiled`:
    train.compile, which compiles the float8 cast too; `graphed`: under CUDA graphs, into the same tensors
    every step)."""
    casts = StepCasts(model, compiled, graphed)
    if casts.linears or casts.experts:
        _RUNS[model] = casts


def around_step(model: nn.Module, micro_batches: int, dtype: torch.dtype):
    """The context a step of `micro_batches` runs in: its casts made once, where enabled and worth it
    (as: the StepCasts, whose `take_grads` goes before each micro-batch's forward; else None)."""
    casts = _RUNS.get(model)
    return casts.step(dtype) if casts is not None and micro_batches > 1 else contextlib.nullcontext()
