"""The deduplicated expert-parallel exchange (parallel.ep_dedup, parallel/expert_dedup.py) against one
process on the same global batch, where dedup matters: 8 experts, top-4, so a token's 4 choices fall
on 2 of the ep=2 ranks (4 experts each) or on 1 to 4 of the ep=4 ranks (2 each). Dropless (the
counted exchange) and with a capacity (the padded one, drops), whole and cut into pipelined chunks
(parallel.ep_overlap_chunks), with a shared expert, sigmoid scores and the expert bias of
auxiliary-loss-free balancing; the per-choice exchange (ep_dedup=false) on the same layouts; and
the rows the forward dispatch sends counted against the distinct (token, rank) pairs of the routing.

Tolerance: test_expert_parallel's, 1e-5 relative on every step's loss, 2e-5 on every final parameter
tensor (AdamW's 1/sqrt(v) there, as its docstring says)."""

import pytest
import torch
from harness import run_ranks
from layout_workers import build, train_random
from test_expert_parallel import _compare

DEDUP = ["model.moe.num_experts=8", "model.moe.router=softmax-topk", "model.moe.top_k=4", "optim.weight_decay=0.0"]
DROPS = DEDUP + ["model.moe.capacity_factor=1.0"]
SHARED = DEDUP + ["model.moe.expert_d_ff=16", "model.moe.shared_experts=1", "model.moe.score=sigmoid",
                  "model.moe.balance=bias", "model.moe.bias_rate=0.01"]
STEPS = 3


def test_ep2_dedup_dropless_capacity_chunked_shared_and_per_choice():
    """ep=2: dropless and with drops, each whole and in 3 chunks; shared expert with the expert bias;
    the per-choice exchange on the dropless and capacity layouts. All equal one process (losses,
    parameters, capacity drops) and the bias one value on both ranks."""
    layouts = [DEDUP + ["parallel.ep=2"], DROPS + ["parallel.ep=2"],
               DEDUP + ["parallel.ep=2", "parallel.ep_overlap_chunks=3"],
               DROPS + ["parallel.ep=2", "parallel.ep_overlap_chunks=3"],
               DEDUP + ["parallel.ep=2", "parallel.ep_dedup=false"], DROPS + ["parallel.ep=2", "parallel.ep_dedup=false"],
               SHARED + ["parallel.ep=2"]]
    runs = _compare(layouts, world=2, param_tol=2e-5, steps=STEPS, routing_seed=True)
    assert runs[1]["moe"]["dropped"] > 0 and runs[0]["moe"]["dropped"] == 0, "the capacity case must drop"
    biases, ref = runs[-1]["expert_bias"], train_random(0, 1, SHARED, steps=STEPS)["expert_bias"][0]
    assert biases[0] == biases[1] == ref and any(any(b) for b in ref.values()), "expert bias: moved, one value"


def test_ep4_dedup_dropless_capacity_chunked_shared():
    """ep=4 (2 experts a rank): dropless whole and in 2 chunks, with drops in 3 chunks (empty ones at
    16-token micro-batches), the shared expert with the bias, and ZeRO-2 beside it."""
    layouts = [DEDUP + ["parallel.ep=4"], DEDUP + ["parallel.ep=4", "parallel.ep_overlap_chunks=2"],
               DROPS + ["parallel.ep=4", "parallel.ep_overlap_chunks=3"], SHARED + ["parallel.ep=4"],
               DROPS + ["parallel.ep=4", "parallel.zero=2"]]
    _compare(layouts, world=4, param_tol=2e-5, steps=STEPS, routing_seed=True)


