"""Reading the formats datasets ship, one part at a time.

A corpus is a list of inputs (corpus.py lists them); each is read as one of these kinds:

    text      a text file: the whole file is one document
    jsonl     JSON lines (*.jsonl, *.ndjson): each record's `text_field` is a document
    parquet   Parquet (*.parquet, read with pyarrow): each row's `text_field` column
    arrow     one Arrow file written by Hugging Face `datasets` (*.arrow, read with `datasets`)
    hf        a folder written by `datasets`' save_to_disk (a Dataset, or a DatasetDict's train split)

A `Part` is a contiguous piece of one input (a byte range of a JSON-lines file, row groups of a
Parquet file, rows of a dataset): what one worker of `teratrain tokenize` reads. Parts of one input,
read in order, give exactly its documents, so splitting never changes the token stream.
pyarrow and `datasets` are optional (the `data` extra): a corpus that needs one says so in one sentence.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from teratrain.data.errors import DataError

JSONL_SUFFIXES = {".jsonl", ".ndjson"}
RECORD_KINDS = ("jsonl", "parquet", "arrow", "hf")  # kinds whose documents are fields of records
ROWS_PER_BATCH = 1024  # rows converted to Python strings at a time (Parquet, Arrow)
SET_FIELD = "set data.text_field (teratrain tokenize: --text-field)"  # the fix, in both commands' words


@dataclass(frozen=True)
class Part:
    path: str
    kind: str
    start: int = 0  # jsonl: byte offset; parquet: row group; arrow/hf: row; text: 0
    stop: int | None = None  # exclusive; None = to the end
    nbytes: int = 0  # its share of the input's bytes on disk (for progress and for sizing shards)

    def to_json(self) -> dict:
        return {"path": self.path, "kind": self.kind, "start": self.start, "stop": self.stop, "nbytes": self.nbytes}


def kind_of(path: Path) -> str:
    if path.is_dir():
        return "hf"
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    return {".parquet": "parquet", ".arrow": "arrow"}.get(suffix, "text")


def is_hf_folder(path: Path) -> bool:
    """A folder written by `datasets`' save_to_disk: a Dataset (state.json) or a DatasetDict."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def input_bytes(path: Path) -> int:
    """Bytes on disk of one input (a datasets folder: its files)."""
    if path.is_dir():
        return sum(f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file())
    return path.stat().st_size


def documents(part: Part, text_field: str = "text", report=None):
    """Yield the documents of one part, in order; `report(fraction)`, when given, hears now and then
    how much of the part has been read (0..1)."""
    report = report or (lambda _: None)
    path = Path(part.path)
    if part.kind == "text":
        yield path.read_text(encoding="utf-8", errors="replace")
        report(1.0)
    elif part.kind == "jsonl":
        yield from _jsonl(path, text_field, part.start, part.stop, report)
    elif part.kind == "parquet":
        yield from _parquet(path, text_field, part.start, part.stop, report)
    else:  # arrow, hf
        yield from _dataset_rows(open_dataset(path, part.kind), path, text_field, part.start, part.stop, report)


