"""Checkpoint saves of a training run: synchronous, or (checkpoint.async) written in the background.

An asynchronous save blocks training only while the state is copied to host memory (pinned on a
GPU, so the copy runs at full PCIe speed; the buffers are kept and reused by every later save), then
a background thread writes this rank's files into `step_X.tmp/` and fsyncs them while training goes
on (as torchtitan's DCP async_save and Megatron's --async-save do). `latest` moves only once every
rank's files are complete, which the ranks agree on with one collective, in the same order on every
rank: piggybacked on the all-reduce the loop already runs after every step (`flags` / `agree`), and
at the next save or at the end of training (`finish`), which waits for the write first. Rank 0 then
publishes as a synchronous save does (checkpoint/io.py: meta.json, rename, `latest`, prune). A crash
or a kill before that leaves a `.tmp` folder that no reader takes, and `latest` names the previous
complete checkpoint. A failed write (a full disk) ends the job on every rank with its sentence.

Each completed save is reported once, for metrics.jsonl: its step, the seconds training was blocked
(the slowest rank's: waiting for the previous write, plus the copy) and the seconds the write took
(the slowest rank's, copy done to files fsynced).
"""

from __future__ import annotations

import math
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from teratrain.checkpoint import io
from teratrain.checkpoint.format import CheckpointError
from teratrain.parallel.comm import MAX, all_reduce

ALIGN = 64  # bytes: every host copy starts on a cache line (and on its dtype's size)
NUM_FLAGS = 4  # (write running, write failed, write ms, blocked ms): what `flags` adds to the per-step all-reduce


@dataclass
class _Write:
    """One save being written in the background."""

    step: int
    tmp: Path
    global_meta: dict
    block_s: float
    started: float = field(default_factory=time.perf_counter)
    write_s: float = 0.0
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def run(self, root: Path, rank: int, tensors: dict, meta: dict) -> None:
        try:
            io.write_rank(root, self.tmp, rank, tensors, meta)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread, which raises it
            self.error = e
        self.write_s = time.perf_counter() - self.started


class Saver:
    """The saves of one run. `stage(step, stopped_by)` returns (tensors, JSON state, checkpoint meta)
    of this rank (checkpoint/training.py stage_training; collective)."""

    def __init__(self, root: Path, rt, keep: int, background: bool, stage: Callable[[int, int], tuple]):
        self.root, self.rt, self.keep, self.background, self.stage = root, rt, keep, background, stage
        self.pending: _Write | None = None
        self.buffers: dict[str, torch.Tensor] = {}  # host copies (views of one buffer), reused save after save
        self.layout: list | None = None  # (key, shape, dtype) of each, in order
        self.completed: list[dict] = []  # saves complete since the last `take`

    def save(self, step: int, stopped_by: int = 0, wait: bool = False) -> None:
        """Checkpoint `step` (collective). With `wait` (the last save of a job) it is complete on return."""
        t0 = time.perf_counter()
        if not self.background:
            tensors, meta, global_meta = self.stage(step, stopped_by)
            io.save(self.root, step, self.rt.rank, self.rt.world, tensors, meta, self.keep, global_meta,
                    barrier=self.rt.barrier)
            dt = time.perf_counter() - t0
            self.completed.append({"step": step, "block_s": round(dt, 4), "write_s": round(dt, 4), "async": False})
            return
        self.finish()  # the previous write, complete on every rank, before this one starts
        tensors, meta, global_meta = self.stage(step, stopped_by)
        tmp = io.begin(self.root, step, self.rt.rank, self.rt.barrier)
        host = self._copy_to_host(tensors)
        write = _Write(step, tmp, global_meta, block_s=time.perf_counter() - t0)
        write.thread = threading.Thread(target=write.run, args=(self.root, self.rt.rank, host, meta),
                                        name=f"checkpoint-{step}", daemon=True)  # a crash does not wait for it
        write.thread.start()
        self.pending = write
        if wait:
            self.finish()

    def _copy_to_host(self, tensors: dict) -> dict:
        """Host copies of `tensors` in one kept buffer (pinned when they are on a GPU: one allocation,
        not one per tensor rounded up by the caching host allocator), copied on the current stream and
        waited for here, so the state training changes next is already copied."""
        layout = [(key, tuple(t.shape), t.dtype) for key, t in tensors.items()]
        if layout != self.layout:
            offsets, total = [], 0
            for _, shape, dtype in layout:
                offsets.append(total)
                total += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
            pin = any(t.device.type == "cuda" for t in tensors.values())
            flat = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
            self.buffers = {key: flat[o:o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                            for (key, shape, dtype), o in zip(layout, offsets)}
            self.layout = layout
        cuda = False
        for key, t in tensors.items():
            cuda |= t.device.type == "cuda"
            self.buffers[key].copy_(t.detach(), non_blocking=t.device.type == "cuda")
        if cuda:
            done = torch.cuda.Event()
            done.record()
            done.synchronize()  # the blocking time includes the device-to-host copy
        return dict(self.buffers)

    def flags(self) -> list[int]:
        """This rank's part of the per-step agreement (summed into one MAX all-reduce by the loop)."""
        w = self.pending
        if w is None:
            return [0] * NUM_FLAGS
        running = w.thread.is_alive()
        return [int(running), int(not running and w.error is not None), 0 if running else int(w.write_s * 1000),
                int(w.block_s * 1000)]

    def agree(self, flags: list[int]) -> None:
        """After the per-step all-reduce (MAX over every rank) of `flags`: complete the pending save
        when no rank is still writing it."""
        if self.pending is not None and not flags[0]:
            self._complete(flags)

    def finish(self) -> None:
        """Wait for the pending write, agree on it over every rank, and complete it (collective)."""
        if self.pending is None:
            return
        self.pending.thread.join()
        flags = torch.tensor(self.flags(), dtype=torch.int64, device=self.rt.device)
        all_reduce(flags, self.rt.group("world"), op=MAX)
        self._complete(flags.tolist())

    def _complete(self, flags: list[int]) -> None:
        w, self.pending = self.pending, None
        if flags[1]:  # some rank could not write: no rank publishes, every rank stops with the reason
            if self.rt.rank == 0:
                shutil.rmtree(w.tmp, ignore_errors=True)
            if w.error is not None:
                raise w.error
            raise CheckpointError(f"another rank could not write checkpoint step_{w.step:08d} (its own message "
                                  "says why); the last complete checkpoint is intact.")
        if self.rt.rank == 0:
            io.publish(self.root, w.step, self.rt.world, self.keep, w.global_meta)
        self.completed.append({"step": w.step, "block_s": flags[3] / 1000, "write_s": flags[2] / 1000,
                               "async": True})

    def take(self) -> list[dict]:
        """The saves completed since the last call (for the next metrics record)."""
        out, self.completed = self.completed, []
        return out
