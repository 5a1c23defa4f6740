"""Data at scale on the CPU: `teratrain tokenize` on N worker processes against one, and the loader's
per-step host time reading 100 token shards against one token file.

    python bench/data.py --out FILE                    # 1 GB of JSON lines, workers 1 and 2
    python bench/data.py --corpus-mb 256 --workers 1,2,2,1 --out FILE   # each count twice, in ABBA order
    python bench/data.py --format parquet --out FILE
    python bench/data.py --smoke                       # 8 MB, seconds

Corpus: the running interpreter's standard-library sources cut into documents of ~4 KB (real text,
on every machine), repeated until --corpus-mb MB, as JSON lines (or Parquet row groups of 1,000 rows),
written under --work. The tokenizer (a byte-level BPE of --vocab-size tokens) is trained once on the
first 16 MB and given to every run, so each run times tokenization alone: the whole corpus through
`teratrain.data.tokenize.tokenize` into shards of --shard-mb MB of input, tokens/s over the wall time
of the run (worker start included). Each worker runs one tokenizer thread, so N workers use N cores.

The ratios: of the median tokens/s of each worker count, and of the best run of each (the run least
slowed by other processes: `timeit`'s rule). Beside them, each run's worker CPU seconds: tokens per CPU
second (the same for every worker count when nothing serializes the workers) and the cores the workers
kept busy (below N when other processes share the machine).

Loader: the first run's tokens written once as one .bin file and once as a 100-shard tokenized folder
(the same stream); `Batches.micro_batches` builds one data-parallel rank's step (--global-batch
sequences of --seq-len tokens, micro-batches of 8) for --loader-steps steps after 5 warm-up steps, from
the page cache (both files were just written). Printed: the median and p90 seconds per step of each
and their ratio, and the seconds to open each (`prepare`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from teratrain.config import DataConfig  # noqa: E402
from teratrain.data.formats import cpu_count  # noqa: E402
from teratrain.data.loader import Batches, prepare  # noqa: E402
from teratrain.data.tokenize import tokenize  # noqa: E402
from teratrain.data.tokenizer import train_bpe  # noqa: E402


def documents(chunk_chars: int = 4096):
    """The stdlib's .py files cut into documents of about `chunk_chars` characters, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        for i in range(0, len(text), chunk_chars):
            yield text[i:i + chunk_chars]


def write_corpus(path: Path, megabytes: float, fmt: str) -> dict:
    """Documents repeated until `megabytes` MB of input, as JSON lines or Parquet; returns its size."""
    target, written, docs = int(megabytes * 1e6), 0, 0
    if fmt == "jsonl":
        with open(path, "w") as f:
            while written < target:
                for doc in documents():
                    line = json.dumps({"text": doc}) + "\n"
                    f.write(line)
                    written, docs = written + len(line), docs + 1
                    if written >= target:
                        break
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([("text", pa.string())])
        with pq.ParquetWriter(path, schema) as w:
            rows = []
            while written < target:
                for doc in documents():
                    rows.append(doc)
                    written, docs = written + len(doc), docs + 1
                    if len(rows) == 1000 or written >= target:
                        w.write_table(pa.table({"text": rows}, schema=schema))
                        rows = []
                    if written >= target:
                        break
    return {"path": path.name, "format": fmt, "bytes": path.stat().st_size, "documents": docs}


