"""Point-to-point transport between pipeline ranks: one process group per directed link.

A link (a -> b) joins the rank at pipeline coordinate a and the rank at b with the same data- and
tensor-parallel coordinates. Each directed link has a communicator of its own (actions.py rule 3):
NCCL runs one communicator's operations in order on one stream, so with a shared one a send could
wait behind a receive in the other direction. Within a link, messages match in the order they are
posted (FIFO), which is the order the schedule lists them in; no tags are needed.

Sends are posted and never waited for until the end of the step (rule 1); receives are waited for
before the next compute action (rule 2). Consecutive sends/receives of an action list are posted
together, one `batch_isend_irecv` per link (a batch must stay within one process group).

Streams (NCCL): each link's communicator runs its kernels on a stream of its own, never behind
compute on the compute stream. Posting an op makes that stream wait for the work already queued on
the compute stream, which a send needs (it sends what that work computed) and a receive pays little
for: the executor posts it before the compute action that precedes its consumer is queued, so it
waits only for the action before that one and its transfer overlaps the action between. `wait()`
makes the compute stream, not the host, wait for the op to end, and a posted batch keeps its tensors
referenced until it is done, so a buffer is neither freed nor reused under a running transfer.
(Receiving on a side stream instead, free of the compute stream, was considered: it would start a
receive's kernel earlier, spinning on SMs beside compute, and the transfer would still end in the
same action's shadow; the profile in bench/pipeline.py --profile shows what communication is exposed.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from teratrain.parallel import inflight


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
        defs = [(link_name(a, b), lambda c, ends=(a, b): (c["dp"], c["tp"]) if c["pp"] in ends else None)
                for a, b in order]
        for (src, dst), name in zip(order, mesh.define_everywhere(defs)):
            if name is not None:
                peer = next(r for r in mesh.ranks(name) if r != mesh.rank)
                self.groups[(src, dst)] = (mesh.group(name), peer)
        warm = [(src == self.me, dst if src == self.me else src, torch.zeros(1, device=device))
                for src, dst in sorted(self.groups)]
        for batch in sum(self.post(warm), []):
            batch.wait()

    def post(self, ops: list[tuple[bool, int, torch.Tensor]]) -> tuple[list["Batch"], list["Batch"]]:
        """Post (is_send, peer pipeline coordinate, tensor) operations, one batch per link; returns
        (send batches, receive batches), each with `.wait()` (a directed link's batch on one rank is
        all sends or all receives)."""
        by_link: dict[tuple[int, int], list] = {}
        for send, peer, t in ops:
            link = (self.me, peer) if send else (peer, self.me)
            group, global_peer = self.groups[link]
            by_link.setdefault(link, []).append(dist.P2POp(dist.isend if send else dist.irecv, t, global_peer, group))
        sends, recvs = [], []
        for (src, dst), batch in by_link.items():
            group, peer = self.groups[(src, dst)]
            what = f"send to rank {peer}" if src == self.me else f"receive from rank {peer}"
            posted = Batch(inflight.launch(what, group, lambda b=batch: dist.batch_isend_irecv(b)),
                           [op.tensor for op in batch])
            (sends if src == self.me else recvs).append(posted)
        return sends, recvs


class Batch:
    """One posted batch (tracked by the hang watchdog, inflight.py) and its tensors."""

    def __init__(self, handle: "inflight.Op", tensors: list[torch.Tensor]):
        self.handle, self.tensors = handle, tensors  # a sent tensor must live until its send is over

    def wait(self) -> None:
        self.handle.wait()

    def done(self) -> bool:
        """Finished (never blocks)."""
        return self.handle.is_completed()
