"""`teratrain tokenize SRC --out DIR`: a corpus of any size into token shards, on every CPU core.

The corpus (any data.path: text, JSON lines, Parquet, datasets folders) is cut into parts of about
`--shard-mb` MB of input (byte ranges of a JSON-lines file, row groups of a Parquet file, rows of a
dataset; a text file whole), consecutive parts packed into shards of that size. A pool of worker
processes (spawned; one tokenizer thread each) encodes one shard each at a time and writes it
atomically (data/shards.py describes the folder). `plan.json` fixes the shards before any is
written, so an interrupted run continues where it stopped: the same command again writes only the
shards that are missing or damaged, then the index. The shards end to end are the tokens start-up
tokenization gives the same corpus and tokenizer.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from teratrain.data.corpus import DataError, fingerprint, user_files
from teratrain.data.formats import Part, cpu_count, documents, split
from teratrain.data.shards import FORMAT, INDEX, PLAN
from teratrain.fsio import atomic_write_bytes, fsync_file, make_dir

ENCODE_BATCH = 256  # documents per encode call


def add_tokenize_parser(sub) -> None:
    t = sub.add_parser("tokenize", help="tokenize a corpus into token shards on every CPU core (train with "
                                        "data.path=DIR)")
    t.add_argument("src", help="text file, JSON-lines or Parquet file, datasets folder, or a folder of them")
    t.add_argument("--out", required=True, help="folder for the shards, index.json and tokenizer.json")
    t.add_argument("--tokenizer", help="tokenizer.json to encode with (default: train a byte-level BPE of "
                                       "--vocab-size tokens on the start of the corpus)")
    t.add_argument("--vocab-size", type=int, default=4096, help="size of the BPE trained without --tokenizer")
    t.add_argument("--bpe-sample-mb", type=float, default=256.0,
                   help="MB of text (from the start of the corpus) the BPE is trained on")
    t.add_argument("--text-field", default="text", help="record field or column that holds the text")
    t.add_argument("--workers", type=int, help="worker processes (default: the CPUs this process may use)")
    t.add_argument("--shard-mb", type=float, default=128.0, help="MB of input per shard")
    t.set_defaults(func=cmd_tokenize)


def cmd_tokenize(args) -> int:
    bpe_low = 2 if args.tokenizer else 257  # a byte-level BPE starts from 256 bytes, plus its end-of-text token
    for flag, value, low in (("--workers", args.workers, 1), ("--vocab-size", args.vocab_size, bpe_low),
                             ("--shard-mb", args.shard_mb, 1e-6), ("--bpe-sample-mb", args.bpe_sample_mb, 1e-6)):
        if value is not None and value < low:
            raise DataError(f"{flag} must be at least {low:g}, got {value}; give a larger value.")
    from teratrain.launch import Stopped

    try:
        index = tokenize(args.src, args.out, args.tokenizer, args.vocab_size, args.text_field, args.workers,
                         args.shard_mb, args.bpe_sample_mb)
    except Stopped as e:
        print(f"teratrain: stopped by {signal.Signals(e.signum).name}; the shards written in {args.out} are kept: "
              "run the same command again to continue.", file=sys.stderr)
        return e.exit_code
    if not index["tokens"]:
        raise DataError(f"{args.src} holds no text: 0 documents in field '{args.text_field}' (training would refuse "
                        f"{args.out}); give a corpus with text, or give --text-field the field that holds it.")
    print(f"done: {index['tokens']:,} tokens of {index['documents']:,} documents in {len(index['shards'])} shards, "
          f"{index['tokens_per_s']:,.0f} tokens/s on {index['workers']} workers -> {args.out} "
          f"(train with --set data.path={args.out})")
    return 0


def tokenize(src: str, out: str, tokenizer: str | None = None, vocab_size: int = 4096, text_field: str = "text",
             workers: int | None = None, shard_mb: float = 128.0, bpe_sample_mb: float = 256.0,
             progress: bool = True) -> dict:
    """Tokenize `src` into `out` (continuing an interrupted run there); returns the index, with the
    run's `seconds`, `tokens_per_s` and `workers` added (not stored)."""
    out_dir = Path(out).expanduser()
    files = user_files(src, key="SRC")
    tok_path = _tokenizer(files, out_dir, tokenizer, vocab_size, text_field, bpe_sample_mb)
    plan = _plan(files, src, out_dir, tok_path, text_field, int(shard_mb * 1e6))
    shards = [[Part(**p) for p in parts] for parts in plan["shards"]]
    records = _records(out_dir, len(shards))
    todo = [k for k in range(len(shards)) if k not in records]
    workers = max(1, min(workers or cpu_count(), len(todo) or 1))
    if todo:
        size_mb = sum(p.nbytes for s in shards for p in s) / 1e6
        _say(f"tokenizing {_count(len(files), 'input')} ({size_mb:,.1f} MB) into "
             f"{len(shards)} shards in {out_dir} on {workers} workers"
             + (f" ({len(shards) - len(todo)} already written)" if len(todo) < len(shards) else ""))
    t0 = time.perf_counter()
    new_tokens = _run_pool(out_dir, shards, todo, tok_path, text_field, plan["dtype"], workers, progress)
    seconds = time.perf_counter() - t0
    records.update(_records(out_dir, len(shards)))
    index = _write_index(out_dir, src, plan, shards, records)
    return {**index, "seconds": seconds, "tokens_per_s": new_tokens / seconds if seconds and new_tokens else 0.0,
            "workers": workers}


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _say(text: str) -> None:
    print(f"teratrain: {text}", file=sys.stderr, flush=True)


