"""Groups made by every rank together (Mesh.define_everywhere) keep every rank's group count equal
when a second pipeline executor on the same mesh asks for them again (a benchmark building several
schedules on one runtime): torch names a group its members make alone after that count, so unequal
counts give a later group different names on its members, and its creation waits forever."""

from teratrain import mesh
from teratrain.mesh import Mesh, ParallelDims
from teratrain.parallel.pipeline.p2p import link_name
from teratrain.parallel.pipeline.runtime import _links


def _count_groups(monkeypatch, rank: int, calls: list[list[tuple[int, int]]]) -> list[int]:
    """Groups this rank creates before each call (links of one executor) and after the last."""
    made = []
    monkeypatch.setattr(mesh, "new_group", lambda ranks, **kw: made.append(tuple(ranks)) or object())
    m = Mesh(ParallelDims(dp=1, pp=4), rank)
    counts = []
    for links in calls:
        counts.append(len(made))
        m.define_everywhere([(link_name(s, d), lambda c, s=s, d=d: c["pp"] if c["pp"] in (s, d) else None)
                             for s, d in sorted(links)])
    return counts + [len(made)]


def test_a_second_executor_keeps_group_counts_equal(monkeypatch):
    calls = [_links(4, 1), _links(4, 2)]  # 1F1B's links, then interleaved 1F1B's (adds last <-> first)
    per_rank = [_count_groups(monkeypatch, r, calls) for r in range(4)]
    assert all(c == per_rank[0] for c in per_rank), per_rank
    assert per_rank[0][1] == len(calls[0]) and per_rank[0][2] == len(calls[1])  # each name made once
