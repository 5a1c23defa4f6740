"""train.compile_scope on 2 gloo ranks (aot_eager, fullgraph, as test_tensor_parallel.py compiles): at
dp=2 `auto` compiles each block apart (parallelize.compile_units), so the engine's gradient
reductions are launched while the backward is still running through earlier blocks, where one
compiled graph of the whole model hands every gradient over at its end; and the compiled run
matches one eager process on the same global batch, with ZeRO-3 too (each block's forward compiled,
its gather and free hooks eager around it)."""

import pytest
import torch

from harness import run_ranks
from layout_workers import batches, build, train_random
from test_tensor_parallel import TOL, compiled_worker, max_rel_diff

LAYOUT = ["model.n_layers=3", "parallel.bucket_mb=0.001", "train.compile=true"]  # a bucket a parameter or so


def compiled_nodes(loss: torch.Tensor) -> list:
    """The backward graph's compiled nodes (one a compiled region) below `loss`."""
    seen, todo, out = set(), [loss.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        out += [node] if "CompiledFunction" in node.name() else []
        todo += [n for n, _ in node.next_functions]
    return out


def launches_worker(rank: int, world: int, scopes: list[str]) -> dict:
    """Per scope, one compiled step: for each bucket reduction the engine launched, how many of the
    backward's compiled regions had finished by then, and how many there are."""
    compile_module = torch.nn.Module.compile
    torch.nn.Module.compile = lambda self, **_: compile_module(self, backend="aot_eager", fullgraph=True)
    try:
        return {scope: _launches(rank, scope) for scope in scopes}
    finally:
        torch.nn.Module.compile = compile_module


def _launches(rank: int, scope: str) -> dict:
    torch._dynamo.reset()
    cfg, rt, model, engine = build(LAYOUT + [f"train.compile_scope={scope}"])
    done, launched = [0], []
    launch = engine.order.launch
    engine.order.launch = lambda b: (launched.append(done[0]), launch(b))[-1]
    rows = batches(cfg, 1)[0][rank * 4:rank * 4 + 2]
    with engine.accumulate(last=True):
        loss = model(rows[:, :-1], rows[:, 1:])
        regions = compiled_nodes(loss)
        for node in regions:
            node.register_hook(lambda *_: done.__setitem__(0, done[0] + 1))
        engine.backward(loss)
    return {"launched_after": launched, "regions": len(regions), "buckets": len(engine.buckets)}


@pytest.mark.long
def test_block_scope_reduces_during_backward_and_matches_one_process_with_zero3_too():
    got = run_ranks(launches_worker, 2, ["block", "model"])[0]
    block, model = got["block"], got["model"]
    assert len(block["launched_after"]) == block["buckets"] > 6 and block["regions"] == 3 + 2, block
    # a reduction goes as soon as its bucket is complete, while blocks' backward is still to run
    early = [n for n in block["launched_after"] if n < block["regions"]]
    assert len(early) >= block["buckets"] // 2 and block["launched_after"][0] <= 2, block
    assert model["regions"] == 1 and set(model["launched_after"]) == {1}, model  # one graph: all at its end
    ref = train_random(0, 1, ["model.n_layers=3"], steps=2)
    # plain data parallelism, and ZeRO-3 (each block's forward compiled, its gather/free hooks eager around it)
    for got in run_ranks(compiled_worker, 2, [["model.n_layers=3"], ["model.n_layers=3", "parallel.zero=3"]],
                         {"steps": 2})[0]:
        assert got["graph_breaks"] == 0 and got["graphs"] == 3, got  # the blocks' one graph, the norm's, the loss's
        assert max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])) < TOL
        assert max_rel_diff(got["params"], ref["params"]) < TOL


def test_zero3_compiled_under_a_pipeline_matches_one_process():
    """pp=2 x dp=2 with ZeRO-3 (stages gathered for the step, parallel/zero_gather.py) and each block's
    forward compiled: the same losses and parameters as one eager process."""
    ref = train_random(0, 1, ["model.n_layers=4"], steps=2)
    got = run_ranks(compiled_worker, 4, [["model.n_layers=4", "parallel.pp=2", "parallel.zero=3"]], {"steps": 2})[0][0]
    assert got["graph_breaks"] == 0 and got["graphs"] == 1, got  # the blocks' one graph (a stage runs no head graph)
    assert max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])) < TOL
    assert max_rel_diff(got["params"], ref["params"]) < TOL
