"""The planner's count of the data-parallel engines' launches (planner/time.py `engine_launches`,
which the host's issue time charges) equals the collectives the engines launch in a real step on 2
gloo ranks: every ZeRO stage, 2 micro-batches a step, and MoE experts at ep=1 (reduced over the
replicas holding them) and ep=2 (held alone: nothing to reduce). The all-to-alls of expert
parallelism are the planner's other count (`issued_collectives`) and are left out here."""

import pytest

from harness import run_ranks
from layout_workers import BASE, count_launches
from teratrain.config import load_config
from teratrain.planner.inputs import layout_of, shape_of, training_of
from teratrain.planner.time import engine_launches

MOE = ["model.moe.num_experts=4", "model.moe.top_k=2"]
CASES = [[f"parallel.zero={z}"] for z in range(4)] + [MOE + ["parallel.ep=1"], MOE + ["parallel.ep=2", "parallel.zero=1"]]
ENGINE = ("all-reduce", "reduce-scatter", "all-gather")


@pytest.mark.slow
def test_planner_counts_the_launches_the_engines_make():
    seen = run_ranks(count_launches, 2, CASES)
    for sets, launched in zip(CASES, seen[0]):
        cfg = load_config(None, BASE + sets)
        planned = engine_launches(shape_of(cfg), training_of(cfg), layout_of(cfg, 2))
        assert sum(launched.get(k, 0) for k in ENGINE) == planned, (sets, launched, planned)
    assert seen[0] == seen[1]  # every rank launches the same collectives
