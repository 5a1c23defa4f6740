"""`teratrain tokenize`: the shards end to end are the tokens start-up tokenization gives; the index
counts documents and tokens and holds each shard's sha256 and source; an interrupted run is
continued (only missing shards written); the loader reads the shards as one stream, lazily."""

import hashlib
import json

import numpy as np
import pytest

from teratrain.config import DataConfig
from teratrain.data.corpus import DataError
from teratrain.data.loader import Batches, prepare
from teratrain.data.shards import ShardedTokens, gather
from teratrain.data.tokenize import tokenize

DOCS = [f"record {i}: {'alpha beta gamma ' * (i % 9)}delta {i * 7}" for i in range(1200)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two JSON-lines files and a text file in one folder (the text file is not read: record files are)."""
    root = tmp_path_factory.mktemp("corpus")
    for name, docs in (("a.jsonl", DOCS[:700]), ("b.jsonl", DOCS[700:])):
        (root / name).write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    return root


@pytest.fixture(scope="module")
def tokenized(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "out"
    index = tokenize(str(corpus), str(out), vocab_size=300, text_field="body", workers=2, shard_mb=0.01,
                     progress=False)
    return out, index


def start_up_tokens(corpus, out, tmp_path):
    cfg = DataConfig(path=str(corpus), tokenizer=str(out / "tokenizer.json"), text_field="body", val_fraction=0.0,
                     cache_dir=str(tmp_path))
    return np.asarray(prepare(cfg, 300).train)


def test_shards_end_to_end_are_the_start_up_tokens(corpus, tokenized, tmp_path):
    out, index = tokenized
    assert len(index["shards"]) > 4 and index["workers"] == 2
    stream = np.asarray(prepare(DataConfig(path=str(out), val_fraction=0.0), 300).train)
    assert np.array_equal(stream, start_up_tokens(corpus, out, tmp_path))


def test_the_index_counts_and_checks_every_shard(tokenized):
    out, index = tokenized
    on_disk = json.loads((out / "index.json").read_text())
    assert on_disk["documents"] == len(DOCS) == sum(s["documents"] for s in on_disk["shards"])
    assert on_disk["tokens"] == sum(s["tokens"] for s in on_disk["shards"]) == index["tokens"]
    assert on_disk["dtype"] == "uint16" and on_disk["vocab_size"] <= 300
    for shard in on_disk["shards"]:
        data = (out / shard["file"]).read_bytes()
        assert len(data) == shard["bytes"] == 2 * shard["tokens"]
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        assert {p["path"] for p in shard["parts"]} <= {"a.jsonl", "b.jsonl"}
    assert not list(out.glob("shard_*.json")), "the per-shard records are folded into the index"


def copy_of(out, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in out.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    return copy


def test_the_same_command_again_writes_only_missing_or_damaged_shards(corpus, tokenized, tmp_path):
    out, index = tokenized
    copy = copy_of(out, tmp_path)
    (copy / index["shards"][2]["file"]).unlink()  # never written
    with open(copy / index["shards"][4]["file"], "r+b") as f:  # cut short
        f.truncate(10)
    before = {f.name: f.stat().st_mtime_ns for f in copy.glob("shard_*.bin")}
    again = tokenize(str(corpus), str(copy), vocab_size=300, text_field="body", workers=2, shard_mb=0.01,
                     progress=False)
    rewritten = {f.name for f in copy.glob("shard_*.bin") if before.get(f.name) != f.stat().st_mtime_ns}
    assert rewritten == {index["shards"][2]["file"], index["shards"][4]["file"]}
    assert json.loads((copy / "index.json").read_text()) == json.loads((out / "index.json").read_text())
    assert again["tokens"] == index["tokens"]


def test_a_folder_without_its_index_is_unfinished(tokenized, tmp_path):
    out, _ = tokenized
    copy = copy_of(out, tmp_path)
    (copy / "index.json").unlink()
    with pytest.raises(DataError, match="unfinished teratrain tokenize output .* run the same teratrain tokenize"):
        prepare(DataConfig(path=str(copy)), 300)


def test_another_corpus_into_the_same_folder_is_refused(tokenized, tmp_path):
    out, _ = tokenized
    (tmp_path / "other.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match="holds the tokens of another corpus or setting .*give another --out"):
        tokenize(str(tmp_path / "other.jsonl"), str(out), text_field="body", workers=1, progress=False)


def test_a_damaged_shard_is_named_by_the_loader(tokenized, tmp_path):
    out, index = tokenized
    copy = copy_of(out, tmp_path)
    name = index["shards"][1]["file"]
    (copy / name).write_bytes((copy / name).read_bytes()[:-2])
    with pytest.raises(DataError, match=f"shard .*{name} is .* bytes, not the .* indexed; run the teratrain tokenize"):
        prepare(DataConfig(path=str(copy)), 300)


def test_a_missing_or_replaced_tokenizer_is_named_by_the_loader(tokenized, tmp_path):
    out, _ = tokenized
    copy = copy_of(out, tmp_path)
    tok = copy / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"model"', '"model" ', 1))  # the same JSON, other bytes
    with pytest.raises(DataError, match="is not the tokenizer .* was encoded with .*sha256 differs from index.json"):
        prepare(DataConfig(path=str(copy)), 300)
    tok.unlink()
    with pytest.raises(DataError, match="has no tokenizer.json, which teratrain tokenize writes beside its shards"):
        prepare(DataConfig(path=str(copy)), 300)


def test_a_vocabulary_larger_than_the_model_is_refused(tokenized):
    out, _ = tokenized
    with pytest.raises(DataError, match="set model.vocab_size >= "):
        prepare(DataConfig(path=str(out)), 100)


def test_windows_across_shard_boundaries_match_one_flat_array(tmp_path):
    flat = np.arange(1000, dtype=np.uint16)
    sizes = [7, 1, 300, 2, 690]
    paths = []
    for k, (a, b) in enumerate(zip(np.cumsum([0] + sizes[:-1]), np.cumsum(sizes))):
        flat[a:b].tofile(tmp_path / f"s{k}.bin")
        paths.append(tmp_path / f"s{k}.bin")
    sharded = ShardedTokens(paths, sizes, np.uint16)
    starts = np.array([0, 5, 6, 7, 8, 300, 305, 306, 309, 900, 1000 - 17])
    assert np.array_equal(gather(sharded, starts, 17), gather(flat, starts, 17))
    view, sub = sharded[100:900], flat[100:900]
    assert len(view) == 800 and np.array_equal(np.asarray(view), sub)
    assert np.array_equal(gather(view, starts[:-1] % 780, 17), gather(sub, starts[:-1] % 780, 17))
    b1, b2 = Batches(sharded, 16, 3, 8), Batches(flat, 16, 3, 8)
    assert all(np.array_equal(b1.get(s, 0, 8)[0], b2.get(s, 0, 8)[0]) for s in range(5))
