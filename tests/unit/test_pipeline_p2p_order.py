"""When the pipeline executor posts its transfers (runtime.py `plan`, p2p.py), checked on every
schedule's action lists without processes: both ends of every directed link post that link's
messages in the same order (NCCL matches point-to-point operations in posting order; a mismatch
hangs or swaps messages), each receive is posted before it is waited for and waited for before its
consumer runs, and a receive is posted after the compute before it (`at_use`) or at most one compute
action earlier (`ahead`). And the simulator's model of the default: a transfer starts once both its
send and its receive are reached."""

import pytest

from teratrain.parallel.pipeline.actions import COMPUTE, RECVS, SENDS, STEP, message
from teratrain.parallel.pipeline.runtime import _unsplit_first_stage, plan
from teratrain.parallel.pipeline.schedules import CONFIG_NAMES, build
from teratrain.parallel.pipeline.simulate import Costs, simulate


def _cases():
    for name in CONFIG_NAMES:
        for d, m, v in ((2, 4, 1), (2, 4, 2), (3, 5, 1), (4, 8, 1), (4, 8, 2)):
            if v > 1 and name != "interleaved-1f1b":
                continue
            try:
                yield name, build(name, d, m, v)
            except ValueError:
                continue  # a schedule's own rule (2BW: pp | m)


@pytest.mark.parametrize("ahead", [False, True])
def test_both_ends_of_every_link_post_in_the_same_order_and_receives_come_before_their_use(ahead):
    cases = list(_cases())
    assert {name for name, _ in cases} == set(CONFIG_NAMES)
    for name, sched in cases:
        S = sched.num_stages
        posted: dict[tuple[int, int, bool], list] = {}  # (src, dst, posted by the sender) -> messages
        for rank, raw in enumerate(sched.ranks):
            acts = _unsplit_first_stage(raw, {0} if rank == 0 else set())
            where = f"{name} pp={sched.pp} v={sched.virtual_stages} rank {rank}"
            steps = plan(acts, ahead=ahead)
            runs = [s[2] for s in steps if s[0] == "run"]
            assert runs == [a for a in acts if a.kind in COMPUTE or a.kind == STEP], where
            comm = [a for s in steps if s[0] == "post" for a in s[1]]
            assert sorted(map(str, comm)) == sorted(str(a) for a in acts if a.kind in SENDS + RECVS), where
            state, computes = {}, 0  # a receive -> "posted" / "waited"; computes issued so far
            posted_after = {}  # a receive -> how many computes were issued before it was posted
            for step in steps:
                if step[0] == "post":
                    for a in step[1]:
                        sending = a.kind in SENDS
                        msg = message(a, rank, sched.pp, S, sending)
                        link = (rank, a.peer) if sending else (a.peer, rank)
                        posted.setdefault((*link, sending), []).append(msg)
                        if not sending:
                            state[a], posted_after[a] = "posted", computes
                elif step[0] == "wait":
                    for a in step[1]:
                        assert state.pop(a, None) == "posted", f"{where}: {a} waited for before it was posted"
                else:
                    a = step[2]
                    need = message(a, rank, sched.pp, S, sending=False)
                    assert all(message(r, rank, sched.pp, S, False) != need for r in state), \
                        f"{where}: {a} runs before its receive is waited for"
                    computes += 1
            assert not state, f"{where}: receives never waited for: {list(state)}"
            for r, before in posted_after.items():  # how far ahead of the list each receive is posted
                in_list = sum(1 for a in acts[:acts.index(r)] if a.kind in COMPUTE or a.kind == STEP)
                assert before in ((in_list - 1, in_list) if ahead else (in_list,)) and before >= 0, (where, r)
        for (src, dst, by_sender), msgs in posted.items():
            if by_sender:
                assert posted.get((src, dst, False)) == msgs, f"{name}: link {src}->{dst} posted in another order"


def test_a_rendezvous_transfer_starts_when_the_receiver_reaches_it():
    """GPipe over 2 stages, the second the slower (f = 1, 4; transfer x): posted early, a message
    that waited for its receiver arrives in time; posted where used, every forward after the first
    and every backward message after the first pays x once more. Naive runs one micro-batch at a
    time, so each receiver is already waiting: both models agree."""
    m, x = 5, 0.5
    costs = dict(forward_s=[1.0, 4.0], backward_s=[0.0, 0.0], send_s=[x])
    eager = simulate(build("gpipe", 2, m), Costs(**costs))
    rdv = simulate(build("gpipe", 2, m), Costs(**costs, rendezvous=True))
    assert eager.makespan_s == pytest.approx(1.0 + x + m * 4.0 + x)
    assert rdv.makespan_s == pytest.approx(eager.makespan_s + 2 * (m - 1) * x)
    naive = [simulate(build("naive", 2, m), Costs(**costs, rendezvous=r)).makespan_s for r in (False, True)]
    assert naive[0] == pytest.approx(naive[1])
