"""The published runs (bench/published_runs.toml) and their table in docs/planner.md: the data is
consistent, and the table in the docs is what `python bench/published.py --write-docs` writes (the rows
without a pipeline recomputed here, the rest under -m long)."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import published  # noqa: E402  (bench/published.py)

RUNS = published.load_runs()


def _docs_lines() -> list[str]:
    doc = (ROOT / "docs" / "planner.md").read_text()
    block = re.search(re.escape(published.BEGIN) + r"\n(.*?)\n" + re.escape(published.END), doc, re.S)
    assert block, "docs/planner.md lacks the published-runs markers"
    return block.group(1).splitlines()


def test_published_runs_are_consistent():
    for run in RUNS:
        assert run["tp"] * run["pp"] * run["dp"] * run["cp"] == run["gpus"], run["name"]
        assert run["global_batch"] % (run["dp"] * run["micro_batch"]) == 0, run["name"]
        assert run["split"] in ("fit", "held_out") and run["gpu"] in published.CARD, run["name"]
        assert run["figure"] == "step_s" or run["flops"] in ("narayanan21", "dense6n"), run["name"]
    assert len({r["name"] for r in RUNS}) == len(RUNS)


def test_narayanan_flops_give_the_papers_aggregate():
    """Table 1's 1T row: the paper's 502 PFLOP/s aggregate over 3,072 GPUs rounds to the 163 TFLOP/s per GPU
    recorded; the step that rate takes for the row's batch follows from the paper's FLOP count."""
    run = next(r for r in RUNS if r["name"] == "narayanan21-1008b")
    assert round(502e3 / run["gpus"]) == run["value"]
    step = published.published_step_s(run)
    assert published.paper_flops(run) / (step * run["gpus"]) == pytest.approx(163e12)


def test_docs_table_matches_the_command():
    """Every row's static columns, and the whole row of the runs without a pipeline (cheap to plan)."""
    lines = _docs_lines()
    assert len(lines) == len(RUNS) + 2 and lines[:2] == published.table([]).splitlines()
    cheap = [r for r in RUNS if r["pp"] == 1]
    fresh = dict(zip([r["name"] for r in cheap], published.table(published.rows(cheap)).splitlines()[2:]))
    for run, line in zip(RUNS, lines[2:]):
        cells = line.split(" | ")
        assert cells[0].lstrip("| ").rstrip("*") == run["name"]
        if run["name"] in fresh:
            assert line == fresh[run["name"]]
        assert published.published_step_s(run) == pytest.approx(float(cells[5]), abs=0.006), run["name"]


@pytest.mark.long
def test_docs_table_is_the_command_output():
    assert _docs_lines() == published.table(published.rows()).splitlines()
