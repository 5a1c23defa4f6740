"""Context parallelism's plan (parallel/cp_plan.py: chunks, ring steps, refusals), pure arithmetic."""

import numpy as np
import pytest

from teratrain.config_base import ConfigError
from teratrain.parallel.cp_plan import (CAUSAL, FULL, MASKED, Block, balanced, check_cp, rank_work, step_blocks,
                                        token_work, zigzag)
from tests.helpers import make_config


def test_zigzag_gives_every_rank_the_same_causal_work():
    for cp in (2, 4, 8):
        split = zigzag(cp, 64 * cp)
        assert split.chunks[0] == (0, 2 * cp - 1) and split.chunks[-1] == (cp - 1, cp)
        assert len(set(rank_work(split, None))) == 1
        assert sorted(np.concatenate([split.positions(r) for r in range(cp)]).tolist()) == list(range(64 * cp))


def test_ring_steps_make_one_call_each_for_causal_chunks():
    """Own chunks: one causal call over both; an earlier rank's keys: all queries against its first
    chunk; a later rank's: the second query chunk against both of its chunks (equal work either way)."""
    split = zigzag(4, 64)  # chunks of 8 tokens
    assert step_blocks(split, 2, 2) == [Block(0, 16, 0, 16, CAUSAL)]
    assert step_blocks(split, 2, 1) == [Block(0, 16, 0, 8, FULL)]
    assert step_blocks(split, 2, 3) == [Block(8, 16, 0, 16, FULL)]


def test_document_work_and_its_balance():
    """A token's work is its position in its document plus one; pairs by work beat the causal pairs
    when documents end mid-sample, and equal them for one document per sample."""
    docs = np.array([[0, 0, 0, 1, 1, 2, 2, 2]])
    assert token_work(docs).tolist() == [1, 2, 3, 1, 2, 1, 2, 3]
    one = np.zeros((2, 64), dtype=np.int64)
    assert balanced(4, one).chunks == zigzag(4, 64).chunks
    packed = np.zeros((2, 64), dtype=np.int64)
    packed[:, 40:] = 1  # a second document from position 40
    work_zigzag, work_balanced = rank_work(zigzag(4, 64), packed), rank_work(balanced(4, packed), packed)
    assert sum(work_zigzag) == sum(work_balanced)
    assert max(work_balanced) < max(work_zigzag)


def test_documents_turn_pairs_masked_or_skip_them():
    docs = np.zeros((1, 32), dtype=np.int64)
    docs[0, 22:] = 1  # chunks of 4 tokens (cp=4): chunk 5 holds the boundary, 6 and 7 the second document
    split = zigzag(4, 32)  # rank 1 holds chunks 1 and 6, rank 2 chunks 2 and 5
    # rank 2's queries against rank 1's keys: 2 sees 1 whole, 5 sees 1 only partly; nothing sees 6 (later)
    assert {(b.q0, b.k0): b.kind for b in step_blocks(split, 2, 1, docs)} == {(0, 0): FULL, (4, 0): MASKED}
    # rank 1's against rank 2's: chunk 6 (second document) sees only the end of 5; 2 and 5 are after 1
    assert {(b.q0, b.k0): b.kind for b in step_blocks(split, 1, 2, docs)} == {(4, 4): MASKED}
    docs[0, 24:] = 2  # a third document from chunk 6 on: chunk 6 sees nothing of rank 2's chunks
    assert step_blocks(split, 1, 2, docs) == []


@pytest.mark.parametrize("sets, words", [
    (["model.seq_len=18"], "cuts model.seq_len (18) into 2 x cp = 4 equal pieces"),
    (["parallel.tp=2", "model.seq_len=20"], "2 x cp x parallel.tp (sequence parallelism"),
    (["model.dropout=0.1"], "set model.dropout=0"),
    (["parallel.cp_form=all-to-all", "model.n_heads=3"], "use parallel.cp_form=ring or another parallel.cp"),
    (["parallel.sync=local-sgd"], "set parallel.sync=allreduce"),
    (["train.compile=true", "train.compile_mode=reduce-overhead"], "set train.compile_mode=default"),
    (["parallel.pp=2", "parallel.schedule=zb-h1", "train.global_batch=4", "train.micro_batch=1"],
     "use another parallel.schedule"),
])
def test_refusals_are_one_sentence_with_the_fix(sets, words):
    from teratrain.parallel.support import check_supported

    cfg = make_config("model.n_layers=2", "model.d_model=48", "model.n_heads=4", "model.seq_len=32",
                      "parallel.cp=2", *sets)
    with pytest.raises(ConfigError) as e:
        check_supported(cfg)
    assert words in str(e.value) and str(e.value).count(". ") == 0 and str(e.value).endswith(".")


def test_document_mask_needs_an_end_of_text_id():
    from types import SimpleNamespace

    from teratrain.parallel.context import apply_cp

    cfg = make_config("data.document_mask=true")
    with pytest.raises(ConfigError, match="set data.eot_id"):
        apply_cp(None, SimpleNamespace(dims=SimpleNamespace(cp=1)), cfg)
