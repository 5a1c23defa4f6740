"""Where the planner charges ZB-H1's split backward its host ops (planner/time.py OPS_SPLIT_EXTRA; the
count itself is checked live by tests/integration/test_bench_smoke.py)."""

import dataclasses

from teratrain.config import load_config
from teratrain.planner.hardware import GPUS
from teratrain.planner.inputs import shape_of, training_of
from teratrain.planner.layout import Layout
from teratrain.planner.search import evaluate
from teratrain.planner.time import OPS_SPLIT_EXTRA, split_ops


def _host(shape, train, lay) -> float:
    return evaluate(shape, train, lay, GPUS["h200"]).time.terms["host_s"]


def test_only_a_split_schedule_pays_the_host_for_it():
    cfg = load_config(None, ["model.preset=llama-1b", "model.n_layers=8", "train.global_batch=16",
                             "train.micro_batch=2"])
    shape, train = shape_of(cfg), training_of(cfg)
    lays = {s: Layout(pp=2, tp=2, micro_batch=2, num_microbatches=8, schedule=s) for s in ("1f1b", "zb-h1")}
    assert split_ops(shape, lays["1f1b"]) == 0
    assert split_ops(shape, lays["zb-h1"]) == 4 * OPS_SPLIT_EXTRA * 8  # 4 blocks a stage, 8 micro-batches
    extra = _host(shape, train, lays["zb-h1"]) - _host(shape, train, lays["1f1b"])
    assert abs(extra - 4 * OPS_SPLIT_EXTRA * 8 * GPUS["h200"].host_op_s) < 1e-12
    assert split_ops(shape, Layout(tp=2, micro_batch=2, num_microbatches=8, schedule="zb-h1")) == 0  # no pipeline
    graphed = dataclasses.replace(train, graphed=True, compiled=True)
    assert _host(shape, graphed, lays["zb-h1"]) == 0  # CUDA graphs: the host issues nothing
