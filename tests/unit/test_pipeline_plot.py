"""Timeline pictures: predicted alone, and predicted beside measured intervals of the same record."""

import struct

import pytest

from teratrain.parallel.pipeline.plot import plot_timeline
from teratrain.parallel.pipeline.schedules import build
from teratrain.parallel.pipeline.simulate import Costs, Interval, bubble_fraction, simulate


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_predicted_and_measured_timelines_are_drawn_from_the_same_record(tmp_path):
    tl = simulate(build("zb-h1", 4, 8), Costs(forward_s=1.0, backward_s=2.0))
    assert bubble_fraction(tl.intervals, 4) == pytest.approx(tl.bubble_fraction)
    # a stand-in for an executor's records: the same actions, 1 ms per unit and 10% slower on rank 3
    measured = [Interval(iv.rank, iv.start * 1e-3, iv.end * 1e-3 * (1.1 if iv.rank == 3 else 1.0), iv.kind,
                         iv.microbatch, iv.chunk) for iv in tl.intervals]
    one, two = tmp_path / "one.png", tmp_path / "two.png"
    plot_timeline(str(one), tl.intervals, title="zb-h1")
    plot_timeline(str(two), tl.intervals, measured, title="zb-h1", unit="ms", scale=1e3)
    (w1, h1), (w2, h2) = png_size(one), png_size(two)
    assert h2 > 1.6 * h1 and abs(w2 - w1) < 0.2 * w1  # a second panel under the first


def test_interleaved_and_asynchronous_timelines_draw(tmp_path):
    for name, kw in (("interleaved-1f1b", {"virtual_stages": 2}), ("pipedream-2bw", {})):
        tl = simulate(build(name, 4, 16, **kw), Costs(step_s=0.1))
        path = tmp_path / f"{name}.png"
        plot_timeline(str(path), tl.intervals, num_ranks=4, title=name)
        assert png_size(path)[0] > 1000
