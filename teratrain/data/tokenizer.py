"""Byte-level BPE (HF `tokenizers`) trained on the corpus and cached, or loaded from tokenizer.json.

A BPE starts from the 256 bytes and adds an end-of-text token, so it needs model.vocab_size >= 257. A
vocabulary of exactly 256 gets the byte tokenizer instead (token id = byte value, no end-of-text
token: documents follow one another directly); a smaller one needs a tokenizer of its own or
pre-tokenized ids.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from teratrain.data.corpus import DataError, fingerprint, read_documents
from teratrain.fsio import atomic_write_bytes

EOT = "<|endoftext|>"
BYTES = 256  # a byte-level vocabulary's alphabet


def train_bpe(files: list[Path], vocab_size: int, out: Path, text_field: str = "text",
              documents=None) -> Tokenizer:
    """Train a byte-level BPE of at most `vocab_size` entries (EOT included) on `documents` (default: all
    of `files`) and save it to `out`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(read_documents(files, text_field) if documents is None else documents, trainer)
    atomic_write_bytes(out, tok.to_str().encode())
    return tok


def load_or_train(files: list[Path], vocab_size: int, cache: Path, given: str | None,
                  text_field: str = "text") -> tuple[Tokenizer, Path]:
    """The tokenizer to use and the path of its json. A given file wins; else a cached or fresh BPE."""
    if given:
        path = Path(given).expanduser()
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise DataError(f"data.tokenizer '{given}' could not be loaded ({e}); give a tokenizer.json saved by HF tokenizers.") from None
    elif vocab_size <= BYTES:
        path = cache / "bytes-256.json"
        tok = _byte_tokenizer(vocab_size, path)
    else:
        path = cache / f"bpe-{fingerprint(files, text_field)}-{vocab_size}.json"
        tok = _load_cached(path)
        if tok is None:
            from teratrain.data.formats import size_hint

            print(f"teratrain: training a {vocab_size:,}-token BPE tokenizer on {len(files):,} files "
                  f"({size_hint(files)}); "
                  f"cached as {path}", file=sys.stderr, flush=True)
            tok = train_bpe(files, vocab_size, path, text_field)
    if tok.get_vocab_size() > vocab_size:
        raise DataError(f"the tokenizer has {tok.get_vocab_size()} tokens but model.vocab_size is {vocab_size}; "
                        f"set model.vocab_size >= {tok.get_vocab_size()}.")
    return tok, path


def _byte_tokenizer(vocab_size: int, path: Path) -> Tokenizer:
    """The 256-token byte tokenizer (cached at `path`); a smaller vocabulary is refused."""
    if vocab_size < BYTES:
        raise DataError(f"model.vocab_size={vocab_size} cannot hold the {BYTES} bytes a tokenizer of text starts "
                        f"from; give data.tokenizer a tokenizer.json of at most {vocab_size} tokens, or token ids in "
                        "a .bin file as data.path.")
    tok = _load_cached(path)
    if tok is None:
        chars = _byte_chars()  # the characters ByteLevel maps bytes to, so id = byte value
        tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(BYTES)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        atomic_write_bytes(path, tok.to_str().encode())
    return tok


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (Radford et al. 2019: bytes_to_unicode of its released encoder),
    which the ByteLevel pre-tokenizer applies: printable bytes stand for themselves, the others for
    the characters from 256 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # "!".."~", "¡".."¬", "®".."ÿ"
    others = [b for b in range(BYTES) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(BYTES + i) for i, b in enumerate(others)}}


def _load_cached(path: Path) -> Tokenizer | None:
    """A cached tokenizer, or None when there is none or it is unreadable (then it is trained again)."""
    if not path.exists():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad files
        print(f"teratrain: warning: the cached tokenizer {path} is unreadable ({str(e)[:80]}); training it again",
              file=sys.stderr, flush=True)
        return None


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
