"""Crash-safe file writes: a reader sees the old content or the new, never a half-written file."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from teratrain.config_base import ConfigError

PICTURES = ("png", "svg", "pdf")  # what the commands' --plot flags write (matplotlib's backends)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary sibling, fsync it, rename it over `path`, fsync the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def make_dir(path: Path, flag: str, given: Path | None = None) -> Path:
    """`path` created with its parents, or one sentence naming the `flag` that gave it and its value (`given`,
    where `path` is a temporary sibling of it) when the filesystem refuses (a parent that is a file, no
    permission)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create {given or path} ({e.strerror}); give {flag} a path in a writable "
                          "folder.") from None
    return path


def output_file(path: str, flag: str, suffixes: tuple[str, ...] = ()) -> Path:
    """`path` checked as a file a command may write before it does the work: its suffix one of `suffixes`
    (when given) and its folder an existing, writable one; else one sentence naming `flag`."""
    out = Path(path).expanduser()
    if suffixes and out.suffix.lower().lstrip(".") not in suffixes:
        names = [f".{s}" for s in suffixes]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        raise ConfigError(f"{flag} {path} does not end in {listed}; give a file name with one of those suffixes.")
    folder = out.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ConfigError(f"{flag} {path}: its folder {folder} does not exist or is not writable; give a path "
                          "in a writable folder.")
    return out
