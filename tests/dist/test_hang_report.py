"""A hang ends within parallel.timeout_s with one sentence naming the rank, the operation and its
peers (parallel/inflight.py), for a collective and for a pipeline transfer: rank 1 never joins,
rank 0's watchdog reports and ends the process with status 1; the launcher prints the report."""

from __future__ import annotations

import json

import pytest

from tests.hang import hang

TIMEOUT_S = 2.0


@pytest.mark.parametrize("kind, what", [("all-reduce", "an all-reduce on group dp (ranks 0, 1)"),
                                        ("receive", "a receive from rank 1 on group pp_link1to0 (ranks 0, 1)")])
def test_a_peer_that_never_joins_is_named_within_the_timeout(tmp_path, kind, what):
    status, report, waited = hang(str(tmp_path), kind, "cpu", TIMEOUT_S)
    assert status == 1, f"rank 0 ended with {status}"
    assert report["kind"] == "hang"
    assert report["message"].startswith(f"rank 0 waited over parallel.timeout_s={TIMEOUT_S:g} s for {what} that "
                                        "never completed")
    assert "--- thread main" in report["traceback"]  # every thread's stack, for error.log
    assert waited < 30, f"the hang took {waited:.0f} s to be reported (start-up included)"


def test_the_launcher_prints_a_hang_in_one_sentence(tmp_path, capsys):
    from types import SimpleNamespace

    from teratrain.launch import _summarize

    reports = tmp_path / "reports"
    reports.mkdir()
    msg = "rank 2 waited over parallel.timeout_s=60 s for a reduce-scatter on group pp_ends (ranks 0, 1, 2, 3) that never completed"
    (reports / "rank2.json").write_text(json.dumps({"rank": 2, "time": 1.0, "kind": "hang", "message": msg,
                                                    "traceback": "--- thread main\n  stack"}))
    status = _summarize({2: SimpleNamespace(exitcode=1), 0: SimpleNamespace(exitcode=143)}, reports, tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1
    assert err[0].startswith(f"teratrain: error: {msg}; the other ranks were stopped")
    assert "stack" in (tmp_path / "error.log").read_text()
