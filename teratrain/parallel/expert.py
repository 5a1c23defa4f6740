"""Expert parallelism: each MoE layer's experts spread over the `ep` ranks, tokens dispatched to them
and their outputs combined by all-to-all (GShard, Lepikhin et al. 2020, sec. 3.2; Switch, Fedus et
al. 2021, fig. 3). Applied from outside by `apply_ep`; the model's MoE layer only sees its
`exchange` replaced.

Expert parallelism borrows its ranks from dp (mesh.py). dp=4, ep=2, 8 experts:

    dp rank       0     1     2     3
    ep            0     1     0     1        ep rank r holds experts [r*n/ep, (r+1)*n/ep): 0-3 | 4-7
    ep_replica    0     0     1     1        `ep` groups {0,1} {2,3}; `ep_replicas` {0,2} {1,3}

Every rank routes its own tokens (the router is a dense, replicated parameter), sends each routed
token to the rank holding its expert (all-to-all over `ep`), runs its n/ep experts on what arrives,
and sends the outputs back (all-to-all), where they are weighted and summed. Routing happens before
dispatch, on the rank's own tokens, so capacity drops and random routing are the same as on one
rank given the same micro-batch.

Under pipeline parallelism the experts live inside the stage's blocks: `ep` and `ep_replicas` vary
only dp coordinates, so every all-to-all and expert reduction stays among one stage's ranks.

Gradients (placement.py's rule: sum over the group, divide by dp). A dense parameter is averaged over
all dp ranks. An expert's gradient on its rank is already the sum of the contributions of all the
tokens of its ep group (the all-to-all's backward brings them back), so expert parameters are summed
over `ep_replicas`, the ranks holding the same experts, and divided by dp x cp (the replicas): the sum
over them of d(loss_r)/dW, over their number, which is the gradient of the global mean loss (not ep times it).

With tensor parallelism the megatron form splits every expert like the dense MLP (tensor.py): every tp
rank routes the same gathered tokens and exchanges them with the ep peers of its own tp index; the
per-layer tp forms (parallel.tp_form=all-gather / all-reduce) keep experts whole, replicated over tp.

No hang on an idle expert: an expert that receives no token still runs on zero rows, so every rank
builds the same autograd graph and its gradient hooks launch the same collectives in the same order;
the all-to-all takes empty blocks.

One row per choice is what this module's exchange sends; `parallel.ep_dedup` (the default) swaps in
expert_dedup.py's, one row per (token, destination rank), the gates along, the experts' outputs
weighted and summed on the rank that ran them. Both share the paths below and the pipelining
(ep_pipeline.py).

The exchange and the host. `all_to_all_single` takes its split sizes as host integers, but the
routed rows per rank are known only on the device, and reading them back stops the host from queueing
further work until the GPU has caught up (the step turns host-bound). Two exchanges, by the router:
- with a capacity (`capacity_factor` > 0): padded, no read-back. An expert takes at most C rows of a
  micro-batch (C = its capacity summed over the local groups, known on the host before routing), so
  every rank sends every expert C slots, `local * C` rows per peer, the unused slots zero (GShard's
  fixed (E, C, d) dispatch buffers, sec. 3.2). The counts travel in a fixed-size all-to-all of
  n integers that stays on the device and tells the receiver which slots hold rows; the experts then
  run on exactly those (models/grouped.py). Costs factor * K * N rows per exchange instead of the
  routed ones (with 1.25 and 25% of choices dropped, 1.7x the bytes), which NVLink absorbs better
  than a stalled host; every rank of the ep group must route the same number of tokens (the
  micro-batch shape), so that the slots agree.
- without a capacity (dropless): exact, one read-back. A padded buffer would need N*K slots per
  expert (any expert may take every token), ep times the rows. So the count all-to-all is followed
  by one device-to-host copy of (rows from each peer, rows to each peer), the minimum the API
  allows: one per layer and forward, none in backward (the splits are kept for it).
  Under train.compile a read-back would end the compiled graph at every layer (and a split size
  from data cannot be traced), so there the dropless exchange is the padded one with N slots per
  expert: a token's k choices are k different experts, so no expert takes more than N rows and
  nothing is dropped (the same rows and results as the counted exchange). It moves n * N rows per
  rank where N * k are routed (n / k times the bytes: 4x for 8 experts, top-2), the price of a
  step the host no longer waits in.
Either way the rows are put into the send buffer, regrouped by local expert on the receiver, and
brought back by permutations whose backward is a gather too (models/permute.py). With advanced
indexing every empty slot would read one shared zero row (and every dropped choice one shared last
row), so each backward's sort-based index_put_ would walk runs as long as the empty slots serially,
three times per layer.

The exchange pipelined with the experts (`parallel.ep_overlap_chunks` = C; the pipelining of
Tutel, Hwang et al. 2023, and of DeepSpeed-MoE, Rajbhandari et al. 2022). Whole, the two
all-to-alls and the experts run one after the other: at ep=4 the exchange was 29% of the step on 4 x
H200, all of it waited for. Cut, every expert's part of the exchange is split into C near-equal
pieces (models/permute.py `piece_bounds`): with a capacity slots [slot c / C, slot (c+1) / C) of
every expert, dropless rows [r c / C, r (c+1) / C) of each (rank, expert) block of r rows, whose
sizes the one read-back already brought to the host (no read-back per chunk). `chunk_major` lays the
send buffer out piece after piece, so chunk c is a contiguous block that is itself a valid exchange
([rank][expert][rows]), and the combined rows come back in that same order, read by the same layout.
Every rank cuts the same C pieces (empty ones too) and issues the same collectives in the same order.
The result is the whole exchange's, but for the experts' dropout masks, drawn piece by piece.

    forward (NCCL stream):  d0 d1 d2 d3 c0 c1 c2 c3          d: dispatch, c: combine, e: experts
    forward (compute):         e0 e1 e2 e3                   e_c waits for d_c only; c_c launched after e_c
    backward: the same with the reverse exchanges (combine's first) and each piece's expert backward

Exposed: the first dispatch and the last combine, about 2/C of the exchange, where the experts of a
piece take longer than its exchange.

How the backward overlaps: through the autograd graph, not a hand-written backward. An exchange is two
nodes (comm.launch_rows, comm.land_rows): the launch's forward starts the all-to-all, the landing's
forward waits for it; in backward the landing's node launches the reverse all-to-all and returns at
once, the launch's node waits for it. The engine runs ready nodes latest-created first, so backward
runs: every combine's reverse launched (their landing nodes are the newest), then piece C-1's
landing wait, its experts' backward, its dispatch's reverse launched (that landing node is newer
than piece C-2's combine launch), then piece C-2's... and the reverse dispatches landed last: the
forward schedule mirrored, each piece's expert backward under the other pieces' exchanges. A custom
Function around the whole layer could force the same order, but would have to run the experts'
backward itself (a nested autograd call per piece, whose weight gradients would each fire the
data-parallel hooks) and rebuild the grouped GEMMs' saved state; the graph keeps one node per weight,
accumulated over the pieces before its hook fires once. The expert stacks are cast for the
grouped GEMMs once per layer forward (models/grouped.py `cast_stacks`), after the dispatches are
launched, so casting them runs under the first dispatch and the pieces share it.

Default 1. Cutting costs C times the launches of the exchange and of the expert pass (argsort,
gathers, three grouped GEMMs per piece, forward and backward) and one copy of the combined rows; it
gains where a piece's experts take as long as its exchange. At ep=1 there is no exchange and the
setting does nothing, but at ep>1 with small micro-batches (the exchange latency-bound, the pieces'
GEMMs too small to fill the GPU) a cut exchange can be slower, so a default above 1 is not safe
without a measurement of the model at hand (bench/moe.py reports both).
"""

