"""CPU offload of the optimizer step (ZeRO-Offload, Ren et al. 2021).

The fp32 master shards and the optimizer moments live in host memory and the optimizer steps there;
the GPU keeps only the compute-dtype parameters and the gradient shards. Host memory therefore holds
(4 + 8) bytes per parameter of this rank's shard for AdamW, plus two small pinned staging buffers
per direction. Those buffers pipeline the step group by group:

    D2H grads of group i+1   |  CPU optimizer step of group i  |  H2D params of group i-1

so the transfers overlap the CPU arithmetic; the copies run on streams of their own, so they do not
queue behind (or hold up) compute on the default stream. Masters stay in pageable memory: pinning ~100 GiB of
optimizer state for a 10B model would page-lock most of a machine; only the staging buffers are pinned.

The host step is memory-bound arithmetic over every parameter of the shard (AdamW reads and writes 16
bytes of state per parameter, the cast 6 more), so its speed is the CPU threads it gets. torchrun
starts every rank of a several-process job with OMP_NUM_THREADS=1 "to avoid your system being
overloaded", which leaves one core per rank stepping billions of parameters while the others idle.
`use_host_threads` gives each rank threads of its own instead, as DeepSpeed's CPU Adam runs on OpenMP
threads (`parallel.offload_threads`; 0 = half the CPUs this process may run on over the local ranks,
or torch's own count in a job of one process).
Measured with `teratrain train --nproc 4 --set parallel.offload=optimizer --set parallel.offload_threads=N`
on 4 x H100 (64 CPUs; llama-1b width, 8 layers, ZeRO-2, one machine): the step took 0.387 s on 1 thread
a rank, 0.221 on 4, 0.196 on 8, 0.216 on 12 and 0.305 on 16, the whole share, whose ranks straggled;
another machine of the kind ran 16 at 0.197 s.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from teratrain.compat import pinned_empty


class Mark:
    """A point in a device stream's work queue to wait for (no-op on CPU, where copies are synchronous)."""

    def __init__(self, device: torch.device):
        self.event = None
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()  # on the current stream: a copy stream inside `on_stream`

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def copy_stream(device: torch.device):
    """A side stream for host <-> device copies (None on CPU): copies then overlap compute and NCCL."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def on_stream(stream):
    """Run the enclosed copies on `stream` once the current stream's work so far is done (a no-op
    context without a stream)."""
    if stream is None:
        return contextlib.nullcontext()
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    return torch.cuda.stream(stream)


class _Clock:
    """Milliseconds of a rank's host step by part: waiting for the gradients' copies down (wait_ms), the
    CPU optimizer (optimizer_ms), the cast into a staging buffer (publish_ms), waiting for the copies up
    to free a staging buffer or to finish (upload_wait_ms), and all of it (host_ms)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.parts = {"wait_ms": 0.0, "optimizer_ms": 0.0, "publish_ms": 0.0, "upload_wait_ms": 0.0}

    @contextlib.contextmanager
    def __call__(self, part: str):
        t0 = time.perf_counter()
        yield
        self.parts[part] += (time.perf_counter() - t0) * 1e3

    def total(self, **more) -> dict:
        return {**self.parts, "host_ms": (time.perf_counter() - self.start) * 1e3, **more}


def host_threads(requested: int = 0) -> int:
    """CPU threads for a rank's host optimizer step: `requested`; else a count given in OMP_NUM_THREADS
    above 1 (torchrun sets 1 only where it is unset); else, with several ranks on this machine
    (LOCAL_WORLD_SIZE, set by torchrun; without it, the job's ranks up to the visible GPUs), half the
    CPUs this process may run on over those ranks, at least 1; else (one process) torch's own count.
    Half: on 4 x H100 (64 CPUs) 8 threads a rank stepped fastest and steadiest in one call, 16, the
    whole share, straggled there (module docstring); a rank runs other threads too (Python's, CUDA's,
    NCCL's). Ranks already pinned to CPUs of their own (taskset, srun --cpu-bind) or held to fewer CPUs
    than they may run on (a container's CPU quota) should give parallel.offload_threads."""
    if requested:
        return requested
    if _int_env("OMP_NUM_THREADS", 1) > 1:
        return torch.get_num_threads()
    world = _int_env("WORLD_SIZE", 1)
    local = _int_env("LOCAL_WORLD_SIZE", min(world, max(1, torch.cuda.device_count())))
    if local <= 1:
        return torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // local // 2)


