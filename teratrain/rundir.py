"""A run directory: where a run lives, who owns it, and the config a resumed run continues with.

- A fresh run without `--out` gets `runs/<timestamp>`, created atomically (`-2`, `-3`, ... when two
  jobs start in the same second), so two jobs never share one by accident.
- A job owns its run directory through an exclusive `flock` on `<run>/run.lock`, held while the job
  lives. The kernel drops it when the holder exits, however it dies (kill -9 included), so a lock is
  never stale; the file records the holder's pid and host for the message a second writer gets. One
  process per job holds it: the `--nproc` launcher, else rank 0 (`teratrain.launch` says which).
  Every rank also holds `ranks.lock` shared, so a new owner waits for ranks that outlive a killed
  launcher by the seconds they take to stop.
- Under plain torchrun rank 0 owns the directory; every other rank takes `ranks.lock` once the job
  agreed on the directory (agree_run_dir), after rank 0 checked it, and must see it as rank 0 does
  (the same `run.lock`: a filesystem every node shares).
- `checkpoint.resume` (`--resume`, `--resume auto`): auto continues the run in `--out` when it holds
  a checkpoint and starts it there otherwise (again, when it stopped before its first checkpoint),
  refusing a folder holding another model's run; it is the default under plain torchrun, whose
  restarts (after a failure, a node joining or leaving) rerun the first command on every node.
- `--resume` starts from the run's saved `config.toml`, on as many processes as wrote its newest
  checkpoint unless `--nproc` is given; a config file and `--set` given with it apply on top (the
  start-up summary lists what differs from the checkpoint resumed, `changes`). A longer
  `train.steps` keeps the run's original schedule length (`optim.decay_steps`) unless the user sets it
  or that schedule ended within its warmup.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

from teratrain import jobenv
from teratrain.checkpoint.hf_config import SOURCE_CONFIG
from teratrain.config import Config, ConfigError, apply_overrides, read_toml, validate

RUNS = Path("runs")
LOCK_NAME = "run.lock"  # held exclusively by the job's owner
MEMBERS_NAME = "ranks.lock"  # held shared by each of its ranks
BEFORE_FIRST_STEP = ("config.toml", "tokenizer.json", SOURCE_CONFIG)  # what a run writes before its first step


def check_out(out: str | Path, resume: bool) -> Path:
    """--out must be a folder, and a fresh run must not overwrite another run's checkpoints."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path} is a file; give a folder for the run.")
    if not resume and _has_checkpoints(path):
        raise ConfigError(f"--out {path} already holds a run; pass --resume to continue it or choose another --out.")
    if not resume and logged_steps(path):
        raise ConfigError(f"--out {path} holds a run that stopped before its first checkpoint (its metrics.jsonl "
                          "logs steps, but nothing can resume them); delete the folder to start over there, or "
                          "choose another --out.")
    return path


def resume_mode(given: bool | str | None) -> bool | str:
    """checkpoint.resume as given (--resume, a config file, --set), else its default: "auto" in a rank
    of plain torchrun, whose restarts (after a failure, or a node joining or leaving) rerun the first
    command on every node, else False (a fresh run refuses a directory that holds one)."""
    if given is not None:
        return given
    return "auto" if jobenv.under_torchrun() else False


def decide_resume(given: bool | str | None, out: str | None, launched: bool | None, note: str | None):
    """(checkpoint.resume's mode, whether this command resumes, the start-up line saying what auto
    decided, the run directory or None for a fresh default one). The ranks of `teratrain train --nproc`
    (`launched`: whether the launcher passed --resume) take the launcher's decision and its `note`: it
    decided once, before it started a run over (which clears what auto would look at)."""
    if launched is not None:
        return launched, launched, note, Path(out) if out else None
    mode = resume_mode(given)
    resume, note = bool(mode), None
    if mode == "auto":
        resume, note = auto_resume(out, given=given is not None)
    return mode, resume, note, Path(out) if out else newest_run() if resume else None


