"""Backward split in two (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 2): I computes
only the gradient of the stage's input, which the previous stage is waiting for; W, later, the
gradients of the weights. The same algorithm as torch.distributed.pipelining's `_backward.py`,
written against public autograd APIs so that W accumulates through each parameter's own
AccumulateGrad node (the engines' gradient hooks fire as in any backward):

- the graph's nodes reachable forward from the input leaf x are the "input closure"; for each
  weight, the first nodes of that closure its gradient path meets are its "intermediates" (e.g. the
  matmul of `x @ W.T`); weights that share an intermediate form one group;
- I: autograd.grad(out -> x) with a pre-hook on every intermediate that keeps the gradient arriving
  there (the graph is retained, but what only I needed is freed as I runs: saved.py);
- W: for each group, backward from its intermediates' gradient edges with those kept gradients, into
  the group's weights only (autograd computes just the weight-side outputs of each node). When one
  intermediate of a group feeds another, the kept gradient replaces the sum so nothing counts twice.
  Groups whose intermediates cannot reach one another (same depth: q, k and v's matmuls; a block's
  gate and up projections) share one autograd call, which computes nothing between them: a Llama
  block takes 6 calls instead of 9, each walking the graph below its roots.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict, deque

import torch
from torch.autograd.graph import GradientEdge, Node

from teratrain.parallel.pipeline.saved import SplitSaved


def _node(t: torch.Tensor) -> Node:
    """A tensor's grad_fn, or a leaf's AccumulateGrad node (made through a view when needed)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """Reverse edges of the graph under `root`: node -> the nodes that feed gradient into it."""
    rev: dict[Node, list[Node]] = defaultdict(list)
    seen, todo = {root}, deque([root])
    while todo:
        node = todo.popleft()
        for nxt, _ in node.next_functions:
            if nxt is not None:
                rev[nxt].append(node)
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
    return rev


def _closure(starts: list[Node], rev: dict, stop: set) -> tuple[set, set]:
    """Nodes reachable from `starts` along reverse edges, not entering `stop`; and the `stop` nodes met."""
    seen, met, todo = set(starts), set(), deque(starts)
    while todo:
        for nxt in rev.get(todo.popleft(), ()):
            if nxt in stop:
                met.add(nxt)
            elif nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen, met


def _groups(out: torch.Tensor, x: torch.Tensor, weights: list[torch.Tensor]) -> tuple[list[dict], set]:
    """The weight groups, and the nodes W runs in the input closure: every intermediate, and the
    nodes between two intermediates of one group (the kept gradient replaces what flows there)."""
    rev = _consumers(out.grad_fn)
    inputs, _ = _closure([_node(x)], rev, set())
    by_node: dict[Node, dict] = {}
    for w in weights:
        acc = _node(w)
        _, met = _closure([acc], rev, inputs)
        group = {"weights": {acc: w}, "nodes": set(met)}
        for node in met:  # merge with every group already meeting one of these nodes
            other = by_node.get(node)
            if other is not None and other is not group:
                group["weights"].update(other["weights"])
                group["nodes"] |= other["nodes"]
        for node in group["nodes"]:
            by_node[node] = group
    unique = {id(g): g for g in by_node.values()}
    groups = [{"weights": g["weights"], "nodes": list(g["nodes"])} for g in unique.values()]
    run_by_w = set(by_node)
    for g in groups:
        if len(g["nodes"]) > 1:
            below = _below(g["nodes"], inputs)
            above, _ = _closure(g["nodes"], rev, set())
            run_by_w |= below & above
    return _batched(groups, _depths(set(by_node), inputs, rev)), run_by_w


def _depths(intermediates: set, inputs: set, rev: dict) -> dict:
    """For each input-closure node, the most intermediates on a path above it (toward the output),
    itself excluded: if intermediate a reaches intermediate b, depth(b) > depth(a)."""
    pending = {n: sum(1 for c in rev.get(n, ()) if c in inputs) for n in inputs}
    todo = deque(n for n, k in pending.items() if k == 0)
    depth = dict.fromkeys(inputs, 0)
    while todo:
        n = todo.popleft()
        below = depth[n] + (n in intermediates)
        for nxt, _ in n.next_functions:
            if nxt in pending:
                depth[nxt] = max(depth[nxt], below)
                pending[nxt] -= 1
                if pending[nxt] == 0:
                    todo.append(nxt)
    return depth


