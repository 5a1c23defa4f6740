"""Where text comes from: the running interpreter's standard-library sources (the default, ~30 MB of
real text on every machine that has Python) or the user's files and folders: text files, and JSON-lines
files (*.jsonl, *.ndjson: one JSON object per line, its `data.text_field` the document), the format
most datasets ship as. Both are read lazily, one document at a time."""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".cpp", ".js", ".ts", ".java", ".go", ".rs",
                 ".json", ".toml", ".yaml", ".yml", ".html", ".css", ".sh", ".tex", ".csv", ".jsonl", ".ndjson", ""}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}


class DataError(ValueError):
    """Bad data input: one sentence naming the problem and the fix."""


def stdlib_files() -> list[Path]:
    """All .py files of this interpreter's standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in _walk(root, skip={"site-packages", "dist-packages", "__pycache__"}) if p.suffix == ".py")


def user_files(path: str) -> list[Path]:
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data.path '{path}' does not exist; point it at a text file, a folder or a .bin token file.")
    if p.is_file():
        if is_binary(p):
            raise DataError(f"data.path '{path}' is a binary file, not text; give a text file, a folder of text "
                            "files, or pre-tokenized tokens named *.bin.")
        return [p]
    files = sorted(f for f in _walk(p, skip={"__pycache__", ".git"})
                   if f.suffix.lower() in TEXT_SUFFIXES and not is_binary(f))
    if not files:
        raise DataError(f"data.path '{path}' holds no text files; add .txt/.py/.md files or point at another folder.")
    return files


def is_binary(path: Path, probe: int = 8192) -> bool:
    """A NUL byte in the first `probe` bytes: how git and grep tell binary files from text."""
    with open(path, "rb") as f:
        return b"\0" in f.read(probe)


def _walk(root: Path, skip: set[str]):
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip and not x.startswith("."))
        for n in sorted(names):
            yield Path(d) / n


def is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in JSONL_SUFFIXES


def read_documents(files: list[Path], text_field: str = "text"):
    """Yield each document: a text file whole, a JSON-lines file record by record (undecodable bytes
    replaced, so any file can be read)."""
    for f in files:
        if is_jsonl(f):
            yield from _records(f, text_field)
        else:
            yield f.read_text(encoding="utf-8", errors="replace")


def _records(path: Path, field: str):
    """The `field` of every record of a JSON-lines file, streamed line by line (blank lines skipped)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {n} is not JSON ({e.msg}); fix or remove that line.") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = ", ".join(list(record)[:8]) if isinstance(record, dict) else "none: not an object"
                raise DataError(f"{path} line {n} has no text field '{field}' (its keys: {keys}); set data.text_field "
                                "to the field that holds the text.")
            yield text


def fingerprint(files: list[Path], text_field: str = "text") -> str:
    """Content-independent identity of a corpus (paths, sizes, mtimes; the text field of JSON lines):
    a cache key."""
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{int(st.st_mtime)}\n".encode())
    if any(is_jsonl(f) for f in files):
        h.update(f"text_field={text_field}".encode())
    return h.hexdigest()[:16]
