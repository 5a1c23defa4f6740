"""Bodies that run inside spawned ranks (module-level so `spawn` can import them), and the
single-process reference they are compared with."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from unittest import mock

import torch

from teratrain.config import load_config
from teratrain.train import run

# A model small enough for 4 ranks on 2 cores, still with GQA, two blocks and a real corpus.
TINY = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
        "model.seq_len=32", "train.global_batch=16", "train.micro_batch=2", "train.eval_batches=0",
        "train.steps=10", "optim.warmup_steps=2", "metrics.progress=false"]


def losses(out: str | Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def assert_bitwise_resume(root: str | Path, step: int, world: int) -> None:
    """`root/straight` and `root/resumed` (stopped and resumed) logged the same losses and wrote the
    same tensors, bit for bit, into every rank's file of checkpoint `step`."""
    from safetensors.torch import load_file

    root = Path(root)
    assert losses(root / "straight") == losses(root / "resumed")
    for rank in range(world):
        name = f"step_{step:08d}/rank{rank:05d}.safetensors"
        a = load_file(str(root / "straight" / "checkpoints" / name))
        b = load_file(str(root / "resumed" / "checkpoints" / name))
        assert a.keys() == b.keys()
        diff = [k for k in a if not torch.equal(a[k], b[k])]
        assert not diff, f"rank {rank}: tensors differ after resume: {diff[:5]}"


def train_one(overrides: list[str], out: str, resume: bool = False) -> dict:
    """Train with the full trainer (`resume` as `--resume` does); return what every parity test compares."""
    summary = run(load_config(None, TINY + overrides), out, resume=resume)
    engine = summary["engine"]
    params = engine.full_params()  # collective: every rank takes part
    return {"params": params, "bytes": engine.last_state_bytes, "skipped": engine.skipped_steps,
            "server": getattr(engine, "is_server", False), "staleness_max": getattr(engine, "staleness_max", None)}


def train_many(rank: int, world: int, runs: list[tuple]) -> list[dict]:
    """Several trainings in one set of processes (process start-up dominates tiny runs). Each run is
    (overrides, out) or (overrides, out, opts) with opts: resume (bool), slow_rank + delay_s (that
    rank sleeps delay_s before each optimizer step: a straggler for the asynchronous modes)."""
    results = []
    for overrides, out, *more in runs:
        opts = more[0] if more else {}
        with _straggler(rank == opts.get("slow_rank"), opts.get("delay_s", 0.0)):
            r = train_one(overrides, out, opts.get("resume", False))
        if rank == 0:
            r["losses"] = losses(out)
        elif not r["server"]:
            r["params"] = None  # rank 0's copy is compared (and each parameter server's share)
        results.append(r)
    return results


@contextlib.contextmanager
def _straggler(slow: bool, delay_s: float):
    if not slow:
        yield
        return
    from teratrain.parallel.param_server import ParamServerWorker

    step = ParamServerWorker.step

    def slow_step(self, lr):
        time.sleep(delay_s)
        return step(self, lr)

    with mock.patch.object(ParamServerWorker, "step", slow_step):
        yield


def reference(overrides: list[str], out: str) -> dict:
    """The same training in this (single) process: world size 1, no ZeRO, no data parallelism. On one
    thread, as every rank runs (harness.py): CPU kernels split their sums by thread, and with the
    pytest process's 2 threads AdamW (eps=1e-6) turned that rounding into 1.1e-5 parameter differences."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = train_one(overrides + ["parallel.zero=0", "parallel.offload=none"], out)
    finally:
        torch.set_num_threads(threads)
    r["losses"] = losses(out)
    return r


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Worst per-tensor relative L2 error ||a - b|| / ||b||."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30)) for k in a)
