"""Pipeline schedules and the simulator against the papers' closed forms, for many (d, m, v).

d = pp (pipeline ranks), m = micro-batches, v = model chunks per rank. Structural facts are counted
here from the action lists themselves (not through actions.check), timing facts from the simulator."""

from collections import Counter

import pytest

from teratrain.parallel.pipeline.actions import (B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, STEP, W, Action,
                                                 Schedule, add_communication, check)
from teratrain.parallel.pipeline.schedules import CONFIG_NAMES, build, interleaved_1f1b, pipedream_2bw
from teratrain.parallel.pipeline.simulate import Costs, Deadlock, simulate


def sweep():
    """Every schedule at every (d, m, v) its rules allow, m up to 3d + 1."""
    for name in CONFIG_NAMES:
        for d in (1, 2, 3, 4, 6, 8):
            for v in ((2, 3, 4) if name == "interleaved-1f1b" else (1,)):
                for m in range(1, 3 * d + 2):
                    kw = {"vertical_sync": True} if name == "pipedream" and m % 2 else {}
                    try:
                        yield name, d, m, v, build(name, d, m, v, **kw)
                    except ValueError:
                        continue  # the schedule's stated rule (interleaved: d | m; 2BW: pp | m)


SWEEP = list(sweep())


def test_the_sweep_covers_every_schedule():
    assert {name for name, *_ in SWEEP} == set(CONFIG_NAMES) and len(SWEEP) > 300


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_microbatch_is_forwarded_and_backwarded_once_per_stage_on_its_rank(name):
    for _, d, m, v, sched in (s for s in SWEEP if s[0] == name):
        seen = Counter()
        for rank, acts in enumerate(sched.ranks):
            for a in acts:
                if a.kind in (F, B, I, W):
                    seen[(a.kind, a.chunk * d + rank, a.microbatch)] += 1
        for s in range(d * v):
            for mb in range(m):
                split = (seen[(I, s, mb)], seen[(W, s, mb)])
                assert seen[(F, s, mb)] == 1 and (seen[(B, s, mb)], split) in ((1, (0, 0)), (0, (1, 1)))
        assert sum(seen.values()) == d * v * m * (3 if name == "zb-h1" else 2)


def test_sends_and_receives_match_on_every_link_in_order():
    for name, d, m, v, sched in SWEEP:
        sent, got = {}, {}
        for rank, acts in enumerate(sched.ranks):
            for a in acts:
                s = a.chunk * d + rank
                if a.kind in (SEND_F, SEND_B):  # what leaves stage s, named by the stage it reaches
                    to = s + 1 if a.kind == SEND_F else s - 1
                    assert to % d == a.peer != rank
                    sent.setdefault((rank, a.peer), []).append((a.kind[-1], a.microbatch, to))
                elif a.kind in (RECV_F, RECV_B):
                    frm = s - 1 if a.kind == RECV_F else s + 1
                    assert frm % d == a.peer != rank
                    got.setdefault((a.peer, rank), []).append((a.kind[-1], a.microbatch, s))
        assert sent == got, (name, d, m, v)
        expected = 2 * m * (d * v - 1) if d > 1 else 0  # every boundary, both directions
        assert sum(map(len, sent.values())) == expected


def test_no_schedule_deadlocks_and_every_list_passes_check():
    for name, d, m, v, sched in SWEEP:
        check(sched)
        tl = simulate(sched, Costs(forward_s=1.0, backward_s=2.0, send_s=0.25))
        assert len(tl.intervals) == sum(a.kind in (F, B, I, W, STEP) for acts in sched.ranks for a in acts)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "pipedream", "pipedream-2bw"])
def test_gpipe_and_1f1b_bubble_is_d_minus_1_over_m_plus_d_minus_1(name):
    for _, d, m, v, sched in (s for s in SWEEP if s[0] == name):
        for fwd, bwd in ((1.0, 1.0), (1.0, 2.0)):
            tl = simulate(sched, Costs(forward_s=fwd, backward_s=bwd))
            assert tl.bubble_fraction == pytest.approx((d - 1) / (m + d - 1), abs=1e-12), (d, m)
            assert tl.makespan_s == pytest.approx((m + d - 1) * (fwd + bwd))


def test_interleaved_bubble_is_divided_by_v():
    cases = [s for s in SWEEP if s[0] == "interleaved-1f1b"]
    assert {(d, v) for _, d, _, v, _ in cases} >= {(2, 2), (4, 2), (4, 4), (8, 3)}
    for _, d, m, v, sched in cases:
        for fwd, bwd in ((1.0, 1.0), (1.0, 2.0)):
            tl = simulate(sched, Costs(forward_s=fwd / v, backward_s=bwd / v))  # a chunk holds 1/v of a stage
            assert tl.bubble_fraction == pytest.approx((d - 1) / (v * m + d - 1), abs=1e-12), (d, m, v)