def auto_resume(out: str | Path | None, given: bool) -> tuple[bool, str | None]:
    """checkpoint.resume=auto (`given`: set by the user, not by default): (whether to resume `out`,
    the start-up line saying what was decided). Resume when it holds a checkpoint; else start the run
    there (again, when it stopped before its first checkpoint)."""
    if out is None:
        limit, done = jobenv.restarts()
        if given:
            raise ConfigError("checkpoint.resume=auto (--resume auto) continues or starts the run in --out; give "
                              "--out DIR.")
        if limit:
            raise ConfigError(f"torchrun may restart this job (--max-restarts {limit}), and a restart continues "
                              "the run only in a folder it knows; give --out DIR.")
        return False, None
    path = Path(out)
    again = f" (torchrun restart {jobenv.restarts()[1]})" if jobenv.restarts()[1] else ""
    if _has_checkpoints(path):
        return True, f"resume=auto: {path} holds checkpoints: continuing its run{again}"
    if (path / "config.toml").is_file() or logged_steps(path):
        return False, (f"resume=auto: {path} holds a run that stopped before its first checkpoint: starting it "
                       f"over{again}")
    return False, f"resume=auto: {path} holds no run: starting it{again}"


def check_same_run(path: Path, cfg: Config) -> None:
    """Under checkpoint.resume=auto: refuse a run directory holding another model (a run of its own,
    not one this command continues or starts over)."""
    if not (path / "config.toml").is_file():
        return
    saved, mine = _flat({"model": read_toml(path / "config.toml").get("model", {})}), _flat(cfg.model_dump())
    for key, value in sorted(saved.items()):
        if key != "model.init_from" and mine.get(key) != value:
            raise ConfigError(f"--out {path} holds another run ({key} = {value!r} there, {mine.get(key)!r} here); "
                              "choose another --out, or give that run's model settings to continue it.")


def logged_steps(path: Path) -> bool:
    """Whether a run in `path` logged a step (its metrics.jsonl is not empty)."""
    try:
        return (Path(path) / "metrics.jsonl").stat().st_size > 0
    except OSError:
        return False


def agree_run_dir(out: str | Path | None, resume: bool, rt) -> Path:
    """The run directory every rank of the job writes to: `out` if given, with `resume` alone the newest
    run, else a fresh `runs/<timestamp>`; decided on rank 0 and shared (collectives). Every rank must
    see it as rank 0 does (the same `run.lock`: one filesystem shared by every node) and have decided
    alike whether to resume (checkpoint.resume=auto decides on each rank)."""
    from teratrain.parallel.comm import all_gather_objects, broadcast_object

    path = None
    if rt.is_main:
        path = str(check_out(out, resume) if out else newest_run() if resume else fresh_run_dir())
    jobenv.run_dir = path = Path(broadcast_object(path, rt.world_group))
    _take_deferred(path)
    views = all_gather_objects((bool(resume), _lock_text(path)), rt.world_group)
    for r, (resumes, lock) in enumerate(views):
        if lock != views[0][1]:
            raise ConfigError(f"rank {r} does not see the run directory {path} as rank 0 does (its {LOCK_NAME} "
                              "differs): --out must be on a filesystem that every node shares (NFS, Lustre, GPFS, "
                              "...); see docs/nodes.md.")
        if resumes != views[0][0]:
            raise ConfigError(f"rank {r} decided {'to' if resumes else 'not to'} resume the run in {path}, rank 0 "
                              "the opposite: give every node the same command and --out on a shared filesystem.")
    return path


def _lock_text(path: Path) -> str | None:
    try:
        return (path / LOCK_NAME).read_text()
    except OSError:
        return None


def _has_checkpoints(path: Path) -> bool:
    root = path / "checkpoints"
    return root.is_dir() and any(p.name.startswith("step_") and not p.name.endswith(".tmp") for p in root.iterdir())


