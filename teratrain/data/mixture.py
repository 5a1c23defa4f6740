"""A mixture of corpora: `data.sources = [{path, weight}, ...]`, samples drawn from each source in
proportion to its weight.

Which source sample j of step s comes from is a function of (seed, step, j) alone, so every layout
and every resume sees the same batches: the global sample index g = s x global_batch + j picks the
source from a Weyl sequence u_g = frac(u_0 + g x phi) (phi the golden ratio's fraction, u_0 from the
seed) cut at the cumulative weights. Its points spread evenly over [0, 1), so after N samples each
source's count is within O(log N) of weight x N (not within sqrt(N), as independent draws would be):
every batch holds the sources in proportion, and so does every run. The window inside the source is
drawn from numpy's generator seeded by (seed, step), as for one corpus.
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from teratrain.config_base import ConfigError
from teratrain.data.corpus import fingerprint, read_documents, user_files
from teratrain.data.errors import DataError
from teratrain.data.shards import gather, is_tokenized
from teratrain.data.tokenizer import train_bpe

_PHI64 = 0x9E3779B97F4A7C15  # round(2**64 x (sqrt(5) - 1) / 2): the golden-ratio step, in 64-bit fixed point
SOURCE_KEYS = ("path", "weight", "text_field")


def check_sources(value: Any) -> list[dict] | None:
    """data.sources as given in TOML or --set, checked and normalized (one sentence per mistake)."""
    if value is None:
        return None
    fix = 'write it as data.sources = [{path = "a.jsonl", weight = 0.7}, {path = "b", weight = 0.3}]'
    if not isinstance(value, list) or not value:
        raise ConfigError(f"data.sources must be a non-empty list of {{path, weight}} tables, got {value!r}; {fix}.")
    out = []
    for i, src in enumerate(value):
        key = f"data.sources[{i}]"
        if not isinstance(src, dict):
            raise ConfigError(f"{key} must be a {{path, weight}} table, got {src!r}; {fix}.")
        unknown = sorted(set(src) - set(SOURCE_KEYS))
        if unknown:
            raise ConfigError(f"{key} has unknown key(s) {', '.join(unknown)}; a source takes "
                              f"{', '.join(SOURCE_KEYS)}.")
        path, weight = src.get("path"), src.get("weight")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{key}.path must be the path of a corpus (a string), got {path!r}; give one.")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
            raise ConfigError(f"{key}.weight must be a positive number, got {weight!r}; give the source's share, "
                              "e.g. 0.3.")
        if "text_field" in src and not isinstance(src["text_field"], str):
            raise ConfigError(f"{key}.text_field must be a string, got {src['text_field']!r}; fix its value.")
        out.append({"path": path, "weight": float(weight), **({"text_field": src["text_field"]}
                                                                 if "text_field" in src else {})})
    return out


@dataclass
class Mixture:
    """Token streams (numpy arrays or ShardedTokens) and their weights."""

    streams: list
    weights: list[float]
    names: list[str]

    def __post_init__(self):
        w = np.asarray(self.weights, dtype=np.float64)
        self.cum = np.cumsum(w / w.sum())
        self.cum[-1] = 1.0

    def part(self, lo_fraction: float, hi_fraction: float) -> "Mixture":
        """Each stream's tokens [lo, hi) as fractions of its length (the train or the held-out split)."""
        cut = [(int(len(s) * lo_fraction), int(len(s) * hi_fraction)) for s in self.streams]
        return Mixture([s[a:b] for s, (a, b) in zip(self.streams, cut)], self.weights, self.names)

    def check(self, width: int, split: str) -> None:
        for name, s in zip(self.names, self.streams):
            if len(s) < width + 1:
                fix = "raise data.val_fraction or set train.eval_batches=0" if split == "val" else \
                    "add text to it or lower model.seq_len"
                raise DataError(f"the {split} split of data.sources entry '{name}' has {len(s)} tokens, too few for "
                                f"model.seq_len={width - 1}; {fix}.")

    def sources(self, seed: int, first: int, n: int) -> np.ndarray:
        """The source of global samples first .. first + n - 1: the Weyl sequence cut at the weights."""
        g = np.arange(first, first + n, dtype=np.uint64)
        u0 = np.random.default_rng([seed, 0x5EED]).integers(0, 2**64, dtype=np.uint64)
        with np.errstate(over="ignore"):  # arithmetic modulo 2**64 is the point
            u = (u0 + g * np.uint64(_PHI64)) >> np.uint64(11)  # top 53 bits: exact in a float64
        return np.searchsorted(self.cum, u.astype(np.float64) / 2.0**53, side="right")

    def windows(self, seed: int, step: int, global_batch: int, lo: int, hi: int, width: int) -> np.ndarray:
        """Samples lo..hi-1 of step's global batch, (hi - lo, width) tokens, each from its source."""
        src = self.sources(seed, step * global_batch, global_batch)
        highs = np.array([len(s) - width + 1 for s in self.streams], dtype=np.int64)
        starts = np.random.default_rng([seed, step]).integers(0, highs[src])  # the step's whole batch: pure
        out = np.empty((hi - lo, width), dtype=np.int64)
        for k, stream in enumerate(self.streams):
            rows = np.nonzero(src[lo:hi] == k)[0]
            if len(rows):
                out[rows] = gather(stream, starts[lo:hi][rows], width)
        return out


