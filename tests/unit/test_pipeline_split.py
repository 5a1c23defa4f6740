"""The pipeline split (parallel/pipeline/split.py) on meta-device models, no process group: which
blocks and end modules each rank keeps, the split's refusals, and a fixed split in config.toml."""

from types import SimpleNamespace

import pytest
import torch

from teratrain.config import ConfigError, load_config
from teratrain.config_toml import to_toml
from teratrain.mesh import ParallelDims
from teratrain.models.transformer import Transformer
from teratrain.parallel.pipeline.split import apply_pipeline, check_split, stage_bounds


def _split(rank: int, *sets: str):
    cfg = load_config(None, ["model.n_layers=8", "model.d_model=32", "model.vocab_size=50", *sets])
    dims = ParallelDims(dp=1, pp=cfg.parallel.pp)
    rt = SimpleNamespace(dims=dims, rank=rank, coord=lambda axis: dims.coords(rank)[axis])
    with torch.device("meta"):
        model = Transformer(cfg.model)
    return model, apply_pipeline(model, rt, cfg)


@pytest.mark.parametrize("tied", [False, True])
def test_each_rank_keeps_its_blocks_by_global_name_and_its_ends(tied):
    sets = ["parallel.pp=4", f"model.tie_embeddings={str(tied).lower()}"]
    for rank in range(4):
        model, layout = _split(rank, *sets)
        assert list(model.layers.keys()) == [str(2 * rank), str(2 * rank + 1)]
        assert (model.tok_embeddings is not None) == (rank == 0 or (tied and rank == 3))
        assert (model.norm is not None) == (rank == 3) and (model.output is not None) == (rank == 3 and not tied)
        assert layout.stages == [rank]


def test_interleaved_chunks_and_a_fixed_uneven_split():
    model, layout = _split(1, "parallel.pp=2", "parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2",
                           "parallel.stage_layers=[1, 3, 2, 2]")
    assert layout.stages == [1, 3] and [list(b) for b in layout.bounds] == [[0], [1, 2, 3], [4, 5], [6, 7]]
    assert list(model.layers.keys()) == ["1", "2", "3", "6", "7"]
    assert model.tok_embeddings is None and model.norm is not None  # rank 1 of 2 holds the last stage


@pytest.mark.parametrize("sets, words", [
    (["parallel.pp=3"], ["parallel.partition=layers", "model.n_layers=8", "profiled"]),
    (["parallel.pp=2", "parallel.stage_layers=[4, 3]"], ["parallel.stage_layers", "8"]),
    (["parallel.pp=3", "parallel.stage_layers=[4, 0, 4]"], ["at least one block", "first", "last"]),
    (["parallel.pp=2", "parallel.stage_layers=[9, -1]"], ["at least one block"]),
])
def test_bad_splits_are_refused_with_one_sentence(sets, words):
    cfg = load_config(None, ["model.n_layers=8", *sets])
    with pytest.raises(ConfigError) as e:
        check_split(cfg)
    assert all(w in str(e.value) for w in words) and str(e.value).count(". ") == 0


def test_the_ends_may_hold_the_embedding_or_the_head_alone():
    """Llama 3 405B's split (Dubey et al. 2024, sec. 3.3.2), small: the first stage the embedding alone, the last the
    head and the loss alone."""
    model, layout = _split(0, "parallel.pp=2", "parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2",
                           "parallel.stage_layers=[0, 4, 4, 0]")
    check_split(load_config(None, ["model.n_layers=8", "parallel.pp=2", "parallel.schedule=interleaved-1f1b",
                                   "parallel.virtual_stages=2", "parallel.stage_layers=[0, 4, 4, 0]"]))
    assert [list(b) for b in layout.bounds] == [[], [0, 1, 2, 3], [4, 5, 6, 7], []]
    assert list(model.layers.keys()) == ["4", "5", "6", "7"] and model.tok_embeddings is not None
    model, _ = _split(1, "parallel.pp=2", "parallel.stage_layers=[8, 0]")
    assert list(model.layers.keys()) == [] and model.norm is not None and model.output is not None
    four = ["model.n_layers=2", "parallel.pp=2", "parallel.schedule=interleaved-1f1b", "parallel.virtual_stages=2"]
    check_split(load_config(None, [*four, "parallel.stage_layers=[0, 1, 1, 0]"]))  # 4 stages, 2 blocks
    with pytest.raises(ConfigError, match="fewer than the parallel.pp x"):
        load_config(None, four)


def test_an_uneven_count_needs_profiling_or_a_fixed_split(tmp_path):
    cfg = load_config(None, ["model.n_layers=7", "parallel.pp=2", "parallel.stage_layers=[4, 3]"])
    check_split(cfg)
    assert [list(r) for r in stage_bounds(cfg, None)] == [[0, 1, 2, 3], [4, 5, 6]]
    (tmp_path / "c.toml").write_text(to_toml(cfg))  # a profiled split is recorded the same way
    assert load_config(tmp_path / "c.toml").parallel.stage_layers == [4, 3]
