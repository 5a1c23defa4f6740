"""Token files and batches.

Tokens live in a flat numpy memmap (uint16 when the vocabulary fits, else uint32; a cached file has a
JSON record of its size and sha256 beside it, checked before use), or in the shards of a `teratrain
tokenize` folder read as one stream (data/shards.py); the last
`data.val_fraction` of it is held out. A batch is a pure function of (seed, global step, global sample
index): sample j of step s starts at offset `starts(s)[j]`, whatever the number of ranks, so every
parallel layout sees the same global batches and a resumed run sees the batches it would have seen.
"""

from __future__ import annotations

import itertools
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from teratrain.data.corpus import DataError, fingerprint, read_documents, stdlib_files, user_files
from teratrain.data import mixture
from teratrain.data.mixture import Mixture
from teratrain.data.shards import gather, is_tokenized, open_tokenized
from teratrain.data.tokenizer import EOT, file_digest, load_or_train
from teratrain.fsio import atomic_write_bytes, make_dir, sha256_file


@dataclass
class TokenData:
    train: np.ndarray
    val: np.ndarray
    tokenizer_path: Path | None  # None for a user's pre-tokenized .bin without a tokenizer
    source: str


def cache_dir(configured: str | None) -> Path:
    return make_dir(Path(configured).expanduser() if configured else Path.home() / ".cache" / "teratrain",
                    "data.cache_dir")


def prepare(data_cfg, vocab_size: int, builder: bool = True, wait: Callable[[], None] = lambda: None,
            key: str = "data.path") -> TokenData:
    """Tokenize the corpus once (cached), then memory-map it. With several processes, `builder` is
    true on one per machine and `wait` is a barrier the others pass once the files exist. `key`: the
    setting that named data_cfg.path, as sentences about it say (a mixture's data.sources[i].path)."""
    cache = cache_dir(data_cfg.cache_dir)
    if data_cfg.sources:  # a mixture: each source prepared as data.path, all with one tokenizer
        tok_path = data_cfg.tokenizer or mixture.shared_tokenizer(data_cfg, vocab_size, cache, builder, wait)
        streams = [prepare(mixture.source_config(data_cfg, src, tok_path), vocab_size, builder, wait,
                           f"data.sources[{i}].path").train for i, src in enumerate(data_cfg.sources)]
        train, val, source = mixture.split(data_cfg, streams)
        return TokenData(train, val, Path(tok_path).expanduser() if tok_path else None, source)
    path = data_cfg.path
    if path and is_tokenized(Path(path).expanduser()):  # a `teratrain tokenize` folder: shards read lazily
        tokens, tok_path = open_tokenized(Path(path).expanduser(), vocab_size, data_cfg.tokenizer)
        source = path
    elif path and Path(path).suffix == ".bin":
        tokens, tok_path, source = _open_bin(Path(path).expanduser(), vocab_size, key), data_cfg.tokenizer, path
    else:
        files, field = (user_files(path, key) if path else stdlib_files()), data_cfg.text_field
        source = path or f"python {sys.version_info.major}.{sys.version_info.minor} standard library ({len(files)} files)"
        if builder:  # train the tokenizer and encode once; the cache makes later calls cheap
            tok, tok_path = load_or_train(files, vocab_size, cache, data_cfg.tokenizer, field)
            bin_path = _bin_path(cache, tok_path, files, field)
            if not _cache_intact(bin_path):
                _say(f"tokenizing {len(files):,} files ({_mb(files)}) into {bin_path}")
                _encode_to_bin(files, tok, bin_path, vocab_size, field)
        wait()
        _, tok_path = load_or_train(files, vocab_size, cache, data_cfg.tokenizer, field)
        bin_path = _bin_path(cache, tok_path, files, field)
        tokens = np.memmap(bin_path, dtype=_dtype(vocab_size), mode="r")
    n_val = int(len(tokens) * data_cfg.val_fraction)
    return TokenData(train=tokens[:len(tokens) - n_val], val=tokens[len(tokens) - n_val:],
                     tokenizer_path=Path(tok_path) if tok_path else None, source=source)


def _say(text: str) -> None:
    print(f"teratrain: {text}", file=sys.stderr, flush=True)


def _mb(files: list[Path]) -> str:
    from teratrain.data.formats import size_hint

    return size_hint(files)


def _bin_path(cache: Path, tok_path: Path, files: list[Path], text_field: str) -> Path:
    return cache / f"tokens-{file_digest(tok_path)}-{fingerprint(files, text_field)}.bin"


def _dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _cache_intact(bin_path: Path) -> bool:
    """Whether a cached token file is the one written: its size, and its sha256 unless its mtime is the
    one recorded (a truncated or overwritten file is rebuilt, never silently trained on)."""
    side = bin_path.with_suffix(".json")
    if not bin_path.exists() or not side.exists():  # never built, or built before records were kept
        return False
    try:
        rec = json.loads(side.read_text())
        st = bin_path.stat()
        unchanged = st.st_mtime_ns == rec["mtime_ns"] or sha256_file(bin_path) == rec["sha256"]
        ok = st.st_size == rec["bytes"] and unchanged
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        _say(f"warning: the token cache {bin_path} does not match its record (truncated or changed); rebuilding it")
    return ok


