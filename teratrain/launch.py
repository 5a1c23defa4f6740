"""How a job's processes start and end: the `--nproc` launcher, ranks that die with it, termination
signals, and one sentence when a rank fails.

    teratrain train --nproc N       this process: the launcher, running torchrun's agent in-process
      |-- rank 0 .. N-1             `python -m teratrain train ...`, each in its own session

- The launcher owns the run directory (rundir.own) and runs torchrun's elastic agent in this process
  (`torch.distributed.run.run`), its own log lines silenced. Ranks find the launcher's pid and a
  report folder in their environment (LAUNCHER_ENV, REPORTS_ENV).
- A rank watches its parent: when the launcher dies, even by kill -9, the rank stops as on SIGTERM
  (torchrun starts ranks in new sessions, so nothing else would reach them).
- SIGTERM, SIGINT and SIGHUP raise `Stopped` once in the main thread (a second signal is ignored while
  the first is handled); the process exits 128 + signal number. Checkpoints are written atomically,
  so the last complete one is intact; one message is printed, by the launcher or else by rank 0.
- A rank under the launcher prints nothing when it fails: it writes a report (kind, message, time,
  traceback), and the launcher prints one sentence for the job: a rank that died without a report
  (killed), else the earliest error, else the signal that stopped it. Under plain torchrun each rank
  prints its own error.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LAUNCHER_ENV = "TERATRAIN_LAUNCHER_PID"
REPORTS_ENV = "TERATRAIN_REPORTS"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SHUTDOWN_GRACE_S = 10.0  # a stopped rank that has not exited by then (a hung collective) exits hard
PARENT_POLL_S = 0.5


class Stopped(BaseException):
    """A termination signal stopped this process (a BaseException, like KeyboardInterrupt, so that
    `except Exception` blocks on the way out do not swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextmanager
def stop_on_signals() -> Iterator[dict]:
    """Within the block, the first termination signal raises `Stopped`; later ones are ignored. Yields
    a dict whose "signum" is set once a signal arrived (an error raised while stopping, e.g. by a
    collective whose peer has exited, is then part of the stop, not a failure of its own). Once the
    caller sets "ending" (it is already deciding how the command ends), a signal raises nothing: it
    would interrupt writing the report of the error being handled."""
    state: dict = {"signum": None, "ending": False}

    def handler(signum, _frame):
        if state["signum"] is None and not state["ending"]:
            state["signum"] = signum
            raise Stopped(signum)

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield state
        return
    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    wake = _exit_if_stuck() if "WORLD_SIZE" in os.environ else None
    try:
        yield state
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if wake is not None:
            signal.set_wakeup_fd(wake[0])
            os.close(wake[1])


def _exit_if_stuck() -> tuple[int, int]:
    """A rank blocked in a collective whose peer is gone runs no Python, so its signal handler would
    wait (up to parallel.timeout_s). CPython writes each signal's number to the wakeup fd at once, from
    C; a thread reading it ends the process SHUTDOWN_GRACE_S later if it is still there (checkpoints
    are atomic: nothing is lost). Returns (the previous wakeup fd, our write end)."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    previous = signal.set_wakeup_fd(w)

    def watch():
        while got := os.read(r, 1):  # b"" once the block ends normally and the write end is closed
            if got[0] in STOP_SIGNALS:
                time.sleep(SHUTDOWN_GRACE_S)
                os._exit(128 + got[0])
        os.close(r)

    threading.Thread(target=watch, name="teratrain-stop-watch", daemon=True).start()
    return previous, w


# ---------------------------------------------------------------- ranks

def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def under_launcher() -> bool:
    """True in a rank started by `teratrain train --nproc` (the launcher owns the run directory)."""
    return LAUNCHER_ENV in os.environ and "WORLD_SIZE" in os.environ


def follow_parent() -> None:
    """In a rank: stop (as on SIGTERM) when the process that started it dies. The launcher's pid is
    known; under plain torchrun the parent at start-up is its agent."""
    if "WORLD_SIZE" not in os.environ:
        return
    parent = int(os.environ.get(LAUNCHER_ENV) or os.getppid())
    if os.getppid() != parent:
        raise Stopped(signal.SIGTERM)  # the launcher died while this rank was starting

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="teratrain-parent-watch", daemon=True).start()


def write_report(kind: str, message: str, exc: BaseException | None = None, detail: str | None = None) -> None:
    """In a rank under the launcher: leave what ended it for the launcher to report (`kind`: user,
    crash, hang or signal; `detail` goes to error.log, as a crash's traceback does)."""
    folder = os.environ.get(REPORTS_ENV)
    if not folder:
        return
    report = {"rank": rank(), "time": time.time(), "kind": kind, "message": message}
    if detail is not None:
        report["traceback"] = detail
    if exc is not None and kind == "crash":
        tb = traceback.extract_tb(exc.__traceback__)
        report["where"] = f"{Path(tb[-1].filename).name}:{tb[-1].lineno} in {tb[-1].name}" if tb else ""
        report["traceback"] = "".join(traceback.format_exception(exc))
    tmp = Path(folder) / f".rank{rank()}.json.tmp"
    tmp.write_text(json.dumps(report))
    tmp.replace(Path(folder) / f"rank{rank()}.json")


def stopped_message(signum: int, run_dir: Path | None) -> str:
    name = signal.Signals(signum).name
    latest = run_dir / "checkpoints" / "latest" if run_dir else None
    if latest is not None and latest.is_file():
        return (f"teratrain: stopped by {name}; the last complete checkpoint ({latest.read_text().strip()}) is intact; "
                f"continue with: teratrain train --out {run_dir} --resume")
    return f"teratrain: stopped by {name} before the first checkpoint was written."


# ---------------------------------------------------------------- the launcher

def launch(argv: list[str], nproc: int, run_dir: Path) -> int:
    """Run `python -m teratrain <argv>` on `nproc` local ranks with torchrun's agent in this process;
    returns the job's exit status after printing at most one line about how it ended."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    reports = Path(tempfile.mkdtemp(prefix="teratrain-reports-"))
    saved_env = dict(os.environ)
    os.environ.update({LAUNCHER_ENV: str(os.getpid()), REPORTS_ENV: str(reports)})
    args = parse_args(["--standalone", f"--nproc-per-node={nproc}", "--monitor-interval=0.2",
                       "-m", "teratrain", *argv])
    try:
        with _quiet_torchrun():
            run(args)
        return 0
    except ChildFailedError as e:
        return _summarize(e.failures, reports, run_dir)
    except SignalException as e:
        print(stopped_message(int(e.sigval), run_dir), file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(reports, ignore_errors=True)


@contextmanager
def _quiet_torchrun():
    """torchrun's agent logs its launch banner, a warning per signal and a report per failure; the
    launcher says what happened in one line instead."""
    log = logging.getLogger("torch.distributed")
    old = (log.propagate, list(log.handlers))
    log.handlers[:] = [logging.NullHandler()]
    log.propagate = False
    try:
        yield
    finally:
        log.propagate, log.handlers[:] = old[0], old[1]


def _summarize(failures: dict, reports: Path, run_dir: Path) -> int:
    """One line for a failed job; returns its exit status."""
    found = {}
    for p in reports.glob("rank*.json"):
        r = json.loads(p.read_text())
        found[r["rank"]] = r
    killed = sorted(r for r, f in failures.items() if r not in found and f.exitcode < 0)
    if killed:
        r = killed[0]
        name = signal.Signals(-failures[r].exitcode).name
        hint = " (out of memory? the kernel's OOM killer sends SIGKILL)" if name == "SIGKILL" else ""
        print(f"teratrain: error: rank {r} was killed by {name}{hint}; the other ranks were stopped.", file=sys.stderr)
        return 1
    errors = sorted((r for r in found.values() if r["kind"] != "signal"), key=lambda r: r["time"])
    if errors:
        first = errors[0]
        if first["kind"] == "user":
            print(f"teratrain: error: {first['message']}", file=sys.stderr)
            return 2
        log = _write_tracebacks(errors, run_dir)
        if first["kind"] == "hang":
            print(f"teratrain: error: {first['message']}; the other ranks were stopped; every rank's waits and "
                  f"stacks in {log}", file=sys.stderr)
            return 1
        print(f"teratrain: error: rank {first['rank']} failed: {first['message']} (at {first['where']}); the other "
              f"ranks were stopped; full traceback in {log}", file=sys.stderr)
        return 1
    if found:  # every report is a signal: the ranks were stopped from outside
        signum = next(iter(found.values()))["message"]
        print(stopped_message(signal.Signals[signum], run_dir), file=sys.stderr)
        return 128 + signal.Signals[signum]
    r, f = min(failures.items())
    if f.exitcode > 128 and f.exitcode - 128 in set(STOP_SIGNALS):  # stopped hard, before it could report
        print(stopped_message(f.exitcode - 128, run_dir), file=sys.stderr)
        return f.exitcode
    print(f"teratrain: error: rank {r} exited with status {f.exitcode}; the other ranks were stopped.", file=sys.stderr)
    return 1


def _write_tracebacks(errors: list[dict], run_dir: Path) -> Path:
    """Every failed rank's traceback, the earliest first, in `<run>/error.log` (which also keeps a run
    that failed before its first step from being removed: rundir.remove_if_unused)."""
    path = run_dir / "error.log"
    path.write_text("\n".join(f"rank {r['rank']}:\n{r.get('traceback', r['message'])}" for r in errors))
    return path
