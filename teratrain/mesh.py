"""Process layout: validated parallel degrees, the named mesh and its groups, torchrun's environment.

Worker ranks form a grid with axes pp (outermost), dp, cp, tp (innermost: tensor-parallel peers are
neighbours, so on one node). For pp=2, dp=2, tp=2 (8 ranks):

            tp=0  tp=1
    pp=0 dp=0  [0]   [1]
         dp=1  [2]   [3]
    pp=1 dp=0  [4]   [5]
         dp=1  [6]   [7]

Context parallelism (cp) splits each sample's sequence: the cp ranks of one dp coordinate read the
same samples, each its own chunks of them (parallel/context.py), and hold the same parameters. For
dp=2, cp=2 (4 ranks): [0] [1] read samples 0..B/2-1, [2] [3] the others; ranks {0, 1} and {2, 3} are
the `cp` groups, and all four reduce gradients (and shard ZeRO state) together in `dp`.

Expert parallelism borrows its ranks from dp rather than multiplying the world: the dp coordinate d
splits into (d // ep, d % ep), so ep neighbours along dp share one set of experts between them
(each still reads its own samples). With dp=4, ep=2: dp ranks {0,1} and {2,3} are the expert groups
(`ep`), and {0,2} and {1,3} hold the same experts (`ep_replicas`).

A group is a set of ranks that differ only along some axes. `Mesh.group(name)` returns this rank's
process group for one of the names below (None when the group is this rank alone: every
collective in parallel/comm.py then degenerates to a local no-op):

    world        every worker                      tp   vary tp
    pp           vary pp                           cp   vary cp (the ring or all-to-all of attention)
    dp           vary dp and cp: the ranks holding the same parameters, over which gradients are
                 reduced and ZeRO shards (Megatron's and torchtitan's data-parallel-with-cp group)
    dp_tp        vary dp, cp and tp (a replicated tensor's partial gradients, e.g. sequence-parallel norms)
    ep           vary the ep part of dp
    ep_replicas  vary the other part of dp, and cp (ranks holding the same experts)

With `parallel.sync=param-server` the job also has `num_servers` server ranks, placed after every
worker and outside the mesh (dp=2, 2 servers: workers [0] [1] form the mesh, servers are ranks 2, 3).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch

from teratrain.config_base import ConfigError

AXES = ("pp", "dp", "cp", "tp")  # outermost to innermost; ep splits dp
GROUPS: dict[str, tuple[str, ...]] = {  # name -> the coordinates that vary within one group
    "world": ("pp", "dp", "cp", "tp"), "pp": ("pp",), "dp": ("dp", "cp"), "tp": ("tp",),
    "dp_tp": ("dp", "cp", "tp"), "ep": ("ep",), "ep_replicas": ("ep_replica", "cp"), "cp": ("cp",),
}


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Degrees of parallelism. dp * cp * tp * pp is the number of worker processes (ep divides dp and
    adds none); the job has `num_servers` more (parameter servers) when parallel.sync=param-server."""

    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    num_servers: int = 0

    @classmethod
    def from_config(cls, pcfg, world: int) -> "ParallelDims":
        servers = pcfg.num_servers if pcfg.sync == "param-server" else 0
        workers, plus = world - servers, " + num_servers" if servers else ""
        if workers < 1:
            raise ConfigError(f"parallel.num_servers={servers} leaves no worker among the {world} processes; "
                              f"launch more processes (--nproc) or lower parallel.num_servers.")
        other = pcfg.tp * pcfg.pp * pcfg.cp
        names = "tp*pp*cp" if pcfg.cp > 1 else "tp*pp"
        if workers % other:
            ones = " ".join(f"--set parallel.{k}=1" for k in ("tp", "pp", "cp") if getattr(pcfg, k) > 1)
            raise ConfigError(f"parallel.{names} = {other} does not divide the {workers} worker processes; "
                              f"choose degrees whose product divides {workers} (e.g. {ones}: a resumed run keeps "
                              "its saved degrees unless given others).")
        dims = cls(dp=pcfg.dp or workers // other, tp=pcfg.tp, pp=pcfg.pp, ep=pcfg.ep, cp=pcfg.cp, num_servers=servers)
        if dims.world != world:
            raise ConfigError(f"parallel.dp*{names}{plus} = {dims.world} but {world} processes were launched; "
                              f"set parallel.dp={workers // other} or launch {dims.world} processes (--nproc).")
        if dims.dp % dims.ep:
            raise ConfigError(f"parallel.ep={dims.ep} must divide the data-parallel degree {dims.dp} (expert "
                              "parallelism borrows data-parallel ranks); choose an ep that divides dp.")
        return dims

    @property
    def workers(self) -> int:
        """Ranks that train (all of them unless there are parameter servers)."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def replicas(self) -> int:
        """Ranks whose losses the step's loss averages (dp x cp): every gradient rule divides by it."""
        return self.dp * self.cp

    @property
    def world(self) -> int:
        return self.workers + self.num_servers

    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> coordinate per axis (row-major over AXES), plus dp's two parts `ep` and
        `ep_replica`; workers only."""
        if rank >= self.workers:
            raise ValueError(f"rank {rank} is a parameter server, outside the worker mesh")
        out = {}
        for axis, size in reversed(list(zip(AXES, self.shape()))):
            out[axis] = rank % size
            rank //= size
        out["ep"], out["ep_replica"] = out["dp"] % self.ep, out["dp"] // self.ep
        return out

    def ranks_with(self, rank: int, vary: tuple[str, ...]) -> list[int]:
        """The workers whose coordinates equal `rank`'s except along the axes in `vary`."""
        me = self.coords(rank)
        fixed = [a for a in ("pp", "cp", "tp") if a not in vary]
        if "dp" not in vary:  # dp is the pair (ep_replica, ep): fixing both parts fixes dp
            fixed += [a for a in ("ep", "ep_replica") if a not in vary]
        return [r for r in range(self.workers) if all(self.coords(r)[a] == me[a] for a in fixed)]


@dataclass
class Mesh:
    """The worker grid and this rank's process groups by name (see the module docstring).

    A group is created by its members only, and torch names it after its ranks and how many groups
    each member had created before (`new_group(use_local_synchronization=True)`), so members must
    create it at the same count. Hence: `create_standard_groups` makes every standard group (and its
    `:gather` twin) up front, in one fixed order on every rank; a custom group (`define`) is made
    on first use by members that share a pipeline stage and so build the same things in the same
    order; a group that spans stages is made with `define_everywhere`, where every rank takes part."""

    dims: ParallelDims
    rank: int
    timeout_s: float = 600.0  # parallel.timeout_s: every group's operations are watched for it (inflight.py)
    dp_max_ctas: int | None = None  # parallel.dp_max_ctas: NCCL's thread blocks per collective of the dp groups
    _ranks: dict[str, list[int]] = field(default_factory=dict, repr=False)
    _groups: dict = field(default_factory=dict, repr=False)
    _used: set = field(default_factory=set, repr=False)  # names a strategy asked for
    _connected: set = field(default_factory=set, repr=False)
    _everywhere: set = field(default_factory=set, repr=False)  # names define_everywhere has made

    @property
    def coords(self) -> dict[str, int]:
        return self.dims.coords(self.rank)

    def ranks(self, name: str) -> list[int]:
        """The workers in this rank's group `name`, in rank order. `name:purpose` (e.g. `dp:gather`)
        is the same set of ranks with a process group of its own, so two streams of collectives
        (ZeRO-3's gathers and its reductions) can each keep their own order."""
        base, _, _purpose = name.partition(":")
        if base != name:
            return self.ranks(base)
        if name not in self._ranks:
            if name not in GROUPS:
                raise KeyError(f"mesh group {name!r} is neither standard ({', '.join(GROUPS)}) nor defined by define()")
            self._ranks[name] = self.dims.ranks_with(self.rank, GROUPS[name])
        return self._ranks[name]

    def size(self, name: str) -> int:
        return len(self.ranks(name))

    def rank_in(self, name: str) -> int:
        return self.ranks(name).index(self.rank)

    def group(self, name: str):
        """This rank's process group called `name` (None if it holds this rank alone)."""
        if name not in self._used:  # a lookup of a known group mutates nothing (compiled, checkpointed code)
            self._used.add(name)
        return self._make(name)

    def _make(self, name: str):
        if name not in self._groups:
            ranks = self.ranks(name)
            self._groups[name] = new_group(ranks, name=name, timeout_s=self.timeout_s,
                                           pg_options=self._options(name)) if len(ranks) > 1 else None
        return self._groups[name]

    def _options(self, name: str):
        """NCCL options of group `name`: the `dp` group and its `:gather` twin take
        parallel.dp_max_ctas (compat.nccl_options: None without NCCL); None elsewhere."""
        from teratrain.compat import nccl_options

        return nccl_options(self.dp_max_ctas) if name.partition(":")[0] == "dp" else None

    def create_standard_groups(self) -> None:
        """Every standard group of this rank (GROUPS, then each `:gather` twin), in one fixed order."""
        for purpose in ("", ":gather"):
            for name in GROUPS:
                self._make(name + purpose)

    def spans_stages(self, name: str) -> bool:
        """Does group `name` hold ranks of several pipeline stages (a tied embedding's `pp_ends`)?"""
        return len({self.dims.coords(r)["pp"] for r in self.ranks(name)}) > 1

    def connect(self, device: torch.device) -> None:
        """Set up the communicator of every group a strategy has asked for, now, in the order the
        groups were created (the same on every member). NCCL sets a communicator up at a group's first
        operation, and that set-up blocks the host until every member arrives: lazily, from a gradient
        hook between a backward and the send a peer stage waits for, it deadlocks. gloo connects when a
        group is made. Each member blocks here only on groups made before this one, so the walk cannot
        cycle. Idempotent: later calls connect groups asked for since."""
        if device.type != "cuda":
            return
        from teratrain.parallel.comm import all_reduce

        names = [n for n, g in self._groups.items() if g is not None and n in self._used and n not in self._connected]
        one = torch.zeros(1, device=device)
        for n in names:  # dicts keep insertion order: the order the groups were made
            all_reduce(one, self._groups[n])
            torch.cuda.synchronize(device)
            self._connected.add(n)

    def define(self, name: str, key: Callable[[dict[str, int]], object]) -> str:
        """Name a custom group: the workers whose coordinates give the same `key` as this rank's (e.g.
        the tensor-parallel ranks that hold the same replicated key/value head). Returns `name`."""
        if name not in self._ranks:
            mine = key(self.coords)
            self._ranks[name] = [r for r in range(self.dims.workers) if key(self.dims.coords(r)) == mine]
        return name


    def define_everywhere(self, defs: list[tuple[str, Callable[[dict[str, int]], object]]]) -> list[str | None]:
        """Define and create, in order, groups that only some ranks belong to (`key` gives None on the
        others), e.g. one per pipeline link. Every worker calls this with the same list at the same
        point: torch names a group its members create alone after its ranks and how many groups each
        member created before it, so a rank outside a group (or alone in it) creates a group of itself
        in its place and the counts stay equal everywhere. Returns this rank's names (None: outside).
        A name made before is not made again, on any rank (a mesh reused by several runs)."""
        out = []
        for name, key in defs:
            inside = key(self.coords) is not None
            if name in self._everywhere:
                out.append(name if inside else None)
                continue
            self._everywhere.add(name)
            if inside:
                self.define(name, key)
            if inside and self.size(name) > 1:
                self.group(name)
            elif self.dims.workers > 1:
                new_group([self.rank], name="unused", timeout_s=self.timeout_s)
            out.append(name if inside else None)
        return out


def new_group(ranks: list[int], name: str, timeout_s: float, local: bool = True, **kwargs):
    """A process group over `ranks`, made by its members alone (`local`) or by every process of the
    job together. Its description (`name` and ranks) is what a hang report names; torch's own timeout
    is the backstop behind the watchdog's `timeout_s` (inflight.py)."""
    import torch.distributed as dist

    from teratrain.parallel.inflight import backstop_s

    return dist.new_group(ranks, use_local_synchronization=local, timeout=timedelta(seconds=backstop_s(timeout_s)),
                          group_desc=f"{name} ranks {','.join(map(str, ranks))}", **kwargs)


def align_group_names() -> None:
    """Before a second run in the same processes (tests, notebooks): torch names a group its members
    make alone after its ranks and how many groups the process already holds, and an earlier run in
    which ranks had different roles (a parameter server, another stage) leaves them holding different
    numbers, so the same group would get different names on its members and its creation would hang.
    Every rank pads its count to the largest with groups of itself (never reused names: destroying
    groups instead would reuse names whose rendezvous keys are still in the store)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    count = torch.tensor([len(c10d._world.pg_names)], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        count = count.cuda()
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    for _ in range(int(count.item()) - len(c10d._world.pg_names)):
        new_group([dist.get_rank()], name="unused", timeout_s=600.0)


@dataclass
class Runtime:
    """Where this process runs and who its peers are. `mesh` is None on parameter servers (they are
    outside the worker mesh); a single process has a mesh of one whose groups are all None."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    dims: ParallelDims
    mesh: Mesh | None

    @property
    def is_server(self) -> bool:
        return self.rank >= self.dims.workers

    @classmethod
    def single(cls, device: torch.device | str) -> "Runtime":
        """A world of one process on `device` (no process group), as a plain `python` run gets."""
        dims = ParallelDims(dp=1)
        return cls(rank=0, world=1, local_rank=0, device=torch.device(device), dims=dims, mesh=Mesh(dims, 0))

    def coord(self, axis: str) -> int:
        """Position along `axis` ("pp", "dp", "cp", "tp", "ep"); 0 on a parameter server."""
        return 0 if self.is_server else self.dims.coords(self.rank)[axis]

    @property
    def dp_rank(self) -> int:
        """Position along dp; 0 on a parameter server (it holds no replica and reads no data)."""
        return self.coord("dp")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def group(self, name: str):
        """The named mesh group of this rank (None when it is this rank alone, or on a parameter server)."""
        return self.mesh.group(name) if self.mesh is not None else None

    @property
    def dp_group(self):
        return self.group("dp")

    @property
    def world_group(self):
        """Every process of the job, servers included (None for a single process)."""
        if self.world == 1:
            return None
        import torch.distributed as dist

        return dist.group.WORLD

    def broadcast(self, obj):
        """Rank 0's picklable `obj` on every process of the job (small control values)."""
        if self.world == 1:
            return obj
        from teratrain.parallel.comm import broadcast_object

        return broadcast_object(obj, self.world_group)

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            from teratrain.parallel.inflight import blocking

            blocking("barrier", None, dist.barrier)


def shutdown() -> None:
    """Destroy this process's groups, after releasing what still uses them: compiled code and its
    CUDA graphs (graphs that captured NCCL work hang the group's destruction: compat.release_compiled),
    and the operations parallel/inflight.py registered (it keeps completed ones until it prunes, and
    each holds its group). A group still referenced once destroyed is freed in the interpreter's
    teardown, where gloo's threads abort the process ("terminate called without an active
    exception": 1 run in 8 of the tp bench's smoke with chunked overlap, none in 44 once forgotten)."""
    import torch.distributed as dist

    from teratrain.compat import release_compiled
    from teratrain.parallel import inflight

    release_compiled()
    inflight.reset()
    if dist.is_initialized():
        dist.destroy_process_group()


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


ATTEMPT_KEY = "teratrain/attempt"  # in torchrun's store: where this attempt's own store is (port, id)
PROBE_S = 2.0


def attempt_store(rank: int, world: int, timeout: timedelta):
    """The store this attempt of the job meets in, or None for torch's own. torchrun's agent keeps one
    store for every restart of a job (TORCHELASTIC_USE_AGENT_STORE), so the keys an earlier attempt
    left there (gloo's addresses, NCCL's unique id) would be read by the next as its peers': it connects
    to dead ports and never starts (https://github.com/pytorch/pytorch/issues/135712; a worker restarted
    while its peer was not cannot tell attempts apart by TORCHELASTIC_RESTART_COUNT either). Each
    attempt meets in a store of its own instead: rank 0 hosts it on a free port and leaves its port and
    a random id in the agent's store; a rank that read an earlier attempt's (nothing answers there, or
    another id) waits for the next value."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or world == 1:
        return None
    import time
    import uuid

    from torch.distributed import TCPStore

    from teratrain.parallel.inflight import blocking

    addr = os.environ["MASTER_ADDR"]
    agent = TCPStore(addr, int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    if rank == 0:
        own = TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        uid = uuid.uuid4().hex
        own.set("attempt", uid)
        agent.set(ATTEMPT_KEY, f"{own.port} {uid}")
        return own
    end, tried = time.monotonic() + timeout.total_seconds(), None
    while time.monotonic() < end:
        value = blocking("lookup of rank 0's store", None, lambda: agent.get(ATTEMPT_KEY)).decode()
        if value != tried:
            tried = value
            if (own := _open_store(addr, *value.split(), timeout)) is not None:
                return own
        time.sleep(0.1)
    raise ConfigError(f"rank {rank} found no store of this attempt's rank 0 at {addr} within "
                      f"{timeout.total_seconds():g} s; check that every node reaches {addr}.")


def _open_store(addr: str, port: str, uid: str, timeout: timedelta):
    """The store at addr:port if it is the one rank 0 made with `uid`, else None."""
    import socket

    from torch.distributed import TCPStore

    try:
        socket.create_connection((addr, int(port)), timeout=PROBE_S).close()  # a gone store refuses at once
        own = TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=PROBE_S))
        if own.get("attempt").decode() == uid:
            own.set_timeout(timeout)
            return own
    except (OSError, RuntimeError):
        pass
    return None


def init_runtime(cfg) -> Runtime:
    """Read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), join the process group (NCCL on
    CUDA, gloo on CPU) and build the named mesh. A plain `python` run is a world of one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dims = ParallelDims.from_config(cfg.parallel, world)
    device = pick_device(cfg.train.device, local_rank)
    if world > 1:
        import torch.distributed as dist

        from teratrain.parallel.inflight import backstop_s, start_watchdog

        if dist.is_initialized():
            align_group_names()  # a run before this one in the same processes
        else:
            backend = "nccl" if device.type == "cuda" else "gloo"
            timeout = timedelta(seconds=backstop_s(cfg.parallel.timeout_s))
            store = attempt_store(rank, world, timeout)
            dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None,
                                    **({"store": store, "rank": rank, "world_size": world} if store else {}))
        start_watchdog(cfg.parallel.timeout_s, rank)
    mesh = Mesh(dims, rank, timeout_s=cfg.parallel.timeout_s,
                dp_max_ctas=cfg.parallel.dp_max_ctas) if rank < dims.workers else None
    if mesh is not None and world > 1:
        mesh.create_standard_groups()
    return Runtime(rank=rank, world=world, local_rank=local_rank, device=device, dims=dims, mesh=mesh)