def bench_tokenize(corpus: Path, tok: Path, work: Path, workers: list[int], shard_mb: float) -> dict:
    """One run per entry of `workers` (a count may repeat: 1,2,2,1 spreads a drifting background load
    over both counts); the ratio compares the median tokens/s of each count with the smallest's."""
    runs = []
    for i, n in enumerate(workers):
        out = work / f"tokens_{i}"
        shutil.rmtree(out, ignore_errors=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        index = tokenize(str(corpus), str(out), tokenizer=str(tok), workers=n, shard_mb=shard_mb, progress=False)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the workers, joined when the pool shut down
        cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        runs.append({"workers": index["workers"], "seconds": round(index["seconds"], 2), "tokens": index["tokens"],
                     "shards": len(index["shards"]), "tokens_per_s": round(index["tokens_per_s"]),
                     "worker_cpu_s": round(cpu_s, 1), "tokens_per_worker_cpu_s": round(index["tokens"] / cpu_s),
                     "cores_busy": round(cpu_s / index["seconds"], 2), "load_average_1m": round(os.getloadavg()[0], 2)})
        print(f"tokenize: {n} workers: {runs[-1]['tokens_per_s']:,} tokens/s, {runs[-1]['cores_busy']} cores busy",
              file=sys.stderr, flush=True)
        if i:
            shutil.rmtree(out, ignore_errors=True)
    median = {n: statistics.median(r["tokens_per_s"] for r in runs if r["workers"] == n) for n in sorted(set(workers))}
    per_cpu = {n: statistics.median(r["tokens_per_worker_cpu_s"] for r in runs if r["workers"] == n) for n in median}
    best = {n: max(r["tokens_per_s"] for r in runs if r["workers"] == n) for n in median}
    one = min(median)
    return {"runs": runs, "same_tokens": len({r["tokens"] for r in runs}) == 1,
            "median_tokens_per_s": median, "x_one": {n: round(median[n] / median[one], 3) for n in median},
            "best_tokens_per_s": best, "x_one_best": {n: round(best[n] / best[one], 3) for n in best},
            "tokens_per_worker_cpu_s_x_one": {n: round(per_cpu[n] / per_cpu[one], 3) for n in per_cpu}}


def write_shards(tokens: np.ndarray, folder: Path, n: int, vocab: int) -> None:
    """The stream as `n` shards of a tokenized folder (index.json as `teratrain tokenize` writes it)."""
    from teratrain.data.shards import FORMAT

    folder.mkdir(parents=True, exist_ok=True)
    cuts = np.linspace(0, len(tokens), n + 1).astype(np.int64)
    shards = []
    for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
        tokens[a:b].tofile(folder / f"shard_{k:05d}.bin")
        shards.append({"file": f"shard_{k:05d}.bin", "tokens": int(b - a), "documents": 0,
                       "bytes": int(b - a) * tokens.itemsize, "sha256": "", "parts": []})
    index = {"format": FORMAT, "dtype": tokens.dtype.name, "vocab_size": vocab, "tokens": len(tokens), "shards": shards}
    (folder / "index.json").write_text(json.dumps(index))


def bench_loader(tokens_dir: Path, work: Path, tok: Path, args) -> dict:
    cfg = DataConfig(path=str(tokens_dir), val_fraction=0.0)
    stream = np.asarray(prepare(cfg, args.vocab_size).train)
    one, many = work / "one.bin", work / "shards100"
    stream.tofile(one)
    shutil.rmtree(many, ignore_errors=True)
    write_shards(stream, many, 100, args.vocab_size)
    (many / "tokenizer.json").write_bytes(tok.read_bytes())
    result = {"tokens": len(stream), "global_batch": args.global_batch, "seq_len": args.seq_len, "micro_batch": 8}
    for name, path in (("one_file", one), ("shards_100", many)):
        t0 = time.perf_counter()
        data = prepare(DataConfig(path=str(path), val_fraction=0.0, tokenizer=str(tok) if name == "one_file" else None),
                       args.vocab_size)
        open_s = time.perf_counter() - t0
        batches = Batches(data.train, args.seq_len, 1234, args.global_batch)
        times = []
        for step in range(5 + args.loader_steps):
            t0 = time.perf_counter()
            list(batches.micro_batches(step, 0, 1, 8))
            times.append(time.perf_counter() - t0)
        times = times[5:]
        result[name] = {"open_s": round(open_s, 4), "step_s_median": round(statistics.median(times), 5),
                        "step_s_p90": round(float(np.percentile(times, 90)), 5)}
    ratio = result["shards_100"]["step_s_median"] / result["one_file"]["step_s_median"]
    result["shards_over_one_file"] = round(ratio, 3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus-mb", type=float, default=1000.0)
    ap.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    ap.add_argument("--workers", default="1,2", help="worker counts to time, comma-separated (may repeat)")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--shard-mb", type=float, default=32.0)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--loader-steps", type=int, default=200)
    ap.add_argument("--work", help="folder for the corpus and tokens (default: a temporary folder)")
    ap.add_argument("--smoke", action="store_true", help="8 MB, a 2,048-token BPE, 10 loader steps")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.smoke:
        args.corpus_mb, args.vocab_size, args.shard_mb, args.loader_steps = 8.0, 2048, 1.0, 10
        args.seq_len = 256
    workers = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        corpus = write_corpus(work / f"corpus.{args.format}", args.corpus_mb, args.format)
        print(f"corpus: {corpus}", file=sys.stderr, flush=True)
        tok = work / "tokenizer.json"
        t0 = time.perf_counter()
        train_bpe([work / corpus["path"]], args.vocab_size, tok, documents=_first(work / corpus["path"], 16e6))
        bpe_s = time.perf_counter() - t0
        load_before = os.getloadavg()
        tok_result = bench_tokenize(work / corpus["path"], tok, work, workers, args.shard_mb)
        load_after = os.getloadavg()
        loader = bench_loader(work / "tokens_0", work, tok, args)
    result = {"bench": "data", "corpus": corpus, "vocab_size": args.vocab_size, "bpe_train_s": round(bpe_s, 1),
              "shard_mb": args.shard_mb, "tokenize": tok_result, "loader": loader,
              "cpus": cpu_count(),
              "load_average_1m": {"before": round(load_before[0], 2), "after": round(load_after[0], 2)},
              "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
              "commit": _commit()}
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)


def _first(path: Path, nbytes: float):
    from teratrain.data.corpus import read_documents

    seen = 0
    for doc in read_documents([path]):
        yield doc
        seen += len(doc)
        if seen >= nbytes:
            return


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return ""


if __name__ == "__main__":
    main()