def _int_env(name: str, default: int) -> int:
    """An integer environment variable (OMP_NUM_THREADS may list nested counts: the first), or `default`."""
    try:
        return int(os.environ[name].split(",")[0])
    except (KeyError, ValueError):
        return default


def use_host_threads(requested: int = 0) -> int:
    """Give this process `host_threads(requested)` CPU threads (process-wide: an offloaded rank's CPU
    work is its optimizer step); returns the count."""
    n = host_threads(requested)
    torch.set_num_threads(n)
    return n


class HostUpdate:
    def __init__(self, shard_numels: list[int], device: torch.device, grad_dtype: torch.dtype, param_dtype: torch.dtype):
        self.times: dict = {}  # the last step's host time by part (`_Clock`), for metrics.jsonl
        n = max(shard_numels)
        self.device = device
        self.grads_in = [pinned_empty(n, grad_dtype) for _ in range(2)]
        self.params_out = [pinned_empty(n, param_dtype) for _ in range(2)]
        self._out_free = [None, None]  # mark of the last H2D copy out of each params_out buffer
        self.d2h, self.h2d = copy_stream(device), copy_stream(device)  # off the compute stream (D2H / H2D)

    def step(self, jobs) -> None:
        """jobs: per flat group (group, optimizer or None, parameter target). `group.grad_shard` is on
        the device, `group.master` on the host, `group.opt_views` the optimizer's views of the master
        in piece order. Steps every optimizer on the host and writes the masters into the targets."""
        jobs = list(jobs)
        clock = _Clock()
        marks = {0: self._fetch(jobs[0][0].grad_shard, 0)} if jobs else {}
        for i, (g, opt, target) in enumerate(jobs):
            with clock("wait_ms"):
                marks[i].wait()
            if i + 1 < len(jobs):  # start the next group's gradients while this one steps
                marks[i + 1] = self._fetch(jobs[i + 1][0].grad_shard, (i + 1) % 2)
            if opt is not None:
                for view, grad in zip(g.opt_views, g.shard_views(self.grads_in[i % 2])):
                    view.grad = grad.view_as(view)  # whole parameters keep their shape (flat.py)
                with clock("optimizer_ms"):
                    opt.step()
            self._publish(g.master, target, i % 2, clock)
        with clock("upload_wait_ms"):
            for mark in self._out_free:
                if mark is not None:
                    mark.wait()
        self._out_free = [None, None]
        if self.h2d is not None:  # the next forward reads the parameters the H2D stream wrote
            torch.cuda.current_stream(self.device).wait_stream(self.h2d)
        self.times = {f"offload_{k}": round(v, 3) for k, v in clock.total(threads=torch.get_num_threads()).items()}

    def _fetch(self, grad: torch.Tensor, slot: int) -> Mark:
        with on_stream(self.d2h):  # after the backward that produced `grad`
            self.grads_in[slot][:grad.numel()].copy_(grad, non_blocking=True)
            return Mark(self.device)

    def _publish(self, master: torch.Tensor, target: torch.Tensor, slot: int, clock: "_Clock") -> None:
        if target.device.type == "cpu":  # offload=params: the parameter shard lives on the host too
            with clock("publish_ms"):
                target.copy_(master)
            return
        if self._out_free[slot] is not None:
            with clock("upload_wait_ms"):
                self._out_free[slot].wait()  # the copy that last used this buffer has left it
        staged = self.params_out[slot][:master.numel()]
        with clock("publish_ms"):
            staged.copy_(master)  # fp32 -> compute dtype on the host, so half the bytes cross PCIe
        with on_stream(self.h2d):
            target.copy_(staged, non_blocking=True)
            self._out_free[slot] = Mark(self.device)

