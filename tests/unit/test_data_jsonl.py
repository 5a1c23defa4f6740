"""data.path accepts JSON-lines files (the format datasets ship as): each record's data.text_field is a
document, streamed and tokenized like a text file; a bad line is one sentence naming the file and line."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from teratrain.config import DataConfig
from teratrain.data.corpus import DataError, fingerprint, read_documents
from teratrain.data.loader import prepare
from teratrain.data.tokenizer import EOT

DOCS = [f"record {i}: the quick brown fox {'jumps ' * (i % 5)}over the lazy dog {i * i}" for i in range(300)]


def write_jsonl(path, docs, field="text", extra=True):
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d, **({"meta": {"x": 1}} if extra else {})}) + "\n")
            if i % 7 == 0:
                f.write("\n")  # blank lines are skipped


def test_records_are_the_documents(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", DOCS[:5], field="content")
    assert list(read_documents([tmp_path / "a.jsonl"], "content")) == DOCS[:5]


def test_a_folder_of_jsonl_and_text_tokenizes_to_the_same_tokens(tmp_path):
    """The records of a .jsonl and the same documents as text files give identical token streams."""
    (tmp_path / "j").mkdir()
    (tmp_path / "t").mkdir()
    write_jsonl(tmp_path / "j" / "part.jsonl", DOCS)
    for i, d in enumerate(DOCS):
        (tmp_path / "t" / f"{i:04d}.txt").write_text(d)
    tok = str(tmp_path / "tok.json")
    from teratrain.data.tokenizer import train_bpe

    train_bpe([tmp_path / "j" / "part.jsonl"], 300, tmp_path / "tok.json")
    a = prepare(DataConfig(path=str(tmp_path / "j"), tokenizer=tok, val_fraction=0.0, cache_dir=str(tmp_path / "c")), 300)
    b = prepare(DataConfig(path=str(tmp_path / "t"), tokenizer=tok, val_fraction=0.0, cache_dir=str(tmp_path / "c")), 300)
    assert np.array_equal(np.asarray(a.train), np.asarray(b.train))
    t = Tokenizer.from_file(tok)
    first = np.asarray(a.train)[:np.argmax(np.asarray(a.train) == t.token_to_id(EOT))]
    assert t.decode(first.tolist()) == DOCS[0]


@pytest.mark.parametrize("line, words", [("{not json", ["line 2", "not JSON"]),
                                         ('{"body": "x"}', ["line 2", "'text'", "body", "data.text_field"])])
def test_a_bad_record_is_one_sentence(tmp_path, line, words):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(DataError) as e:
        list(read_documents([tmp_path / "d.jsonl"]))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_text_field_is_part_of_the_cache_key_for_jsonl_only(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", DOCS[:3])
    (tmp_path / "d.txt").write_text("x")
    assert fingerprint([tmp_path / "d.jsonl"], "text") != fingerprint([tmp_path / "d.jsonl"], "body")
    assert fingerprint([tmp_path / "d.txt"], "text") == fingerprint([tmp_path / "d.txt"], "body")
