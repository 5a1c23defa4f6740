"""data.path reads the formats datasets ship: Parquet files and folders written by Hugging Face
`datasets` (save_to_disk; one Arrow file), the text in data.text_field; the same documents give the
same tokens in every format; a part of a file read alone gives its share of the documents."""

import json
import sys

import numpy as np
import pytest

from teratrain.config import DataConfig
from teratrain.data.corpus import DataError, read_documents, user_files
from teratrain.data.formats import Part, documents, split
from teratrain.data.loader import prepare
from teratrain.data.tokenizer import train_bpe

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

DOCS = [f"doc {i}: {'lorem ipsum ' * (i % 7)}dolor {i * 31}\nsit amet" for i in range(400)]


def write_parquet(path, docs, field="content", row_group_size=50):
    table = pa.table({"id": list(range(len(docs))), field: docs})
    pq.write_table(table, path, row_group_size=row_group_size)


def write_jsonl(path, docs, field="content"):
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))


@pytest.fixture
def formats(tmp_path):
    """The same documents as JSON lines, Parquet, a datasets folder, a DatasetDict and one Arrow file."""
    write_jsonl(tmp_path / "d.jsonl", DOCS)
    write_parquet(tmp_path / "d.parquet", DOCS)
    ds = datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "content": DOCS})
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(tmp_path / "dd"))
    (arrow,) = (tmp_path / "ds").glob("data-00000-*.arrow")
    return tmp_path, arrow


@pytest.mark.parametrize("name", ["d.jsonl", "d.parquet", "ds", "dd"])
def test_every_format_reads_the_same_documents(formats, name):
    root, _ = formats
    files = user_files(str(root / name))
    assert list(read_documents(files, "content")) == DOCS


def test_one_arrow_file_of_a_datasets_folder(formats):
    _, arrow = formats
    got = list(read_documents(user_files(str(arrow)), "content"))
    assert got == DOCS[:len(got)] and 0 < len(got) < len(DOCS)


@pytest.mark.parametrize("name, target", [("d.jsonl", 5000), ("d.jsonl", 777), ("d.parquet", 5000), ("ds", 9000)])
def test_parts_in_order_are_the_whole_input(formats, name, target):
    root, _ = formats
    parts = split(root / name, target)
    assert len(parts) > 2
    assert [d for p in parts for d in documents(p, "content")] == DOCS


def test_the_same_documents_tokenize_the_same_in_every_format(formats, tmp_path):
    root, _ = formats
    train_bpe([root / "d.jsonl"], 300, tmp_path / "tok.json", "content")
    streams = []
    for name in ("d.jsonl", "d.parquet", "ds"):
        cfg = DataConfig(path=str(root / name), tokenizer=str(tmp_path / "tok.json"), text_field="content",
                         val_fraction=0.0, cache_dir=str(tmp_path / "cache"))
        streams.append(np.asarray(prepare(cfg, 300).train))
    assert all(np.array_equal(streams[0], s) for s in streams[1:])


def test_a_folder_of_parquet_shards_skips_its_readme(tmp_path):
    (tmp_path / "data").mkdir()
    write_parquet(tmp_path / "data" / "train-00001.parquet", DOCS[200:])
    write_parquet(tmp_path / "data" / "train-00000.parquet", DOCS[:200])
    (tmp_path / "README.md").write_text("# a dataset card, not a document\n")
    files = user_files(str(tmp_path))
    assert [f.name for f in files] == ["train-00000.parquet", "train-00001.parquet"]
    assert list(read_documents(files, "content")) == DOCS


def test_null_rows_are_no_documents(tmp_path):
    pq.write_table(pa.table({"text": ["a", None, "b"]}), tmp_path / "n.parquet")
    assert list(read_documents([tmp_path / "n.parquet"])) == ["a", "b"]


@pytest.mark.parametrize("name", ["d.parquet", "ds"])
def test_a_missing_column_names_the_columns_and_the_key(formats, name):
    root, _ = formats
    with pytest.raises(DataError) as e:
        list(read_documents(user_files(str(root / name)), "text"))
    assert "no column 'text'" in str(e.value) and "id, content" in str(e.value) and "data.text_field" in str(e.value)


def test_a_column_that_is_not_text(formats):
    root, _ = formats
    with pytest.raises(DataError, match="column 'id' .* holds int64, not text; set data.text_field"):
        list(read_documents([root / "d.parquet"], "id"))


@pytest.mark.parametrize("record, words", [({"text": 5}, "holds int in its field 'text', not text"),
                                           ({"body": "x"}, "has no text field 'text' (its keys: body)")])
def test_a_jsonl_record_without_text_says_which_way(tmp_path, record, words):
    """A field that holds no string is told apart from a missing field; the fix names both commands' spellings."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(DataError) as e:
        list(read_documents([path], "text"))
    assert words in str(e.value) and "data.text_field (teratrain tokenize: --text-field)" in str(e.value)


def test_a_datasetdict_without_a_train_split(formats, tmp_path):
    root, _ = formats
    ds = datasets.Dataset.from_dict({"content": DOCS[:5]})
    datasets.DatasetDict({"validation": ds}).save_to_disk(str(tmp_path / "nv"))
    with pytest.raises(DataError, match=r"without a train split \(its splits: validation\); point data.path"):
        list(read_documents(user_files(str(tmp_path / "nv")), "content"))


def test_without_pyarrow_the_sentence_names_the_extra(formats, monkeypatch):
    root, _ = formats
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # an import of it now raises ImportError
    with pytest.raises(DataError, match=r"needs the pyarrow package; install it with pip install 'teratrain\[data\]'"):
        list(documents(Part(str(root / "d.parquet"), "parquet")))