def _tokenizer(files: list[Path], out_dir: Path, given: str | None, vocab_size: int, text_field: str,
               sample_mb: float) -> Path:
    """out/tokenizer.json: the given one, the one an interrupted run there used, or a BPE trained on
    the first `sample_mb` MB of text."""
    from tokenizers import Tokenizer

    from teratrain.data.tokenizer import EOT, train_bpe

    path = out_dir / "tokenizer.json"
    data = None
    if given:  # checked before anything is written
        try:
            data = Path(given).expanduser().read_bytes()
            Tokenizer.from_str(data.decode())
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad files
            why = e.strerror if isinstance(e, OSError) else str(e)[:80]
            raise DataError(f"--tokenizer '{given}' could not be loaded ({why}); give a tokenizer.json saved by HF "
                            "tokenizers.") from None
    make_dir(out_dir, "--out")
    if data is not None:
        if path.exists() and path.read_bytes() != data:
            raise DataError(f"'{out_dir}' holds tokens of another tokenizer; give another --out or delete it.")
        if not path.exists():
            atomic_write_bytes(path, data)
    elif not path.exists():
        _say(f"training a {vocab_size:,}-token BPE tokenizer on the first {sample_mb:,.0f} MB of "
             f"{_count(len(files), 'input')}; saved as {path}")
        train_bpe(files, vocab_size, path, text_field, _first_bytes(files, text_field, int(sample_mb * 1e6)))
    if Tokenizer.from_file(str(path)).token_to_id(EOT) is None:
        _say(f"warning: {path} has no {EOT} token; documents are concatenated without a separator")
    return path


def _first_bytes(files: list[Path], text_field: str, limit: int):
    """Documents from the start of the corpus until `limit` bytes of text."""
    from teratrain.data.corpus import read_documents

    seen = 0
    for doc in read_documents(files, text_field):
        yield doc
        seen += len(doc)
        if seen >= limit:
            return