def split(path: Path, target_bytes: int) -> list[Part]:
    """One input as parts of about `target_bytes` each (a text file stays whole: it is one document)."""
    kind, size = kind_of(path), input_bytes(path)
    n = max(1, round(size / max(target_bytes, 1)))
    if kind == "text" or n == 1:
        return [Part(str(path), kind, nbytes=size)]
    if kind == "jsonl":  # byte ranges; a part owns the lines that start inside it
        cuts = [size * i // n for i in range(n + 1)]
        return [Part(str(path), kind, a, b, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]
    total = _parquet_file(path).metadata.num_row_groups if kind == "parquet" else len(open_dataset(path, kind))
    cuts = sorted({total * i // n for i in range(n + 1)})  # row groups (parquet) or rows
    return [Part(str(path), kind, a, b, size * (b - a) // total) for a, b in zip(cuts, cuts[1:])]


# ------------------------------------------------------------------ JSON lines

def _jsonl(path: Path, field: str, start: int = 0, stop: int | None = None, report=lambda _: None):
    """The `field` of every record whose line starts in [start, stop), streamed (blank lines skipped;
    undecodable bytes replaced, so any file can be read)."""
    end = path.stat().st_size if stop is None else stop
    with open(path, "rb") as f:
        if start:
            f.seek(start - 1)
            f.readline()  # the rest of the line that began before `start` belongs to the previous part
        n = 0
        while stop is None or f.tell() < stop:
            at = f.tell()
            raw = f.readline()
            if not raw:
                break
            n += 1
            if n % ROWS_PER_BATCH == 0:
                report((at - start) / max(end - start, 1))
            line = raw.decode("utf-8", errors="replace")
            if line.strip():
                yield _record_text(line, field, path, f"line {n}" if not start else f"the line at byte {at}")
    report(1.0)


def _record_text(line: str, field: str, path: Path, where: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} {where} is not JSON ({e.msg}); fix or remove that line.") from None
    text = record.get(field) if isinstance(record, dict) else None
    if isinstance(text, str):
        return text
    if isinstance(record, dict) and field in record:
        raise DataError(f"{path} {where} holds {type(text).__name__} in its field '{field}', not text; make it a "
                        f"string, or {SET_FIELD} to the field that holds the text.")
    keys = ", ".join(list(record)[:8]) if isinstance(record, dict) else "none: not an object"
    raise DataError(f"{path} {where} has no text field '{field}' (its keys: {keys}); {SET_FIELD} to the field that "
                    "holds the text.")


# ------------------------------------------------------------------ Parquet, Arrow, datasets folders

def _need(module: str, path: Path, what: str):
    try:
        return __import__(module)
    except ImportError:
        raise DataError(f"'{path}' holds {what}, which needs the {module} package; install it with "
                        f"pip install 'teratrain[data]' (or pip install {module}).") from None


def _parquet_file(path: Path):
    _need("pyarrow", path, "Parquet files")
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid and OSError alike
        raise DataError(f"{path} is not a readable Parquet file ({str(e)[:100]}); re-download or remove it.") from None


def _parquet(path: Path, field: str, start: int = 0, stop: int | None = None, report=lambda _: None):
    pf = _parquet_file(path)
    names = pf.schema_arrow.names
    if field not in names:
        raise _no_column(path, field, names)
    groups = list(range(start, pf.metadata.num_row_groups if stop is None else stop))
    rows, done = sum(pf.metadata.row_group(g).num_rows for g in groups), 0
    for batch in pf.iter_batches(batch_size=ROWS_PER_BATCH, row_groups=groups, columns=[field]):
        yield from _strings(batch.column(0), path, field)
        done += batch.num_rows
        report(done / max(rows, 1))


def open_dataset(path: Path, kind: str):
    """A `datasets.Dataset`: one Arrow file (memory-mapped), or a save_to_disk folder (a
    DatasetDict's train split)."""
    _need("datasets", path, "a Hugging Face datasets folder" if kind == "hf" else "Arrow files")
    import datasets

    if kind == "arrow":
        return datasets.Dataset.from_file(str(path))
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise DataError(f"'{path}' is a DatasetDict without a train split (its splits: {', '.join(splits)}); "
                            f"point data.path at one split's folder, e.g. {path / splits[0]}." if splits else
                            f"'{path}' is a DatasetDict with no splits; point data.path at a dataset folder.")
        path = path / "train"
    return datasets.load_from_disk(str(path))


def _dataset_rows(ds, path: Path, field: str, start: int = 0, stop: int | None = None, report=lambda _: None):
    if field not in ds.column_names:
        raise _no_column(path, field, ds.column_names)
    table = ds.select_columns([field]).with_format("arrow")
    stop = len(ds) if stop is None else stop
    for lo in range(start, stop, ROWS_PER_BATCH):
        hi = min(lo + ROWS_PER_BATCH, stop)
        yield from _strings(table[lo:hi].column(0), path, field)
        report((hi - start) / max(stop - start, 1))


def _strings(column, path: Path, field: str):
    """The non-null strings of one Arrow column (null rows are no documents)."""
    import pyarrow as pa

    is_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type) or is_view(column.type)):
        raise DataError(f"column '{field}' of {path} holds {column.type}, not text; {SET_FIELD} to the "
                        "column that holds the text.")
    for text in column.to_pylist():
        if text is not None:
            yield text


def _no_column(path: Path, field: str, names: list[str]) -> DataError:
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    return DataError(f"{path} has no column '{field}' (its columns: {shown}); {SET_FIELD} to the column "
                     "that holds the text.")


def size_hint(paths: list[Path]) -> str:
    return f"{sum(input_bytes(p) for p in paths) / 1e6:,.1f} MB"


def cpu_count() -> int:
    """CPUs this process may run on (a container's or taskset's limit, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1
