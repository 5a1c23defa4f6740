"""Data order is a pure function of (seed, step, sample index), whatever the number of ranks; the
tokenizer/token cache turns a user's text into tokens that decode back to it."""

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from teratrain.config import DataConfig
from teratrain.data.corpus import DataError
from teratrain.data.loader import Batches, prepare
from teratrain.data.tokenizer import EOT

SEQ, GLOBAL = 16, 8


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 1000, size=5000).astype(np.uint16)


def batches(tokens, seed=3) -> Batches:
    return Batches(tokens, SEQ, seed, GLOBAL)


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("micro_batch", [1, 2])
def test_micro_batches_over_dp_ranks_concatenate_to_the_global_batch(tokens, dp, micro_batch):
    b = batches(tokens)
    for step in (0, 1, 17):
        x_ref, y_ref = b.get(step, 0, GLOBAL)
        parts = [mb for rank in range(dp) for mb in b.micro_batches(step, rank, dp, micro_batch)]
        assert len(parts) == GLOBAL // micro_batch
        assert torch.equal(torch.cat([x for x, _ in parts]), x_ref)
        assert torch.equal(torch.cat([y for _, y in parts]), y_ref)


def test_batch_is_a_pure_function_of_seed_and_step(tokens):
    a, b = batches(tokens), batches(tokens)
    for step in (5, 0, 3):  # order of calls does not matter: no hidden iterator state
        assert torch.equal(a.get(step, 0, GLOBAL)[0], b.get(step, 0, GLOBAL)[0])
    assert not torch.equal(a.get(0, 0, GLOBAL)[0], a.get(1, 0, GLOBAL)[0])
    assert not torch.equal(a.get(0, 0, GLOBAL)[0], batches(tokens, seed=4).get(0, 0, GLOBAL)[0])


def test_a_sample_does_not_depend_on_the_slice_that_asks_for_it(tokens):
    b = batches(tokens)
    x_all, _ = b.get(2, 0, GLOBAL)
    for j in range(GLOBAL):
        assert torch.equal(b.get(2, j, j + 1)[0][0], x_all[j])


def test_targets_are_inputs_shifted_by_one_token(tokens):
    b = batches(tokens)
    x, y = b.get(4, 0, GLOBAL)
    assert x.shape == y.shape == (GLOBAL, SEQ) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row, start in zip(x, b.starts(4)):
        assert torch.equal(row, torch.from_numpy(tokens[start:start + SEQ].astype(np.int64)))


def test_offsets_stay_inside_the_split(tokens):
    b = Batches(tokens[:SEQ + 2], SEQ, 0, 64)
    x, y = b.get(0, 0, 64)
    assert y.shape == (64, SEQ)


def test_too_few_tokens_is_a_data_error():
    with pytest.raises(DataError, match="model.seq_len"):
        Batches(np.zeros(SEQ + 1, dtype=np.uint16), SEQ, 0, 4)


@pytest.fixture(scope="module")
def user_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = {"a.txt": "def main():\n    return 42\n" * 30, "sub/b.py": "import os\nprint(os.getcwd())\n" * 30,
            "c.md": "# Title\n\nSome words, some more words.\n" * 30}
    for name, text in docs.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "skip.bin").write_bytes(b"\x00\x01")  # not a text suffix: ignored
    return root, docs


def test_prepare_encodes_user_text_that_decodes_back(user_corpus, tmp_path):
    root, docs = user_corpus
    cfg = DataConfig(path=str(root), cache_dir=str(tmp_path), val_fraction=0.1)
    data = prepare(cfg, vocab_size=400)
    tok = Tokenizer.from_file(str(data.tokenizer_path))
    assert tok.get_vocab_size() <= 400
    ids = np.concatenate([data.train, data.val]).tolist()
    eot = tok.token_to_id(EOT)
    assert ids.count(eot) == len(docs)  # one end-of-text after each document
    decoded = tok.decode(ids, skip_special_tokens=False).split(EOT)[:-1]
    assert decoded == [docs[k] for k in ("a.txt", "c.md", "sub/b.py")]  # sorted path order
    assert len(data.val) == int(len(ids) * 0.1)


def test_prepare_reuses_its_cache(user_corpus, tmp_path):
    root, _ = user_corpus
    cfg = DataConfig(path=str(root), cache_dir=str(tmp_path))
    first = prepare(cfg, vocab_size=400)
    files = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    again = prepare(cfg, vocab_size=400)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == files
    assert np.array_equal(first.train, again.train)


def test_missing_data_path_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="data.path"):
        prepare(DataConfig(path=str(tmp_path / "nope"), cache_dir=str(tmp_path)), vocab_size=400)


def test_a_256_token_vocabulary_trains_on_bytes(user_corpus, tmp_path):
    """model.vocab_size=256: one token per byte (id = byte value), documents back to back."""
    root, docs = user_corpus
    data = prepare(DataConfig(path=str(root), cache_dir=str(tmp_path), val_fraction=0.0), vocab_size=256)
    text = "".join(docs[k] for k in ("a.txt", "c.md", "sub/b.py"))
    assert data.train.tolist() == list(text.encode())
    tok = Tokenizer.from_file(str(data.tokenizer_path))
    assert tok.get_vocab_size() == 256 and tok.decode(tok.encode("é\x00\t ok").ids) == "é\x00\t ok"


def test_a_vocabulary_below_256_on_text_is_one_sentence(user_corpus, tmp_path):
    root, _ = user_corpus
    with pytest.raises(DataError) as e:
        prepare(DataConfig(path=str(root), cache_dir=str(tmp_path)), vocab_size=200)
    assert "model.vocab_size=200" in str(e.value) and "data.tokenizer" in str(e.value) and ".bin" in str(e.value)
