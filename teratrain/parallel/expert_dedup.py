"""The deduplicated expert-parallel exchange (`parallel.ep_dedup`): each token goes once to each ep
rank holding at least one of its chosen experts, not once per chosen expert (DeepSeek-V3, Liu et al.
2024, sec. 3.4.2: a token sent to a node once, its experts there served by one copy; Megatron-Core's
MoE token dispatcher does the same per rank). With top-8 of 128 experts at ep=4 a token's 8 choices
fall on 3.6 ranks on average (`ep_plan.expected_ranks`), so the rows of each exchange drop from
8 N to 3.6 N.

One row per (token, rank), travelling with its metadata in m = min(k, n/ep) extra columns each way:

    sender t, rank r:  [ x_t (d) | gates of t's choices on r (m, 0 past them) | their local experts + 1 (m, 0: none) ]

The receiver expands each row to its (row, local expert) pairs (the experts' grouped GEMMs run over
those, models/moe.py `run_local`), weights each output by the gate that came with it and sums them
per row (`combine`), and sends one row back per row received: that rank's share of the token's
output. The sender sums a token's rows over the ranks. The gate weights travel inside the row, so
the weighted sum is differentiable end to end: the reverse all-to-all of the backward brings back
each gate's gradient <expert output, output gradient>, computed where the output is. The expert
indices are small integers, exact in any compute dtype up to 256 (`MAX_LOCAL`; check_ep refuses
more); the receiver reads them detached.

The same three paths as the per-choice exchange (expert.py), each bounding the rows per rank:
- dropless, eager: exactly the (token, rank) pairs; their counts exchanged and read back once.
- dropless, compiled (train.compile): N slots per destination rank (a token goes to a rank at most
  once), where the per-choice exchange needs N per expert: n/ep times fewer rows.
- with a capacity: min(N, n/ep x capacity) slots per rank. An empty slot arrives as a zero row
  whose experts read "none", so no count exchange is needed.
Every rank issues the same collectives in the same order; an expert that receives nothing runs on
zero rows. Chunking (`parallel.ep_overlap_chunks`) cuts each rank's block as expert.py does.
"""

from __future__ import annotations

import torch

from teratrain.models.grouped import compute_dtype
from teratrain.models.permute import Layout, chunk_major, combine, dispatch, grouped_layout, piece_bounds, \
    slotted_layout
from teratrain.parallel import comm
from teratrain.parallel.ep_plan import MAX_LOCAL
from teratrain.parallel.ep_pipeline import Exchange, chunk_rows, pipeline, with_a_row


def rank_choices(key: torch.Tensor, w: torch.Tensor, ep: int, local: int):
    """Each token's choices grouped by destination rank. key (N*k,) global expert (n = ep * local: not
    sent), w (N, k) gates. Returns dest (N*ep,): r for the pair (t, r) where token t chose an expert on
    rank r, else ep (not sent); gates (N*ep, m) the gates of those choices in choice order, zero past
    them; ids (N*ep, m) their local experts + 1, zero past them; m = min(k, local). A token's k
    choices are k different experts (every router's top-k), so at most m fall on one rank."""
    N, k = w.shape
    m, dev = min(k, local), key.device
    key = key.view(N, k)
    rank = key // local  # (N, k): ep where not sent
    same = rank.unsqueeze(-1) == torch.arange(ep + 1, device=dev)  # (N, k, ep + 1)
    pos = (same.cumsum(1) - 1).gather(2, rank.unsqueeze(-1)).squeeze(-1)  # (N, k): place among t's choices on r
    token = torch.arange(N, device=dev).unsqueeze(1)
    slot = torch.where(rank < ep, (token * ep + rank) * m + pos, N * ep * m)  # (N, k): the last slot: a dump
    choice = torch.arange(k, device=dev).expand(N, k)
    which = torch.full((N * ep * m + 1,), k, device=dev).scatter_(0, slot.flatten(), choice.flatten())
    which = which[:-1].view(N, ep * m)  # (N, ep * m): the choice in each (rank, place), k where none
    gates = torch.cat([w, w.new_zeros(N, 1)], 1).gather(1, which).view(N * ep, m)
    base = (torch.arange(ep, device=dev) * local).repeat_interleave(m)  # (ep * m,) each rank's first expert
    ids = torch.where(which < k, key.gather(1, which.clamp(max=k - 1)) - base + 1, 0).view(N * ep, m)
    dest = torch.where(which.view(N, ep, m)[:, :, 0] < k, torch.arange(ep, device=dev), ep).flatten()
    return dest, gates, ids


