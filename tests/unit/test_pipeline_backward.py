"""ZB-H1's backward split (parallel/pipeline/backward.py, saved.py) against one full backward, on a
real model chunk in one process, the way the executor runs it (the forward under `SplitSaved`):
I alone gives the input gradient and no weight gradient; W then gives every weight gradient through
AccumulateGrad (hooks fire), equal to the full backward's to fp64 rounding, with dropout replayed
under recomputation. And what the split costs: I + W run B's FLOPs (no forward replayed twice,
whatever the recomputation policy), and after I the chunk holds less than its forward saved."""

import collections
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from teratrain.memory.recompute import apply_recompute
from teratrain.parallel.pipeline.backward import backward_input, backward_weight
from teratrain.parallel.pipeline.saved import SplitSaved
from teratrain.parallel.pipeline.stage import Chunk
from teratrain.parallel.pipeline.weight_rules import RULES
from tests.helpers import small_model


def _chunk(arch: str, recompute: str, last: bool, dtype=torch.float64, **more):
    keys = dict(arch=arch, n_kv_heads=4, tie_embeddings=True, bias=True) if arch == "gpt2" else {}
    model = apply_recompute(small_model(dtype=dtype, **keys, **more), recompute)
    return model, Chunk(model, stage=1, num_stages=2 if last else 3, blocks=range(2))


def _inputs(last: bool, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 16, 32, dtype=dtype, generator=g)
    y = torch.randint(0, 50, (2, 16), generator=g)
    seed = torch.tensor(0.5, dtype=dtype) if last else torch.randn(2, 16, 32, dtype=dtype, generator=g)
    return x0, y, seed


def _forward(chunk, x0, y, saved: SplitSaved | None = None):
    torch.manual_seed(1)  # the same dropout masks in both runs
    x = x0.clone().requires_grad_()
    m = chunk.model
    pos = m.sequence(y, y, 0, m.rope)[2]  # the positions of 16 tokens from 0
    if saved is None:
        return x, chunk.forward(x, y, pos)
    with saved.recording():
        return x, chunk.forward(x, y, pos, segment=saved.segment)


@pytest.mark.parametrize("arch,recompute", [("llama", "none"), ("gpt2", "none"), ("llama", "full"),
                                            ("llama", "selective")])
@pytest.mark.parametrize("last", [False, True])
def test_input_then_weight_equals_full_backward(arch, recompute, last):
    model, chunk = _chunk(arch, recompute, last, dropout=0.1)
    x0, y, seed = _inputs(last)
    x, out = _forward(chunk, x0, y)
    torch.autograd.backward(out, seed)
    full = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    full_x = x.grad.clone()
    model.zero_grad(set_to_none=True)

    fired = []
    for p in chunk.weights():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    saved = SplitSaved()
    x, out = _forward(chunk, x0, y, saved)
    groups = backward_input(out, seed, x, chunk.weights(), saved)
    assert torch.allclose(x.grad, full_x, rtol=1e-12, atol=1e-14)
    assert all(p.grad is None for p in model.parameters()), "I must not touch the weights"
    backward_weight(groups)
    split = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert split.keys() == full.keys()
    for n in full:
        assert torch.allclose(split[n], full[n], rtol=1e-10, atol=1e-14), n
    assert len(fired) == len(chunk.weights())


def _heads_of(q, k, v) -> tuple[torch.Size, torch.Size]:
    """k's and v's shapes with q's heads: grouped-query attention costs as if each query head had its own (torch
    2.11's formulas assert equal heads)."""
    return tuple(torch.Size((t.shape[0], q.shape[1], *t.shape[2:])) for t in (k, v))


