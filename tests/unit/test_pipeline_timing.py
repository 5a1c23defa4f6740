"""Feeding the simulator with a measured timeline (parallel/pipeline/timing.py): from a timeline the
simulator itself produced (uneven stages, a transfer time per boundary), `measured_costs` recovers
the action times and the transfers, so the re-simulated bubble equals the one it was read from; a
consumer that was busy when its message arrived says nothing about the transfer."""

import pytest

from teratrain.parallel.pipeline.schedules import build
from teratrain.parallel.pipeline.simulate import Costs, Interval, bubble_fraction, simulate
from teratrain.parallel.pipeline.timing import measured_costs, transfer_s


@pytest.mark.parametrize("name,pp,m,v", [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("zb-h1", 4, 8, 1),
                                         ("interleaved-1f1b", 2, 4, 2), ("1f1b", 3, 5, 1)])
@pytest.mark.parametrize("rendezvous", [False, True])
def test_a_simulated_timeline_round_trips_through_measured_costs(name, pp, m, v, rendezvous):
    S = pp * v
    send = [0.05 * (s + 1) for s in range(S - 1)]
    costs = Costs(forward_s=[1.0 + 0.1 * s for s in range(S)], backward_s=[2.0 + 0.3 * s for s in range(S)],
                  weight_grad_s=[0.9 + 0.1 * s for s in range(S)] if name == "zb-h1" else None, send_s=send,
                  rendezvous=rendezvous)
    sched = build(name, pp, m, v)
    measured = simulate(sched, costs).intervals
    got = measured_costs(measured, pp, S, rendezvous=rendezvous)
    assert got.send_s == pytest.approx(send)
    again = simulate(sched, got)
    assert again.bubble_fraction == pytest.approx(bubble_fraction(measured, pp))
    assert again.makespan_s == pytest.approx(max(iv.end for iv in measured))


def test_only_a_waiting_consumer_measures_the_transfer():
    busy_until = [Interval(1, 0.0, 2.0, "F", 5)]  # rank 1 was busy when F0's output arrived at 1.0
    made = [Interval(0, 0.0, 1.0, "F", 0)]
    assert transfer_s(made + busy_until + [Interval(1, 2.5, 3.0, "F", 0)], 2, 2) == [0.0]
    assert transfer_s(made + [Interval(1, 1.3, 2.0, "F", 0)], 2, 2) == [pytest.approx(0.3)]


def test_the_profile_account_splits_a_step_into_compute_exposed_communication_and_idle():
    from bench.pipeline_profile import account

    kernels = [(0.0, 2.0, "ampere_gemm"), (1.5, 3.0, "ncclDevKernel_SendRecv"), (3.5, 4.0, "elementwise"),
               (3.6, 3.8, "ncclDevKernel_SendRecv")]  # a send hidden under compute
    got = account(kernels)
    assert got["span_s"] == 4.0 and got["compute_s"] == 2.5 and got["comm_s"] == pytest.approx(1.7)
    assert got["exposed_comm_s"] == pytest.approx(1.0) and got["idle_s"] == pytest.approx(0.5)
    assert got["compute_s"] + got["exposed_comm_s"] + got["idle_s"] == pytest.approx(got["span_s"])

