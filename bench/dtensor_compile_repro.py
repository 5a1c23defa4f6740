"""What DTensor tensor parallelism needs to train compiled, and why bench/tensor_parallel.py's compiled
DTensor rows keep the residual stream a DTensor and run with SP only: a minimal reproduction in plain
PyTorch, none of teratrain's code. Two residual blocks (an RMSNorm, then an MLP of two linears) between
an embedding and a head, split by torchtitan's tensor-parallel plan (the embedding rowwise, each block's
first linear colwise and second rowwise with `PrepareModuleInput` gathering the block's input; with
sequence parallelism the norm `SequenceParallel` and the residual stream sharded by sequence, without
it replicated), then each block compiled on its own, as torchtitan does, and one forward and backward.

    torchrun --nproc-per-node 2 bench/dtensor_compile_repro.py [--out FILE]   # gloo on the CPU, seconds

Each case runs in its own try: `eager` (no compile), and torch.compile with the backend `eager` (dynamo's
graph, run eagerly), `aot_eager` (AOTAutograd's forward and backward graphs, run eagerly) and `inductor`;
with and without sequence parallelism; the residual stream between the blocks as plain local tensors
(torchtitan's plan: `use_local_output` left on) or kept a DTensor (`use_local_output=False`, what
bench/tensor_parallel.py's compiled DTensor rows use). The result names each case's outcome: "ok", or the
exception's type and message. Measured: bench/README.md, "Tensor parallelism against DTensor".
"""

from __future__ import annotations

import argparse
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# common puts the checkout on sys.path
from common import emit, env_info, error_text

BACKENDS = ("eager", "aot_eager", "inductor")


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(d), MLP(d)

    def forward(self, x):
        return x + self.feed_forward(self.ffn_norm(x))


def case(mesh, sp: bool, local: bool, backend: str | None) -> str:
    """One forward and backward of the split model; "ok" or what it raised."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    torch.manual_seed(0)
    d, vocab = 16, 64
    emb, head = nn.Embedding(vocab, d), nn.Linear(d, vocab, bias=False)
    blocks = nn.ModuleList(Block(d) for _ in range(2))
    seq = Shard(1) if sp else Replicate()
    parallelize_module(emb, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                                  use_local_output=local))
    parallelize_module(head, mesh, ColwiseParallel(input_layouts=seq, output_layouts=Replicate()))
    for block in blocks:
        plan = {"feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=seq, use_local_output=local),
                "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))}
        if sp:
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, mesh, plan)
        if not sp and not local:  # the norm meets a DTensor: its weight one too, whole on every rank
            distribute_module(block.ffn_norm, mesh)
        if backend:
            block.compile(backend=backend, fullgraph=True)
    try:
        h = emb(torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(1)))
        for block in blocks:
            h = block(h)
        head(h).float().square().mean().backward()
        return "ok"
    except Exception as e:  # noqa: BLE001 - the outcome is what this script reports
        where = traceback.extract_tb(e.__traceback__)[-1]
        return f"{error_text(e)} ({where.filename.split('site-packages/')[-1]}:{where.lineno})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--backends", type=lambda s: s.split(","), default=list(BACKENDS),
                   help=f"torch.compile backends to try besides eager (default: {','.join(BACKENDS)})")
    a = p.parse_args()
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows = []
    for sp in (True, False):
        for local in (True, False):
            for backend in [None, *a.backends]:
                torch._dynamo.reset()
                rows.append({"sequence_parallel": sp, "stream": "local" if local else "dtensor",
                             "compile": backend or "none", "outcome": case(mesh, sp, local, backend)})
                dist.barrier()
    if dist.get_rank() == 0:
        emit({"bench": "dtensor_compile_repro", **env_info(torch.device("cpu")), "world": dist.get_world_size(),
              "rows": rows}, a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
