"""Data input through the CLI: pre-tokenized .bin files, a corrupt cache, binary files, the messages
while the tokenizer trains and the corpus is tokenized, no run directory left by a rejected corpus.

A private cache and a small corpus (60 standard-library modules, a 512-token BPE) keep the
tokenizer-training cases to a few seconds."""

import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from tests.integration.runner import assert_user_error, metrics

SMALL = ["model.vocab_size=512", "train.eval_batches=0", "data.val_fraction=0.0"]


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]:
        shutil.copy(f, folder / f.name)
    return folder


def private(cli, tmp_path, *sets):
    return [f"data.cache_dir=\"{tmp_path / 'cache'}\"", *sets]


@pytest.mark.slow
def test_bin_without_sidecar_trains_as_uint16(cli, tmp_path):
    """What nanoGPT-style scripts write: uint16 token ids back to back, no sidecar."""
    tokens = np.random.default_rng(0).integers(0, 4096, size=20_000, dtype=np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    run = tmp_path / "run"
    cli.train(run, f"data.path=\"{tmp_path / 'train.bin'}\"", "train.eval_batches=0", steps=2)
    assert [r["step"] for r in metrics(run)] == [1, 2]
    assert abs(metrics(run)[0]["loss"] - np.log(4096)) < 0.15


def test_bin_without_sidecar_for_a_vocabulary_beyond_uint16(cli, tmp_path):
    np.arange(1000, dtype=np.uint32).tofile(tmp_path / "big.bin")
    proc = cli.train(tmp_path / "run", f"data.path=\"{tmp_path / 'big.bin'}\"", "model.vocab_size=70000", steps=1,
                     expect_rc=None, in_process=True)
    assert_user_error(proc, "big.json", "uint32")


def test_binary_file_is_not_text(cli, tmp_path):
    blob = tmp_path / "weights.safetensors"
    blob.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + bytes(range(256)) * 64)
    proc = cli.train(tmp_path / "run", f"data.path=\"{blob}\"", steps=1, expect_rc=None, in_process=True)
    assert_user_error(proc, "weights.safetensors", "binary")


@pytest.mark.long
@pytest.mark.slow
def test_messages_and_a_corrupt_cache_rebuilt(cli, tmp_path, corpus):
    """The first run says it trains a tokenizer and tokenizes; a truncated token cache (of even size,
    so still whole uint16 tokens) and a garbled tokenizer cache are rebuilt, and train exactly as before."""
    sets = private(cli, tmp_path, f"data.path=\"{corpus}\"", *SMALL)
    first = cli.train(tmp_path / "a", *sets, steps=1)
    assert "training a 512-token BPE tokenizer on 60 files" in first.stderr
    assert "tokenizing 60 files" in first.stderr

    cache = tmp_path / "cache"
    (bin_file,) = cache.glob("tokens-*.bin")
    size = bin_file.stat().st_size
    with open(bin_file, "r+b") as f:
        f.truncate(size // 20 * 2)
    second = cli.train(tmp_path / "b", *sets, steps=1)
    assert "token cache" in second.stderr and "rebuilding" in second.stderr
    assert bin_file.stat().st_size == size
    assert metrics(tmp_path / "b")[0]["loss"] == metrics(tmp_path / "a")[0]["loss"]

    (tok,) = cache.glob("bpe-*.json")
    tok.write_text(tok.read_text()[:1000])
    third = cli.train(tmp_path / "c", *sets, steps=1)
    assert "cached tokenizer" in third.stderr and "unreadable" in third.stderr and "Traceback" not in third.stderr
    assert metrics(tmp_path / "c")[0]["loss"] == metrics(tmp_path / "a")[0]["loss"]  # the same BPE again


@pytest.mark.slow
def test_a_rejected_corpus_leaves_no_run_directory(cli, tmp_path):
    """The default run directory is made before the data is read; a corpus too small to train on must
    not leave it behind, empty but for the config."""
    small = tmp_path / "small.txt"
    small.write_text("a few words only\n")
    proc = cli.train(None, *private(cli, tmp_path, f"data.path=\"{small}\"", "model.vocab_size=300"), steps=1,
                     cwd=tmp_path, expect_rc=None)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("teratrain: error: the train split has") and "too few" in proc.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())

