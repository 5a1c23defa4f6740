"""ZeRO-3 gathers of the float8 linears' weights in float8, 1 byte an element instead of the compute
dtype's 2 or 4 (memory.fp8_gather; as FSDP2 gathers torchao's `WeightWithDynamicFloat8CastTensor`
under `enable_fsdp_float8_all_gather`, torchao.float8.fsdp_utils).

Where: memory.fp8=tensorwise under parallel.zero=3. Only tensorwise: rowwise scales each weight along
its rows for the output GEMM and along its columns for the input gradient's, two casts of the full
weight that no single float8 copy serves (torchao gathers in float8 under tensorwise only too).

Layout: in each block, the weights of its float8 linears form flat groups of their own (zero.py's
group key gains "gathered in float8"), beside the block's other parameters. Such a group keeps its
fp32 master shard, optimizer state and gradient reduction as any group; what changes is its gather:
- once per step, at the group's first gather after an update, each rank takes its shard in the
  compute dtype (the dtype a single process's linear holds the weight in), finds the absolute maximum
  of each weight's piece in it, and one all-reduce (MAX) over the group's gather ranks gives every
  weight's global amax: one small collective per block. Scale = e4m3 max / amax (torchao's
  `amax_to_scale`), and the shard is cast piece by piece to e4m3 (`to_fp8_saturated(piece * scale)`)
  into a 1-byte shard kept until the next update (Psi/N bytes), so the gathers before the block's
  backward and the next micro-batches' cast nothing.
- the gather moves that 1-byte shard (as uint8: gloo and NCCL both take it) into the group's
  gathered buffer, itself 1 byte an element and freed after use like any gathered block.
- each float8 linear holds a `Float8Weight` (memory/fp8.py): a view of its weight in that buffer
  and its scale. Its GEMMs take it as torchao's Float8TrainingTensor, so torchao casts the weight no
  more (neither in forward nor for the input gradient in backward). The module's weight parameter
  is a view of a compute-dtype buffer whose storage stays empty: it exists to receive the gradient,
  which the group reduces as before.
Numerics: the global amax of the shards is the amax of the whole weight, and a cast is elementwise,
so every float8 byte is the one a single process's tensorwise cast of the same weight makes.
"""

from __future__ import annotations

import torch
from torch import nn

from teratrain import compat
from teratrain.memory.fp8 import Float8Weight, TensorwiseCast, float8_linears, gathers_in_float8
from teratrain.parallel.comm import MAX, all_reduce


def gathered_in_float8(model: nn.Module, cfg) -> set[int]:
    """ids of the weights ZeRO-3 gathers in float8: the float8 linears' under tensorwise scales with
    memory.fp8_gather (their biases and every other parameter gather in the compute dtype)."""
    if not gathers_in_float8(cfg.parallel.zero, cfg.memory.fp8, cfg.memory.fp8_gather):
        return set()
    return {id(linear.weight) for linear in float8_linears(model)}


class Float8Shard:
    """A float8 group's cast shard: its e4m3 bytes (padding stays 0), one scale per member weight,
    and whether they are this step's (`stale` after each update or restore)."""

    def __init__(self, g, device: torch.device):
        self.bytes = torch.zeros(g.shard_numel, dtype=torch.uint8, device=device)
        self.scales = torch.ones(len(g.params), dtype=torch.float32, device=device)
        self.index = torch.tensor([pc.index for pc in g.pieces], dtype=torch.long, device=device)  # each piece's weight
        self.stale = True
        self.tensorwise = TensorwiseCast()

    def cast(self, g, shard: torch.Tensor) -> None:
        """Cast this rank's `shard` (shard_numel,) of the group's weights, in the compute dtype, with
        the scales of the weights' global amaxes (one all-reduce over the group's gather ranks)."""
        pieces = g.shard_views(shard)
        amax = torch.zeros(len(g.params), dtype=torch.float32, device=shard.device)  # absent piece: 0
        if pieces:  # torch.max(abs(.)) in the shard's dtype, as torchao's tensor_to_amax
            amax.index_copy_(0, self.index, torch.stack([p.abs().max() for p in pieces]).float())
        all_reduce(amax, g.gather_pg, op=MAX)
        self.scales.copy_(self.tensorwise.scale(amax))
        for pc, piece, out in zip(g.pieces, pieces, g.shard_views(self.bytes)):
            out.view(compat.FLOAT8_E4M3).copy_(self.tensorwise.e4m3(piece, self.scales[pc.index]))
        self.stale = False


def float8_buffer(g, model: nn.Module, device: torch.device) -> torch.Tensor:
    """Set up float8 group `g` (its parameters already views of an empty compute-dtype buffer): its
    cast shard, and each owning linear's Float8Weight viewing the returned 1-byte gathered buffer
    (empty until gathered)."""
    g.float8 = Float8Shard(g, device)
    full = torch.empty(g.padded, dtype=torch.uint8, device=device)
    for i, (name, data) in enumerate(zip(g.names, g.views(full))):
        owner = model.get_submodule(name.rpartition(".")[0])
        owner.float8_weight = Float8Weight(data.view(compat.FLOAT8_E4M3), g.float8.scales[i])
    full.untyped_storage().resize_(0)
    return full


def float8_source(g, compute_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's shard of a float8 group in the compute dtype, on the device: the kept compute-dtype
    shard (on the host under parallel.offload=params), else the fp32 master's cast."""
    src = g.param_shard if g.param_shard is not None else g.master
    return src.to(device=device, dtype=compute_dtype)
