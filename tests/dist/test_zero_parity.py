"""ZeRO stages 0-3 (and CPU offload) on 2 and 4 gloo ranks against one process on the same global
batch: fp32, 10 steps, gradient accumulation, global-norm clipping.

Tolerance: 1e-5 relative on every step's loss and on every final parameter tensor (||a-b|| / ||b||).
Measured: losses ~1e-7; parameters ~2e-8 with SGD and ~1e-6 with AdamW. AdamW runs with eps=1e-6:
it divides each element by its own gradient scale, so an element whose gradient is a near-cancelling
sum (|g| << eps) turns fp32 summation-order rounding (a different reduction order across ranks) into
an update difference amplified by up to 1/eps; with the default eps=1e-8 a few dozen embedding
entries differ by ~1e-4 and the worst tensor reaches ~1e-5."""

import pytest

from teratrain.config import load_config

from harness import run_ranks
from workers import max_rel_diff, reference, train_many

TOL = 1e-5
LAYOUTS = [["parallel.zero=0"], ["parallel.zero=1"], ["parallel.zero=2"], ["parallel.zero=3"],
           ["parallel.zero=2", "parallel.offload=optimizer"], ["parallel.zero=3", "parallel.offload=params"]]
# waiting for each reduction where it is launched: the same launch order at any world size, so 2 ranks
SERIAL = [["parallel.zero=0", "parallel.overlap_comm=false"], ["parallel.zero=3", "parallel.overlap_comm=false"]]


@pytest.mark.parametrize("world, optim", [(2, "adamw"), pytest.param(2, "sgd", marks=pytest.mark.long),
                                          pytest.param(4, "adamw", marks=pytest.mark.long), (4, "sgd")])
def test_zero_stages_match_single_process(world, optim, dist_workdir):
    common = [f"optim.name={optim}", "optim.lr=0.01", "optim.eps=1e-6"]
    ref = reference(common, str(dist_workdir / f"ref-{world}-{optim}"))
    layouts = LAYOUTS + (SERIAL if world == 2 else [])
    runs = [(common + lay, str(dist_workdir / f"w{world}-{optim}-{i}")) for i, lay in enumerate(layouts)]
    results = run_ranks(train_many, world, runs)[0]
    for layout, got in zip(layouts, results):
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
        assert len(got["losses"]) == len(ref["losses"]) == 10
        assert loss_err < TOL, f"{layout}: losses differ by {loss_err:.2e}"
        param_err = max_rel_diff(got["params"], ref["params"])
        assert param_err < TOL, f"{layout}: parameters differ by {param_err:.2e}"


def test_low_precision_reduction_stays_close(dist_workdir):
    """reduce_dtype=bf16 with gradient accumulation: the first reduction of each step goes through a
    temporary (the shard is fp32) and must replace, not add to, the previous step's shard. bf16 keeps
    8 mantissa bits, so the tolerance is 2e-2 relative (measured ~5e-3 to 9e-3)."""
    ref = reference(["optim.name=sgd", "optim.lr=0.01"], str(dist_workdir / "ref-bf16-reduce"))
    # zero=0 in many small buckets: more reductions of cast copies in flight than the engine lets run
    layouts = [[f"parallel.zero={z}", "parallel.reduce_dtype=bf16"] + (["parallel.bucket_mb=0.001"] if z == 0 else [])
               for z in (0, 1, 2, 3)]
    runs = [(["optim.name=sgd", "optim.lr=0.01"] + lay, str(dist_workdir / f"bf16-reduce-{i}")) for i, lay in enumerate(layouts)]
    for layout, got in zip(layouts, run_ranks(train_many, 2, runs)[0]):
        err = max_rel_diff(got["params"], ref["params"])
        assert err < 2e-2, f"{layout}: parameters differ by {err:.2e}"


