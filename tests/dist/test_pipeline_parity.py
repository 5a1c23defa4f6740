"""The flush pipeline schedules (naive, GPipe, 1F1B, interleaved 1F1B, ZB-H1) against one process on
the same global batch: fp32, AdamW (SGD for the tied GPT-2, see test_tensor_parallel.py), 8 sequences
a step in 4 micro-batches of 2 per pipeline (2 with dp=2), clipping on; pp=2 and pp=4, alone and with
data parallelism (ZeRO 0-2; ZeRO-3, MoE, compression and compile: test_pipeline_compose.py) and tensor
parallelism (with and without sequence parallelism: without it the stage-to-stage messages are scattered
over the tp ranks and all-gathered after, p2p.Scatter), the chunked loss on the last stage, even and
uneven splits (`parallel.partition=profiled` on a layer count no stage count divides;
the planner's own split, handed over in `parallel.stage_layers` under naive, GPipe and interleaved 1F1B; the
asynchronous schedules' in test_pipeline_async.py), splits whose first stage holds the embedding alone or whose
last holds the head and the loss alone (alone, interleaved, tied, with tp and with ZeRO-3), tied embeddings held
at both ends, recomputation.

Tolerance: 1e-5 relative on every step's loss and every final parameter (gathered whole across
stages by `engine.full_params()`). Measured: pipelining alone is bitwise (each stage runs the same
kernels on the same micro-batches in the same order of accumulation); dp and tp add what they add
alone (up to ~2e-6, test_tensor_parallel.py)."""

from harness import run_ranks
from layout_workers import BASE, GPT2, train_random
from test_tensor_parallel import TOL, max_rel_diff

STEPS = 2
GPT2_SGD = GPT2 + ["optim.name=sgd", "optim.lr=0.05"]
UNEVEN = ["model.n_layers=3", "parallel.partition=profiled"]  # 3 blocks over 2 stages: 2 + 1 or 1 + 2
INTERLEAVED = ["parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2"]
# the model's first stage with the embedding alone, or its last with the head and the loss alone
FIRST_EMPTY, LAST_EMPTY = ["model.n_layers=3", "parallel.stage_layers=[0, 3]"], ["model.n_layers=3",
                                                                                "parallel.stage_layers=[3, 0]"]


def _planned_split(*more: str) -> list[str]:
    """5 blocks over 2 pipeline ranks, split as the planner splits them (planner/pipeline.py planned_split,
    which `parallel.auto` hands the executor): uneven, 3 + 2, or interleaved 1 + 1 + 2 + 1."""
    from teratrain.config import load_config
    from teratrain.planner.inputs import layout_of, shape_of
    from teratrain.planner.pipeline import planned_split

    sets = ["model.n_layers=5", "parallel.pp=2", *more]
    cfg = load_config(None, BASE + sets)
    split = list(planned_split(shape_of(cfg), layout_of(cfg, 2)))
    assert sum(split) == 5 and len(set(split)) > 1, split
    return ["model.n_layers=5", f"parallel.stage_layers={split}"]


SPLIT_5, SPLIT_5_V2 = _planned_split(), _planned_split(*INTERLEAVED)


def _compare(layouts: list[list[str]], world: int, check=None) -> list[dict]:
    """Each layout against one process (`check(layout, got, ref)`: more to compare, e.g. MoE statistics);
    rank 0's runs."""
    runs = run_ranks(_many, world, layouts)[0]
    refs = {}
    for layout, got in zip(layouts, runs):
        # the math; the reference computes the whole logits where a layout chunks its loss
        same = tuple(o for o in layout if not o.startswith(("parallel.", "memory.recompute", "memory.loss_chunks")))
        if same not in refs:
            refs[same] = train_random(0, 1, list(same), steps=STEPS)
        ref = refs[same]
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
        assert loss_err < TOL, f"{layout}: losses differ by {loss_err:.2e}"
        assert got["params"].keys() == ref["params"].keys(), f"{layout}: the gathered model misses parameters"
        param_err = max_rel_diff(got["params"], ref["params"])
        assert param_err < TOL, f"{layout}: parameters differ by {param_err:.2e}"
        if check is not None:
            check(layout, got, ref)
    return runs