class _Flops(TorchDispatchMode):
    """FLOPs of the ops run, by torch's own formulas (matmuls, and attention: its CPU kernel too)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if name == "_scaled_dot_product_flash_attention_for_cpu":
            self.total += sdpa_flop_count(args[0].shape, *_heads_of(args[0], args[1], args[2]))
        elif name == "_scaled_dot_product_flash_attention_for_cpu_backward":
            self.total += sdpa_backward_flop_count(args[0].shape, args[1].shape, *_heads_of(args[1], args[2], args[3]))
        elif func._overloadpacket in flop_registry:
            self.total += flop_registry[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
        return out


def _count(fn) -> tuple[int, object]:
    with _Flops() as f:
        r = fn()
    return f.total, r


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_split_costs_the_flops_of_one_backward_and_frees_what_only_i_needed(recompute):
    model, chunk = _chunk("llama", recompute, last=False, dtype=torch.float32)
    x0, y, seed = (t.float() for t in _inputs(last=False))
    x, out = _forward(chunk, x0, y)
    b_flops, _ = _count(lambda: torch.autograd.backward(out, seed))

    _, plain = _chunk("llama", "none", last=False, dtype=torch.float32)  # the same weights, nothing recomputed
    params = frozenset(p.untyped_storage().data_ptr() for p in model.parameters())
    everything = SplitSaved()
    _forward(plain, x0, y, everything)
    saved = SplitSaved()
    x, out = _forward(chunk, x0, y, saved)
    i_flops, groups = _count(lambda: backward_input(out, seed, x, chunk.weights(), saved))
    after_i = saved.held_bytes(params)
    w_flops, _ = _count(lambda: backward_weight(groups))
    assert abs((i_flops + w_flops) / b_flops - 1) < 0.02, (i_flops, w_flops, b_flops)
    assert after_i < 0.5 * everything.held_bytes(params), "after I the chunk should hold only what W needs"


class _Kernels(TorchDispatchMode):
    """The aten ops that launch a kernel on a GPU (all but views and aliases), by name."""

    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func._overloadpacket.__name__ not in ("detach", "alias"):
            self.count[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _engine_calls_and_kernels(fn, monkeypatch) -> tuple[list, collections.Counter]:
    """fn()'s autograd engine calls (their roots) and kernels."""
    calls, run = [], torch.autograd.graph._engine_run_backward

    def counting(roots, *args, **kwargs):
        calls.append(list(roots))
        return run(roots, *args, **kwargs)

    monkeypatch.setattr(torch.autograd, "_engine_run_backward", counting)
    monkeypatch.setattr(torch.autograd.graph, "_engine_run_backward", counting)
    with _Kernels() as k:
        fn()
    monkeypatch.undo()
    return calls, k.count


def _reaches(root, target) -> bool:
    seen, todo = {root}, [root]
    while todo:
        for child, _ in todo.pop().next_functions:
            if child is target:
                return True
            if child is not None and child not in seen:
                seen.add(child)
                todo.append(child)
    return False


