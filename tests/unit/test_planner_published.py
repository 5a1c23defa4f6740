"""The published runs (bench/published_runs.toml) and their table in docs/published_runs.md: the data is
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
    doc = (ROOT / "docs" / "published_runs.md").read_text()
    block = re.search(re.escape(published.BEGIN) + r"\n(.*?)\n" + re.escape(published.END), doc, re.DOTALL)
    assert block, "docs/published_runs.md lacks the published-runs markers"
    return block.group(1).splitlines()


def test_published_runs_are_consistent():
    for run in RUNS:
        assert run["tp"] * run["pp"] * run["dp"] * run["cp"] == run["gpus"], run["name"]
        assert run["global_batch"] % (run["dp"] * run["micro_batch"]) == 0, run["name"]
        assert run["split"] in ("fit", "held_out") and run["gpu"] in published.CARD, run["name"]
        assert run["figure"] in published.FIGURE_UNIT, run["name"]
        assert run["figure"] != "tflops_per_gpu" or run["flops"] in ("narayanan21", "dense6n"), run["name"]
    assert len({r["name"] for r in RUNS}) == len(RUNS)


def test_narayanan_flops_give_the_papers_aggregate():
    """Table 1's 1T row: the paper's 502 PFLOP/s aggregate over 3,072 GPUs rounds to the 163 TFLOP/s per GPU
    recorded; the step that rate takes for the row's batch follows from the paper's FLOP count."""
    run = next(r for r in RUNS if r["name"] == "narayanan21-1008b")
    assert round(502e3 / run["gpus"]) == run["value"]
    step = published.published_step_s(run)
    assert published.paper_flops(run) / (step * run["gpus"]) == pytest.approx(163e12)


def test_tokens_per_second_give_the_step_of_the_global_batch():
    """A tokens-per-second-per-GPU figure is the step of the run's global batch at that rate: llm-foundry's
    7B row states 85,144 tokens/s on 8 GPUs (10,643 a GPU) for 48 sequences of 2,048 tokens a step."""
    run = next(r for r in RUNS if r["name"] == "llmfoundry-mpt-7b")
    assert published.published_step_s(run) == pytest.approx(48 * 2048 / 85144, rel=1e-4)
    assert published.published_step_s({**run, "value": 2 * run["value"]}) == pytest.approx(
        published.published_step_s(run) / 2)
    with pytest.raises(ValueError, match="figure = 'tokens_per_s' is unknown"):
        published.published_step_s({**run, "figure": "tokens_per_s"})


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip("| ").split(" | ")]


def _within_ten_percent(cells: list[str]) -> bool:
    """A docs row's predicted step (column 7) within 10% of the published one (column 6)."""
    return abs(float(cells[6]) / float(cells[5]) - 1) <= 0.10


def test_docs_table_matches_the_command():
    """Every row's static columns, and the runs without a pipeline (cheap to plan) as planned, all but the
    planner's pick (a search: -m long checks it)."""
    lines = _docs_lines()
    assert len(lines) == len(RUNS) + 2 and lines[:2] == published.table([]).splitlines()
    cheap = [r for r in RUNS if r["pp"] == 1]
    fresh = dict(zip([r["name"] for r in cheap], published.table(published.rows(cheap, picks=False)).splitlines()[2:]))
    for run, line in zip(RUNS, lines[2:]):
        cells = _cells(line)
        assert cells[0].rstrip("*") == run["name"]
        if run["name"] in fresh:
            assert cells[:-2] == _cells(fresh[run["name"]])[:-2]
        assert published.published_step_s(run) == pytest.approx(float(cells[5]), abs=0.006), run["name"]


def test_the_pick_is_no_slower_where_the_published_layout_fits():
    """The planner's own pick of each run (bench/published.py FREE) is predicted no slower than the layout
    the paper ran, wherever that layout plans as fitting its card (the docs table, which -m long checks
    against the command)."""
    for line in _docs_lines()[2:]:
        cells = _cells(line)
        if cells[9] == "yes":
            assert float(cells[11]) <= float(cells[6]), cells[0]


# the papers whose rows calibrate the A100 (their fit rows and held-out rows alike)
CALIBRATION_SET = ("Narayanan et al. 2021", "Korthikanti et al. 2022")


def test_the_calibration_set_is_predicted_within_ten_percent():
    """Every run of the calibration set is predicted within 10% of its published step and plans as fitting
    its card, as it ran (the docs table, which -m long checks against the command)."""
    rows = [(run, _cells(line)) for run, line in zip(RUNS, _docs_lines()[2:]) if run["paper"] in CALIBRATION_SET]
    assert len(rows) == 18
    for run, cells in rows:
        assert _within_ten_percent(cells) and cells[9] == "yes", run["name"]