def _batched(groups: list[dict], depth: dict) -> list[dict]:
    """Groups of one intermediate at the same depth merged into one: none reaches another, so one
    autograd call runs each one's weight half and nothing between them (fewer calls, each of
    which walks the graph below its roots). Groups of vectors only (norm scales) stay apart: I
    computes them (`early`)."""
    out, by_depth = [], {}
    for g in groups:
        early = all(w.dim() <= 1 for w in g["weights"].values())
        if len(g["nodes"]) > 1:
            out.append({**g, "clamp": True, "early": early})
            continue
        d = (depth[g["nodes"][0]], early)
        if d not in by_depth:
            by_depth[d] = {"weights": {}, "nodes": [], "clamp": False, "early": early}
            out.append(by_depth[d])
        by_depth[d]["weights"].update(g["weights"])
        by_depth[d]["nodes"] += g["nodes"]
    return out


def _below(starts: list[Node], within: set) -> set:
    """Nodes reachable from `starts` along next_functions (toward the input), inside `within`."""
    seen, todo = set(starts), deque(starts)
    while todo:
        for nxt, _ in todo.popleft().next_functions:
            if nxt is not None and nxt in within and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor,
                   weights: list[torch.Tensor], saved: SplitSaved | None = None) -> list[dict]:
    """I: set x.grad to d(out)/dx (given d(out) = `grad`, or `grad` as the seed of a scalar loss) and
    return what W needs. With `saved` (the forward ran under `saved.recording()`), the tensors only
    I needed are freed as it goes.

    Groups of vectors only (`early`: RMSNorm/LayerNorm scales, whose weight gradient is one
    elementwise product and a sum) are computed here, right after I, into gradients of their own
    size: deferred, each would hold two activation-sized tensors (its normalized input and the
    gradient arriving at it, fp32 under autocast) for a gradient of d numbers, about a third of what
    a Llama block's W holds otherwise. W then accumulates them (backward_weight)."""
    groups, run_by_w = _groups(out, x, weights)
    handles = []
    for g in groups:
        g["grads"] = [None] * len(g["nodes"])
        for i, node in enumerate(g["nodes"]):
            def keep(grad_outputs, g=g, i=i):
                g["grads"][i] = grad_outputs
            handles.append(node.register_prehook(keep))
    try:
        with saved.dropping(run_by_w) if saved is not None else contextlib.nullcontext():
            (x.grad,) = torch.autograd.grad(out, x, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    early = [g for g in groups if g["early"]]
    for g in early:
        g["done"] = _weight_grads(g, lambda edges, grads, ws: torch.autograd.grad(
            edges, ws, grads, retain_graph=True, allow_unused=True))
        g["grads"] = None
    if saved is not None:
        saved.release([node for g in early for node in g["nodes"]])
    return groups


def _weight_grads(g: dict, run):
    """run(edges, grads, weights) from the group's intermediates with their kept gradients (None
    when no gradient reached them). A group of several intermediates clamps each to its kept
    gradient, so that what flows from one into another does not count twice."""
    edges, grads = [], []
    for node, kept in zip(g["nodes"], g["grads"]):
        for i, t in enumerate(kept or ()):
            if t is not None:
                edges.append(GradientEdge(node, i))
                grads.append(t)
    if not edges:
        return None
    handles = [node.register_prehook(lambda _, kept=kept: kept) for node, kept in zip(g["nodes"], g["grads"])
               if kept is not None] if g["clamp"] else []
    try:
        return run(edges, grads, list(g["weights"].values()))
    finally:
        for h in handles:
            h.remove()


def backward_weight(groups: list[dict]) -> None:
    """W: accumulate every group's weight gradients into `.grad` (through AccumulateGrad, so the
    engines' gradient hooks fire here, as in a whole backward); an early group's, computed by I."""
    for n, g in enumerate(groups):
        if g["early"]:
            pairs = [(w, d) for w, d in zip(g["weights"].values(), g["done"] or ()) if d is not None]
            if pairs:
                torch.autograd.backward([w for w, _ in pairs], [d for _, d in pairs])
            continue
        retain = any(not h["early"] for h in groups[n + 1:])
        _weight_grads(g, lambda edges, grads, ws: torch.autograd.backward(edges, grads, inputs=ws,
                                                                          retain_graph=retain))
