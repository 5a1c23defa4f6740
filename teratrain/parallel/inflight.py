"""Every collective and transfer this process has launched and not yet seen complete, and the
watchdog that turns a hang into one sentence.

A hang is an operation a peer never joins (a rank waits in a reduction while its peer waits for a
pipeline transfer: a cycle; or a peer that died or took another path). Under NCCL the host does not
block in the operation itself: it blocks later, at whatever next waits for the GPU, so the stack of
a hung rank says little. The operations do: comm.py and the pipeline's p2p register each one here
(what, on which group, since when) with its torch `Work`, and a watchdog thread looks, once a
second, at the oldest one not completed. Past `parallel.timeout_s` it names it, with the group's
name and ranks (mesh.py gives every group a description), writes the launcher's report
(launch.py) and ends the process; the launcher prints the earliest report as the job's one line.
Under plain torchrun each rank says it itself and appends it, with its stacks, to the run's error.log.

torch's own timeouts (the process groups' `timeout`, after which NCCL's watchdog aborts the
process, and gloo's, after which the wait raises) are set longer (`backstop_s`), so ours speaks
first; they remain in case this thread cannot run.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections import deque

import torch

POLL_S = 1.0
PRUNE_AT = 256  # entries kept before completed ones are dropped on the way in (at least; see launch)


def backstop_s(timeout_s: float) -> float:
    """torch's own timeout for a configured `parallel.timeout_s`: later than the watchdog's."""
    return timeout_s * 1.5 + 30.0


class Works:
    """Several works as one (gloo keeps one per operation of a batch_isend_irecv)."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class Op:
    """One launched operation, and the handle its caller waits on. Pending until torch's `work`
    completes; once waited for, until the current stream passes the point of the wait (NCCL: a wait
    only orders the stream) or, on a CPU backend, at once. A waited work is let go: nothing here
    keeps its tensors alive."""

    __slots__ = ("what", "group", "since", "work", "event", "returned")

    def __init__(self, what: str, group):
        self.what, self.group, self.since = what, group, time.monotonic()
        self.work, self.event, self.returned = None, None, False

    def is_completed(self) -> bool:
        try:
            if self.returned:
                return True
            if self.event is not None:
                return bool(self.event.query())
            return self.work is not None and bool(self.work.is_completed())
        except Exception:  # noqa: BLE001 - a failed work is over (its error surfaces where it is waited for)
            return True

    def wait(self) -> bool:
        if self.work is not None:
            try:
                self.work.wait()
            except BaseException:
                _failed[0] = self
                raise
            self.work = None
            if torch.cuda.is_initialized():  # a wait only ordered the stream: mark where
                self.event = torch.cuda.Event()
                self.event.record()
            else:
                self.returned = True
        return True


_ops: deque[Op] = deque()
_failed: list[Op | None] = [None]  # the last operation whose wait raised (a peer lost: lost_peer)
_lock = threading.Lock()  # the main thread registers, the watchdog prunes
_limit = [PRUNE_AT]  # size past which launch prunes: twice what the last pruning kept


def launch(what: str, group, start) -> Op:
    """Register an operation on `group`, then `start()` it (a torch call with async_op=True, giving
    a work or a list of works); returns its handle. Registering never asks the device anything: an
    append, and once the registry has doubled since its last pruning, one pass that drops the completed
    operations (amortized O(1) per launch however many are pending: the host runs ahead of the GPU
    by a whole step of collectives, and a check of every pending one per launch made a step quadratic)."""
    op = Op(what, group)
    with _lock:
        _ops.append(op)
        crowded = len(_ops) > _limit[0]
    if crowded:
        _prune()
    try:
        work = start()
    except BaseException:
        op.returned = True
        _failed[0] = op
        raise
    op.work = Works(work) if isinstance(work, list) else work
    return op


def reset() -> None:
    """Forget every registered operation (benchmarks and tests that fake pending ones)."""
    with _lock:
        _ops.clear()
        _limit[0] = PRUNE_AT
        _failed[0] = None


def blocking(what: str, group, call):
    """Run a call that has no asynchronous form (object collectives), registered while inside."""
    op = Op(what, group)
    with _lock:
        _ops.append(op)
    try:
        return call()
    except BaseException:
        _failed[0] = op
        raise
    finally:
        op.returned = True


def failed() -> Op | None:
    """The last operation that raised instead of completing (e.g. its peer's connection reset)."""
    return _failed[0]