def _count_rows(rank: int, world: int, overrides: list[str]) -> tuple[list[int], list[int]]:
    """One forward of each MoE layer on a micro-batch: (rows its first all-to-all sends from this rank,
    distinct (token, rank holding the expert) pairs of its routed choices), per layer."""
    from teratrain.models.moe import moe_layers
    from teratrain.parallel import comm

    cfg, rt, model, _ = build(overrides)
    sent, pairs, launch = [], [], comm.launch_rows
    local = cfg.model.moe.num_experts // rt.dims.ep

    def counted(x, out_splits, in_splits, group):
        if len(sent) < len(pairs):  # the layer's dispatch (its combine follows)
            sent.append(sum(in_splits))
        return launch(x, out_splits, in_splits, group)

    def routed(module, args, r):
        chosen = {(t, int(e) // local) for t, (row, ok) in enumerate(zip(r.experts, r.routed)) for e, o in zip(row, ok) if o}
        pairs.append(len(chosen))

    comm.launch_rows = counted
    for _, layer in moe_layers(model):
        layer.router.register_forward_hook(routed)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.model.seq_len),
                           generator=torch.Generator().manual_seed(rank))
    model(tokens)
    comm.launch_rows = launch
    return sent, pairs


@pytest.mark.parametrize("world", [2, 4])
def test_rows_sent_are_the_distinct_token_rank_pairs(world):
    """The dropless dispatch sends exactly one row per distinct (token, rank) pair of the routing, on
    every rank and layer, fewer than the routed choices (top-4: 4 a token)."""
    layout = DEDUP + [f"parallel.ep={world}", "model.moe.every=1"]
    for sent, pairs in run_ranks(_count_rows, world, layout):
        assert sent == pairs and len(pairs) == 2, (sent, pairs)
        assert all(p < 4 * 2 * 16 for p in pairs)  # micro-batch 2 x 16 tokens, 4 choices each


@pytest.mark.long
def test_ep2_dedup_compiled():
    """train.compile (aot_eager, one graph, no graph break; test_moe_compile.py's check): the padded
    deduplicated exchange, N slots per destination rank dropless and min(N, n/ep x capacity) with
    drops, the latter in 2 chunks, and the per-choice one (N slots per expert), and the shared expert
    traced between the dispatch and its landing; equal to one process eager."""
    from test_moe_compile import _compare as compiled_compare

    compiled_compare([DEDUP + ["parallel.ep=2"], DROPS + ["parallel.ep=2", "parallel.ep_overlap_chunks=2"],
                      DEDUP + ["parallel.ep=2", "parallel.ep_dedup=false"],  # N slots per expert
                      SHARED + ["parallel.ep=2"]], world=2)


def _event_order(rank: int, world: int, overrides: list[str]) -> list[str]:
    """One forward: the order in which each MoE layer launches and lands its exchanges' rows and runs
    its shared expert."""
    from teratrain.models.moe import moe_layers
    from teratrain.parallel import comm

    cfg, _, model, _ = build(overrides)
    events, launch, land = [], comm.launch_rows, comm.land_rows

    def launched(*a):
        events.append("launch")
        return launch(*a)

    def landed(*a):
        events.append("land")
        return land(*a)

    comm.launch_rows, comm.land_rows = launched, landed
    for _, layer in moe_layers(model):
        layer.shared_expert.register_forward_hook(lambda *_: events.append("shared"))
    try:
        model(torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank)))
    finally:
        comm.launch_rows, comm.land_rows = launch, land
    return events


@pytest.mark.parametrize("dedup, chunks", [("true", 1), ("false", 2)])
def test_shared_experts_run_while_the_dispatch_moves(dedup, chunks):
    """Every dispatch is launched before the shared expert runs, and its rows land after: the shared
    experts' GEMMs overlap the exchange (ep_pipeline.pipeline), on both exchanges, whole and chunked."""
    layout = SHARED + ["parallel.ep=2", f"parallel.ep_dedup={dedup}", f"parallel.ep_overlap_chunks={chunks}"]
    for events in run_ranks(_event_order, 2, layout):
        layer = ["launch"] * chunks + ["shared"] + ["land", "launch"] * chunks + ["land"] * chunks
        assert events == layer * (len(events) // len(layer)) and len(events) >= len(layer), events
