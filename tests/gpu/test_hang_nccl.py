"""Under NCCL a rank does not block in a collective or a receive; it blocks later, wherever it next
waits for the GPU. A peer that never joins is still named within parallel.timeout_s, by the
operation that never completed (parallel/inflight.py), for a collective and for a pipeline receive."""

import pytest

from tests.hang import hang


@pytest.mark.gpu(2)
@pytest.mark.parametrize("kind, what", [("all-reduce", "an all-reduce on group dp (ranks 0, 1)"),
                                        ("receive", "a receive from rank 1 on group pp_link1to0 (ranks 0, 1)")])
def test_a_peer_that_never_joins_is_named_under_nccl(tmp_path, kind, what):
    status, report, _ = hang(str(tmp_path), kind, "cuda", timeout_s=5.0)
    assert status == 1 and report["kind"] == "hang" and what in report["message"], report