def test_bf16_gradients_stay_close(dist_workdir):
    """parallel.grad_dtype=bf16 (bf16 parameters with fp32 masters; micro-batches accumulate in
    bf16; stage 1 reduce-scatters its bf16 buffer in place, in bf16 or through an fp32 copy; the
    optimizer sees one group's fp32 copy at a time, on the host when offloaded) against one process
    keeping bf16 parameters and gradients with fp32 masters (memory.master_weights=true), on 2 ranks
    with 4 micro-batches each, SGD, 4 steps. Tolerance 1e-3 relative on losses and parameters:
    measured ~1e-5 and ~1.4e-4 (ZeRO with fp32 gradients: ~1.3e-4), the rounding of bf16 sums in
    another order. (AdamW with eps=1e-6 turns that rounding into ~2e-2 parameter differences, with
    fp32 gradients as well: see the module docstring.)"""
    common = ["optim.name=sgd", "optim.lr=0.01", "memory.precision=bf16", "train.steps=4"]
    ref = reference(common + ["memory.master_weights=true"], str(dist_workdir / "ref-bf16-grads"))
    layouts = [["parallel.zero=1"], ["parallel.zero=1", "parallel.reduce_dtype=bf16"], ["parallel.zero=3"],
               ["parallel.zero=2", "parallel.offload=optimizer"]]
    runs = [(common + ["parallel.grad_dtype=bf16"] + lay, str(dist_workdir / f"bf16-grads-{i}"))
            for i, lay in enumerate(layouts)]
    for layout, got in zip(layouts, run_ranks(train_many, 2, runs)[0]):
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
        assert loss_err < 1e-3, f"{layout}: losses differ by {loss_err:.2e}"
        err = max_rel_diff(got["params"], ref["params"])
        assert err < 1e-3, f"{layout}: parameters differ by {err:.2e}"


def test_eval_loss_matches_with_uneven_eval_batches(dist_workdir):
    """3 held-out micro-batches over 2 ranks under ZeRO-3 (every forward all-gathers parameters, so
    ranks must run the same number of forwards): same eval loss as one process, no hang."""
    import json
    from pathlib import Path

    extra = ["train.eval_batches=3", "train.steps=2", "parallel.timeout_s=60"]
    reference(extra, str(dist_workdir / "ref-eval"))  # writes the single-process eval loss
    run_ranks(train_many, 2, [(extra + ["parallel.zero=3"], str(dist_workdir / "eval-z3"))], timeout_s=180)

    def eval_loss(out):
        return json.loads((Path(out) / "metrics.jsonl").read_text().splitlines()[-1])["eval_loss"]

    a, b = eval_loss(dist_workdir / "eval-z3"), eval_loss(dist_workdir / "ref-eval")
    assert abs(a - b) <= 1e-5 * abs(b), (a, b)


def _layouts_run(rank: int, world: int, layouts: list[list[str]]) -> list[dict]:
    from layout_workers import train_random

    return [train_random(rank, world, lay) for lay in layouts]


@pytest.mark.parametrize("optim", ["adafactor", "sm3"])
def test_factored_optimizers_under_zero_shard_whole_parameters(optim):
    """Adafactor and SM3 keep row/column statistics of whole matrices, so ZeRO deals whole
    parameters to ranks (parallel/flat.py) instead of cutting flat ranges: ZeRO 1-3 (and offload)
    on 2 ranks equal one process (1e-5 relative; SGD-like steps, no eps amplification), and the
    planner's bytes equal the live ones."""
    from layout_workers import BASE, train_random
    from teratrain.planner.inputs import layout_of, shape_of, training_of
    from teratrain.planner.states import model_states

    common = [f"optim.name={optim}", "optim.lr=0.01"]
    layouts = [common + [f"parallel.zero={z}"] for z in (1, 2, 3)] + [common + ["parallel.zero=2", "parallel.offload=optimizer"]]
    got = run_ranks(_layouts_run, 2, layouts)[0]
    ref = train_random(0, 1, common)
    for lay, r in zip(layouts, got):
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])) < TOL, lay
        assert max_rel_diff(r["params"], ref["params"]) < TOL, lay
        cfg = load_config(None, BASE + lay)
        planned = model_states(shape_of(cfg), training_of(cfg), layout_of(cfg, 2), device="cpu")
        assert {k: r["bytes"][k] for k in ("params", "grads", "optimizer")} == \
               {k: planned[k] for k in ("params", "grads", "optimizer")}, lay