from __future__ import annotations

import torch
from torch import nn

from teratrain.models.grouped import compute_dtype
from teratrain.models.permute import (Layout, chunk_major, combine, dispatch, grouped_layout, piece_bounds,
                                      slotted_layout)
from teratrain.models.moe import moe_layers
from teratrain.parallel import comm
from teratrain.parallel.ep_pipeline import Exchange, chunk_rows, pipeline, with_a_row
from teratrain.parallel.ep_plan import keep_local_experts
from teratrain.parallel.expert_dedup import DedupExchange
from teratrain.parallel.placement import placement


class ExpertExchange(Exchange):
    """Dispatch and combine for one MoE layer: `MoE.exchange`."""

    def __call__(self, flat: torch.Tensor, key: torch.Tensor, w: torch.Tensor, k: int, slot: int | None,
                 moe, under=None) -> tuple[torch.Tensor, torch.Tensor]:
        """flat (N, d) this rank's tokens; key (N*k,) the global expert of each choice (n: not sent); w
        (N, k) their gate weights. Returns (N, d) the weighted sum of each token's expert outputs and
        (n,) the rows routed to each expert. `slot`: the most rows one expert can take (its capacity),
        or None without a limit. `under()`: work that needs no exchanged row, run while the dispatch
        moves (ep_pipeline.pipeline)."""
        n = self.ep * self.local
        if slot is None and comm.traced():  # dropless, compiled: padded to the most an expert can take
            slot = flat.shape[0]
        lay = slotted_layout(key, n, slot) if slot is not None else grouped_layout(key, n)  # by destination rank
        recv = torch.empty_like(lay.counts)  # recv[s * local + j]: rows rank s sends to this rank's expert j
        comm.all_to_all(recv, lay.counts, [self.local] * self.ep, [self.local] * self.ep, self.group)  # no read-back
        if slot is not None:
            ys, lay = self._padded(flat, lay, k, recv.view(self.ep, self.local), slot, moe, under)
        else:
            ys, lay = self._counted(flat, lay, k, recv.view(self.ep, self.local), moe, under)
        return combine(ys, lay, w.to(ys.dtype), k), lay.counts

    def _padded(self, flat, lay: Layout, k: int, recv, slot: int, moe, under) -> tuple[torch.Tensor, Layout]:
        """Every expert's rows in `slot` fixed slots: equal blocks of local * slot rows to every rank;
        chunk c carries slots [lo_c, lo_c+1) of every expert (`piece_bounds`)."""
        n, lo = self.ep * self.local, piece_bounds(slot, self.chunks)
        moe.count_exchange(lay.counts.sum(), n * slot)  # slotted_layout: no count above its slot
        if self.chunks > 1:
            lay = chunk_major(lay, torch.full((n,), slot, device=flat.device), self.chunks)
        send = dispatch(flat, lay, k, compute_dtype(flat))  # (n * slot, d): [chunk][rank][expert][slot], unused zero
        blocks = [self.local * (b - a) for a, b in zip(lo, lo[1:])]
        experts = torch.arange(self.local, device=flat.device).view(1, -1, 1)

        def experts_on(c: int, got: torch.Tensor, stacks) -> torch.Tensor:  # got: [source][expert][slot of chunk c]
            used = torch.arange(lo[c], lo[c + 1], device=flat.device) < recv.unsqueeze(-1)  # (ep, local, slots)
            return combine(*moe.run_local(got, torch.where(used, experts, self.local).flatten(), stacks=stacks))

        return pipeline(send, [([b] * self.ep, [b] * self.ep) for b in blocks], experts_on, moe, self.group, under), lay

    def _counted(self, flat, lay: Layout, k: int, recv, moe, under) -> tuple[torch.Tensor, Layout]:
        """Exactly the routed rows, with split sizes read back to the host (all_to_all_single takes
        them there): the layer's one device-to-host copy, which also gives every chunk's splits."""
        n, C = self.ep * self.local, self.chunks
        host = torch.cat([recv.flatten(), lay.counts]).tolist()
        got_rows, sent_rows = host[:n], host[n:]  # per (source, local expert), per (destination, its expert)
        moe.count_exchange(sum(sent_rows), sum(sent_rows))
        got, sent = chunk_rows(got_rows, self.ep, C), chunk_rows(sent_rows, self.ep, C)
        splits = list(zip(got, sent))  # chunk c: (rows from each source, rows to each destination)
        if C > 1:
            lay = chunk_major(lay, lay.counts, C)
        send = dispatch(flat, lay.first(sum(sent_rows)), k, compute_dtype(flat))  # the sent rows lead the layout
        experts = torch.arange(self.local, device=flat.device).repeat(self.ep)
        pieces = piece_bounds(recv.flatten(), C)  # (C + 1, ep * local)

        def experts_on(c: int, got: torch.Tensor, stacks) -> torch.Tensor:  # got: by source rank, then expert
            key = experts.repeat_interleave(pieces[c + 1] - pieces[c], output_size=sum(splits[c][0]))
            return combine(*moe.run_local(got, key, stacks=stacks))

        back = with_a_row(pipeline(send, splits, experts_on, moe, self.group, under))
        return back, lay.first(back.shape[0])


def apply_ep(model: nn.Module, rt, cfg) -> None:
    """Keep this rank's experts of every MoE layer and record their placements (ep_plan.py), and
    route through all-to-all."""
    ep, n = rt.dims.ep, cfg.model.moe.num_experts
    keep_local_experts(model, n, ep, rt.coord("ep"))
    if ep == 1:
        return
    if any(placement(p).group == "ep_replicas_tp" for p in model.parameters()):
        rt.mesh.define("ep_replicas_tp", lambda c: (c["pp"], c["ep"]))
    exchange = DedupExchange if cfg.parallel.ep_dedup else ExpertExchange
    for _, layer in moe_layers(model):
        layer.exchange = exchange(rt.mesh, ep, n // ep, cfg.parallel.ep_overlap_chunks)
