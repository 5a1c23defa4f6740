"""How a job's processes start and end: the `--nproc` launcher, ranks that die with it, termination
signals, and one sentence when a rank fails.

    teratrain train --nproc N       this process: the launcher, running torchrun's agent in-process
      |-- rank 0 .. N-1             `python -m teratrain train ...`, each in its own session

- The launcher owns the run directory (rundir.own) and runs torchrun's elastic agent in this process
  (`torch.distributed.run.run`), its own log lines silenced. Ranks find the launcher's pid and a
  report folder in their environment (LAUNCHER_ENV, REPORTS_ENV).
- A rank watches its parent: when the launcher dies, even by kill -9, the rank stops as on SIGTERM
  (torchrun starts ranks in new sessions, so nothing else would reach them); if it was already
  stopping (the launcher gave up: a second Ctrl-C), it exits at once.
- SIGTERM, SIGINT and SIGHUP stop a process. During training (`stop_after_step`) the ranks finish the
  step, agree that one of them was signalled (a small all-reduce each step, train.py), write a
  checkpoint and exit 128 + signal number, within checkpoint.stop_timeout_s of the signal; elsewhere
  (start-up), and on a second signal in a process of its own, `Stopped` is raised at once.
  Checkpoints are written atomically, so the last complete one is intact whenever the stop is cut
  short; one message names the checkpoint and the command that continues the job, printed by the
  launcher or else by rank 0.
- A rank under the launcher prints nothing when it fails: it writes a report (kind, message, time,
  traceback), and the launcher prints one sentence for the job: a rank that died without a report
  (killed), else the earliest error, else the signal that stopped it. Under plain torchrun each rank
  prints its own error; a peer lost (its process or node gone: the connection reset, or a wait past
  parallel.timeout_s) is one sentence, appended with the traceback to the run's error.log and
  written to torchrun's error file (its failure report quotes it), and the rank exits 1 at once, so
  that torchrun restarts the job when --max-restarts allows (checkpoint.resume is auto there).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from teratrain import jobenv
from teratrain.jobenv import LAUNCHER_ENV, rank, under_launcher

REPORTS_ENV = "TERATRAIN_REPORTS"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SHUTDOWN_GRACE_S = 10.0  # outside training, a stopped rank that has not exited by then (a hung collective) exits hard
AGENT_MARGIN_S = 15  # torchrun waits this much longer than the ranks' own bound before it SIGKILLs them
PARENT_POLL_S = 0.5

_active: dict | None = None  # the state of the innermost stop_on_signals block (for the parent watch)
_STARTED = time.time()  # this process's start: a checkpoint written since is this job's


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
    """Within the block, the first termination signal raises `Stopped`, or, while "defer" is set (the
    training loop: `stop_after_step`), is only recorded for the loop to act on at the end of the step.
    A later signal raises `Stopped` at once in a process of its own, and is ignored in a rank under an
    agent (torchrun forwards the signal a scheduler also sent every rank; the agent's SIGKILL, or the
    launcher's death, ends a rank that takes too long). Yields a dict whose "signum" is set once a
    signal arrived (an error raised while stopping, e.g. by a collective whose peer has exited, is then
    part of the stop, not a failure of its own). Once the caller sets "ending" (it is already deciding
    how the command ends), a signal raises nothing: it would interrupt writing the report of the error
    being handled. "timeout_s" bounds a stop (`_exit_if_stuck`)."""
    global _active
    state: dict = {"signum": None, "ending": False, "defer": False, "pending": False, "timeout_s": SHUTDOWN_GRACE_S}

    def handler(signum, _frame):
        if state["ending"]:
            return
        if state["signum"] is None:
            state["signum"] = signum
            if state["defer"]:
                state["pending"] = True
                return
            raise Stopped(signum)
        if state["pending"] and "WORLD_SIZE" not in os.environ:  # again while the step ends and saves
            state.update(pending=False, defer=False)
            raise Stopped(state["signum"])

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield state
        return
    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    wake = _exit_if_stuck(state)
    outer, _active = _active, state
    try:
        yield state
    finally:
        state["closed"] = True
        _active = outer
        for s, h in old.items():
            signal.signal(s, h)
        if wake is not None:
            signal.set_wakeup_fd(wake[0])
            os.close(wake[1])


@contextmanager
def stop_after_step(timeout_s: float) -> Iterator[dict]:
    """The training loop's block: a stop signal is recorded (state["signum"]) rather than raised, so
    that the ranks can finish the step, agree and save before they exit (train.py); the stop must end
    within `timeout_s` of the signal. Outside a `stop_on_signals` block (the library's `run()` called
    from a script, which may handle signals its own way) signals are left alone."""
    if _active is None:
        yield {"signum": None}
        return
    state = _active
    state.update(defer=state["signum"] is None, timeout_s=timeout_s)
    try:
        yield state
    finally:
        state.update(defer=False, pending=False, timeout_s=SHUTDOWN_GRACE_S)


def _exit_if_stuck(state: dict) -> tuple[int, int]:
    """A rank blocked in a collective whose peer is gone runs no Python, so its signal handler would
    wait (up to parallel.timeout_s); a process inside one long kernel (a step of a large model on a CPU)
    runs none either, and saving at a stop may take too long. CPython writes each signal's number to the
    wakeup fd at once, from C; a thread reading it ends the process state["timeout_s"] after the first
    stop signal (checkpoints are atomic: a save cut short leaves the previous one): a rank if it is still
    there (its teardown may hang on a lost peer), a process of its own if it is still inside the block (a
    caller that goes on after it, e.g. a test, is left alone). Returns (the previous wakeup fd, our write end)."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    previous = signal.set_wakeup_fd(w)
    rank = "WORLD_SIZE" in os.environ

    def watch():
        while got := os.read(r, 1):  # b"" once the block ends normally and the write end is closed
            if got[0] in STOP_SIGNALS:
                time.sleep(state["timeout_s"])
                if rank or not state.get("closed"):
                    if not rank:  # a rank's launcher reports for the job
                        os.write(2, f"teratrain: stopped by {signal.Signals(got[0]).name}, still running "
                                    f"{state['timeout_s']:g} s after it: exited without a new checkpoint.\n".encode())
                    os._exit(128 + got[0])
        os.close(r)

    threading.Thread(target=watch, name="teratrain-stop-watch", daemon=True).start()
    return previous, w


# ---------------------------------------------------------------- ranks


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
        stopping = _active is not None and _active["signum"]
        if stopping:  # the launcher gave up on this stop (a second Ctrl-C): end now
            os._exit(128 + stopping)
        os.kill(os.getpid(), signal.SIGTERM)  # stop as on SIGTERM: finish the step and save

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


def record_failure(message: str, detail: str | None = None) -> None:
    """On plain torchrun, leave what ended this rank where its user and torchrun look: appended to the
    run's error.log (with `detail`: a traceback, or every thread's stack), and in torchrun's error file,
    whose message its failure report then shows."""
    if jobenv.run_dir is not None and jobenv.run_dir.is_dir():
        head = f"[{time.strftime('%Y-%m-%d %H:%M:%S')} on {socket.gethostname()}] {message}\n"
        fd = os.open(jobenv.run_dir / "error.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (head + (detail or "") + "\n").encode())  # one write: ranks append in turn
        finally:
            os.close(fd)
    error_file(message)


def error_file(message: str) -> None:
    """On torchrun, `message` in this rank's error file: its failure report quotes it."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        Path(os.environ["TORCHELASTIC_ERROR_FILE"]).write_text(json.dumps(
            {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}))


def stopped_message(signum: int, run_dir: Path | None) -> str:
    """The one line a stopped job ends with: the checkpoint it wrote at the stop (or the last complete
    one) and the command that continues the same job."""
    name = signal.Signals(signum).name
    latest = run_dir / "checkpoints" / "latest" if run_dir else None
    if latest is None or not latest.is_file():
        left = f"; {run_dir} holds no checkpoint to resume: delete it to start again there" \
            if run_dir is not None and run_dir.is_dir() else ""
        return f"teratrain: stopped by {name} before the first checkpoint was written{left}."
    ckpt = latest.parent / latest.read_text().strip()
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
        now = meta.get("stopped_by") == name and (ckpt / "meta.json").stat().st_mtime >= _STARTED
    except (OSError, ValueError):
        meta, now = {}, False
    what = f"at step {meta['step']}: wrote checkpoint {ckpt.name}" if now else \
        f"the last complete checkpoint ({ckpt.name}) is intact"
    return f"teratrain: stopped by {name} {what}; continue with: {resume_command(run_dir, meta.get('world', 1))}"


def resume_command(run_dir: Path, world: int) -> str:
    """The command that continues the run in `run_dir` as the job that wrote its checkpoint ran it:
    the same processes (under a multi-machine torchrun: the same torchrun command)."""
    if "WORLD_SIZE" in os.environ and not under_launcher() and \
            os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]) != os.environ["WORLD_SIZE"]:
        return f"the same torchrun command with --out {run_dir} --resume auto"
    return "teratrain train" + (f" --nproc {world}" if world > 1 else "") + f" --out {run_dir} --resume"


# ---------------------------------------------------------------- the launcher

def launch(argv: list[str], nproc: int, run_dir: Path, stop_timeout_s: float) -> int:
    """Run `python -m teratrain <argv>` on `nproc` local ranks with torchrun's agent in this process;
    returns the job's exit status after printing at most one line about how it ended. The agent
    forwards a stop signal to the ranks and SIGKILLs those still running AGENT_MARGIN_S after their
    own bound, `stop_timeout_s` (torch >= 2.12 reads the wait from TORCH_ELASTIC_SHUTDOWN_TIMEOUT;
    older versions wait 30 s)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    reports = Path(tempfile.mkdtemp(prefix="teratrain-reports-"))
    saved_env = dict(os.environ)
    os.environ.update({LAUNCHER_ENV: str(os.getpid()), REPORTS_ENV: str(reports)})
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(stop_timeout_s) + AGENT_MARGIN_S))
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