def source_config(data_cfg, src: dict, tokenizer: str | None):
    """The data config of one source, as data.path (its whole tokens: the mixture holds out its own)."""
    return data_cfg.model_copy(update={"path": src["path"], "sources": None, "tokenizer": tokenizer,
                                      "text_field": src.get("text_field", data_cfg.text_field), "val_fraction": 0.0})


def split(data_cfg, streams: list) -> tuple[Mixture, Mixture, str]:
    """The train and held-out mixtures of the sources' streams (each source's last data.val_fraction
    held out) and a description for the start-up summary."""
    names = [src["path"] for src in data_cfg.sources]
    weights = [src["weight"] for src in data_cfg.sources]
    mix, keep = Mixture(streams, weights, names), 1.0 - data_cfg.val_fraction
    shown = ", ".join(f"{n} ({w / sum(weights):.2f})" for n, w in zip(names, weights))
    return mix.part(0.0, keep), mix.part(keep, 1.0), f"mixture: {shown}"


def shared_tokenizer(data_cfg, vocab_size: int, cache: Path, builder: bool, wait) -> str | None:
    """The tokenizer every source is encoded with: the one the tokenized folders among them were
    written with (all the same), else a BPE trained on all text sources together (cached), else None
    (pre-tokenized .bin sources only)."""
    folders = [Path(s["path"]).expanduser() for s in data_cfg.sources if is_tokenized(Path(s["path"]).expanduser())]
    if folders:
        first = (folders[0] / "tokenizer.json").read_bytes()
        for other in folders[1:]:
            if (other / "tokenizer.json").read_bytes() != first:
                raise DataError(f"data.sources '{folders[0]}' and '{other}' were tokenized with different tokenizers; "
                                "tokenize every source with the same --tokenizer.")
        return str(folders[0] / "tokenizer.json")
    texts = [(user_files(s["path"], key=f"data.sources[{i}].path"), s.get("text_field", data_cfg.text_field))
             for i, s in enumerate(data_cfg.sources) if Path(s["path"]).suffix != ".bin"]
    if not texts:
        return None
    key = hashlib.sha256("|".join(fingerprint(f, field) for f, field in texts).encode()).hexdigest()[:16]
    path = cache / f"bpe-mix-{key}-{vocab_size}.json"
    if builder and not path.exists():
        n = sum(len(f) for f, _ in texts)
        print(f"teratrain: training a {vocab_size:,}-token BPE tokenizer on the {len(texts)} text sources of "
              f"data.sources ({n:,} files); cached as {path}", file=sys.stderr, flush=True)
        train_bpe([], vocab_size, path, documents=(d for f, field in texts for d in read_documents(f, field)))
    wait()
    return str(path)
