"""The deduplicated expert-parallel exchange's bookkeeping (parallel/expert_dedup.py): one row per
distinct (token, destination rank), each carrying its choices' gates and local experts, checked
against a count by hand; and the exchange on a group of one against the layer's own dispatch. The
collectives at ep = 2 and 4 are tests/dist/test_ep_dedup.py's."""

import pytest
import torch

from teratrain.models import moe
from teratrain.models.permute import grouped_layout
from teratrain.parallel.expert_dedup import DedupExchange, rank_choices
from tests.helpers import one_rank_moe
from tests.unit.test_moe import _OneRank


def _routing(N: int, n: int, k: int, seed: int, dropped: float = 0.0):
    """key (N*k,) k distinct experts a token (some not sent: n), gates (N, k)."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(N)])  # (N, k)
    sent = torch.rand(N, k, generator=g) >= dropped
    return torch.where(sent, experts, n).flatten(), torch.rand(N, k, generator=g)


@pytest.mark.parametrize("n,ep,k,dropped", [(8, 2, 4, 0.0), (8, 4, 4, 0.3), (16, 4, 2, 0.0), (8, 4, 1, 0.5),
                                            (8, 2, 6, 0.2)])
def test_rows_sent_are_the_distinct_token_rank_pairs(n, ep, k, dropped):
    """The rows laid out for sending equal the distinct (token, rank) pairs of the sent choices, per
    rank; each pair's gates and local experts (+ 1) are its choices on that rank in choice order,
    zero past them, and the pairs not sent carry nothing."""
    N, local = 40, n // ep
    key, w = _routing(N, n, k, seed=n * ep + k, dropped=dropped)
    dest, gates, ids = rank_choices(key, w, ep, local)
    m = min(k, local)
    assert gates.shape == ids.shape == (N * ep, m)
    pairs = {(c // k, int(e) // local) for c, e in enumerate(key.tolist()) if e < n}
    counts = grouped_layout(dest, ep).counts
    assert counts.sum().item() == len(pairs)
    assert len(pairs) < N * k or k == 1 or local == 1, "dedup must matter in these cases"
    assert counts.tolist() == [sum(1 for _, r in pairs if r == s) for s in range(ep)]
    for t in range(N):
        for r in range(ep):
            mine = [(float(w[t, i]), int(key[t * k + i]) - r * local + 1) for i in range(k)
                    if key[t * k + i] < n and int(key[t * k + i]) // local == r]
            row = t * ep + r
            assert int(dest[row]) == (r if mine else ep)
            want = mine + [(0.0, 0)] * (m - len(mine))
            assert [(float(a), int(b)) for a, b in zip(gates[row], ids[row])] == want


def test_top4_of_8_at_ep2_sends_under_half_the_rows():
    """Uniform top-4 of 8 at ep=2: at most 2 rows a token instead of 4, and about 1.97 (ep_plan's
    expected_ranks) on 4000 tokens: within 2%."""
    from teratrain.parallel.ep_plan import expected_ranks

    N = 4000
    key, w = _routing(N, 8, 4, seed=1)
    dest, _, _ = rank_choices(key, w, 2, 4)
    rows = int((dest < 2).sum())
    assert rows / N == pytest.approx(expected_ranks(8, 2, 4), rel=0.02)


@pytest.mark.parametrize("kernel", ["loop", "grouped"])
@pytest.mark.parametrize("keys", [dict(capacity_factor=0.75), dict(capacity_factor=0)])
def test_dedup_exchange_equals_the_layer_without_one(keys, kernel):
    """DedupExchange on a group of one (every token one row; its k experts expanded on the receiver),
    padded (a capacity) and dropless, whole and cut into 3 and 7 chunks: outputs and every gradient
    (gates included, through the router) equal the layer's own dispatch (fp32, 1e-5)."""
    if kernel == "grouped" and getattr(torch, "_grouped_mm", None) is None:
        pytest.skip("this torch has no grouped GEMM")
    m, x, c, params = one_rank_moe(kernel, top_k=3, **keys)

    def run(exchange):
        m.exchange = exchange
        y = m(x)
        return [y, m.pop_stats()["load"], *torch.autograd.grad((y * c).sum() + m.aux_loss, params)]

    want = run(None)
    for chunks in (1, 3, 7):
        for a, b in zip(run(DedupExchange(_OneRank(), 1, 4, chunks)), want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
