"""checkpoint.async through the CLI: a job killed (SIGKILL) in the middle of a background write leaves
`latest` on the previous complete checkpoint; that checkpoint holds the bytes a synchronous save
writes, and the run resumed from it is bitwise the synchronous run that never stopped.

The write of step 4 is held deterministically: the job runs `teratrain train` through a wrapper
that makes the background writer write half of its tensor file, say so in a marker file, and wait
forever; the test kills the job once the marker exists (no sleep decides the timing)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import TINY_SETS
from tests.integration.runner import latest_checkpoint, metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SETS = ["model.dropout=0.1", "optim.schedule=constant", "optim.warmup_steps=4", "train.eval_batches=0",
        "checkpoint.every=2", "checkpoint.keep=4"]
HOLD = """
import sys, threading
from pathlib import Path
from teratrain.checkpoint import io
from teratrain.cli import main

marker, held = Path(sys.argv[1]), f"step_{int(sys.argv[2]):08d}.tmp"
original = io.write_safetensors

def write(path, tensors, metadata=None):
    digest = original(path, tensors, metadata)
    if path.parent.name == held:  # half the file on disk, then the writer never finishes
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
        marker.write_text(str(path))
        threading.Event().wait()
    return digest

io.write_safetensors = write
sys.exit(main(sys.argv[3:]))
"""


@pytest.fixture(scope="module")
def straight(cli, tmp_path_factory):
    run = tmp_path_factory.mktemp("sync") / "run"
    cli.train(run, *SETS, steps=8)
    return run


def held_job(cli, run: Path, marker: Path, step: int, *sets: str) -> subprocess.Popen:
    args = ["train", "--out", str(run), "--steps", "8"]
    args += [a for s in [*TINY_SETS, f"data.cache_dir={cli.cache}", *sets] for a in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", HOLD, str(marker), str(step), *args], cwd=cli.cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_sigkill_mid_write_keeps_latest_and_resumes_bitwise(cli, straight, tmp_path):
    run, marker = tmp_path / "run", tmp_path / "held"
    job = held_job(cli, run, marker, 4, *SETS, "checkpoint.async=true")
    deadline = time.monotonic() + 240
    while not marker.exists():
        if job.poll() is not None or time.monotonic() > deadline:
            job.kill()
            pytest.fail(f"the job never reached the held write (rc {job.returncode}):\n{job.communicate()[1]}")
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=30)

    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000002"
    assert (ckpts / "step_00000004.tmp").is_dir() and not (ckpts / "step_00000004").exists()
    assert Path(marker.read_text()).stat().st_size > 0  # the half-written file is there, and ignored
    for name in ("rank00000.safetensors", "rank00000.json"):  # the async checkpoint is the sync one, byte for byte
        sync = straight / "checkpoints/step_00000002" / name
        assert (ckpts / "step_00000002" / name).read_bytes() == sync.read_bytes()

    proc = cli.train(run, *SETS, "checkpoint.async=true", steps=8, resume=True)
    assert "Traceback" not in proc.stderr
    a, b = metrics(straight), metrics(run)
    assert [r["step"] for r in b] == list(range(1, 9))
    for col in ("loss", "grad_norm", "lr"):
        assert [r[col] for r in b] == [r[col] for r in a], col
    assert latest_checkpoint(run).name == "step_00000008" and not list(ckpts.glob("*.tmp"))
    ta, tb = (load_file(latest_checkpoint(r) / "rank00000.safetensors") for r in (straight, run))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)

    saves = [c for r in b[2:] for c in r.get("checkpoints", [])]  # the resumed job's saves, each reported once
    assert [c["step"] for c in saves] == [4, 6, 8] and all(c["async"] for c in saves)
    assert all(c["block_s"] >= 0 and c["write_s"] > 0 for c in saves)
    sync = [c for r in a for c in r.get("checkpoints", [])]
    assert [c["step"] for c in sync] == [2, 4, 6, 8] and not any(c["async"] for c in sync)
