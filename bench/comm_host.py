"""Host time of tensor-parallel communication (issue 20): what one collective costs the host through
parallel/comm.py (and its hang registry, parallel/inflight.py) against the raw torch.distributed call,
and what one training step of a tp=2 model costs the host with and without sequence parallelism.

    torchrun --nproc-per-node 2 bench/comm_host.py                 # the backend of the machine (NCCL on GPUs)
    python bench/comm_host.py --fake                              # one process, torch's fake process group
    torchrun --nproc-per-node 2 bench/comm_host.py --smoke        # gloo on CPU, fewer calls

Per collective (tiny tensors, so the figures are host time): `issue_us` is the time to launch one of
`burst` asynchronous collectives in a row (nothing waited in between: the host runs ahead, as in a
training step, and every one of them is pending in the registry at once; on a GPU a spin kernel keeps
the device busy meanwhile, so none completes early), `wait_us` the time to then wait for each (under
NCCL a wait only orders the stream). The fake process group's works never complete before their wait,
so the same holds there. Per step: the model of `--fake` is 8 tiny blocks at tp=2 (bf16 autocast, AdamW,
clipping); under the fake process group collectives cost nothing, so the step time is the host's own
work, the same code path as on GPUs. The JSON gives each figure for ours and for raw where both exist.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import emit, sync, time_steps  # noqa: E402

from teratrain.compat import all_gather_single, reduce_scatter_single  # noqa: E402
from teratrain.parallel import comm, inflight  # noqa: E402

TINY = ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128", "model.seq_len=32",
        "model.vocab_size=512", "model.n_layers=8", "memory.precision=bf16", "train.grad_clip=1.0", "parallel.tp=2",
        "train.micro_batch=2", "train.global_batch=2"]
STEP_VARIANTS = {"no_sp": ["parallel.sequence_parallel=false"], "sp": ["parallel.sequence_parallel=true"],
                 "sp_chunked2": ["parallel.sequence_parallel=true", "parallel.tp_overlap=chunked"]}


class _Work:
    """A stand-in for torch's work: completed or pending as told (the registry's own cost, no backend)."""

    def __init__(self, done: bool = False):
        self.done = done

    def wait(self):
        return True

    def is_completed(self):
        return self.done


def collectives(group, device, burst: int, rounds: int) -> dict:
    """Median over `rounds` of (issue, wait) microseconds per call, for each kind, raw and ours."""
    n = dist.get_world_size(group)
    x, full = torch.ones(16, device=device), torch.empty(16 * n, device=device)
    kinds = {
        "all_gather": (lambda: all_gather_single(full, x, group=group, async_op=True),
                       lambda: comm.all_gather(full, x, group, async_op=True)),
        "reduce_scatter": (lambda: reduce_scatter_single(x, full, group=group, async_op=True),
                           lambda: comm.reduce_scatter(x, full, group, async_op=True)),
        "all_reduce": (lambda: dist.all_reduce(x, group=group, async_op=True),
                       lambda: comm.all_reduce(x, group, async_op=True)),
    }
    out = {}
    for kind, (raw, ours) in kinds.items():
        for tag, call in (("raw", raw), ("ours", ours)):
            issue, wait = [], []
            for r in range(rounds + 2):
                sync(device)
                dist.barrier(group)
                if device.type == "cuda":  # the device busy for ~50 ms: every collective of the burst stays pending
                    torch.cuda._sleep(100_000_000)
                t0 = time.perf_counter()
                works = [call() for _ in range(burst)]
                t1 = time.perf_counter()
                for w in works:
                    w.wait()
                t2 = time.perf_counter()
                if r >= 2:  # two warm-up rounds
                    issue.append((t1 - t0) / burst * 1e6)
                    wait.append((t2 - t1) / burst * 1e6)
            out[f"{kind}_{tag}"] = {"issue_us": round(statistics.median(issue), 2),
                                    "wait_us": round(statistics.median(wait), 2)}
    out["burst"] = burst
    return out


def registry(bursts=(16, 64, 128, 256, 1024), calls: int = 20000) -> dict:
    """Microseconds to register (and wait for) one operation while `k` others are still pending, with
    a trivial work: the registry's own cost, free of any backend."""
    out = {}
    done = _Work(done=True)
    for k in bursts:
        inflight.reset()
        for _ in range(k):
            inflight.launch("all-reduce", None, _Work)
        t0 = time.perf_counter()
        for _ in range(calls):
            inflight.launch("all-gather", None, lambda: done).wait()
        out[f"pending_{k}_us"] = round((time.perf_counter() - t0) / calls * 1e6, 2)
    inflight.reset()
    return out


def watchdog_share(seconds: float = 3.0, pending: int = 200) -> dict:
    """What the watchdog thread takes from the main thread (it holds the GIL while it polls): the cost
    of one poll with `pending` operations registered, its share of the poll interval, and the measured
    change in a pure-Python loop's throughput once the thread runs (noise-level on a shared machine)."""

    def spin() -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(1000):
                n += 1
        return n / seconds

    inflight.reset()
    for _ in range(pending):
        inflight.launch("all-reduce", None, _Work)
    t0 = time.perf_counter()
    for _ in range(100):
        inflight.oldest_pending()  # what the watchdog does once per poll
    poll_us = (time.perf_counter() - t0) / 100 * 1e6
    alone = spin()
    inflight.start_watchdog(3600.0, 0)
    watched = spin()
    inflight.reset()
    return {"pending": pending, "poll_s": inflight.POLL_S, "poll_us": round(poll_us, 1),
            "share": round(poll_us * 1e-6 / inflight.POLL_S, 6), "measured_slowdown": round(1 - watched / alone, 4)}


def step_host(steps: int) -> dict:
    """Median ms of one training step of the tiny tp=2 model (fake process group: host time only)."""
    from teratrain.config import load_config
    from teratrain.mesh import init_runtime
    from teratrain.models.transformer import Transformer
    from teratrain.optim.engine import train_step
    from teratrain.parallel.parallelize import parallelize

    out = {}
    for name, extra in STEP_VARIANTS.items():
        cfg = load_config(None, TINY + ["train.device=cpu"] + extra)
        rt = init_runtime(cfg)
        with torch.device("meta"):
            model = Transformer(cfg.model)
        engine = parallelize(model, rt, cfg)
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1), generator=torch.Generator().manual_seed(0))
        times = time_steps(lambda: train_step(model, engine, [(x[:, :-1], x[:, 1:])], "bf16", 1e-4), 3, steps,
                           torch.device("cpu"))
        out[name] = {"step_ms": round(statistics.median(times) * 1e3, 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fake", action="store_true", help="one process, fake process group of 2: host time only")
    ap.add_argument("--smoke", action="store_true", help="gloo on CPU, few calls")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        os.environ.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        burst, rounds = (16, 3) if args.smoke else (146, 20)
        result = {"backend": "fake", "collectives": collectives(dist.group.WORLD, torch.device("cpu"), burst, rounds),
                  "registry": registry(), "step": step_host(5 if args.smoke else 20),
                  "watchdog": watchdog_share(1.0 if args.smoke else 3.0)}
        emit(result, args.out)
        return
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    group = dist.new_group(list(range(dist.get_world_size())))
    burst, rounds = (16, 3) if args.smoke else (146, 20)  # 146: the collectives of an SP step at llama-1b width
    result = {"backend": dist.get_backend(), "world": dist.get_world_size(),
              "collectives": collectives(group, device, burst, rounds)}
    if dist.get_rank() == 0:
        emit(result, args.out)
    from teratrain.mesh import shutdown

    shutdown()


if __name__ == "__main__":
    main()
