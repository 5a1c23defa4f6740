"""Logical checkpoints in one process: piece arithmetic, reassembly of any split from any other,
exact coverage checks, and optimizers (elementwise, per-tensor and factored state) that continue
bit for bit after a save and a restore."""

import json
import math
import random

import pytest
import torch

from teratrain.checkpoint.holdings import PARAM, Entry
from teratrain.checkpoint.index import INDEX, Index, Reader
from teratrain.checkpoint.io import CheckpointError, save
from teratrain.checkpoint.pieces import Piece, _flat_range_boxes
from teratrain.checkpoint.training import encode, restore_training, save_training
from teratrain.mesh import Runtime
from teratrain.models.transformer import Transformer
from teratrain.optim.engine import train_step
from teratrain.parallel.parallelize import parallelize
from teratrain.parallel.placement import Placement
from tests.helpers import make_config


def test_a_flat_range_is_a_few_contiguous_sub_boxes():
    rng = random.Random(0)
    for _ in range(500):
        box = tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 4)))
        n = math.prod(box)
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        t = torch.arange(n).view(box)
        got = []
        boxes = _flat_range_boxes(box, lo, hi)
        assert len(boxes) <= max(1, 2 * len(box) - 1)
        for start, shape, flat in boxes:
            vals = t[tuple(slice(s, s + k) for s, k in zip(start, shape))].reshape(-1)
            assert torch.equal(vals, torch.arange(flat, flat + vals.numel())), (box, lo, hi)  # contiguous
            got.append(vals)
        assert torch.equal(torch.cat(got) if got else torch.arange(0), torch.arange(lo, hi)), (box, lo, hi)


def test_a_padded_tensor_parallel_piece():
    """Vocabulary 50 over tp=4: pieces of 13 rows, the last holds 11 real rows and 2 of padding."""
    pl = Placement(name="tok_embeddings.weight", global_shape=(50, 8), dim=0, axis="tp", index=3, count=4)
    piece = Piece.of(pl)
    assert piece.offsets == (39, 0) and piece.box == (13, 8) and piece.in_bounds() == 11 * 8
    assert piece.clipped().box == (11, 8)


def split(shape, dim, count, index):
    return Placement(name="w", global_shape=shape, dim=dim, axis="tp", index=index, count=count)


def write_layout(tmp_path, full: torch.Tensor, dim: int, count: int, shards: int):
    """A checkpoint of `full` as tp=`count` pieces along `dim`, each cut into `shards` flat ranges."""
    entries = []
    for i in range(count):
        pl = split(tuple(full.shape), dim, count, i)
        local = torch.zeros(pl.local_shape())
        local[pl.local_slices()] = full[pl.global_slices()]
        per = math.ceil(local.numel() / shards)
        for s in range(shards):
            lo, hi = min(s * per, local.numel()), min((s + 1) * per, local.numel())
            entries.append(Entry(PARAM, Piece.of(pl, lo, hi), local.reshape(-1)[lo:hi]))
    tensors, pieces = encode(entries)
    return save(tmp_path / "checkpoints", 1, 0, 1, tensors, {"pieces": pieces}, keep=1)


@pytest.mark.parametrize("src, dst", [((1, 3, 2), (0, 2, 3)), ((0, 4, 1), (1, 3, 2)), ((0, 1, 5), (1, 1, 1))])
def test_any_split_reads_back_from_any_other(tmp_path, src, dst):
    full = torch.randn(7, 10, generator=torch.Generator().manual_seed(0))
    path = write_layout(tmp_path, full, *src)
    dim, count, shards = dst
    with Reader(Index(path)) as reader:
        assert torch.equal(reader.read(PARAM, "w"), full)
        for i in range(count):
            pl = split((7, 10), dim, count, i)
            local = torch.zeros(pl.local_shape())
            per = math.ceil(local.numel() / shards)
            for s in range(shards):
                lo, hi = min(s * per, local.numel()), min((s + 1) * per, local.numel())
                reader.fill(Entry(PARAM, Piece.of(pl, lo, hi), local.reshape(-1)[lo:hi]))
            assert torch.equal(local[pl.local_slices()], full[pl.global_slices()])
            assert not local[tuple(slice(n, None) if d == dim else slice(None)
                                   for d, n in enumerate(local[pl.local_slices()].shape))].any()  # padding untouched


def test_an_index_with_a_gap_is_a_checkpoint_error(tmp_path):
    path = write_layout(tmp_path, torch.ones(7, 10), 0, 2, 2)
    index = json.loads((path / INDEX).read_text())
    index["tensors"]["param/w"]["pieces"].pop(1)
    (path / INDEX).write_text(json.dumps(index))
    with Reader(Index(path)) as reader, pytest.raises(CheckpointError, match="covers 50 of the 70 elements"):
        reader.read(PARAM, "w")


SMALL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
         "model.vocab_size=50", "model.seq_len=16", "train.global_batch=4", "train.micro_batch=2", "optim.lr=0.05",
         "train.device=cpu"]


def engine_of(*sets):
    cfg = make_config(*SMALL, *sets)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    return cfg, model, parallelize(model, Runtime.single("cpu"), cfg)