def newest_run(root: Path = RUNS) -> Path:
    """The run under `root` whose newest checkpoint is the most recent (for `--resume` alone)."""
    runs = [p.parent.parent for p in root.glob("*/checkpoints/latest")]
    if not runs:
        raise ConfigError(f"--resume found no run with a checkpoint under {root}/; pass --out DIR of the run to "
                          "resume.")
    return max(runs, key=lambda p: (p / "checkpoints" / "latest").stat().st_mtime)


def processes(run_dir: Path) -> int:
    """How many processes wrote the run's newest checkpoint (what `--resume` launches unless --nproc
    says otherwise); 1 when it has none."""
    root = Path(run_dir) / "checkpoints"
    try:
        return int(json.loads((root / (root / "latest").read_text().strip() / "meta.json").read_text())["world"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1


def fresh_run_dir(root: Path = RUNS) -> Path:
    """Create and return `root/<timestamp>`, or `<timestamp>-2`, ... if another job took the name."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    _mkdir(root, parents=True)
    for n in range(1, 10_000):
        path = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise ConfigError(f"could not find a free run name under {root}/; pass --out DIR.")


def _mkdir(path: Path, parents: bool = False) -> None:
    try:
        path.mkdir(parents=parents, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the run directory {path} ({e.strerror}); give --out a writable "
                          "folder.") from None


@contextmanager
def own(path: Path, resume: bool, created: bool = False, start_over: bool = False) -> Iterator[Path]:
    """Hold the run directory for this job (see the module docstring). A directory this job created
    is removed again if the job ends without having logged a step (a rejected data check leaves nothing).
    `start_over` (checkpoint.resume=auto): a run there that stopped before its first checkpoint is
    started again (its metrics.jsonl, of steps nothing can resume, goes)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path} is a file; give a folder for the run.")
    created = created or not path.exists()
    _mkdir(path, parents=True)
    fd = _lock(path)
    try:
        _check_no_members(path)
        if start_over and not resume and not _has_checkpoints(path):
            (path / "metrics.jsonl").unlink(missing_ok=True)
        check_out(path, resume)
        yield path
    finally:
        if created:
            remove_if_unused(path)
        os.close(fd)  # releases the lock (the file stays: deleting it would race with a new holder)


def _lock(path: Path) -> int:
    lock = path / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"--out {path} is not writable ({e.strerror}); choose a writable folder.") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
        raise ConfigError(f"{path} is in use by another teratrain job ({_holder(lock)}); wait for it to end, stop "
                          "it, or choose another --out.") from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    os.fsync(fd)  # other nodes read it (agree_run_dir): a network filesystem shows them what was synced
    return fd