def _plan(files: list[Path], src: str, out_dir: Path, tok_path: Path, text_field: str, shard_bytes: int) -> dict:
    """The shards of this corpus (each a list of parts), written to plan.json before any shard; an
    existing plan of the same corpus, tokenizer and settings is continued, another one refused."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tok_path)).get_vocab_size()
    key = {"format": FORMAT, "source": str(Path(src).expanduser().resolve()), "text_field": text_field,
           "fingerprint": fingerprint(files, text_field), "tokenizer_sha256": _sha256(tok_path.read_bytes()),
           "shard_bytes": shard_bytes, "vocab_size": vocab, "dtype": "uint16" if vocab <= 2**16 else "uint32"}
    path = out_dir / PLAN
    if path.exists():
        plan = json.loads(path.read_text())
        if {k: plan.get(k) for k in key} != key:
            changed = ", ".join(k for k in key if plan.get(k) != key[k])
            raise DataError(f"'{out_dir}' holds the tokens of another corpus or setting ({changed} differ); give "
                            "another --out, or delete it to tokenize again.")
        return plan
    if (out_dir / INDEX).exists() or any(out_dir.glob("shard_*")):
        raise DataError(f"'{out_dir}' holds files of another tokenize run; give another --out or delete it.")
    shards, current, size = [], [], 0
    for part in itertools.chain.from_iterable(split(f, shard_bytes) for f in files):
        if current and size + part.nbytes > shard_bytes * 1.5:  # pack small inputs, never grow a shard past 1.5x
            shards.append(current)
            current, size = [], 0
        current.append(part)
        size += part.nbytes
        if size >= shard_bytes:
            shards.append(current)
            current, size = [], 0
    shards += [current] if current else []
    plan = {**key, "shards": [[p.to_json() for p in s] for s in shards]}
    atomic_write_bytes(path, json.dumps(plan, indent=1).encode())
    return plan


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _names(k: int) -> tuple[str, str]:
    return f"shard_{k:05d}.bin", f"shard_{k:05d}.json"


def _records(out_dir: Path, n: int) -> dict[int, dict]:
    """The shards already written (by shard number): a record, or an entry of the index a finished
    run wrote, whose file has the recorded size."""
    indexed = {}
    try:
        indexed = {r["file"]: r for r in json.loads((out_dir / INDEX).read_text())["shards"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    done = {}
    for k in range(n):
        bin_name, rec_name = _names(k)
        try:
            rec = json.loads((out_dir / rec_name).read_text()) if (out_dir / rec_name).exists() else indexed[bin_name]
            if (out_dir / bin_name).stat().st_size == rec["bytes"]:
                done[k] = rec
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return done


# ------------------------------------------------------------------ the worker processes

_WORKER: dict = {}


def _init_worker(tok_path: str, text_field: str, dtype: str, queue) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the pool spreads over the cores
    from tokenizers import Tokenizer

    from teratrain.data.tokenizer import EOT

    tok = Tokenizer.from_file(tok_path)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # ids without character offsets, where there
    _WORKER.update(encode=encode, eot=tok.token_to_id(EOT), field=text_field, dtype=np.dtype(dtype), queue=queue)


def _encode_shard(out_dir: str, k: int, parts: list[Part]) -> dict:
    """Encode shard k (EOT after each document), write it atomically, then its record."""
    w = _WORKER
    eot = [] if w["eot"] is None else [w["eot"]]
    arrays, docs, sent = [], 0, [0.0, 0, time.monotonic()]  # bytes and tokens reported, last report time

    def report(done_bytes: float, force: bool = False) -> None:
        if force or time.monotonic() - sent[2] > 0.5:
            tokens = sum(len(a) for a in arrays)
            w["queue"].put((done_bytes - sent[0], tokens - sent[1]))
            sent[:] = [done_bytes, tokens, time.monotonic()]

    base = 0
    for part in parts:
        batch = []
        for doc in documents(part, w["field"], lambda f, b=base, n=part.nbytes: report(b + f * n)):
            batch.append(doc)
            if len(batch) == ENCODE_BATCH:
                arrays += [np.asarray(e.ids + eot, dtype=w["dtype"]) for e in w["encode"](batch)]
                docs, batch = docs + len(batch), []
        if batch:
            arrays += [np.asarray(e.ids + eot, dtype=w["dtype"]) for e in w["encode"](batch)]
            docs += len(batch)
        base += part.nbytes
    data = np.concatenate(arrays) if arrays else np.empty(0, dtype=w["dtype"])
    bin_name, rec_name = _names(k)
    path = Path(out_dir) / bin_name
    tmp = path.with_name(f".{bin_name}.tmp-{os.getpid()}")
    data.tofile(tmp)
    fsync_file(tmp)
    os.replace(tmp, path)
    rec = {"file": bin_name, "tokens": int(len(data)), "documents": docs, "bytes": int(data.nbytes),
           "sha256": _sha256(data.tobytes())}
    atomic_write_bytes(Path(out_dir) / rec_name, json.dumps(rec).encode())
    report(base, force=True)
    return rec


def _run_pool(out_dir: Path, shards: list[list[Part]], todo: list[int], tok_path: Path, text_field: str,
              dtype: str, workers: int, show: bool) -> int:
    """Encode shards `todo` on `workers` processes with a progress line; returns the tokens written."""
    if not todo:
        return 0
    ctx = multiprocessing.get_context("spawn")  # no fork of a process whose tokenizer threads have run
    queue = ctx.Queue()
    bar = _Bar(sum(p.nbytes for k in todo for p in shards[k]), show)
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)  # workers start deaf to Ctrl-C: this process stops them
    try:
        pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                   initargs=(str(tok_path), text_field, dtype, queue))
        pending = {pool.submit(_encode_shard, str(out_dir), k, shards[k]) for k in todo}
    finally:
        signal.signal(signal.SIGINT, handler)
    try:
        while pending:
            _drain(queue, bar, wait_s=0.2)
            for job in [j for j in pending if j.done()]:
                job.result()  # a worker's DataError is raised here, in one sentence
                pending.remove(job)
        _drain(queue, bar, wait_s=0.0)
    except BaseException:  # an error or a stop: end the workers now (written shards stay, whole)
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in multiprocessing.active_children():
            proc.terminate()
        raise
    finally:
        bar.close()
    pool.shutdown()
    return bar.tokens


def _drain(queue, bar: "_Bar", wait_s: float) -> None:
    import queue as queue_mod

    try:
        bar.update(*queue.get(timeout=wait_s) if wait_s else queue.get_nowait())
        while True:
            bar.update(*queue.get_nowait())
    except queue_mod.Empty:
        pass


class _Bar:
    """Input bytes done, tokens/s and ETA: a tqdm bar on a terminal, else a line every 10 s."""

    def __init__(self, total_bytes: int, show: bool):
        self.total, self.done, self.tokens, self.t0, self.said = total_bytes, 0.0, 0, time.perf_counter(), 0.0
        self.show, self.bar, self.said_done = show, None, 0.0
        if show and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenize", dynamic_ncols=True)

    def update(self, nbytes: float, tokens: int) -> None:
        self.done += nbytes
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.update(nbytes)
            self.bar.set_postfix(tok_s=f"{rate:,.0f}", tokens=f"{self.tokens:,}", refresh=False)
        elif self.show and time.perf_counter() - self.said >= 10:
            self._line(rate)

    def _line(self, rate: float) -> None:
        self.said, self.said_done = time.perf_counter(), self.done
        eta = (self.said - self.t0) / max(self.done, 1) * (self.total - self.done)
        mb = self.total / 1e6
        print(f"tokenize: {100 * self.done / max(self.total, 1):.0f}% of {mb:,.{0 if mb >= 10 else 2}f} MB | "
              f"{self.tokens:,} tokens | {rate:,.0f} tokens/s | eta {eta:,.0f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.show and self.done != self.said_done:  # where it ended, not 10 s before
            self._line(self.tokens / max(time.perf_counter() - self.t0, 1e-9))


def _write_index(out_dir: Path, src: str, plan: dict, shards: list[list[Part]], done: dict[int, dict]) -> dict:
    """index.json from the shard records (then dropped: the index holds them); returns it."""
    root = Path(src).expanduser().resolve()
    records = []
    for k, parts in enumerate(shards):
        rec = done[k]
        records.append({**{key: rec[key] for key in ("file", "tokens", "documents", "bytes", "sha256")},
                        "parts": [{**p.to_json(), "path": _relative(p.path, root)} for p in parts]})
    index = {"format": FORMAT, "dtype": plan["dtype"], "vocab_size": plan["vocab_size"],
             "tokenizer_sha256": plan["tokenizer_sha256"], "source": plan["source"], "text_field": plan["text_field"],
             "tokens": sum(r["tokens"] for r in records), "documents": sum(r["documents"] for r in records),
             "shards": records}
    atomic_write_bytes(out_dir / INDEX, json.dumps(index, indent=1).encode())
    for k in range(len(shards)):
        (out_dir / _names(k)[1]).unlink(missing_ok=True)
    for stale in out_dir.glob(".shard_*.tmp-*"):  # a worker's file cut short by an interrupt
        stale.unlink(missing_ok=True)
    return index


def _relative(path: str, root: Path) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(root)) if p != root and p.is_relative_to(root) else p.name