@pytest.mark.parametrize("blocks", [2, 4])
def test_split_runs_the_kernels_of_one_backward_and_walks_the_graph_once(blocks, monkeypatch):
    """I + W launch exactly B's kernels, op by op (no recomputation, copy or cast more), under bf16
    autocast over fp32 weights as the executor runs them; I is one autograd call, and no call of W
    starts where it could walk the activations' graph (none of its roots reaches the stage input:
    one call per weight group from the intermediates walked the graph below each, O(blocks^2))."""
    model, chunk = _chunk("llama", "none", last=True, dtype=torch.float32, n_layers=blocks)
    chunk = Chunk(model, stage=1, num_stages=2, blocks=range(blocks))
    x0, y, seed = (t.float() if t.is_floating_point() else t for t in _inputs(last=True))
    for p in chunk.weights():
        p.grad = torch.zeros_like(p)  # accumulated into, as for every micro-batch after a step's first

    def forward(saved=None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _forward(chunk, x0, y, saved)

    x, out = forward()
    b_calls, b_kernels = _engine_calls_and_kernels(lambda: torch.autograd.backward(out, seed), monkeypatch)
    saved = SplitSaved({})
    x, out = forward(saved)
    plan = []
    i_calls, i_kernels = _engine_calls_and_kernels(
        lambda: plan.append(backward_input(out, seed, x, chunk.weights(), saved)), monkeypatch)
    x_node = torch.autograd.graph.get_gradient_edge(x).node
    assert all(t.grad_fn is None for item in plan[0] for t in item.done or () if t is not None), \
        "what I hands to W must not carry a graph (it would hold the gradients it was made from)"
    w_calls, w_kernels = _engine_calls_and_kernels(lambda: backward_weight(plan[0]), monkeypatch)
    assert i_kernels + w_kernels == b_kernels
    assert len(i_calls) == len(b_calls) == 1
    w_roots = [edge.node for roots in w_calls for edge in roots]
    assert w_roots and not any(_reaches(node, x_node) for node in w_roots)


def _rules_graph(ws: dict, x: torch.Tensor) -> torch.Tensor:
    """Every weight-side case of weight_rules.py, and one node without a rule (bmm, run by autograd)."""
    h = ws["left_t"].t() @ (ws["left"] @ x)                         # MmBackward0, weight on the left (side 0)
    h = torch.nn.functional.linear(h, ws["lin"], ws["bias"])        # AddmmBackward0: weight and bias
    h = torch.addmm(ws["bias"], h, ws["right"], beta=0.5, alpha=2)  # AddmmBackward0, row-major weight, alpha, beta
    h = ws["scale"] * h * ws["scale"]                               # MulBackward0, weight on both sides
    h = torch.nn.functional.layer_norm(h, (h.shape[-1],), ws["ln_w"], ws["ln_b"])
    return torch.bmm(h.unsqueeze(0), ws["batched"].unsqueeze(0)).squeeze(0)  # BmmBackward0: autograd


def test_weight_rules_equal_autograd_and_a_shared_weight_without_rule_is_refused():
    g = torch.Generator().manual_seed(0)
    shapes = {"left": (6, 6), "left_t": (6, 6), "lin": (5, 5), "bias": (5,), "right": (5, 5), "scale": (5,),
              "ln_w": (5,), "ln_b": (5,), "batched": (5, 4)}
    ws = {k: torch.randn(s, dtype=torch.float64, generator=g).requires_grad_() for k, s in shapes.items()}
    x0, seed = torch.randn(6, 5, dtype=torch.float64, generator=g), torch.randn(6, 4, dtype=torch.float64, generator=g)
    x = x0.clone().requires_grad_()
    torch.autograd.backward(_rules_graph(ws, x), seed)
    full = {k: w.grad.clone() for k, w in ws.items()}
    full_x = x.grad.clone()
    for w in ws.values():
        w.grad = None
    x = x0.clone().requires_grad_()
    plan = backward_input(_rules_graph(ws, x), seed, x, list(ws.values()))
    assert torch.allclose(x.grad, full_x, rtol=1e-12, atol=1e-14)
    assert {item.node.name() for item in plan} == set(RULES) - {"FusedRmsNormBackward0"} | {"BmmBackward0"}
    backward_weight(plan)
    for k, w in ws.items():
        assert torch.allclose(w.grad, full[k], rtol=1e-12, atol=1e-14), k

    x = x0.clone().requires_grad_()
    shared = ws["left"][:5, :5].unsqueeze(0)  # one node feeding two nodes without a rule
    out = torch.bmm(torch.bmm(x.unsqueeze(0), shared), shared)
    with pytest.raises(RuntimeError, match="no weight-gradient rule for BmmBackward0"):
        backward_input(out.squeeze(0), torch.ones(6, 5, dtype=torch.float64), x, list(ws.values()))


@pytest.mark.parametrize("keepdim", [True, False])
def test_fused_rms_norm_rule_equals_autograd(keepdim):
    """F.rms_norm's CUDA kernel (FusedRmsNormBackward0, absent on CPU): the rule on a node holding what
    it saves, against autograd through torch's composite of the same op; its rstd with or without
    the trailing 1."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 8, generator=g), torch.randn(8, generator=g).requires_grad_()
    seed = torch.randn(2, 3, 8, generator=g)
    y, rstd = torch._fused_rms_norm(x, [8], w, 1e-5)
    (ref,) = torch.autograd.grad(y, w, seed)
    node = SimpleNamespace(_saved_input=x, _saved_result1=rstd if keepdim else rstd.squeeze(-1),
                           _saved_normalized_shape=[8], _saved_weight=w.detach())
    (got,) = RULES["FusedRmsNormBackward0"](node, (seed, None), [1])
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_a_rule_whose_node_lacks_what_it_reads_falls_back_to_autograd(monkeypatch):
    """Another torch may save a node's tensors under other names: then autograd runs that node into
    its weight-side edges, with the same gradients."""
    from teratrain.parallel.pipeline import weight_rules

    monkeypatch.setitem(weight_rules._READS, "MmBackward0", ("_saved_self", "_saved_in_another_torch"))
    monkeypatch.setattr(weight_rules, "_usable", {})
    model, chunk = _chunk("llama", "none", last=False)
    x0, y, seed = _inputs(last=False)
    x, out = _forward(chunk, x0, y)
    torch.autograd.backward(out, seed)
    full = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    saved = SplitSaved()
    x, out = _forward(chunk, x0, y, saved)
    plan = backward_input(out, seed, x, chunk.weights(), saved)
    assert {item.node.name() for item in plan if item.rule is None} == {"MmBackward0"}
    backward_weight(plan)
    for n, p in model.named_parameters():
        if n in full:
            assert torch.allclose(p.grad, full[n], rtol=1e-10, atol=1e-14), n