def _many(rank: int, world: int, layouts: list[list[str]]) -> list[dict]:
    return [train_random(rank, world, layout, steps=STEPS) for layout in layouts]


def _pp(schedule: str, *more: str, pp: int = 2) -> list[str]:
    return [f"parallel.pp={pp}", f"parallel.schedule={schedule}", *more]



def test_every_flush_schedule_at_pp2():
    layouts = [_pp(s) for s in ("naive", "gpipe", "1f1b", "zb-h1")]
    layouts += [["parallel.pp=2", *INTERLEAVED, "model.n_layers=4"],
                _pp("1f1b", *UNEVEN), _pp("zb-h1", *UNEVEN, "memory.recompute=full"),
                _pp("gpipe", *SPLIT_5), _pp("naive", *SPLIT_5), ["parallel.pp=2", *INTERLEAVED, *SPLIT_5_V2],
                _pp("1f1b", "parallel.pipeline_recv=ahead"),  # receives posted one action early (p2p.py)
                _pp("1f1b", "memory.loss_chunks=3"), GPT2_SGD + _pp("zb-h1", "memory.loss_chunks=3"),  # chunked loss
                ["parallel.pp=2", *INTERLEAVED, "model.n_layers=4", "parallel.pipeline_recv=ahead"],
                GPT2_SGD + _pp("zb-h1"), GPT2_SGD + _pp("1f1b", "parallel.zero=2"), GPT2_SGD + ["parallel.pp=2", *INTERLEAVED, "model.n_layers=4",
                                                     "memory.recompute=selective"]]
    layouts += [_pp("1f1b", *FIRST_EMPTY), _pp("zb-h1", *LAST_EMPTY), _pp("gpipe", *LAST_EMPTY),
                GPT2_SGD + _pp("zb-h1", *FIRST_EMPTY),  # tied: stage 0 holds the embedding alone
                ["parallel.pp=2", *INTERLEAVED, "model.n_layers=4", "parallel.stage_layers=[0, 2, 2, 0]"]]
    _compare(layouts, world=2)


def test_pp4_and_pp2_with_dp2_or_tp2():
    layouts = [_pp("zb-h1", "model.n_layers=4", pp=4)]
    layouts += [["parallel.pp=4", *INTERLEAVED, "model.n_layers=8"],
                _pp("1f1b", "model.n_layers=5", "parallel.partition=profiled", pp=4)]
    # gpipe x dp=2 runs with ZeRO-3 in test_pipeline_compose.py; ZeRO-2 under a pipeline above (at pp=2)
    layouts += [_pp("1f1b", "parallel.dp=2"), _pp("zb-h1", "parallel.dp=2", "parallel.zero=1", *UNEVEN),
                GPT2_SGD + ["parallel.pp=2", "parallel.dp=2", "parallel.zero=1", *INTERLEAVED, "model.n_layers=4"]]
    layouts += [_pp("1f1b", "parallel.tp=2"), _pp("zb-h1", "parallel.tp=2", "parallel.sequence_parallel=false"),
                _pp("1f1b", "parallel.tp=2", "parallel.tp_overlap=chunked", "memory.recompute=full"),
                GPT2_SGD + ["parallel.pp=2", "parallel.tp=2", *INTERLEAVED, "model.n_layers=4"]]
    layouts += [_pp("1f1b", "parallel.tp=2", "parallel.stage_layers=[0, 2]"),
                _pp("zb-h1", "parallel.tp=2", "parallel.sequence_parallel=false", "parallel.stage_layers=[2, 0]"),
                _pp("1f1b", "parallel.dp=2", "parallel.zero=3", "memory.recompute=full", "parallel.stage_layers=[0, 2]")]
    _compare(layouts, world=4)
