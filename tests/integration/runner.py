"""Running `python -m teratrain ...` as a user does, and reading what a run leaves on disk."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import load_file

from teratrain.cli import main
from teratrain.metrics import read_metrics
from tests.helpers import TINY_SETS


@dataclass
class Cli:
    """Runs `python -m teratrain` in `cwd` (a scratch folder, so nothing lands in the repo)."""

    cwd: Path
    cache: str

    def __call__(self, *args, cwd: Path | None = None, expect_rc: int | None = 0,
                 in_process: bool = False) -> subprocess.CompletedProcess:
        """`in_process` calls `teratrain.cli.main` here instead (no interpreter start-up; an exception that
        escapes it fails the test as a traceback would): for runs that only need an exit code and stderr."""
        argv = [str(a) for a in args]
        if in_process:
            assert cwd is None, "an in-process run has the test's own working directory"
            proc = _main_in_process(argv)
        else:
            proc = subprocess.run([sys.executable, "-m", "teratrain", *argv], cwd=cwd or self.cwd,
                                  capture_output=True, text=True, timeout=300)
        if expect_rc is not None and proc.returncode != expect_rc:
            pytest.fail(f"teratrain {' '.join(map(str, args))} exited {proc.returncode}, expected {expect_rc}\n"
                        f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        return proc

    def train(self, out: Path | None, *sets: str, steps: int | None = None, resume: bool | str = False,
              nproc: int | None = None, config: Path | None = None, **kw):
        """`teratrain train [config]` of the tiny test shape, plus `sets` (section.key=value), on `nproc`
        processes (unset: one, or a resumed run's own count); `resume`: --resume, or "auto" for
        --resume auto."""
        args = ["train"] + ([config] if config else []) + (["--out", out] if out is not None else [])
        args += ["--steps", steps] if steps else []
        args += ["--nproc", nproc] if nproc is not None else []
        args += [a for s in [*TINY_SETS, f"data.cache_dir={json.dumps(self.cache)}", *sets] for a in ("--set", s)]
        return self(*args, *(["--resume"] if resume else []), *([resume] if isinstance(resume, str) else []), **kw)


def _main_in_process(argv: list[str]) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's own usage errors
            rc = e.code
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())


def metrics(run: Path) -> list[dict]:
    return read_metrics(run / "metrics.jsonl")


def latest_checkpoint(run: Path) -> Path:
    root = run / "checkpoints"
    return root / (root / "latest").read_text().strip()


def checkpoint_tensors(run: Path) -> dict:
    return load_file(latest_checkpoint(run) / "rank00000.safetensors")


def assert_user_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2 with one line `teratrain: error: ...` naming `words`, and no traceback."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("teratrain: error: "), proc.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def pids_running(out: str) -> list[int]:
    """Processes (launcher and ranks) whose command line names this run directory."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if out.encode() in cmd and state != "Z":
                found.append(int(d.name))
    return found