def _prune() -> None:
    with _lock:
        keep = [op for op in _ops if not op.is_completed()]
        _ops.clear()
        _ops.extend(keep)
        _limit[0] = max(PRUNE_AT, 2 * len(keep))


def oldest_pending() -> Op | None:
    _prune()
    return _ops[0] if _ops else None


def describe(group) -> str:
    """'<name> (ranks 0, 1)' for a group mesh.py made, else its ranks."""
    import torch.distributed as dist

    desc = getattr(group, "group_desc", "") or ""
    name = desc.split(" ")[0] if desc and not desc.startswith("undefined") else ""
    try:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    except Exception:  # noqa: BLE001 - a group this rank is not in, or no process group at all
        ranks = []
    members = f"ranks {', '.join(map(str, ranks))}" if ranks else "its ranks"
    return f"group {name} ({members})" if name else f"the group of {members}"


def hang_message(op: Op, rank: int, timeout_s: float) -> str:
    article = "an" if op.what[0] in "aeiou" else "a"
    return (f"rank {rank} waited over parallel.timeout_s={timeout_s:g} s for {article} {op.what} on "
            f"{describe(op.group)} that never completed: a peer never joined it (a peer was lost, hung or stuck "
            "elsewhere); raise parallel.timeout_s if the wait was legitimate")


_watch = {"timeout_s": None, "rank": 0, "thread": None}


def start_watchdog(timeout_s: float, rank: int) -> None:
    """Watch this process's pending operations; report and exit once the oldest has been pending for
    `timeout_s`. A later call (another run in the same processes) only changes the timeout."""
    _watch.update(timeout_s=timeout_s, rank=rank)
    if _watch["thread"] is not None:
        return

    def watch():
        while True:
            time.sleep(POLL_S)
            op, limit = oldest_pending(), _watch["timeout_s"]
            if op is not None and time.monotonic() - op.since > limit:
                _report_and_exit(hang_message(op, _watch["rank"], limit))
                return

    _watch["thread"] = threading.Thread(target=watch, name="teratrain-hang-watch", daemon=True)
    _watch["thread"].start()


def _report_and_exit(message: str) -> None:
    """Leave the launcher a report (with every thread's stack, for error.log), or without a launcher
    say it and append it with the stacks to the run's error.log; exit 1."""
    from teratrain import jobenv
    from teratrain.launch import record_failure, write_report

    main = threading.main_thread().ident
    stacks = "".join(f"--- thread {'main' if ident == main else ident}\n" + "".join(traceback.format_stack(frame))
                     for ident, frame in sys._current_frames().items())
    write_report("hang", message, detail=stacks)
    if not jobenv.under_launcher():
        if jobenv.run_dir is not None:
            message += f"; every thread's stack in {jobenv.run_dir / 'error.log'}"
        record_failure(message, stacks)
        print(f"teratrain: error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


# what torch's backends say when the other end of a connection is gone (gloo, NCCL, the TCP store)
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
             "Connection was likely closed", "remote process exited", "NCCL communicator was aborted",
             "ncclRemoteError")


def lost_peer(e: BaseException) -> str | None:
    """The sentence for an operation that failed because a peer is gone (its process or its node
    ended), naming this rank, the operation and its group (`failed` knows which raised),
    and what comes next; None for any other error."""
    from teratrain import jobenv
    from teratrain.jobenv import rank, restarts
    from teratrain.launch import resume_command

    if not isinstance(e, (RuntimeError, OSError)) or isinstance(e, BrokenPipeError):  # (stdout's reader left)
        return None
    text = str(e)
    why = next((w for w in PEER_GONE if w.lower() in text.lower()), None)
    if why is None:
        return None
    import torch.distributed as dist

    op = failed()
    what = f"{'an' if op.what[0] in 'aeiou' else 'a'} {op.what}" if op else "a collective"
    if op is not None and (op.group is not None or dist.is_initialized()):
        what += f" on {describe(op.group)}"
    limit, done = restarts()
    run_dir = jobenv.run_dir
    if limit > done:
        left = limit - done
        then = f"torchrun restarts the job ({left} restart{'s' if left > 1 else ''} left on this node)"
    elif run_dir is not None and (run_dir / "checkpoints" / "latest").is_file():
        then = f"continue with: {resume_command(run_dir, int(os.environ.get('WORLD_SIZE', '1')))}"
    else:
        then = "no checkpoint was written yet"
    where = f"; details in {run_dir / 'error.log'}" if run_dir is not None else ""
    return f"rank {rank()}: a peer was lost during {what} ({why}: its process or node ended); {then}{where}"
