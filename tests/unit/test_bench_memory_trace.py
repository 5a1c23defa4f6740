"""bench/memory_trace.py's replay of an allocation trace: the peak, what was allocated before the step,
and the step's blocks alive at the peak grouped by allocation site."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from memory_trace import peak_of, site_of  # noqa: E402

MIB = 2**20


def test_peak_and_what_is_alive_at_it():
    events = [("alloc", 1, 4 * MIB, "a"), ("alloc", 2, 2 * MIB, "b"), ("free", 1, 4 * MIB, "a"),
              ("alloc", 3, 8 * MIB, "c"), ("alloc", 4, 1 * MIB, "b"), ("free", 99, 3 * MIB, "older"),
              ("alloc", 5, 2 * MIB, "b"), ("free", 3, 8 * MIB, "c")]
    got = peak_of(events, before=10 * MIB)
    # 10 + 4 + 2 - 4 + 8 + 1 = 21 MiB before the free of an older block
    assert got["peak_mib"] == 21 and got["before_step_mib"] == 10 and got["step_allocations_alive_at_peak_mib"] == 11
    assert [(s["site"], s["mib"], s["blocks"]) for s in got["largest_sites_at_peak"]] == [("c", 8, 1), ("b", 3, 2)]
    assert got["largest_blocks_mib"] == [8, 2, 1] and got["peak_event"] == 4 and got["events_after_peak"] == 3


def test_allocator_totals_override_the_running_sum():
    """Frees on other threads are not events on CPU: the reporter's own total is used for the peak."""
    events = [("alloc", 1, 4 * MIB, "a"), ("alloc", 1, 4 * MIB, "a2"), ("alloc", 2, 1 * MIB, "b")]
    got = peak_of(events, totals=[4 * MIB, 4 * MIB, 5 * MIB])  # block 1 was freed unseen before its reuse
    assert got["peak_mib"] == 5 and [s["site"] for s in got["largest_sites_at_peak"]] == ["a2", "b"]


def test_site_names_our_frames_first():
    frames = [{"filename": "/x/torch/_ops.py", "line": 1, "name": "__call__"},
              {"filename": "/w/teratrain/parallel/flat.py", "line": 82, "name": "flatten"},
              {"filename": "/w/teratrain/parallel/zero.py", "line": 223, "name": "_reduce_grads"}]
    assert site_of(frames) == "flat.py:82(flatten) < zero.py:223(_reduce_grads)"
    assert site_of([]) == "?"
