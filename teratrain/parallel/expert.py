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
over `ep_replicas`, the ranks holding the same experts, and divided by dp: sum over all dp ranks of
d(loss_r)/dW, over dp, which is the gradient of the global mean loss (not ep times it).

With tensor parallelism the megatron form splits every expert like the dense MLP (tensor.py): every tp
rank routes the same gathered tokens and exchanges them with the ep peers of its own tp index; the
seeds' tp forms leave experts whole, replicated over tp.

No hang on an idle expert: an expert that receives no token still runs on zero rows, so every rank
builds the same autograd graph and its gradient hooks launch the same collectives in the same order;
the all-to-all takes empty blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from teratrain.config import ConfigError
from teratrain.models.moe import moe_layers
from teratrain.parallel.comm import all_gather, all_to_all, all_to_all_rows
from teratrain.parallel.placement import place, placement


@dataclass
class ExpertExchange:
    """Dispatch and combine for one MoE layer: `MoE.exchange`."""

    mesh: object  # the group is looked up at the first exchange: the planner applies this without one
    ep: int
    local: int  # experts per rank

    @property
    def group(self):
        return self.mesh.group("ep")

    def __call__(self, xs: torch.Tensor, counts: torch.Tensor, run_local) -> torch.Tensor:
        """xs (M, d): the routed rows sorted by global expert; counts (n,): rows per expert. Returns
        the experts' outputs (M, d) in xs's order. run_local(rows, counts per local expert) runs
        this rank's experts on consecutive row blocks."""
        ep, local = self.ep, self.local
        send = counts.view(ep, local)  # rows for each expert of each rank
        recv = torch.empty_like(send)  # recv[s, j]: rows rank s sends to this rank's expert j
        all_to_all(recv.view(-1), send.reshape(-1), [local] * ep, [local] * ep, self.group)
        host = torch.cat([recv.reshape(-1), send.sum(1)]).tolist()  # the one device-to-host copy
        sizes, send_rows = host[:ep * local], host[ep * local:]
        recv_rows = [sum(sizes[s * local:(s + 1) * local]) for s in range(ep)]
        per_expert = [sum(sizes[s * local + j] for s in range(ep)) for j in range(local)]
        got = all_to_all_rows(xs, recv_rows, send_rows, self.group)  # (R, d): by source rank, then expert
        order = expert_major(recv, sum(recv_rows))
        ys = run_local(got[order], per_expert)  # (R, d), grouped by local expert
        return all_to_all_rows(ys[torch.argsort(order)], send_rows, recv_rows, self.group)


def expert_major(recv: torch.Tensor, total: int) -> torch.Tensor:
    """Positions in a buffer of `total` rows laid out by source rank then expert (block [s, j] holds
    recv[s, j] rows), listed by expert then source rank."""
    ep, local = recv.shape
    sizes = recv.reshape(-1)
    starts = sizes.cumsum(0) - sizes  # of each block in the source-major buffer
    blocks = torch.arange(ep * local, device=recv.device).view(ep, local).t().reshape(-1)  # expert-major
    lengths = sizes[blocks]
    first = (lengths.cumsum(0) - lengths).repeat_interleave(lengths, output_size=total)  # block start, expert-major
    return starts[blocks].repeat_interleave(lengths, output_size=total) + torch.arange(total, device=recv.device) - first


def apply_ep(model: nn.Module, rt, cfg) -> None:
    """Keep this rank's experts of every MoE layer (the others are dropped from the meta-device
    model, names unchanged), record their placements, and route through all-to-all."""
    ep, n = rt.dims.ep, cfg.model.moe.num_experts
    local = n // ep
    first = rt.coord("ep") * local
    for _, layer in moe_layers(model):
        for key in list(layer.experts.keys()):
            if not first <= int(key) < first + local:
                del layer.experts[key]
        for key, expert in layer.experts.items():
            for p in expert.parameters():
                pl = placement(p)
                place(p, pl.with_(group=_expert_group(pl.group, rt.mesh) if ep > 1 else pl.group, expert=int(key)))
        if ep > 1:
            layer.exchange = ExpertExchange(rt.mesh, ep, local)


def _expert_group(group: str, mesh) -> str:
    """The group of an expert parameter: the dp part of its dense group becomes `ep_replicas`."""
    if group == "dp":
        return "ep_replicas"
    if group == "dp_tp":  # partial over tp too (an expert's row-parallel bias)
        return mesh.define("ep_replicas_tp", lambda c: (c["pp"], c["ep"]))
    raise ValueError(f"no expert-parallel group for parameters reduced over {group!r}")


@torch.no_grad()
def gather_experts(full: dict[str, torch.Tensor], model: nn.Module, mesh, device) -> dict[str, torch.Tensor]:
    """`full` (whole CPU tensors by global name, this rank's experts among them) plus the experts of
    the other ep ranks, gathered through `device`. Collective over `ep`; rank r's j-th expert is
    global expert r * n/ep + j."""
    group = mesh.group("ep") if mesh is not None else None
    if group is None or not moe_layers(model):  # a pipeline stage without MoE layers (its ep peers neither)
        return full
    names = [(f"layers.{key}.feed_forward.experts.", j, int(e), f".{leaf}")
             for key, layer in moe_layers(model) for j, e in enumerate(layer.experts)
             for leaf, _ in layer.experts[e].named_parameters()]
    mine = [full[f"{pre}{e}{leaf}"] for pre, _, e, leaf in names]
    flat = torch.cat([t.reshape(-1).to(mine[0].dtype) for t in mine]).to(device)
    everyone = torch.empty(mesh.size("ep") * flat.numel(), dtype=flat.dtype, device=device)
    all_gather(everyone, flat, group)
    everyone = everyone.cpu()
    out = dict(full)
    local = len(next(iter(moe_layers(model)))[1].experts)
    for s, chunk in enumerate(everyone.view(mesh.size("ep"), -1)):
        offset = 0
        for (pre, j, _, leaf), t in zip(names, mine):
            out[f"{pre}{s * local + j}{leaf}"] = chunk[offset:offset + t.numel()].view(t.shape).to(t.dtype).clone()
            offset += t.numel()
    return out


def check_ep(cfg) -> None:
    """Refuse, with the fix, expert-parallel layouts this model or run cannot use."""
    p, m = cfg.parallel, cfg.model.moe
    if p.ep == 1:
        return
    if not m.enabled:
        raise ConfigError(f"parallel.ep={p.ep} needs a mixture-of-experts model; set model.moe.num_experts > 1 "
                          "(or a preset such as moe-tiny) or parallel.ep=1.")
    if m.num_experts % p.ep:
        raise ConfigError(f"parallel.ep ({p.ep}) must divide model.moe.num_experts ({m.num_experts}); choose an ep "
                          "that divides it.")
    if p.sync != "allreduce":
        raise ConfigError(f"parallel.sync={p.sync} keeps whole replicas, but expert parallelism splits the experts; "
                          "set parallel.sync=allreduce or parallel.ep=1.")
