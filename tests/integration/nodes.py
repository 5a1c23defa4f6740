"""Several nodes on one machine: two torchrun agents, each standing for a node with one worker,
meeting through c10d rendezvous on 127.0.0.1 (gloo, the tiny model), and faults injected into the
workers at a given step.

A fault is `kill-worker@S` (the worker SIGKILLs itself as step S begins), `kill-node@S` (it SIGKILLs
its agent, then itself: the node is gone, its connections reset), `stop-node@S` (SIGSTOP instead: the
node is silent, as one cut off or powered down, its connections left open) or `sleep@S:SECONDS`; each
kind fires once per job (a marker file in the job's folder), in whichever attempt reaches the step
first. The moment a fault struck and that of the first step logged after it are written there too, so
the time a restart takes can be read back.

    python -m tests.integration.nodes              # a worker killed: kill -> first step after the restart
    python -m tests.integration.nodes --lose-node  # a node lost under --nnodes 1:2: the job goes on alone
                                                   # (--rdzv-conf ITEMS: e.g. last_call_timeout=2)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import TINY_SETS, free_port
from tests.integration.runner import pids_running

# The job every test runs: 12 steps, a checkpoint every 5, no evaluation; a lost peer is named within
# 60 s at most (it takes a second: the peer's connection is reset)
STEPS = 12
SETS = ["train.eval_batches=0", "checkpoint.every=5", "parallel.timeout_s=60"]

SITE = '''\
import os, signal, time
spec, folder = os.environ.get("TERATRAIN_TEST_FAULT"), os.environ.get("TERATRAIN_TEST_FAULT_DIR")
if folder and "RANK" in os.environ:
    import teratrain.data.loader as loader
    import teratrain.metrics as metrics

    def mark(name):
        with open(os.path.join(folder, name), "x") as f:
            f.write(repr(time.time()))

    if spec:
        kind, _, at = spec.partition("@")
        step, _, seconds = at.partition(":")
        batches = loader.Batches.micro_batches

        def micro_batches(self, s, *a, **kw):
            if s == int(step) and not os.path.exists(os.path.join(folder, "fired-" + kind)):
                mark("fired-" + kind)
                if kind == "sleep":
                    time.sleep(float(seconds))
                else:
                    mark("struck")
                    sig = signal.SIGSTOP if kind == "stop-node" else signal.SIGKILL
                    if kind != "kill-worker":
                        os.kill(os.getppid(), sig)
                    os.kill(os.getpid(), sig)
            return batches(self, s, *a, **kw)

        loader.Batches.micro_batches = micro_batches
    write = metrics.MetricsLog.write

    def logged(self, record):
        write(self, record)
        if os.path.exists(os.path.join(folder, "struck")) and not os.path.exists(os.path.join(folder, "first_step")):
            mark("first_step")

    metrics.MetricsLog.write = logged
'''


@dataclass
class Job:
    """Two agents (node 0 hosts the rendezvous store) running `teratrain train` into `out`."""

    out: Path
    folder: Path  # markers, the injected module, each agent's log
    agents: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def wait(self, timeout: float = 240.0, nodes: tuple[int, ...] = (0, 1)) -> list[int]:
        """The exit status of these nodes' agents (killed ones: negative)."""
        end = time.monotonic() + timeout
        for node in nodes:
            self.agents[node].wait(timeout=max(1.0, end - time.monotonic()))
        return [self.agents[node].returncode for node in nodes]

    def log(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")

    def marker(self, name: str) -> float | None:
        path = self.folder / name
        return float(path.read_text()) if path.exists() else None

    def kill(self) -> None:
        """Kill every process of the job still alive, agents and workers (each in a session of its own),
        by process group."""
        pids = [a.pid for a in self.agents if a.poll() is None] + pids_running(str(self.out))
        for pid in pids:
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for a in self.agents:
            try:
                a.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def start(out: Path, folder: Path, cache: str, *sets: str, nodes: str = "2", max_restarts: int = 0,
          faults: dict[int, str] | None = None, rdzv: str = "", steps: int = STEPS) -> Job:
    """Start two agents, `torchrun --nnodes NODES --nproc-per-node 1 --max-restarts N ... -m teratrain
    train --out OUT`, node i with fault `faults[i]`. `rdzv`: more `--rdzv-conf` items."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITE)
    port, job = free_port(), Job(out, folder)
    argv = ["train", "--out", str(out), "--steps", str(steps)]
    for s in [*TINY_SETS, f"data.cache_dir={json.dumps(cache)}", *SETS, *sets]:
        argv += ["--set", s]
    for node in (1, 0):  # the store's client first: it waits for the host, so both join the first round
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TERATRAIN_TEST_FAULT_DIR": str(folder),
               "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
        env.pop("TERATRAIN_TEST_FAULT", None)
        if faults and node in faults:
            env["TERATRAIN_TEST_FAULT"] = faults[node]
        conf = f"is_host={'true' if node == 0 else 'false'}" + (f",{rdzv}" if rdzv else "")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nodes, "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"job{port}",
               "--rdzv-conf", conf, "--max-restarts", str(max_restarts), "--monitor-interval", "0.2",
               "-m", "teratrain", *argv]
        log = folder / f"node{node}.log"
        with open(log, "w") as f:
            job.agents.insert(0, subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                                  start_new_session=True, cwd=folder))
        job.logs.insert(0, log)
    return job


def measure_restart(root: Path, cache: str, lose_node: bool = False, rdzv: str = "") -> dict:
    """A worker killed at step 7 of a 2-node job under --max-restarts 1 (a checkpoint every 5 steps), or
    (`lose_node`) its whole node under --nnodes 1:2: the seconds from the kill to the first step logged
    after the restart. `rdzv`: --rdzv-conf items (torch's defaults otherwise)."""
    fault, nodes = ("kill-node@7", "1:2") if lose_node else ("kill-worker@7", "2")
    job = start(root / "run", root / "job", cache, max_restarts=1, faults={1: fault}, nodes=nodes, rdzv=rdzv)
    try:
        codes = job.wait(nodes=(0,) if lose_node else (0, 1))
    finally:
        job.kill()
    killed, first = job.marker("struck"), job.marker("first_step")
    if any(codes) or killed is None or first is None:
        raise SystemExit(f"the job did not restart and finish (exit {codes}):\n{job.log(0)}\n{job.log(1)}")
    return {"kill_to_first_step_s": round(first - killed, 1), "killed": "node" if lose_node else "worker",
            "nnodes": nodes, "rdzv_conf": rdzv or "torch defaults", "steps": STEPS, "killed_at_step": 7,
            "resumed_from_step": 5, "backend": "gloo", "device": "cpu", "torch": torch_version()}


def torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    import argparse
    import tempfile

    from teratrain.config import DataConfig
    from teratrain.data.loader import cache_dir, prepare

    cache = os.environ.get("TERATRAIN_TEST_CACHE") or str(cache_dir(None))
    prepare(DataConfig(cache_dir=cache), 4096)
    parser = argparse.ArgumentParser(description=measure_restart.__doc__)
    parser.add_argument("--lose-node", action="store_true", help="kill node 1's agent too, under --nnodes 1:2")
    parser.add_argument("--rdzv-conf", default="", help="more --rdzv-conf items, e.g. last_call_timeout=2")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(measure_restart(Path(tmp), cache, args.lose_node, args.rdzv_conf)))