def test_first_stage_holds_m_microbatches_under_gpipe_and_at_most_d_under_1f1b():
    for name, d, m, v, sched in SWEEP:
        peak = simulate(sched).peak_activations
        if name == "gpipe":
            assert peak[0] == m
        elif name in ("1f1b", "pipedream", "pipedream-2bw"):
            assert peak[0] == min(m, d) and all(p <= d - r for r, p in enumerate(peak))
        elif name == "zb-h1":  # 1F1B's peak on every rank (Qi et al. 2023, sec. 2.1)
            assert max(peak) == min(m, d)
        elif name == "interleaved-1f1b" and m >= 2 * d:  # p + (p-1)/v stages' worth (Korthikanti et al.)
            assert peak[0] / v == pytest.approx(d + (d - 1) / v)
        elif name == "naive":
            assert max(peak) == 1


@pytest.mark.parametrize("t_f, t_i, t_w", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.0, 0.5), (2.0, 1.0, 1.0),
                                           (1.0, 1.2, 0.8)])
def test_zb_h1_bubble_matches_the_paper(t_f, t_i, t_w):
    """Qi et al. 2023, Table: ZB-H1's bubble is (p-1)(T_F + T_B - T_W) (their B is our I) against
    1F1B's (p-1)(T_F + T_B + T_W), for m >= p and T_W <= T_F (the deferred W fits the gap)."""
    for _, d, m, v, sched in (s for s in SWEEP if s[0] == "zb-h1" and s[2] >= s[1]):
        tl = simulate(sched, Costs(forward_s=t_f, backward_s=t_i + t_w, weight_grad_s=t_w))
        idle = (d - 1) * (t_f + t_i - t_w)
        assert tl.makespan_s == pytest.approx(m * (t_f + t_i + t_w) + idle), (d, m)
        assert tl.bubble_fraction == pytest.approx(idle / (m * (t_f + t_i + t_w) + idle))
    one_f = simulate(build("1f1b", 4, 8), Costs(forward_s=1.0, backward_s=2.0)).bubble_fraction
    zb = simulate(build("zb-h1", 4, 8), Costs(forward_s=1.0, backward_s=2.0)).bubble_fraction
    assert zb < one_f / 2


def test_naive_model_parallel_runs_one_microbatch_at_a_time_uneven_stages_and_sends():
    f, b, x = [1.0, 3.0, 2.0], [2.0, 5.0, 1.0], [0.5, 0.25]
    tl = simulate(build("naive", 3, 4), Costs(forward_s=f, backward_s=b, send_s=x))
    assert tl.makespan_s == pytest.approx(4 * (sum(f) + sum(b) + 2 * sum(x)))
    assert simulate(build("naive", 5, 7)).bubble_fraction == pytest.approx(4 / 5)


def test_uneven_stages_follow_the_flow_shop_formula():
    """GPipe with free backwards: the last forward ends at sum(f) + sum(x) + (m-1) max(f), the longest
    path of a flow line (the slowest stage sets the pace, transfers add once); then the gradients
    cross every boundary back once more."""
    f, x = [1.0, 4.0, 2.0, 3.0], [0.5, 1.0, 0.25]
    for m in (1, 2, 5, 9):
        tl = simulate(build("gpipe", 4, m), Costs(forward_s=f, backward_s=0.0, send_s=x))
        assert tl.makespan_s == pytest.approx(sum(f) + sum(x) + (m - 1) * max(f) + sum(x))


