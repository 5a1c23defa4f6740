"""The pipelined expert-parallel exchange shared by both exchanges (parallel/expert.py, one row per
choice; parallel/expert_dedup.py, one row per token and rank): the dispatches of every chunk launched
first, each chunk's experts under the others' exchanges, backward mirrored (expert.py's docstring
draws the schedule)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from teratrain.models.permute import piece_bounds
from teratrain.parallel import comm


@dataclass
class Exchange:
    """What both exchanges (`MoE.exchange`) hold: the mesh whose "ep" group they use, looked up at the first
    exchange (the planner applies them without one), ep, the experts per rank, and
    parallel.ep_overlap_chunks, the pieces of the exchange pipelined with the experts."""

    mesh: object
    ep: int
    local: int
    chunks: int = 1

    @property
    def group(self):
        return self.mesh.group("ep")


def pipeline(send: torch.Tensor, splits: list[tuple[list[int], list[int]]], experts_on, moe, group,
             under=None) -> torch.Tensor:
    """send (rows, d) chunk after chunk; splits[c] = (rows chunk c receives from each rank, rows it
    sends to each). Every chunk's dispatch is launched first, then `under()` runs beneath them (the
    shared experts: models/moe.py); chunk c's experts (experts_on(c, received rows, stacks) -> their
    outputs in the same row order) wait only for dispatch c, and its combine is launched right after
    them, under chunk c + 1's experts. Returns the combined rows, chunk after chunk. Backward mirrors
    it (parallel/expert.py's docstring)."""
    pieces = send.split([sum(sent) for _, sent in splits]) if len(splits) > 1 else [send]
    arriving = [comm.launch_rows(p, got, sent, group) for p, (got, sent) in zip(pieces, splits)]
    if under is not None:
        under()
    stacks = moe.stacked(send)  # the weights cast once, under the first dispatch
    leaving = []
    for c, ((rows, ex), (got, sent)) in enumerate(zip(arriving, splits)):
        ys = experts_on(c, comm.land_rows(rows, ex), stacks)
        leaving.append(comm.launch_rows(ys, sent, got, group))
    back = [comm.land_rows(rows, ex) for rows, ex in leaving]
    return back[0] if len(back) == 1 else torch.cat(back)


def chunk_rows(rows: list[int], ep: int, chunks: int) -> list[list[int]]:
    """[c][r]: rows of chunk c for (or from) rank r, given rows[r * local + j] for its expert j, each
    block cut by piece_bounds."""
    local = len(rows) // ep
    bounds = [piece_bounds(x, chunks) for x in rows]
    return [[sum(b[c + 1] - b[c] for b in bounds[r * local:(r + 1) * local]) for r in range(ep)] for c in range(chunks)]


def with_a_row(back: torch.Tensor) -> torch.Tensor:
    """The combined rows of an exact exchange, with one zero row where none came back (nothing sent): the
    rows not sent read it (masked) inside the graph."""
    return back if back.shape[0] else torch.cat([back, back.new_zeros(1, back.shape[1])])