def test_the_readme_counts_are_the_docs_tables():
    """The README's line on published runs counts, per card, the runs the docs table predicts within 10%."""
    within = {}
    for run, line in zip(RUNS, _docs_lines()[2:]):
        hit = _within_ten_percent(_cells(line))
        got, total = within.get(run["gpu"], (0, 0))
        within[run["gpu"]] = (got + hit, total + 1)
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith(f"| planner against {len(RUNS)} published large runs"))
    assert f"A100 {within['a100'][0]} of {within['a100'][1]}, H100 {within['h100'][0]} of {within['h100'][1]}" in line


def test_the_plot_draws_the_runs_it_plans(tmp_path):
    """`--plot` draws the runs without a pipeline (cheap to plan) into a PNG; the docs' picture is drawn by it."""
    out = tmp_path / "runs.png"
    published.plot(published.rows([r for r in RUNS if r["pp"] == 1][:4], picks=False), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "(published_runs.png)" in (ROOT / "docs" / "published_runs.md").read_text()


@pytest.mark.long
def test_docs_table_is_the_command_output():
    assert _docs_lines() == published.table(published.rows()).splitlines()


def test_published_runs_are_planned_at_their_software_efficiency():
    """Each card of the published runs has the GEMM efficiency its published runs' software reached
    (calibration/published.toml), fitted on that card's fit runs alone, and bench/published.py plans the runs
    with it; the A100, without teratrain runs of its own, takes it as its preset too."""
    from teratrain.planner.hardware import GPUS, calibration

    entries = calibration("published")
    for gpu in sorted({r["gpu"] for r in RUNS}):
        eff = published.software_efficiency(gpu)
        assert set(eff) == {"flops_max", "flops_d_half"}, gpu
        run = next(r for r in RUNS if r["gpu"] == gpu)
        assert {k: getattr(published.card(run), k) for k in eff} == eff
        fit = [r["name"] for r in RUNS if r["gpu"] == gpu and r["split"] == "fit"]
        for key in eff:
            entry = entries[f"{gpu}_{key}"]
            assert {"term", "source", "runs", "fit_error"} <= set(entry)
            assert [name.split(": ")[1] for name in entry["runs"]] == fit, (gpu, key)
    assert {k: getattr(GPUS["a100"], k) for k in ("flops_max", "flops_d_half")} == published.software_efficiency("a100")
    assert GPUS["h100"].flops_max != published.software_efficiency("h100")["flops_max"]  # teratrain's own rate


def test_published_fit_recovers_known_constants():
    """Steps made by a known efficiency curve (step = 1 + 9 / eff at each run's width) give the curve back
    from bench/calibrate/published_fit.py's grid: the fit between the planned efficiencies."""
    sys.path.insert(0, str(ROOT / "bench" / "calibrate"))
    from published_fit import EFFS, fit, interpolate

    def step(eff):
        return 1 + 9 / eff

    fm, dh = 0.62, 1325.0
    curves = {d: (d, step(fm * d / (d + dh)), [(1 / e, step(e)) for e in EFFS]) for d in (2304, 8192, 20480)}
    assert interpolate(curves[2304][2], 1 / 0.55) == pytest.approx(step(0.55))
    got = fit(curves)
    assert got[0] == pytest.approx(fm, abs=0.006) and got[1] == pytest.approx(dh, abs=60) and got[2] < 1e-5


@pytest.mark.long  # twelve plans of Llama 3 405B: a minute on 2 cores
def test_llama3_rows_take_the_planners_fastest_virtual_stages():
    """The Llama 3 rows' virtual stages follow the rule their comment fixes: of the splits with one block
    fewer on the model's first and last chunk (v = 1, 2, 4, 8: 128 block slots over 16 x v chunks; at 8 the
    ends hold the embedding alone and the head alone, as the paper describes), the one it predicts fastest."""
    for run in (r for r in RUNS if r["name"].startswith("dubey24")):
        steps = {}
        for v in (1, 2, 4, 8):
            k = 128 // (run["pp"] * v)
            split = [k - 1] + [k] * (run["pp"] * v - 2) + [k - 1]
            steps[v] = published.plan({**run, "virtual_stages": v, "stage_layers": split}).time.step_time_s
        assert min(steps, key=steps.get) == run["virtual_stages"], (run["name"], steps)
        assert run["stage_layers"] == [0] + [1] * 126 + [0]
