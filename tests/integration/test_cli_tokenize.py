"""`teratrain tokenize` then `teratrain train --set data.path=DIR`; a mixture of a tokenized folder
and a .bin file resumes bitwise; bad input is one sentence."""

import json

import numpy as np
import pytest

from tests.integration.runner import assert_user_error, metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenized(cli, tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "range", "print", "x", "y"]
    with open(root / "corpus.jsonl", "w") as f:
        for i in range(3000):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=rng.integers(5, 60)))}) + "\n")
    proc = cli("tokenize", root / "corpus.jsonl", "--out", root / "out", "--vocab-size", 512, "--workers", 2,
               "--shard-mb", 0.05)
    assert "done: " in proc.stdout and "shards" in proc.stdout and "tokens/s on 2 workers" in proc.stdout
    assert "training a 512-token BPE tokenizer" in proc.stderr
    return root


def test_training_reads_the_shards_and_keeps_their_tokenizer(cli, tokenized, tmp_path):
    """The shards' stream equals start-up tokenization's (tests/unit/test_data_tokenize.py); here the CLI
    trains on them and copies their tokenizer into the run."""
    out = tokenized / "out"
    assert len(json.loads((out / "index.json").read_text())["shards"]) > 3
    cli.train(tmp_path / "a", f'data.path="{out}"', steps=2)
    assert [r["step"] for r in metrics(tmp_path / "a")] == [1, 2]
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()


def test_a_mixture_resumes_bitwise(cli, tokenized, tmp_path):
    ids = np.random.default_rng(1).integers(0, 512, size=30_000).astype(np.uint16)
    ids.tofile(tmp_path / "noise.bin")
    sources = (f'data.sources=[{{path="{tokenized / "out"}", weight=0.7}}, '
               f'{{path="{tmp_path / "noise.bin"}", weight=0.3}}]')
    sets = [sources, "optim.schedule=constant", "optim.warmup_steps=2", "train.eval_batches=1"]
    cli.train(tmp_path / "straight", *sets, steps=4)
    cli.train(tmp_path / "resumed", *sets, steps=2)
    cli.train(tmp_path / "resumed", *sets, steps=4, resume=True)
    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


def test_a_missing_source_is_one_sentence(cli, tmp_path):
    proc = cli("tokenize", tmp_path / "nope.jsonl", "--out", tmp_path / "out", expect_rc=None, in_process=True)
    assert_user_error(proc, "SRC", "nope.jsonl", "does not exist")
    proc = cli("tokenize", tmp_path, "--out", tmp_path / "out", "--workers", 0, expect_rc=None, in_process=True)
    assert_user_error(proc, "--workers must be at least 1")


def test_a_missing_tokenizer_or_an_unwritable_out_is_one_sentence(cli, tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text('{"text": "hello world"}\n')
    for given, why in ((tmp_path / "nope.json", "No such file"), (tmp_path, "Is a directory")):
        proc = cli("tokenize", src, "--out", tmp_path / "out", "--tokenizer", given, expect_rc=None, in_process=True)
        assert_user_error(proc, "--tokenizer", why)
        assert not (tmp_path / "out").exists(), "a refused tokenizer must not leave an empty --out behind"
    (tmp_path / "a_file").write_text("")
    proc = cli("tokenize", src, "--out", tmp_path / "a_file" / "out", expect_rc=None, in_process=True)
    assert_user_error(proc, "cannot create", "--out")
