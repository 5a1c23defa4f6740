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

With `parallel.sync=param-server` the job also has `num_servers` server ranks, placed after every
worker and outside the mesh (dp=2, 2 servers: workers [0] [1] form the mesh, servers are ranks 2, 3).
Workers' collectives (the loss average, evaluation) therefore never wait on a server.
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
    """Degrees of parallelism; their product is the number of worker processes, and the job has
    `num_servers` more (parameter servers) when parallel.sync=param-server."""

    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    num_servers: int = 0

    @classmethod
    def from_config(cls, pcfg, world: int) -> "ParallelDims":
        servers = pcfg.num_servers if pcfg.sync == "param-server" else 0
        workers, plus = world - servers, " + num_servers" if servers else ""
        if workers < 1:
            raise ConfigError(f"parallel.num_servers={servers} leaves no worker among the {world} processes; "
                              f"launch more processes (--nproc) or lower parallel.num_servers.")
        other = pcfg.tp * pcfg.pp * pcfg.ep
        if workers % other:
            raise ConfigError(f"parallel.tp*pp*ep = {other} does not divide the {workers} worker processes; "
                              f"choose degrees whose product divides {workers}.")
        dims = cls(dp=pcfg.dp or workers // other, tp=pcfg.tp, pp=pcfg.pp, ep=pcfg.ep, num_servers=servers)
        if dims.world != world:
            raise ConfigError(f"parallel.dp*tp*pp*ep{plus} = {dims.world} but {world} processes were launched; "
                              f"set parallel.dp={workers // other} or launch {dims.world} processes (--nproc).")
        return dims

    @property
    def workers(self) -> int:
        """Ranks that train (all of them unless there are parameter servers)."""
        return self.dp * self.tp * self.pp * self.ep

    @property
    def world(self) -> int:
        return self.workers + self.num_servers

    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> coordinate per axis (row-major over AXES); workers only."""
        if rank >= self.workers:
            raise ValueError(f"rank {rank} is a parameter server, outside the worker mesh")
        out = {}
        for axis, size in reversed(list(zip(AXES, self.shape()))):
            out[axis] = rank % size
            rank //= size
        return out


@dataclass
class Runtime:
    """Where this process runs and who its peers are. `mesh` is None for a single process and on
    parameter servers (they are outside the worker mesh)."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    dims: ParallelDims
    mesh: object | None  # torch.distributed.device_mesh.DeviceMesh

    @property
    def is_server(self) -> bool:
        return self.rank >= self.dims.workers

    @classmethod
    def single(cls, device: torch.device | str) -> "Runtime":
        """A world of one process on `device` (no process group), as a plain `python` run gets."""
        return cls(rank=0, world=1, local_rank=0, device=torch.device(device), dims=ParallelDims(dp=1), mesh=None)

    @property
    def dp_rank(self) -> int:
        """Position along dp; 0 on a parameter server (it holds no replica and reads no data)."""
        return 0 if self.is_server else self.dims.coords(self.rank)["dp"]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_group(self):
        """The data-parallel process group (None for a single process or on a parameter server)."""
        return self.mesh["dp"].get_group() if self.mesh is not None else None

    @property
    def world_group(self):
        """Every process of the job (None for a single process)."""
        if self.world == 1:
            return None
        import torch.distributed as dist

        return dist.group.WORLD

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA GPU is visible; set train.device=cpu or auto.")
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} visible); "
                              "launch at most one process per GPU on each machine.")
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
        # the mesh spans the workers only; servers take part in creating its groups (a collective)
        mesh = init_device_mesh(device.type, dims.shape(), mesh_dim_names=AXES)
        if rank >= dims.workers:
            mesh = None
    return Runtime(rank=rank, world=world, local_rank=local_rank, device=device, dims=dims, mesh=mesh)
