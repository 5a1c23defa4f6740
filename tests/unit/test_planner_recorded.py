"""The planner against recorded GPU measurements: bench/results/planner_validate_h200x4.json (28
layouts of `bench/planner_validate.py --gpus 4` on 4 x H200, torch 2.11) recomputed here with today's
planner and the terms that run measured. A change to the memory or time model that loses a row the
model now predicts within issue 24's targets (peak memory 5%, step time 15%) fails here; the counts
are what the model reached (docs/planner.md has the table), fit rows and held-out rows apart."""

import functools
import json
from pathlib import Path

import pytest

from teratrain.planner.refit import _prepared, result_gpu
from teratrain.planner.search import evaluate

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
RESULT = RESULTS / "planner_validate_h200x4.json"
# (fit rows, held-out rows) within the target, of (15, 13). Its two ZB-H1 rows ran before ZB-H1's memory
# change (every micro-batch held whole until its W), which the planner no longer counts (-23.0%, -9.1%).
REACHED = {"peak": (14, 11), "step": (12, 8)}  # step: without BEFORE_ZB_REWRITE's two rows
TARGET = {"peak": 0.05, "step": 0.15}
# The same 28 layouts on 4 x H100 (the next session, after the refit from the H200 rows: every row out
# of sample for the card). Its ZB-H1 rows ran after ZB-H1's memory change but before the head's weight
# gradient moved into I (parallel/pipeline/stage.py `early_weights`) and the received activation was
# freed at I: the planner, which counts both, is 6.7% and 2.5% under them (counting the code those rows
# ran, 1.9% and 1.0% under; +25.4% and +4.3% before it counted what W waits with). Its tp rows ran on a
# host faster than the fitted per-collective cost (+20-28%).
H100 = RESULTS / "planner_validate_h100x4.json"
REACHED_H100 = {"peak": (14, 12), "step": (12, 10)}
# The H200 rows of ZB-H1 ran the weight pass before it became one autograd call plus B's own weight
# kernels (parallel/pipeline/weight_rules.py): code that no longer exists, so their step times are not
# compared (their memory is).
BEFORE_ZB_REWRITE = {"pp4 zb-h1 m8", "pp2 tp2 zb-h1 m8"}
# 27 layouts of `bench/planner_validate.py --gpus 2` on 2 x H200 (this planner never fitted to them)
H200X2 = RESULTS / "planner_validate_h200x2.json"
REACHED_H200X2 = {"peak": (15, 10), "step": (11, 10)}


@functools.cache
def _errors(path: Path) -> list[dict]:
    result = json.loads(path.read_text())
    gpu = result_gpu(result)
    out = []
    for shape, train, lay, row in _prepared(result):
        cand = evaluate(shape, train, lay, gpu)
        out.append({"name": row["name"], "held_out": row["held_out"],
                    "peak": cand.memory.peak_allocated / 2**30 / row["measured_peak_gib"] - 1,
                    "step": cand.time.step_time_s / row["measured_step_s"] - 1})
    return out


@pytest.fixture(scope="module")
def errors() -> list[dict]:
    return _errors(RESULT)


@pytest.mark.parametrize("what", ["peak", "step"])
@pytest.mark.parametrize("card", ["h200", "h100", "h200x2"])
def test_recorded_rows_stay_within_the_targets(errors, what, card):
    rows, reached, sizes = {"h200": (errors, REACHED, (15, 13)), "h100": (_errors(H100), REACHED_H100, (15, 13)),
                            "h200x2": (_errors(H200X2), REACHED_H200X2, (15, 12))}[card]
    if card == "h200" and what == "step":
        rows = [e for e in rows if e["name"] not in BEFORE_ZB_REWRITE]
        sizes = (14, 12)
    fit = [e for e in rows if not e["held_out"]]
    held = [e for e in rows if e["held_out"]]
    assert (len(fit), len(held)) == sizes
    got = tuple(sum(abs(e[what]) <= TARGET[what] for e in group) for group in (fit, held))
    missed = {e["name"]: round(100 * e[what], 1) for e in rows if abs(e[what]) > TARGET[what]}
    assert got[0] >= reached[what][0] and got[1] >= reached[what][1], f"{what}: {got} within target; out: {missed}"


def test_pipeline_memory_follows_the_schedule(errors):
    """Every pipeline schedule's peak within 5%, these three within 4%: GPipe's last rank holds all m
    micro-batches with their logits, 1F1B's first rank p of them (planner/memory.py); before, the
    planner gave every pp4 schedule of m <= p the same peak. ZB-H1's rows ran older code (above):
    what its ranks hold is checked against live bytes on CPU (tests/dist/test_pipeline_held_planner.py)."""
    pipes = {e["name"]: e["peak"] for e in errors if e["name"].startswith("pp4") and "zb-h1" not in e["name"]}
    assert len(pipes) == 8 and max(abs(v) for v in pipes.values()) < 0.05
    for name in ("pp4 1f1b m4", "pp4 gpipe m4", "pp4 gpipe m8"):
        assert abs(pipes[name]) < 0.04, (name, pipes[name])
