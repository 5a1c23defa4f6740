"""Process layout: validated parallel degrees, the named DeviceMesh, torchrun's environment.

Ranks are laid out with tp innermost (tensor-parallel peers are neighbours, so on one node),
then ep, dp, and pp outermost. For pp=2, dp=2, tp=2 (8 ranks):

            tp=0  tp=1
    pp=0 dp=0  [0]   [1]
         dp=1  [2]   [3]
    pp=1 dp=0  [4]   [5]
         dp=1  [6]   [7]

A rank's coordinate on each axis is its position along that axis; every group of the mesh is a
set of ranks that differ in exactly one coordinate.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from teratrain.config import ConfigError

AXES = ("pp", "dp", "ep", "tp")  # outermost to innermost


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Degrees of parallelism; their product is the number of processes."""

    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @classmethod
    def from_config(cls, pcfg, world: int) -> "ParallelDims":
        other = pcfg.tp * pcfg.pp * pcfg.ep
        if world % other:
            raise ConfigError(f"parallel.tp*pp*ep = {other} does not divide the {world} processes; "
                              f"choose degrees whose product divides {world}.")
        dims = cls(dp=pcfg.dp or world // other, tp=pcfg.tp, pp=pcfg.pp, ep=pcfg.ep)
        if dims.world != world:
            raise ConfigError(f"parallel.dp*tp*pp*ep = {dims.world} but {world} processes were launched; "
                              f"set parallel.dp={world // other} or launch {dims.world} processes (--nproc).")
        return dims

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.ep

    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> coordinate per axis (row-major over AXES)."""
        out = {}
        for axis, size in reversed(list(zip(AXES, self.shape()))):
            out[axis] = rank % size
            rank //= size
        return out


@dataclass
class Runtime:
    """Where this process runs and who its peers are. `mesh` is None for a single process."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    dims: ParallelDims
    mesh: object | None  # torch.distributed.device_mesh.DeviceMesh

    @property
    def dp_rank(self) -> int:
        return self.dims.coords(self.rank)["dp"]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA GPU is visible; set train.device=cpu or auto.")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_runtime(cfg) -> Runtime:
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), join the process group (NCCL on
    CUDA, gloo on CPU) and build the named mesh. A plain `python` run is a world of one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dims = ParallelDims.from_config(cfg.parallel, world)
    device = pick_device(cfg.train.device, local_rank)
    mesh = None
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=cfg.parallel.timeout_s),
                                    device_id=device if device.type == "cuda" else None)
        mesh = init_device_mesh(device.type, dims.shape(), mesh_dim_names=AXES)
    return Runtime(rank=rank, world=world, local_rank=local_rank, device=device, dims=dims, mesh=mesh)
