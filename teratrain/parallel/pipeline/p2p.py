"""Point-to-point transport between pipeline ranks: one process group per directed link.

A link (a -> b) joins the rank at pipeline coordinate a and the rank at b with the same data- and
tensor-parallel coordinates. Each directed link has a communicator of its own (actions.py rule 3):
NCCL runs one communicator's operations in order on one stream, so with a shared one a send could
wait behind a receive in the other direction. Within a link, messages match in the order they are
posted (FIFO), which is the order the schedule lists them in; no tags are needed.

Sends are posted right after the action that computed them and waited for at the end of the step
(rule 1); receives are waited for before the compute action that uses them (rule 2). Every rank posts
in the order of its list, so a link's messages are posted in the same order at both ends. What the
executor posts at one point goes in one `batch_isend_irecv` per link (a batch must stay within one
process group, and with one group per direction a send and a receive never share one).

Streams (NCCL): each link's communicator runs its kernels on a stream of its own, never behind
compute on the compute stream. Posting an op makes that stream wait for the work already queued on
the compute stream, which a send needs (it sends what that work computed). `wait()` makes the compute
stream, not the host, wait for the op to end, and a posted batch keeps its tensors referenced until it
is done, so a buffer is neither freed nor reused under a running transfer.

When to post a receive (`parallel.pipeline_recv`, runtime.py `plan`). NCCL moves a message with a
kernel on each side, and the one posted first spins on its SMs until the other is posted. `at_use`
(the default) posts a receive once the action before its consumer is queued: its kernel starts when
that action ends, while the consumer waits for it anyway, and the transfer (about 0.1 ms for a
16 MiB activation over NVLink, bench/results/h100x2/2026-11-26_pipeline.json) is exposed when the message was
ready before. `ahead` posts it one action earlier so that the transfer hides under that action, but
while the peer has not sent yet its kernel spins beside that action and slows it. On 2 x H100 (same
file) 1F1B's last stage ran its B in 25.4 ms with the next receive spinning beside it, against
21.5 ms under GPipe, where nothing spins beside it; stage 0 its F in 10.8 ms (a receive spinning
beside it) against 8.8 ms under GPipe, whose B on stage 0 has the spinning receive instead (22.5 ms
against 18.8 ms): 3.9 ms of each 36 ms micro-batch on the rank that sets 1F1B's pace.
Megatron's non-interleaved 1F1B, too, receives where it uses a message (send_forward_recv_backward
after the forward); its interleaved schedule's `overlap_p2p_comm` is our `ahead`.

Scattered messages (`Scatter`; Narayanan et al. 2021 sec. 4.1, "scatter/gather optimization"). With
tp > 1 and no sequence parallelism every tp rank of a stage holds the same activation (and the same
input gradient: the column-parallel layers' backward all-reduces it). Each tp rank then sends only its
1/tp piece of the flattened message over its own link, and the receiving stage all-gathers the pieces
over tp (NVLink inside a node) before use: the inter-node bytes fall by tp. Under sequence parallelism
the message is already the rank's T/tp rows, different on each tp rank, and goes whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from teratrain.parallel import inflight
from teratrain.parallel.comm import all_gather


def link_name(src: int, dst: int) -> str:
    return f"pp_link{src}to{dst}"


class Links:
    def __init__(self, mesh, links: set[tuple[int, int]], device: torch.device):
        """Create the process groups of every directed link of `links` (pipeline coordinates), every
        rank taking part in one global order (mesh.define_everywhere), and exchange one element on
        each link of this rank to start them."""
        self.me, self.device = mesh.coords["pp"], device
        self.groups: dict[tuple[int, int], tuple[object, int]] = {}  # (src, dst) -> (group, global peer)
        order = sorted(links)
        defs = [(link_name(a, b), lambda c, ends=(a, b): (c["dp"], c["cp"], c["tp"]) if c["pp"] in ends else None)
                for a, b in order]
        for (src, dst), name in zip(order, mesh.define_everywhere(defs)):
            if name is not None:
                peer = next(r for r in mesh.ranks(name) if r != mesh.rank)
                self.groups[(src, dst)] = (mesh.group(name), peer)
        warm = [(src == self.me, dst if src == self.me else src, torch.zeros(1, device=device))
                for src, dst in sorted(self.groups)]
        for batch in set(self.post(warm)):
            batch.wait()

    def post(self, ops: list[tuple[bool, int, torch.Tensor]]) -> list["Batch"]:
        """Post (is_send, peer pipeline coordinate, tensor) operations in their order, one batch per
        link; returns each op's batch (ops on one link share it; a directed link's batch on one rank is
        all sends or all receives)."""
        by_link: dict[tuple[int, int], list] = {}
        for send, peer, t in ops:
            link = (self.me, peer) if send else (peer, self.me)
            group, global_peer = self.groups[link]
            by_link.setdefault(link, []).append(dist.P2POp(dist.isend if send else dist.irecv, t, global_peer, group))
        posted = {}
        for (src, dst), batch in by_link.items():
            group, peer = self.groups[(src, dst)]
            what = f"send to rank {peer}" if src == self.me else f"receive from rank {peer}"
            posted[(src, dst)] = Batch(inflight.launch(what, group, lambda b=batch: dist.batch_isend_irecv(b)),
                                       [op.tensor for op in batch])
        return [posted[(self.me, peer) if send else (peer, self.me)] for send, peer, _ in ops]


class Batch:
    """One posted batch (tracked by the hang watchdog, inflight.py) and its tensors."""

    def __init__(self, handle: "inflight.Op", tensors: list[torch.Tensor]):
        self.handle, self.tensors = handle, tensors  # a sent tensor must live until its send is over

    def wait(self) -> None:
        self.handle.wait()

    def done(self) -> bool:
        """Finished (never blocks)."""
        return self.handle.is_completed()


class Scatter:
    """Messages split over the tp ranks of a stage and all-gathered after the receive (module
    docstring). `tp_rank` is this rank's tp coordinate; a message of numel not divisible by tp is sent
    whole (every tp rank decides the same from the same shape)."""

    def __init__(self, tp_group, tp: int, tp_rank: int):
        self.group, self.tp, self.rank = tp_group, tp, tp_rank

    def splits(self, numel: int) -> bool:
        return self.tp > 1 and numel % self.tp == 0

    def piece(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous 1/tp of `full` (a view: sending it sends those elements)."""
        if not self.splits(full.numel()):
            return full
        k = full.numel() // self.tp
        return full.contiguous().view(-1)[self.rank * k:(self.rank + 1) * k]

    def gather(self, full: torch.Tensor) -> None:
        """Fill `full`, whose `piece` was received, with every tp rank's piece (all-gather over tp)."""
        if self.splits(full.numel()):
            flat = full.view(-1)
            all_gather(flat, self.piece(flat), self.group)