def test_weight_versions_pipedream_stashing_vertical_sync_and_2bw():
    def versions(sched):
        out = {}
        for rank, acts in enumerate(sched.ranks):
            steps = 0
            for a in acts:
                steps += a.kind == STEP
                if a.kind in (F, B):
                    out.setdefault((rank, a.microbatch), set()).add(a.version)
                    assert a.version <= steps  # a version exists before it is used
        assert all(len(v) == 1 for v in out.values())  # forward and backward use the same one
        return {k: v.pop() for k, v in out.items()}

    for d, m in ((2, 6), (4, 8), (4, 16), (8, 16)):
        plain = versions(build("pipedream", d, m))
        assert any(plain[(r, mb)] != plain[(0, mb)] for r in range(d) for mb in range(m))  # stale per stage
        vs = versions(build("pipedream", d, m, vertical_sync=True))
        assert all(vs[(r, mb)] == vs[(0, mb)] == plain[(0, mb)] for r in range(d) for mb in range(m))
        tl = simulate(build("pipedream", d, m))
        assert tl.peak_versions[0] == min(m, d)  # stage 0 stashes one version per micro-batch in flight
        for k in (d, 2 * d):
            if m % k:
                continue
            two = build("pipedream-2bw", d, m, weight_version_every=k)
            assert all(v == max(mb // k - 1, 0) for (r, mb), v in versions(two).items())
            assert max(simulate(two).peak_versions) == (2 if m > k else 1)
    with pytest.raises(ValueError, match="before this rank made it"):  # why 2BW needs k >= pp
        check(pipedream_2bw(4, 8, every=2))


def test_a_schedule_that_cannot_complete_is_reported_with_its_cycle():
    """Megatron's interleaved order with m not a multiple of pp (why the rule exists), and a list
    whose two ranks each receive before they send."""
    with pytest.raises(Deadlock) as e:
        simulate(interleaved_1f1b(4, 5, 3))
    assert e.value.cycle[0] == e.value.cycle[-1] and len(e.value.cycle) >= 3 and "rank 0 waits at RECV" in str(e.value)
    crossed = Schedule("crossed", 2, 1, 1, (
        (Action(RECV_B, 0, peer=1), Action(F, 0), Action(SEND_F, 0, peer=1), Action(B, 0)),
        (Action(RECV_F, 0, peer=0), Action(F, 0), Action(B, 0), Action(SEND_B, 0, peer=0))))
    with pytest.raises(Deadlock) as e:
        simulate(crossed)
    assert e.value.cycle == [0, 1, 0] and set(e.value.waits) == {0, 1}
    with pytest.raises(ValueError, match="never sends"):
        add_communication("lost", 2, 1, 1, [[Action(F, 0), Action(B, 0)], [Action(F, 0)]])


def test_check_rejects_broken_lists():
    good = build("1f1b", 2, 2)
    swapped = Schedule("swapped", 2, 2, 1, (good.ranks[0], tuple(reversed(good.ranks[1]))))
    with pytest.raises(ValueError, match="before"):
        check(swapped)
    gone = (Action(B, 1), Action(SEND_B, 1, peer=0))
    missing = Schedule("missing", 2, 2, 1, (good.ranks[0], tuple(a for a in good.ranks[1] if a not in gone)))
    with pytest.raises(ValueError, match="exactly once"):
        check(missing)


@pytest.mark.parametrize("name, d, m, v, k, words", [
    ("interleaved-1f1b", 4, 6, 2, None, "multiple of parallel.pp=4"),
    ("interleaved-1f1b", 4, 8, 1, None, "virtual_stages >= 2"),
    ("1f1b", 4, 8, 2, None, "needs parallel.schedule=interleaved-1f1b"),
    ("pipedream-2bw", 4, 8, 1, 2, "at least 4"),
    ("pipedream-2bw", 4, 6, 1, None, "multiple of 4"),
    ("gpipe", 4, 8, 1, 4, "only applies to parallel.schedule=pipedream-2bw"),
])
def test_impossible_schedules_are_refused_with_one_sentence(name, d, m, v, k, words):
    with pytest.raises(ValueError, match=words) as e:
        build(name, d, m, v, weight_version_every=k)
    assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")


def test_costs_need_one_value_per_stage():
    with pytest.raises(ValueError, match="one per stage"):
        simulate(build("1f1b", 4, 4), Costs(forward_s=[1.0, 1.0]))
    with pytest.raises(ValueError, match="cannot exceed"):
        simulate(build("zb-h1", 2, 2), Costs(backward_s=1.0, weight_grad_s=2.0))


def test_the_first_stage_runs_whole_backwards_where_w_follows_i():
    from teratrain.parallel.pipeline.runtime import _unsplit_first_stage

    sched = build("zb-h1", 4, 8)
    ranks = (_unsplit_first_stage(sched.ranks[0], {0}),) + sched.ranks[1:]
    assert not any(a.kind in (I, W) for a in ranks[0]) and sum(a.kind == B for a in ranks[0]) == 8
    assert all(_unsplit_first_stage(acts, set()) == acts for acts in sched.ranks[1:])
    check(Schedule("zb-h1", 4, 8, 1, ranks))  # still a valid list for the other ranks' sends and receives
    assert simulate(Schedule("zb-h1", 4, 8, 1, ranks), Costs()).makespan_s == simulate(sched, Costs()).makespan_s
