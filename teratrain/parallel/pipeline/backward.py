"""Backward split in two (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 2): I computes
only the gradient of the stage's input, which the previous stage is waiting for; W, later, the
gradients of the weights: for each linear `x @ W.T` the one GEMM dW = dY^T x, from the layer
input its node saved and the output gradient I kept (the paper's W), nothing else.

- The graph's nodes that reach the input leaf x are the "input closure"; its nodes with an edge
  leaving it toward a trainable weight (e.g. the matmul of `x @ W.T`, whose other edge leads to
  the weight's cast and AccumulateGrad) are the "intermediates". One walk of the graph finds them.
- I: one autograd.grad from out to x and to a gradient edge at every intermediate, which hands back
  the gradient arriving there beside x's (the graph is retained, but what only I needed is freed as
  I runs: saved.py).
- W: each intermediate's weight-side outputs by the node's own derivative formula (`weight_rules.py`:
  the formulas of torch's derivatives.yaml, on the node's saved tensors and the kept gradient),
  then ONE autograd call rooted at those weight-side edges, which runs only what lies between
  them and the weights (a transpose, autocast's cast back to fp32) and their AccumulateGrad nodes,
  so the engines' gradient hooks fire as in a whole backward. An intermediate of another kind is
  run by autograd from its kept gradient into its weight-side edges only.

Why not autograd from the intermediates: each call walks the whole graph below its roots, and
intermediates at different depths need separate calls (one call would run everything between
them again), so W would cost O(blocks^2) graph nodes per micro-batch. tests/unit/test_pipeline_backward.py
holds I + W to B's kernels, I to one autograd call, and every call of W to roots that cannot reach
the stage input.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.graph import GradientEdge, Node

from teratrain.compat import backward_from
from teratrain.parallel.pipeline.saved import SplitSaved
from teratrain.parallel.pipeline.weight_rules import rule_for


def graph_root(out: torch.Tensor | GradientEdge) -> Node:
    """The node a backward starts from: a tensor's grad_fn, or an edge's node (a pipeline stage keeps only its
    output's edge once the output is sent: runtime.py)."""
    return out.node if isinstance(out, GradientEdge) else out.grad_fn


def _postorder(root: Node) -> list[tuple[Node, tuple]]:
    """Every node under `root` with its next_functions, each after all the nodes it feeds gradient into."""
    order, seen = [], {root}
    stack = [(root, root.next_functions, 0)]
    while stack:
        node, kids, i = stack.pop()
        while i < len(kids):
            child = kids[i][0]
            i += 1
            if child is not None and child not in seen:
                seen.add(child)
                stack.append((node, kids, i))
                stack.append((child, child.next_functions, 0))
                break
        else:
            order.append((node, kids))
    return order


class _Intermediate:
    """One intermediate: its weight-side edges (output index, edge), the gradient kept in I, and
    (early) the weight-side gradients computed in I."""

    __slots__ = ("node", "rule", "sides", "edges", "early", "kept", "done")

    def __init__(self, node: Node, kids: tuple, sides: list[int], early: bool):
        self.node, self.rule, self.sides, self.early = node, rule_for(node), sides, early
        self.edges = [GradientEdge(*kids[i]) for i in sides]
        self.kept = self.done = None

    def outputs(self) -> range:
        """The node's outputs whose gradient W needs: a rule's node has one differentiable output
        (derivatives.yaml: a norm's mean and rstd are not), another node all of them."""
        return range(1) if self.rule is not None else range(len(self.node._input_metadata))

    def weight_grads(self) -> list[torch.Tensor | None]:
        """The node's gradients into its weight-side edges, from the kept gradient, shaped and typed
        as those edges take them."""
        if self.kept is None or all(g is None for g in self.kept):
            return [None] * len(self.sides)
        if self.rule is not None:
            with torch.no_grad():  # a saved tensor comes back requiring grad: record no graph on it
                got = self.rule(self.node, self.kept, self.sides)
                return [None if g is None else _fit(g, e) for g, e in zip(got, self.edges)]
        roots = [(GradientEdge(self.node, i), g) for i, g in enumerate(self.kept) if g is not None]
        got = torch.autograd.grad([e for e, _ in roots], self.edges, [g for _, g in roots],
                                  retain_graph=True, allow_unused=True)
        return [None if g is None else _fit(g, e) for g, e in zip(got, self.edges)]


def _fit(g: torch.Tensor, edge: GradientEdge) -> torch.Tensor:
    """`g` summed over broadcast dimensions and cast as the edge's input takes it (what autograd's
    engine does to a node's outputs)."""
    meta = edge.node._input_metadata[edge.output_nr]
    if tuple(g.shape) != tuple(meta.shape):
        g = g.sum_to_size(meta.shape)
    return g if g.dtype == meta.dtype else g.to(meta.dtype)


_CLOSURE = (False, False, "input closure")  # _plan's mark of the closure: leads to no weight *outside* it


def _plan(out: torch.Tensor | GradientEdge, x: torch.Tensor, weights: list[torch.Tensor],
          early=()) -> list[_Intermediate]:
    """The intermediates of the graph under `out`, in one walk. Each node outside the input closure
    is marked (leads to a weight of `weights`, all of those made in I: vectors (norm scales, biases)
    or in `early`)."""
    now = {id(w) for w in early}
    wanted = {id(w): (True, w.dim() <= 1 or id(w) in now) for w in weights}
    mark: dict = {}
    found = []
    order = _postorder(graph_root(out))
    for node, kids in order:
        if not kids:  # a leaf's AccumulateGrad (its `variable`), or a node that feeds nothing
            v = getattr(node, "variable", None)
            mark[node] = _CLOSURE if v is x else wanted.get(id(v), (False, True))
            continue
        inside, reach, vectors = False, False, True
        for child, _ in kids:
            m = mark.get(child)
            if m is _CLOSURE:
                inside = True
            elif m is not None and m[0]:
                reach, vectors = True, vectors and m[1]
        if not inside:
            mark[node] = (reach, vectors)
            continue
        mark[node] = _CLOSURE
        if reach:
            found.append((node, kids, [i for i, (c, _) in enumerate(kids) if mark.get(c, _CLOSURE)[0]]))
    if any(rule_for(node) is None for node, _, _ in found):
        _check_fallback(found, order)
    return [_Intermediate(node, kids, sides, early=all(mark[kids[i][0]][1] for i in sides))
            for node, kids, sides in found]


def _check_fallback(found: list, order: list) -> None:
    """An intermediate without a rule is run by autograd into its weight-side edges; where another node
    also feeds such an edge's node, that run would go through the input side to it: refuse."""
    parents: dict = {}
    for _, kids in order:
        for c, _ in kids:
            parents[c] = parents.get(c, 0) + 1
    for node, kids, sides in found:
        if rule_for(node) is None and any(parents[kids[i][0]] > 1 for i in sides):
            raise RuntimeError(f"the split backward has no weight-gradient rule for {node.name()}, whose weight "
                               "another node also uses: add one to parallel/pipeline/weight_rules.py")


def backward_input(out: torch.Tensor | GradientEdge, grad: torch.Tensor | None, x: torch.Tensor,
                   weights: list[torch.Tensor], saved: SplitSaved | None = None, early=()) -> list[_Intermediate]:
    """I: set x.grad to d(out)/dx (given d(out) = `grad`, or `grad` as the seed of a scalar loss) and
    return what W needs. With `saved` (the forward ran under `saved.recording()`), the tensors only
    I needed are freed as it goes.

    Intermediates whose weights are all vectors (`early`: RMSNorm/LayerNorm scales, whose weight
    gradient is one elementwise product and a sum) are computed here, right after I, into gradients
    of their own size: deferred, each would hold two activation-sized tensors (its normalized input
    and the gradient arriving at it, fp32 under autocast) for a gradient of d numbers, about a third
    of what a Llama block's W holds otherwise. So are those of the weights in `early` (the last
    stage's output projection, stage.py `early_weights`). W then accumulates them (backward_weight)."""
    plan = _plan(out, x, weights, early)
    edges = [GradientEdge(item.node, i) for item in plan for i in item.outputs()]
    with saved.dropping({item.node for item in plan}) if saved is not None else contextlib.nullcontext():
        got = torch.autograd.grad(out, [x, *edges], grad, retain_graph=True, allow_unused=True)
    x.grad, k = got[0], 1
    for item in plan:
        n = len(item.outputs())
        item.kept, k = got[k:k + n], k + n
    now = [item for item in plan if item.early]
    for item in now:
        item.done, item.kept = item.weight_grads(), None
    if saved is not None:
        saved.release([item.node for item in now])
    return plan


_HELD = 4  # W's gradients waiting for accumulation: at most about this many of its largest


def backward_weight(plan: list[_Intermediate]) -> None:
    """W: every intermediate's weight-side gradients (an early one's, computed by I), accumulated
    into `.grad` through the weights' AccumulateGrad nodes (the engines' gradient hooks fire here, as
    in a whole backward). One autograd call takes the gradients made since the last one once they
    hold `_HELD` times the largest of them: one call for all would hold every weight's gradient at
    once (a stage's parameters in bf16 beside B's peak), one per gradient would pay the engine's
    start per weight."""
    roots, grads, held, largest = [], [], 0, 0
    for item in plan:
        got = item.done if item.early else item.weight_grads()
        item.kept = item.done = None
        for edge, g in zip(item.edges, got):
            if g is not None:
                roots.append(edge)
                grads.append(g)
                size = g.numel() * g.element_size()
                held, largest = held + size, max(largest, size)
        if held >= _HELD * largest and roots:
            backward_from(roots, grads)
            roots, grads, held = [], [], 0
    if roots:
        backward_from(roots, grads)
