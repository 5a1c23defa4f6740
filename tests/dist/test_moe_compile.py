"""train.compile with mixture-of-experts layers: the whole model (or at dp > 1 each block, the norm and
the loss: train.compile_scope) traces with fullgraph=True (no graph break: no read-back of routed
counts, the all-to-all a functional collective whose backward is the reverse all-to-all) and trains as
one process does, at ep=1 and ep=2, top-1 and top-2, with and without a capacity, with and without
recomputation. (The other routers, gpt2's biased experts and ep=2 top-1 compile too; left out to keep
this test's compiles few.)

The compiler is aot_eager, as in test_tensor_parallel.py: the traced forward and backward graphs run
eagerly (inductor would take minutes on 2 cores and check nothing more about the graphs). fp32, so the
experts' grouped GEMM is models/grouped_loop.py's operator (torch's `_grouped_mm` traces in bf16 only:
its CUTLASS kernel and its trace on Hopper are checked by bench/moe.py --compile on the GPUs).

Tolerance: 1e-5 relative on every step's loss and every final parameter tensor (test_tensor_parallel's
TOL); the graph-break counter (torch._dynamo.utils.counters) must stay at zero."""

import pytest
from harness import run_ranks
from layout_workers import BASE, train_random
from test_expert_parallel import TOP1, TOP2, TOP2_ALL
from test_tensor_parallel import TOL, compiled_worker, max_rel_diff

from teratrain.config import load_config
from teratrain.parallel.parallelize import compile_scope

STEPS = 2


def graphs(layout: list[str], world: int) -> int:
    """Graphs the compiled model makes: one (train.compile_scope model), or one per kind of block
    (MoE and dense) plus the final norm's and the loss's (block: parallelize.compile_units)."""
    cfg = load_config(None, BASE + layout + ["train.compile=true"])
    if compile_scope(cfg, world // cfg.parallel.tp) == "model":
        return 1
    return len({cfg.model.moe.is_moe_layer(i) for i in range(cfg.model.n_layers)}) + 2


def _compare(layouts: list[list[str]], world: int) -> None:
    runs = run_ranks(compiled_worker, world, layouts, {"steps": STEPS})[0]
    refs = {}
    for layout, got in zip(layouts, runs):
        assert (got["graph_breaks"], got["graphs"]) == (0, graphs(layout, world)), layout
        same = tuple(o for o in layout if not o.startswith(("parallel.", "memory.recompute")))
        if same not in refs:  # one process, eager
            refs[same] = train_random(0, 1, list(same), steps=STEPS)
        ref = refs[same]
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
        assert loss_err < TOL, f"{layout}: losses differ by {loss_err:.2e}"
        param_err = max_rel_diff(got["params"], ref["params"])
        assert param_err < TOL, f"{layout}: parameters differ by {param_err:.2e}"


@pytest.mark.long
def test_moe_compiled_is_one_graph_at_ep1_and_ep2():
    """ep=1 (dp=2, every expert on each rank): top-1 with drops under full recomputation (the block
    writes its aux loss and statistics inside the checkpoint). ep=2 (the all-to-all traced): top-2
    dropless (compiled: the padded exchange with N slots per expert), and top-2 with a capacity,
    recomputed, its exchange cut in 2 pipelined chunks."""
    layouts = [TOP1 + ["memory.recompute=full"], TOP2_ALL + ["parallel.ep=2"],
               TOP2 + ["parallel.ep=2", "memory.recompute=full", "parallel.ep_overlap_chunks=2"]]
    _compare(layouts, world=2)
