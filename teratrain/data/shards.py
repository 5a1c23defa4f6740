"""A folder written by `teratrain tokenize`, read as one token stream.

    DIR/index.json          format, dtype, vocabulary size, the tokenizer's sha256, the source, and per
                            shard: file, tokens, documents, bytes, sha256, the parts of the source it holds
    DIR/tokenizer.json      the tokenizer every shard was encoded with
    DIR/shard_00000.bin     token ids back to back (EOT after each document), numpy dtype of the index

The stream is the shards end to end, the same tokens start-up tokenization of the same corpus gives
(tokens of one document never straddle two shards). Shards are memory-mapped when first read and
at most `MAX_OPEN` stay mapped at once (each holds a file descriptor), so a corpus of thousands of
shards opens in milliseconds and costs what a step reads.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from pathlib import Path

import numpy as np

from teratrain.data.errors import DataError

FORMAT = "teratrain-tokens/1"
INDEX = "index.json"
PLAN = "plan.json"
MAX_OPEN = 256


def is_tokenized(path: Path) -> bool:
    """A `teratrain tokenize` output folder (finished or not)."""
    return path.is_dir() and ((path / INDEX).is_file() or (path / PLAN).is_file())


def read_index(folder: Path) -> dict:
    if not (folder / INDEX).is_file():
        raise DataError(f"'{folder}' is an unfinished teratrain tokenize output (no {INDEX}); run the same "
                        "teratrain tokenize command again to finish it.")
    try:
        index = json.loads((folder / INDEX).read_text())
        ok = index.get("format") == FORMAT and isinstance(index.get("shards"), list)
    except (OSError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise DataError(f"{folder / INDEX} is not a teratrain tokenize index ({FORMAT}); run teratrain tokenize "
                        "again into an empty --out folder.")
    return index


class ShardedTokens:
    """Tokens [lo, hi) of the stream of shard files `paths` (`sizes` tokens each). Slicing with a step
    of 1 gives another ShardedTokens (a view: nothing is read); np.asarray reads the tokens."""

    def __init__(self, paths: list[Path], sizes: list[int], dtype: np.dtype, lo: int = 0, hi: int | None = None,
                 _maps: OrderedDict | None = None):
        self.paths, self.sizes, self.dtype = list(paths), np.asarray(sizes, dtype=np.int64), np.dtype(dtype)
        self.ends = np.cumsum(self.sizes)  # (n_shards,) global end offset of each shard
        self.begins = self.ends - self.sizes
        self.lo, self.hi = lo, int(self.ends[-1]) if hi is None else hi
        self._maps = OrderedDict() if _maps is None else _maps  # shared by views: one mapping per shard

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("ShardedTokens supports contiguous slices only")
        a, b, _ = key.indices(len(self))
        return ShardedTokens(self.paths, self.sizes, self.dtype, self.lo + a, self.lo + max(a, b), self._maps)

    def __array__(self, dtype=None, copy=None):
        out = self._read(self.lo, self.hi)
        return out if dtype is None else out.astype(dtype)

    def windows(self, starts: np.ndarray, width: int) -> np.ndarray:
        """(len(starts), width) tokens: row i is tokens [starts[i], starts[i] + width) of this view."""
        g = np.asarray(starts, dtype=np.int64) + self.lo
        shard = np.searchsorted(self.ends, g, side="right")  # the shard each window starts in
        local, fits = g - self.begins[shard], g + width <= self.ends[shard]
        out = np.empty((len(g), width), dtype=self.dtype)
        maps = self._maps
        for i, (k, s, whole) in enumerate(zip(shard.tolist(), local.tolist(), fits.tolist())):
            if whole:
                m = maps.get(k)
                out[i] = (self._map(k) if m is None else m)[s:s + width]
            else:  # crosses into the next shard(s)
                out[i] = self._read(int(g[i]), int(g[i]) + width)
        return out

    def _read(self, a: int, b: int) -> np.ndarray:
        """Global tokens [a, b) as one array (a copy)."""
        parts = []
        k = int(np.searchsorted(self.ends, a, side="right"))
        while a < b:
            s = a - int(self.begins[k])
            n = min(b - a, int(self.sizes[k]) - s)
            if n > 0:
                parts.append(self._map(k)[s:s + n])
            a, k = a + max(n, 0), k + 1
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.dtype)

    def _map(self, k: int) -> np.ndarray:
        """Shard k, mapped now if it is not. The oldest mapping is dropped past MAX_OPEN (first in,
        first out: cheaper per read than keeping the order of use, and as good for uniform reads)."""
        m = self._maps.get(k)
        if m is None:
            # a plain ndarray over the mapping (which it keeps alive): slicing it skips np.memmap's per-slice work
            m = np.memmap(self.paths[k], dtype=self.dtype, mode="r", shape=(int(self.sizes[k]),)).view(np.ndarray)
            self._maps[k] = m
            if len(self._maps) > MAX_OPEN:  # unmapped (its descriptor closed) once no reference is left
                self._maps.popitem(last=False)
        return m


def open_tokenized(folder: Path, vocab_size: int, tokenizer: str | None) -> tuple[ShardedTokens, Path]:
    """The stream of a tokenized folder (shard sizes checked against the index) and its tokenizer.json."""
    index = read_index(folder)
    dtype = np.dtype(index["dtype"])
    if index["vocab_size"] > vocab_size:
        raise DataError(f"'{folder}' was tokenized with a {index['vocab_size']}-token tokenizer but model.vocab_size "
                        f"is {vocab_size}; set model.vocab_size >= {index['vocab_size']}.")
    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file():
        raise DataError(f"'{folder}' has no tokenizer.json, which teratrain tokenize writes beside its shards; put "
                        "back the tokenizer it was encoded with, or run teratrain tokenize again.")
    if index.get("tokenizer_sha256") not in (None, hashlib.sha256(tok_path.read_bytes()).hexdigest()):
        raise DataError(f"'{tok_path}' is not the tokenizer '{folder}' was encoded with (its sha256 differs from "
                        "index.json's); put back that tokenizer, or run teratrain tokenize again.")
    if tokenizer and Path(tokenizer).expanduser().read_bytes() != tok_path.read_bytes():
        raise DataError(f"data.tokenizer '{tokenizer}' is not the tokenizer '{folder}' was encoded with; leave "
                        "data.tokenizer unset (the folder's tokenizer.json is used).")
    paths, sizes = [], []
    for shard in index["shards"]:
        if not shard["tokens"]:
            continue
        p = folder / shard["file"]
        size = p.stat().st_size if p.is_file() else -1
        if size != shard["tokens"] * dtype.itemsize:
            what = "missing" if size < 0 else f"{size} bytes, not the {shard['tokens'] * dtype.itemsize} indexed"
            raise DataError(f"shard {p} is {what}; run the teratrain tokenize command that wrote '{folder}' again "
                            "to rewrite it.")
        paths.append(p)
        sizes.append(shard["tokens"])
    if not paths:
        raise DataError(f"'{folder}' holds no tokens; tokenize a corpus with documents into it.")
    return ShardedTokens(paths, sizes, dtype), tok_path


def gather(tokens, starts: np.ndarray, width: int) -> np.ndarray:
    """(len(starts), width) windows of a token array or a ShardedTokens."""
    if isinstance(tokens, ShardedTokens):
        return tokens.windows(starts, width)
    return np.stack([tokens[s:s + width] for s in starts])