def steps(cfg, model, engine, seeds):
    for seed in seeds:
        batch = torch.randint(0, 50, (4, 17), generator=torch.Generator().manual_seed(seed))
        micro = [(batch[i:i + 2, :-1], batch[i:i + 2, 1:]) for i in (0, 2)]
        train_step(model, engine, micro, "fp32", cfg.optim.lr)


@pytest.mark.parametrize("name", ["adamw", "sgd", "adafactor"])
def test_optimizer_state_continues_exactly(name, tmp_path):
    """AdamW: elementwise moments + a per-tensor step; SGD: momentum; Adafactor: factored row/column
    state. 4 steps straight == 2 steps, save, restore into a fresh engine, 2 more."""
    sets = [f"optim.name={name}"]
    cfg, model, engine = engine_of(*sets)
    steps(cfg, model, engine, [0, 1])
    save_training(tmp_path / "checkpoints", 2, cfg, Runtime.single("cpu"), engine)
    cfg2, model2, engine2 = engine_of(*sets, "optim.weight_decay=0.3")
    assert restore_training(tmp_path / "checkpoints", cfg2, Runtime.single("cpu"), engine2, tmp_path) == 2
    assert all(g["weight_decay"] in (0.3, 0.0) for g in engine2.optimizer.param_groups)  # hyperparameters: as now
    for g in engine2.optimizer.param_groups:
        g["weight_decay"] = 0.1 if g["weight_decay"] else 0.0
    steps(cfg, model, engine, [2, 3])
    steps(cfg2, model2, engine2, [2, 3])
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(p, q), (name, n)
    factored = any("@" in k for k in Index(tmp_path / "checkpoints" / "step_00000002").tensors)
    assert factored == (name == "adafactor")


def test_what_cannot_carry_over_is_one_sentence(tmp_path):
    """Factored state (Adafactor) under another tensor split; local SGD at another dp; another optimizer."""
    from teratrain.checkpoint.training import check_resume
    from teratrain.config import ConfigError

    cfg, model, engine = engine_of("optim.name=adafactor")
    steps(cfg, model, engine, [0])
    save_training(tmp_path / "checkpoints", 1, cfg, Runtime.single("cpu"), engine)
    index = Index(tmp_path / "checkpoints" / "step_00000001")
    one = {"dp": 1, "tp": 1, "pp": 1, "ep": 1, "num_servers": 0}
    check_resume(cfg, one, cfg, {**one, "dp": 4}, tmp_path, index)  # dp is free
    with pytest.raises(ConfigError, match=r"factored state .* resume with parallel.tp=1\."):
        check_resume(cfg, one, cfg, {**one, "tp": 2}, tmp_path, index)
    lsgd = make_config(*SMALL, "optim.name=adafactor", "parallel.sync=local-sgd")
    with pytest.raises(ConfigError, match=r"local-sgd keeps state per rank.*parallel.dp=1\."):
        check_resume(lsgd, one, lsgd, {**one, "dp": 2}, tmp_path, index)
    with pytest.raises(ConfigError, match='optim.name is "sgd" but the checkpoint .* written with "adafactor"'):
        check_resume(cfg, one, make_config(*SMALL, "optim.name=sgd"), one, tmp_path, index)
    with pytest.raises(ConfigError, match=r"model.moe.num_experts is 4 .* with 1; resume with the same model shape\."):
        check_resume(cfg, one, make_config(*SMALL, "optim.name=adafactor", "model.moe.num_experts=4"), one, tmp_path,
                     index)
    with pytest.raises(ConfigError, match=r"lora.rank is 8 .* with 0; resume with the same setting\."):
        check_resume(cfg, one, make_config(*SMALL, "optim.name=adafactor", "lora.rank=8"), one, tmp_path, index)
    for free in ("model.seq_len=32", "model.dropout=0.1", "model.rope_theta=500000.0"):  # no parameter changes
        check_resume(cfg, one, make_config(*SMALL, "optim.name=adafactor", free), one, tmp_path, index)


def test_a_checkpoint_of_one_parameter_per_expert_names_the_way_to_stacked_experts(tmp_path):
    """Experts are stacks (models/moe.py Experts): a checkpoint that holds each expert as its own parameter
    cannot fill a stack, and the error says so and how to carry the weights over (through Hugging Face)."""
    from teratrain.checkpoint.format import FORMAT

    one = {"name": "layers.0.feed_forward.experts.0.w1.weight", "kind": "param", "shape": [8, 4], "dtype": "fp32",
           "pieces": []}
    (tmp_path / INDEX).write_text(json.dumps({"format": FORMAT, "tensors": {f"param/{one['name']}": one}}))
    stack = Piece.whole_of("layers.0.feed_forward.experts.w1", (2, 8, 4))
    with pytest.raises(CheckpointError, match=r"each expert as its own parameter .*teratrain export.*model.init_from"):
        Reader(Index(tmp_path)).plan(Entry(PARAM, stack, torch.empty(2, 8, 4)))
    other = Piece.whole_of("layers.0.attention.wq.weight", (4, 4))
    with pytest.raises(CheckpointError, match="written for another model"):
        Reader(Index(tmp_path)).plan(Entry(PARAM, other, torch.empty(4, 4)))
