"""Per-rank model-state bytes, counted from live tensors, equal the ZeRO formulas (Rajbhandari et
al. 2019, sec. 5) up to padding, on every rank of 2 and 4. Psi = parameters, N = data-parallel ranks.

fp32 AdamW (no master copies):      bf16 (+ fp32 masters under ZeRO):    bf16, parallel.grad_dtype=bf16:
  stage  params  grads   opt         params  grads   opt                  params  grads   opt
    0    4Psi    4Psi    8Psi         4Psi    4Psi    8Psi  (autocast)
    1    4Psi    4Psi    8Psi/N       2Psi    4Psi    12Psi/N              2Psi    2Psi    12Psi/N
    2    4Psi    4Psi/N  8Psi/N       2Psi    4Psi/N  12Psi/N              2Psi    2Psi/N  12Psi/N
    3    4Psi/N  4Psi/N  8Psi/N       0       4Psi/N  12Psi/N              0       2Psi/N  12Psi/N
Stage 1 reduce-scatters its full gradient buffer in place (Megatron-LM's distributed optimizer), so
its shard costs nothing more; with bf16 gradients stages 1 and 2 are the ZeRO paper's Table 1.
Padding adds under N elements per flat group; AdamW adds a 4-byte step counter per tensor piece.
The planner (`teratrain plan`) must predict rank 0's bytes exactly, padding and counters included."""

import pytest

from harness import run_ranks
from teratrain.config import load_config
from teratrain.models.transformer import count_params
from teratrain.planner.inputs import layout_of, shape_of, training_of
from teratrain.planner.states import model_states
from layout_workers import BASE, GPT2, train_random
from workers import TINY, train_many

FORMULAS = {  # (precision, grad_dtype, stage) -> (params, grads, optimizer) in bytes per parameter, as functions of N
    ("fp32", "fp32", 0): lambda n: (4, 4, 8), ("fp32", "fp32", 1): lambda n: (4, 4, 8 / n),
    ("fp32", "fp32", 2): lambda n: (4, 4 / n, 8 / n), ("fp32", "fp32", 3): lambda n: (4 / n, 4 / n, 8 / n),
    ("bf16", "fp32", 0): lambda n: (4, 4, 8), ("bf16", "fp32", 1): lambda n: (2, 4, 12 / n),
    ("bf16", "fp32", 2): lambda n: (2, 4 / n, 12 / n), ("bf16", "fp32", 3): lambda n: (0, 4 / n, 12 / n),
    ("bf16", "bf16", 1): lambda n: (2, 2, 12 / n), ("bf16", "bf16", 2): lambda n: (2, 2 / n, 12 / n),
    ("bf16", "bf16", 3): lambda n: (0, 2 / n, 12 / n),
}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.long)])
def test_state_bytes_follow_zero_formulas(world, dist_workdir):
    cases = list(FORMULAS)
    runs = [([f"memory.precision={prec}", f"parallel.grad_dtype={grads}", f"parallel.zero={stage}", "train.steps=1"],
             str(dist_workdir / f"b{world}-{prec}-{grads}-{stage}")) for prec, grads, stage in cases]
    per_rank = run_ranks(train_many, world, runs)
    psi = count_params(load_config(None, TINY).model)["total"]
    for i, case in enumerate(cases):
        cfg = load_config(None, TINY + runs[i][0])
        planned = model_states(shape_of(cfg), training_of(cfg), layout_of(cfg, world),
                               device="cpu")
        rank0 = per_rank[0][i]["bytes"]
        keys = ("params", "grads", "optimizer")
        assert {k: rank0[k] for k in keys} == {k: planned[k] for k in keys}, f"planner vs live, {case}"
        expected = [b * psi for b in FORMULAS[case](world)]
        for rank, results in enumerate(per_rank):
            got = results[i]["bytes"]
            for key, want in zip(("params", "grads", "optimizer"), expected):
                slack = 8 * 4 * world + 1024  # padding of a few groups + AdamW step counters
                assert abs(got[key] - want) <= slack, (
                    f"{case} rank {rank}/{world}: {key} = {got[key]} B, formula {want:.0f} B")


TP_LAYOUTS = {
    2: [["parallel.tp=2"], ["parallel.tp=2", "parallel.sequence_parallel=false", "memory.precision=bf16"],
        ["parallel.tp=2", "lora.rank=4", "parallel.zero=2"],
        ["parallel.tp=2", "parallel.tp_form=all-reduce"], GPT2 + ["parallel.tp=2", "parallel.zero=1"]],
    4: [["parallel.tp=4"], ["parallel.tp=2", "parallel.zero=1", "memory.precision=bf16"],
        ["parallel.tp=2", "parallel.zero=2"], ["parallel.tp=2", "parallel.zero=3", "memory.precision=bf16"],
        GPT2 + ["parallel.tp=2", "parallel.zero=3"]],
}


def _bytes_of_layouts(rank: int, world: int, layouts: list[list[str]]) -> list[dict]:
    return [train_random(rank, world, lay, steps=1)["bytes"] for lay in layouts]


@pytest.mark.parametrize("world", [2, 4])
def test_planner_predicts_tensor_parallel_bytes(world):
    """Tensor-parallel layouts (vocabulary padded, key/value heads replicated at tp=4, sequence-
    parallel norms sharded over dp x tp): the planner's rank-0 bytes equal the live ones exactly."""
    layouts = TP_LAYOUTS[world]
    live = run_ranks(_bytes_of_layouts, world, layouts)[0]
    for lay, got in zip(layouts, live):
        cfg = load_config(None, BASE + lay)
        planned = model_states(shape_of(cfg), training_of(cfg), layout_of(cfg, world),
                               device="cpu")
        keys = ("params", "grads", "optimizer")
        assert {k: got[k] for k in keys} == {k: planned[k] for k in keys}, lay
