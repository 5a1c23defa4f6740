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


def test_dp_max_ctas_reaches_the_data_parallel_groups_only(monkeypatch):
    """parallel.dp_max_ctas: the NCCL options go to `dp` and its `:gather` twin (ZeRO-3's gathers), and
    to no other group; no cap, or another backend, makes every group without options."""
    import torch.distributed as dist

    from teratrain import compat
    from teratrain.config import load_config

    made, real = {}, compat.nccl_options
    monkeypatch.setattr(mesh, "new_group", lambda ranks, name, **kw: made.setdefault(name, kw.get("pg_options")) or object())
    monkeypatch.setattr(compat, "nccl_options", lambda cap: None if cap is None else ("capped", cap))  # an NCCL job
    m = Mesh(ParallelDims(dp=2, tp=2), 0, dp_max_ctas=load_config(None, ["parallel.dp_max_ctas=8"]).parallel.dp_max_ctas)
    m.create_standard_groups()
    assert made.pop("dp") == ("capped", 8) and made.pop("dp:gather") == ("capped", 8)
    assert made and all(opts is None for opts in made.values()), made  # world, tp, dp_tp and their twins
    made.clear()
    Mesh(ParallelDims(dp=2, tp=2), 0).create_standard_groups()  # no cap
    assert made and all(opts is None for opts in made.values())
    made.clear()
    monkeypatch.setattr(compat, "nccl_options", real)  # a gloo job: no NCCL options, cap or not
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    Mesh(ParallelDims(dp=2, tp=2), 0, dp_max_ctas=8).create_standard_groups()
    assert made and all(opts is None for opts in made.values())


def test_nccl_options_absent_without_nccl(monkeypatch):
    """No cap, no options; a CPU build has no ProcessGroupNCCL (no options whatever the cap: gloo runs
    ignore the key); a CUDA build carries the cap in ncclConfig_t."""
    import torch.distributed as dist

    from teratrain.compat import nccl_options

    assert nccl_options(None) is None
    if hasattr(dist, "ProcessGroupNCCL"):  # a CUDA build under an NCCL job: the cap is in the config NCCL gets
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        assert nccl_options(8).config.max_ctas == 8
    else:
        assert nccl_options(8) is None
