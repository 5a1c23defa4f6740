"""What the live storages of a pipeline step are, after each action (bench/pipeline_live.py --account).

Every storage the step made and still holds (pipeline_live.LiveBytes) is put in the first of these
kinds it belongs to, by following what the executor holds (runtime._Call), never by estimate:
- casts: autocast's bf16 copies of the weights (made by a _to_copy of a parameter, tagged when made);
- w_inputs: the tensors each pending W reads besides its kept gradient (Qi et al. 2023 sec. 2: a
  linear's input; an intermediate without a rule: all its node saved), the head's apart (head_input);
- w_grads: the output gradients kept for pending W's (and weight gradients I made early), the
  head's apart (logit_grad: the (tokens, vocab) gradient of the logits; head_weight_grad: the head's
  weight gradient, where I makes it: parallel/pipeline/stage.py `early_weights`);
- inflight: tensors saved by the forwards of micro-batches whose backward (B or I) has not run;
- w_extra: anything else a pending W's state keeps alive (what the retained graph still saves, the
  stage input leaf): what the split holds beyond what W needs;
- messages: received activations / gradients not consumed yet, and sends not known to be finished;
- other: the rest (the loss values, the optimizer's temporaries, autograd's buffers of the moment).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from teratrain.parallel.pipeline.backward import _Intermediate, _postorder, graph_root

KINDS = ("casts", "inflight", "w_inputs", "w_grads", "head_input", "logit_grad", "head_weight_grad", "w_extra",
         "messages", "other")
_READ_INPUTS = {"MmBackward0": ("_saved_self",), "AddmmBackward0": ("_saved_mat1",),
                "MulBackward0": ("_saved_self", "_saved_other")}  # what a pending rule reads besides the weight cast


def _ptr(t) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None


def saved_of(node, names=None) -> list[torch.Tensor]:
    """The tensors `node` still saves (all, or those `names`); a dropped one (split backward) is skipped. A
    custom autograd Function's node (models/swiglu_kernel.py silu_mul) names them `saved_tensors`."""
    out = []
    own = [n for n in dir(node) if n.startswith("_saved_")] + (["saved_tensors"] if hasattr(node, "apply") else [])
    for name in names or own:
        try:
            v = getattr(node, name)
        except RuntimeError:  # freed: by a backward without retain_graph, or dropped by saved.py during I
            continue
        out += [t for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, torch.Tensor)]
    return out


def graph_saved(root) -> list[torch.Tensor]:
    """Every tensor still saved by the graph under `root` (a node), the leaves' variables included."""
    out = []
    for node, _ in _postorder(root):
        out += saved_of(node)
        v = getattr(node, "variable", None)
        if v is not None:
            out.append(v)
    return out


def _pending(plan: list[_Intermediate], vocab: int) -> dict[str, list]:
    """A pending W's state, by kind: the inputs its rules read, its kept gradients, the head's apart."""
    out = {"w_inputs": [], "w_grads": [], "head_input": [], "logit_grad": [], "head_weight_grad": []}
    for item in plan:
        kept = [g for g in (item.kept or ()) if g is not None]
        done = [g for g in (item.done or ()) if g is not None]
        head = any(vocab in g.shape and g.dim() >= 2 for g in kept + done)
        if head:
            out["head_weight_grad"] += done
            done = []
        if item.early or item.kept is None:
            inputs = []
        elif item.rule is not None:
            inputs = saved_of(item.node, _READ_INPUTS.get(item.node.name(), ()))
        else:
            inputs = saved_of(item.node)
        out["head_input" if head else "w_inputs"] += inputs
        out["logit_grad" if head else "w_grads"] += kept + done
    return out


def account(call, refs: dict[int, tuple], casts: set[int], vocab: int) -> dict[str, float]:
    """MiB of each kind (KINDS) among the live storages `refs` (data pointer -> (weak ref, bytes))."""
    with _disable_current_modes():
        found: dict[str, list] = {k: [] for k in KINDS}
        for (chunk, mb), (h0, x, out, plan) in call.states.items():
            if out is not None:  # forward done, backward (B or I) not yet
                found["inflight"] += graph_saved(graph_root(out))
            elif isinstance(plan, list):  # I done, W pending
                for k, v in _pending(plan, vocab).items():
                    found[k] += v
                found["w_extra"] += [t for item in plan for t in graph_saved(item.node)] + [h0, x]
        found["messages"] = list(call.inbox.values()) + list(call.outbox.values()) + \
            [t for batch in call.sends for t in batch.tensors]
        owner: dict[int, str] = {p: "casts" for p in casts}
        for kind in KINDS:
            for t in found[kind]:
                p = _ptr(t)
                if p is not None:
                    owner.setdefault(p, kind)
    mib = {k: 0.0 for k in KINDS}
    for p, (_, nbytes) in refs.items():
        mib[owner.get(p, "other")] += nbytes / 2**20
    return {k: round(v, 3) for k, v in mib.items()}