def _encode_to_bin(files: list[Path], tok, out: Path, vocab_size: int, text_field: str, chunk: int = 256) -> None:
    """Encode documents as they are read, in batches (the tokenizer runs them in parallel), EOT after
    each one: only the tokens are held, never the whole text; then record the file's size and digest
    beside it (`_cache_intact`)."""
    eot = tok.token_to_id(EOT)
    parts: list[np.ndarray] = []
    docs = iter(read_documents(files, text_field))
    while batch := list(itertools.islice(docs, chunk)):
        for enc in tok.encode_batch(batch):
            ids = enc.ids + ([eot] if eot is not None else [])
            parts.append(np.asarray(ids, dtype=_dtype(vocab_size)))
    data = np.concatenate(parts).tobytes()
    atomic_write_bytes(out, data)
    rec = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "mtime_ns": out.stat().st_mtime_ns}
    atomic_write_bytes(out.with_suffix(".json"), json.dumps(rec).encode())


def _open_bin(path: Path, vocab_size: int, key: str = "data.path") -> np.ndarray:
    """A user's pre-tokenized file (the value of `key`): token ids back to back, dtype from the `<name>.json`
    sidecar ({"dtype": "uint16"}) when there is one, else uint16 (what nanoGPT-style scripts write)."""
    if not path.is_file():
        raise DataError(f"{key} '{path}' does not exist; give a pre-tokenized .bin file or a text folder.")
    side = path.with_suffix(".json")
    if side.exists():
        try:
            dtype = np.dtype(json.loads(side.read_text())["dtype"])
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{side} should be JSON like {{\"dtype\": \"uint16\"}} ({e}); fix it or delete "
                            "it.") from None
    elif vocab_size <= 2**16:
        dtype = np.dtype(np.uint16)
    else:
        raise DataError(f"{key} '{path}' has no {side.name} to say its dtype, and model.vocab_size {vocab_size} "
                        f"does not fit uint16; write {side.name} with {{\"dtype\": \"uint32\"}} beside it.")
    if os.path.getsize(path) == 0:
        raise DataError(f"{key} '{path}' is empty; write the token ids into it (e.g. "
                        f"np.array(ids, dtype=np.{dtype.name}).tofile(...)) or point {key} at another file.")
    if os.path.getsize(path) % dtype.itemsize:
        raise DataError(f"{key} '{path}' is not a whole number of {dtype.name} tokens; write it with numpy "
                        f"as {dtype.name} or give its dtype in {side.name}.")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise DataError(f"{key} '{path}' holds token id {int(tokens.max())} >= model.vocab_size {vocab_size}; "
                        "raise model.vocab_size.")
    return tokens


class Batches:
    """(x, y) batches of `seq_len` tokens at pseudo-random offsets of one split."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, global_batch: int, split: str = "train"):
        if isinstance(tokens, Mixture):
            tokens.check(seq_len + 1, split)
        elif len(tokens) < seq_len + 2:
            fix = "raise data.val_fraction or set train.eval_batches=0" if split == "val" else "add text or lower model.seq_len"
            raise DataError(f"the {split} split has {len(tokens)} tokens, too few for model.seq_len={seq_len}; {fix}.")
        self.tokens, self.seq_len, self.seed, self.global_batch = tokens, seq_len, seed, global_batch

    def starts(self, step: int) -> np.ndarray:
        """Offsets of the step's global batch: a pure function of (seed, step)."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.global_batch)

    def get(self, step: int, lo: int, hi: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Samples lo..hi-1 of step's global batch as (x, y), each (hi-lo, seq_len) int64."""
        T = self.seq_len
        if isinstance(self.tokens, Mixture):
            rows = self.tokens.windows(self.seed, step, self.global_batch, lo, hi, T + 1)
        else:
            rows = gather(self.tokens, self.starts(step)[lo:hi], T + 1).astype(np.int64)
        t = torch.from_numpy(rows)
        if torch.device(device).type == "cuda":
            t = t.pin_memory().to(device, non_blocking=True)
        return t[:, :-1], t[:, 1:]

    def micro_batches(self, step: int, dp_rank: int, dp: int, micro_batch: int, device="cpu"):
        """This rank's share of the step's global batch, `micro_batch` samples at a time.
        Rank r owns samples [r*B/dp, (r+1)*B/dp); gradient accumulation walks them in order."""
        per_rank = self.global_batch // dp
        base = dp_rank * per_rank
        for lo in range(base, base + per_rank, micro_batch):
            yield self.get(step, lo, lo + micro_batch, device)