def _check_no_members(path: Path) -> None:
    """Ranks of an earlier job may outlive their owner by a few seconds (they stop when it dies)."""
    fd = os.open(path / MEMBERS_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise ConfigError(f"{path} is still used by ranks of an earlier job, which are stopping; retry in a few "
                          "seconds.") from None
    finally:
        os.close(fd)  # also releases the lock just taken: this job's own ranks take it shared


@contextmanager
def member(path: Path | None, defer: bool = False) -> Iterator[None]:
    """Every rank of a job holds a shared lock on the run directory while it runs, so a new owner
    can tell that ranks of an earlier job are still writing there. `defer` (a rank of plain torchrun
    other than rank 0, its owner): taken once the job agreed on the directory (agree_run_dir), so
    after rank 0 checked it; taken at once, it would look to rank 0 like a rank of an earlier job."""
    if defer or path is None or not Path(path).is_dir():  # (rank 0 may still be creating it)
        _deferred["wanted"] = True
        try:
            yield
        finally:
            if "fd" in _deferred:
                os.close(_deferred["fd"])
            _deferred.clear()
        return
    fd = os.open(Path(path) / MEMBERS_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # an owner holds it exclusively only for an instant
        yield
    finally:
        os.close(fd)


_deferred: dict = {}  # a member lock left for agree_run_dir to take ("wanted"), and its fd once taken


def _take_deferred(path: Path) -> None:
    if _deferred.pop("wanted", False) and path.is_dir():
        _deferred["fd"] = fd = os.open(path / MEMBERS_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)


def _holder(lock: Path) -> str:
    try:
        info = json.loads(lock.read_text())
        return f"pid {info['pid']} on host {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError):  # the holder took the lock but has not written it yet
        return "its pid is not written yet"


def remove_if_unused(path: Path) -> None:
    """Delete a run directory that holds nothing but what a job writes before its first step (an
    error.log of a crash, metrics or checkpoints keep it)."""
    if path.is_dir() and {p.name for p in path.iterdir()} <= {LOCK_NAME, MEMBERS_NAME, *BEFORE_FIRST_STEP}:
        shutil.rmtree(path, ignore_errors=True)


def resume_config(run_dir: Path, config: str | None, overrides: list[str], replan: bool = False) -> Config:
    """The config a resumed run continues with: the saved `config.toml` (but parallel.dp, which follows
    the processes launched, and a saved stage split when the pipeline changes), then the config file
    and `overrides` on top, nested tables key by key. A new train.steps keeps the schedule's length
    unless optim.decay_steps is given. `replan` (another process count): a parallel.auto run's saved layout keys,
    the pick for the old count, are left for parallel.auto to choose again."""
    saved_path = Path(run_dir) / "config.toml"
    if Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise ConfigError(f"--out {run_dir} is a file; give the folder of the run to resume.")
    if not saved_path.is_file():
        raise ConfigError(f"no usable checkpoint in {run_dir}: it holds no run (no config.toml); train without "
                          "--resume to start one there.")
    base, given = read_toml(saved_path), read_toml(config) if config else {}
    given = apply_overrides(given, overrides)
    # the saved dp is what the launch gave (train.run records it): a resume at another process count
    # (resharding) derives its own unless given
    base = {**base, "parallel": {k: v for k, v in base.get("parallel", {}).items() if k != "dp"}}
    if replan and given.get("parallel", {}).get("auto", base.get("parallel", {}).get("auto")):
        from teratrain.planner.auto import CP_KEYS, KEYS, PP_KEYS

        for key in (*KEYS.values(), *CP_KEYS.values(), *PP_KEYS.values()):
            section, name = key.split(".")
            base[section] = {k: v for k, v in base.get(section, {}).items() if k != name}
    try:
        saved = validate(base)
    except ConfigError as e:
        raise ConfigError(f"{saved_path} (the run's saved config): {e}") from None
    merged = _merge(base, given)
    merged["parallel"] = p = dict(merged.get("parallel", {}))
    if "stage_layers" not in given.get("parallel", {}) and \
            (p.get("pp"), p.get("virtual_stages")) != (saved.parallel.pp, saved.parallel.virtual_stages):
        p.pop("stage_layers", None)  # a split of the old stages (resharding to another pp)
    cfg = validate(merged)
    # a run whose schedule ended within its warmup never began to decay: pinned, its lr would fall
    # from the peak to min_lr_ratio x peak in one step after the warmup; it spans the new length instead
    decayed = saved.schedule_steps > saved.optim.warmup_steps
    if cfg.train.steps != saved.train.steps and "decay_steps" not in given.get("optim", {}) and decayed:
        cfg.optim.decay_steps = saved.schedule_steps
    return cfg


def changes(old: dict, new: Config) -> list[str]:
    """`key: old -> new` for every key of `new` whose value differs from the raw config `old`."""
    a, b = _flat(old), _flat(new.model_dump())
    out = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in b if a.get(k) != b.get(k)]
    if a.get("optim.decay_steps") is None and b["optim.decay_steps"] == a.get("train.steps"):
        out = [line + (" (the lr schedule keeps its original length; set optim.decay_steps to stretch it)"
                       if line.startswith("optim.decay_steps:") else "") for line in out]
    return out


def _merge(base: dict, top: dict) -> dict:
    """`top` over `base`, tables merged key by key at every depth (a [model.moe] key given alone keeps
    the saved table's others)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _flat(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf of the tables in `raw` (model.moe.top_k)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        elif prefix:
            out[prefix + key] = value
    return out
