"""Where text comes from: the running interpreter's standard-library sources (the default, ~30 MB of
real text on every machine that has Python) or the user's files and folders: text files, JSON-lines
files (*.jsonl, *.ndjson: one JSON object per line, its `data.text_field` the document), Parquet files
and folders written by Hugging Face `datasets` (data/formats.py reads them). All are read lazily, one
document at a time. A folder holding record files (JSON lines, Parquet, Arrow, datasets folders) is
read for those only: its README or licence is no document.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

from teratrain.data.errors import DataError
from teratrain.data.formats import RECORD_KINDS, Part, documents, is_hf_folder, kind_of

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".cpp", ".js", ".ts", ".java", ".go", ".rs",
                 ".json", ".toml", ".yaml", ".yml", ".html", ".css", ".sh", ".tex", ".csv", ".jsonl", ".ndjson", ""}
RECORD_SUFFIXES = {".jsonl", ".ndjson", ".parquet", ".arrow"}


def stdlib_files() -> list[Path]:
    """All .py files of this interpreter's standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in _walk(root, skip={"site-packages", "dist-packages", "__pycache__"}) if p.suffix == ".py")


def user_files(path: str, key: str = "data.path") -> list[Path]:
    """The inputs under `path` (the value of `key`), in a fixed order: files, and datasets folders as one
    input each."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{key} '{path}' does not exist; point it at a text file, a folder or a .bin token file.")
    if p.is_file():
        if p.suffix.lower() not in RECORD_SUFFIXES and is_binary(p):
            raise DataError(f"{key} '{path}' is a binary file, not text; give a text file, a folder of text "
                            "files, or pre-tokenized tokens named *.bin.")
        return [p]
    if is_hf_folder(p):
        return [p]
    found = list(_inputs(p, is_hf_folder))
    records = [f for f in found if f.is_dir() or f.suffix.lower() in RECORD_SUFFIXES]
    files = records or [f for f in found if f.suffix.lower() in TEXT_SUFFIXES and not is_binary(f)]
    if not files:
        raise DataError(f"{key} '{path}' holds no text files; add .txt/.py/.md files or point at another folder.")
    return files


def _inputs(root: Path, is_dataset):
    """Files under `root`, and datasets folders (not walked into), in sorted order."""
    for d, dirs, names in os.walk(root):
        keep = sorted(x for x in dirs if x not in {"__pycache__", ".git"} and not x.startswith("."))
        dirs[:] = [x for x in keep if not is_dataset(Path(d) / x)]
        yield from sorted([Path(d) / n for n in names] + [Path(d) / x for x in keep if is_dataset(Path(d) / x)])


def is_binary(path: Path, probe: int = 8192) -> bool:
    """A NUL byte in the first `probe` bytes: how git and grep tell binary files from text."""
    with open(path, "rb") as f:
        return b"\0" in f.read(probe)


def _walk(root: Path, skip: set[str]):
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip and not x.startswith("."))
        for n in sorted(names):
            yield Path(d) / n


def read_documents(files: list[Path], text_field: str = "text"):
    """Yield each document: a text file whole, a record file (JSON lines, Parquet, Arrow, a datasets
    folder) record by record."""
    for f in files:
        yield from documents(Part(str(f), kind_of(f)), text_field)


def fingerprint(files: list[Path], text_field: str = "text") -> str:
    """Content-independent identity of a corpus (paths, sizes, mtimes, a datasets folder's files; the
    text field of record files): a cache key."""
    h = hashlib.sha256()
    for f in files:
        for g in sorted(x for x in f.rglob("*") if x.is_file()) if f.is_dir() else [f]:
            st = g.stat()
            h.update(f"{g}\0{st.st_size}\0{int(st.st_mtime)}\n".encode())
    if any(kind_of(f) in RECORD_KINDS for f in files):
        h.update(f"text_field={text_field}".encode())
    return h.hexdigest()[:16]