class DedupExchange(Exchange):
    """`MoE.exchange` sending one row per (token, destination rank) (module docstring)."""

    def __call__(self, flat: torch.Tensor, key: torch.Tensor, w: torch.Tensor, k: int, slot: int | None,
                 moe, under=None) -> tuple[torch.Tensor, torch.Tensor]:
        """As expert.py's ExpertExchange: (N, d) the weighted sum of each token's expert outputs, (n,) the
        rows routed to each expert; `under()` runs while the dispatch moves."""
        N, n = flat.shape[0], self.ep * self.local
        assert self.local <= MAX_LOCAL, "check_ep refuses more local experts than the ids carry exactly"
        counts = torch.zeros(n + 1, dtype=torch.long, device=key.device).scatter_add_(0, key, torch.ones_like(key))[:n]
        dest, gates, ids = rank_choices(key, w, self.ep, self.local)
        meta = torch.cat([gates.to(compute_dtype(flat)), ids.to(compute_dtype(flat))], 1)  # (N * ep, 2m)
        if slot is None and comm.traced():  # dropless, compiled: a token goes to a rank at most once
            slot = N
        if slot is not None:
            back, lay = self._padded_ranks(flat, meta, dest, min(N, self.local * slot), moe, under)
        else:
            back, lay = self._counted_ranks(flat, meta, dest, moe, under)
        return combine(back, lay, back.new_ones(N, self.ep), self.ep), counts

    def _rows(self, flat: torch.Tensor, meta: torch.Tensor, lay: Layout) -> torch.Tensor:
        """The send buffer: each (token, rank) row, then its gates and expert ids: (lay.rows, d + 2m)."""
        dtype = compute_dtype(flat)
        return torch.cat([dispatch(flat, lay, self.ep, dtype), dispatch(meta, lay, 1, dtype)], 1)

    def _experts_on(self, moe, m: int):
        """The receiver's pass over rows [x | gates | ids]: each row's experts, weighted and summed."""
        def run(c: int, got: torch.Tensor, stacks) -> torch.Tensor:
            d = got.shape[1] - 2 * m
            ids = got[:, d + m:].detach().round().long() - 1  # (rows, m); -1: none
            key = torch.where(ids >= 0, ids, self.local).flatten()  # (rows * m,)
            ys, lay = moe.run_local(got[:, :d], key, m, stacks=stacks)
            return combine(ys, lay, got[:, d:d + m].to(ys.dtype), m)  # (rows, d)
        return run

    def _padded_ranks(self, flat, meta, dest, per_rank: int, moe, under) -> tuple[torch.Tensor, Layout]:
        """`per_rank` fixed slots for each destination rank, unused ones zero (ids none); chunk c carries
        slots [lo_c, lo_c+1) of every rank."""
        lay = slotted_layout(dest, self.ep, per_rank)
        moe.count_exchange(lay.counts.sum(), self.ep * per_rank)  # slotted_layout: none above per_rank
        if self.chunks > 1:
            lay = chunk_major(lay, torch.full((self.ep,), per_rank, device=flat.device), self.chunks)
        lo = piece_bounds(per_rank, self.chunks)
        splits = [([b - a] * self.ep, [b - a] * self.ep) for a, b in zip(lo, lo[1:])]
        send = self._rows(flat, meta, lay)
        return pipeline(send, splits, self._experts_on(moe, meta.shape[1] // 2), moe, self.group, under), lay

    def _counted_ranks(self, flat, meta, dest, moe, under) -> tuple[torch.Tensor, Layout]:
        """Exactly the (token, rank) rows: their counts exchanged and read back (the one device-to-host
        copy of the layer, which gives every chunk's splits too)."""
        lay = grouped_layout(dest, self.ep)
        recv = torch.empty_like(lay.counts)  # rows from each source rank
        comm.all_to_all(recv, lay.counts, [1] * self.ep, [1] * self.ep, self.group)
        host = torch.cat([recv, lay.counts]).tolist()
        got_rows, sent_rows = host[:self.ep], host[self.ep:]
        moe.count_exchange(sum(sent_rows), sum(sent_rows))
        splits = list(zip(chunk_rows(got_rows, self.ep, self.chunks), chunk_rows(sent_rows, self.ep, self.chunks)))
        if self.chunks > 1:
            lay = chunk_major(lay, lay.counts, self.chunks)
        send = self._rows(flat, meta, lay.first(sum(sent_rows)))
        back = with_a_row(pipeline(send, splits, self._experts_on(moe, meta.shape[1] // 2), moe, self.group, under))
        return back, lay.first(back.shape[0])
