"""bench/planner_multi.py `_read`: a host-paced row measured twice keeps its faster visit, every visit's
step and its first visit's, and the larger peak; the host probe's two passes merge the same way."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import planner_multi  # noqa: E402
from planner_multi import _read  # noqa: E402


def _row(step_s: float, peak: float, reserved: float, loop_us: float, freed: bool = True) -> dict:
    return {"measured_step_s": step_s, "step_times_s": [step_s] * 2, "host_loop_us": loop_us,
            "measured_peak_gib": peak, "measured_peak_per_rank_gib": [peak, peak - 0.1],
            "measured_reserved_gib": reserved, "outside_allocator_gib": 0.5, "left_allocated_gib": 0.0,
            "model_freed": freed}


def test_revisit_keeps_the_faster_visit_and_the_larger_peak(tmp_path):
    events = [{"record": "machine", "collectives": [], "world": 2},
              {"record": "probe", "name": "probe dp", "sets": [], **_row(0.05, 1.0, 1.5, 0.4)},
              {"record": "probe", "name": "probe dp", "sets": [], **_row(0.03, 1.0, 1.5, 0.3)},
              {"record": "start", "name": "tp2"},
              {"record": "row", "name": "tp2", **_row(0.30, 2.0, 3.0, 0.5)},
              {"record": "start", "name": "pp2"},
              {"record": "row", "name": "pp2", **_row(0.20, 4.0, 5.0, 0.4)},
              {"record": "start", "name": "moe"},
              {"record": "row", "name": "moe", **_row(0.10, 3.0, 4.0, 0.3)},
              {"record": "skipped", "name": "late"},
              {"record": "revisit", "name": "moe", **_row(0.12, 3.5, 3.5, 0.6, freed=False)},  # slower, larger peak
              {"record": "revisit", "name": "late", **_row(0.12, 1.0, 1.0, 0.6)},  # never measured here: ignored
              {"record": "revisit", "name": "tp2", **_row(0.20, 1.9, 3.2, 0.3)}]  # faster, a smaller peak
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    results = {}
    machine = _read(path, results, None)

    tp2 = results["tp2"]  # the revisit's figures, the first visit's peak
    assert tp2["measured_step_s"] == 0.20 and tp2["step_times_s"] == [0.20, 0.20] and tp2["host_loop_us"] == 0.3
    assert tp2["visits_s"] == [0.30, 0.20] and tp2["first_visit_step_s"] == 0.30
    assert tp2["measured_peak_gib"] == 2.0 and tp2["measured_reserved_gib"] == 3.2
    moe = results["moe"]  # the first visit's figures, the revisit's peak
    assert moe["measured_step_s"] == 0.10 and moe["host_loop_us"] == 0.3
    assert moe["visits_s"] == [0.10, 0.12] and moe["first_visit_step_s"] == 0.10
    assert moe["measured_peak_gib"] == 3.5 and moe["measured_reserved_gib"] == 4.0
    assert moe["measured_peak_per_rank_gib"] == [3.5, 3.4] and moe["model_freed"] is False  # a leak is kept
    assert tp2["measured_peak_per_rank_gib"] == [2.0, 1.9] and tp2["model_freed"] is True
    pp2 = results["pp2"]  # one visit
    assert pp2["visits_s"] == [0.20] and pp2["first_visit_step_s"] == 0.20 and pp2["measured_peak_gib"] == 4.0
    assert "skipped" in results["late"]
    (probe,) = machine["host_probe"]
    assert probe["name"] == "probe dp" and probe["measured_step_s"] == 0.03 and probe["passes_s"] == [0.05, 0.03]

    # the driver reads the whole file again after a relaunch: the same figures, not a third visit
    assert _read(path, results, None) == machine and results["tp2"] == tp2 and results["moe"] == moe


def test_a_relaunch_adds_a_probe_pass_and_a_visit(tmp_path):
    """A relaunch (run_rows' `relaunches`) appends its probe pass and its revisits to the same events
    file; a visit the deadline left no time for ("late") changes nothing."""
    events = [{"record": "machine", "collectives": [], "world": 2},
              {"record": "probe", "name": "probe dp", "sets": [], **_row(0.05, 1.0, 1.5, 0.4)},
              {"record": "start", "name": "tp2"},
              {"record": "row", "name": "tp2", **_row(0.30, 2.0, 3.0, 0.5)},
              {"record": "start", "name": "pp2"},
              {"record": "row", "name": "pp2", **_row(0.20, 4.0, 5.0, 0.4)},
              # the relaunch: the probe once, then the host-paced rows
              {"record": "probe", "name": "probe dp", "sets": [], **_row(0.04, 1.0, 1.5, 0.3)},
              {"record": "revisit", "name": "tp2", **_row(0.25, 2.0, 3.0, 0.3)},
              {"record": "late", "name": "pp2"}]
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    results = {}
    machine = _read(path, results, None)
    (probe,) = machine["host_probe"]
    assert probe["passes_s"] == [0.05, 0.04] and probe["measured_step_s"] == 0.04
    assert results["tp2"]["visits_s"] == [0.30, 0.25] and results["tp2"]["measured_step_s"] == 0.25
    assert results["pp2"]["visits_s"] == [0.20] and results["pp2"]["measured_step_s"] == 0.20


def _fake_jobs(monkeypatch, steps: dict) -> list[dict]:
    """Replace the torchrun job by one that writes what a worker would for its plan; the plans it got."""
    plans = []

    def launch(cmd, env, limit_s):
        plan = json.loads(open(cmd[-1]).read())
        plans.append(plan)
        with open(plan["out"], "a") as out:
            def emit(record):
                out.write(json.dumps(record) + "\n")
            if plan["measure_machine"]:
                emit({"record": "machine", "collectives": [], "world": 2})
            for p in plan["probes"] if plan.get("relaunch") else plan["probes"] * 2:
                emit({"record": "probe", "name": p["name"], "sets": [], **_row(0.05 - 0.01 * len(plans), 1, 1, 0.3)})
            for r in plan["rows"]:
                kind = "revisit" if plan.get("relaunch") else "row"
                emit({"record": kind, "name": r["name"], **_row(steps[r["name"]] * (1 + 0.1 * len(plans)), 1, 1, 0.3)})
        return 0

    monkeypatch.setattr(planner_multi, "_launch", launch)
    return plans


def test_run_rows_relaunches_the_host_paced_rows_in_alternating_order(monkeypatch):
    """After the main job, each relaunch runs the probe and only the rows marked for a revisit that the main
    job measured, forward first (the main job's own revisits ran in reverse), then reversed; none when the
    deadline leaves no time for a start, the probe and a row."""
    import time

    steps = {"tp2": 0.3, "pp2": 0.2, "moe": 0.1}
    rows = [{"name": "tp2", "sets": [], "est_s": 5.0, "revisit": True},
            {"name": "pp2", "sets": [], "est_s": 5.0, "revisit": False},
            {"name": "moe", "sets": [], "est_s": 5.0, "revisit": True}]
    probes = [{"name": "probe dp", "sets": []}]
    plans = _fake_jobs(monkeypatch, steps)
    machine, results = planner_multi.run_rows(rows, 2, smoke=True, steps=1, warmup=1, deadline=time.time() + 600,
                                              measure_machine=True, probes=probes, relaunches=2)
    assert [p.get("relaunch", False) for p in plans] == [False, True, True]
    assert [[r["name"] for r in p["rows"]] for p in plans[1:]] == [["tp2", "moe"], ["moe", "tp2"]]
    assert len(results["tp2"]["visits_s"]) == 3 and len(results["pp2"]["visits_s"]) == 1
    assert results["tp2"]["measured_step_s"] == min(results["tp2"]["visits_s"])
    assert len(machine["host_probe"][0]["passes_s"]) == 4  # two in the main job, one a relaunch

    plans = _fake_jobs(monkeypatch, steps)  # a deadline with time for the main job only
    _, results = planner_multi.run_rows(rows, 2, smoke=True, steps=1, warmup=1, deadline=time.time() + 20,
                                        measure_machine=True, probes=probes, relaunches=2)
    assert len(plans) == 1 and len(results["tp2"]["visits_s"]) == 1
