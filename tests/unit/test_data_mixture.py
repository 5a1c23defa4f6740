"""data.sources: samples drawn from each source in proportion to its weight, the sample order a pure
function of (seed, step, sample), so every data-parallel layout and every resume sees the same
batches; all sources share one tokenizer; a bad entry is one sentence naming it."""

import json

import numpy as np
import pytest
import torch

from teratrain.config import ConfigError, DataConfig, load_config
from teratrain.data.corpus import DataError
from teratrain.data.loader import Batches, prepare
from teratrain.data.mixture import Mixture

SEQ = 16


@pytest.fixture(scope="module")
def mix() -> Mixture:
    """Source a holds token ids below 1000, source b ids from 1000: a row tells its source."""
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1000, size=20_000).astype(np.uint16)
    b = rng.integers(1000, 2000, size=7_000).astype(np.uint16)
    return Mixture([a, b], [0.7, 0.3], ["a", "b"])


def from_b(x: torch.Tensor) -> torch.Tensor:
    return (x >= 1000).all(dim=1)


def test_the_counted_proportion_over_10000_samples_is_within_1_percent(mix):
    batches = Batches(mix, SEQ, seed=5, global_batch=50)
    rows = torch.cat([batches.get(step, 0, 50)[0] for step in range(200)])  # 10,000 samples
    assert len(rows) == 10_000
    is_b = from_b(rows)
    assert bool((is_b | (rows < 1000).all(dim=1)).all()), "a row mixes sources"
    share = float(is_b.float().mean())
    assert abs(share - 0.3) < 0.01, share
    per_batch = is_b.view(200, 50).float().mean(dim=1)
    assert float((per_batch - 0.3).abs().max()) <= 0.04  # every batch in proportion, not only the total


@pytest.mark.parametrize("seed", [0, 1, 1234])
def test_the_proportion_holds_for_any_seed(mix, seed):
    src = mix.sources(seed, 0, 10_000)
    assert abs(float((src == 1).mean()) - 0.3) < 0.01


@pytest.mark.parametrize("dp", [1, 2])
def test_the_same_batches_at_any_data_parallel_degree_and_after_a_resume(mix, dp):
    gb, mb = 8, 2
    reference = Batches(mix, SEQ, 3, gb)
    resumed = Batches(mix, SEQ, 3, gb)  # a new process that starts at step 6, as a resume does
    for step in (6, 7, 0, 11):
        want = reference.get(step, 0, gb)
        parts = [m for r in range(dp) for m in resumed.micro_batches(step, r, dp, mb)]
        assert torch.equal(torch.cat([x for x, _ in parts]), want[0])
        assert torch.equal(torch.cat([y for _, y in parts]), want[1])
    assert not torch.equal(reference.get(0, 0, gb)[0], reference.get(1, 0, gb)[0])
    assert not torch.equal(reference.get(0, 0, gb)[0], Batches(mix, SEQ, 4, gb).get(0, 0, gb)[0])


def test_targets_are_the_next_tokens_of_the_same_source(mix):
    x, y = Batches(mix, SEQ, 0, 32).get(2, 0, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(from_b(x), (y >= 1000).all(dim=1))


def test_sources_of_every_kind_share_one_tokenizer(tmp_path):
    """Two JSON-lines corpora with different text fields and a pre-tokenized .bin: one BPE is trained
    on the text sources together; each source keeps its last data.val_fraction for evaluation."""
    docs = [f"line {i}: {'abc ' * (i % 5)}xyz" for i in range(400)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:200]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"body": d.upper()}) + "\n" for d in docs[200:]))
    (np.arange(5000) % 250).astype(np.uint16).tofile(tmp_path / "c.bin")
    sources = [{"path": str(tmp_path / "a.jsonl"), "weight": 2}, {"path": str(tmp_path / "b.jsonl"), "weight": 1,
                                                                   "text_field": "body"},
               {"path": str(tmp_path / "c.bin"), "weight": 1}]
    cfg = DataConfig(sources=sources, cache_dir=str(tmp_path / "cache"), val_fraction=0.1)
    data = prepare(cfg, 300)
    assert data.tokenizer_path and data.tokenizer_path.name.startswith("bpe-mix-")
    assert "mixture: " in data.source and "(0.50)" in data.source and "(0.25)" in data.source
    assert [len(t) + len(v) for t, v in zip(data.train.streams, data.val.streams)][2] == 5000
    assert len(data.val.streams[2]) == 500
    again = prepare(cfg, 300)  # cached: the same tokens
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(data.train.streams, again.train.streams))
    x, _ = Batches(data.train, SEQ, 0, 64).get(0, 0, 64)
    assert int(x.max()) < 300


def test_a_source_too_short_names_its_entry(mix):
    with pytest.raises(DataError, match="split of data.sources entry 'b' has 7000 tokens, too few for model.seq_len"):
        Batches(mix, 7000, 0, 4)


@pytest.mark.parametrize("value, words", [
    ('[{path="a", wieght=1}]', "data.sources[0] has unknown key(s) wieght"),
    ('[{path="a", weight=0}]', "data.sources[0].weight must be a positive number"),
    ('[{weight=1}]', "data.sources[0].path must be the path of a corpus"),
    ("[]", "data.sources must be a non-empty list"),
])
def test_a_bad_entry_is_one_sentence(value, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"data.sources={value}"])
    assert words in str(e.value)


def test_path_and_sources_together_are_refused():
    with pytest.raises(ConfigError, match="data.path and data.sources are both set"):
        load_config(None, ["data.path=x.jsonl", 'data.sources=[{path="a", weight=1}]'])
