"""The model protocol in one process: where blocks are found, a model built on a real device keeps its
values (and its tied parameters stay tied), and a meta-device model of your own uses its own init."""

import importlib.util
from pathlib import Path

import torch
from torch import nn

from teratrain.mesh import Runtime
from teratrain.models.protocol import blocks
from teratrain.models.transformer import build_model
from teratrain.parallel.parallelize import parallelize
from tests.helpers import make_config

SETS = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.vocab_size=50", "model.seq_len=16",
        "train.device=cpu"]


def example():
    spec = importlib.util.spec_from_file_location("own_model", Path(__file__).parents[2] / "examples" / "own_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_blocks_are_found_by_method_or_known_paths():
    class HFLike(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    assert [n for n, _ in blocks(HFLike())] == ["model.layers.0", "model.layers.1"]
    cfg = make_config(*SETS)
    assert [n for n, _ in blocks(build_model(cfg.model))] == ["layers.0", "layers.1"]
    assert [n for n, _ in blocks(example().tiny_decoder(cfg))] == ["blocks.0", "blocks.1"]
    assert blocks(nn.Linear(2, 2)) == []


def test_a_model_built_on_a_real_device_keeps_its_values_and_ties():
    cfg = make_config(*SETS, "parallel.zero=1")
    ours = build_model(cfg.model, seed=7)  # not the seed parallelize would init with
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    parallelize(ours, Runtime.single("cpu"), cfg)
    after = dict(ours.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in before.items())

    tiny = example().TinyDecoder(50, 32, 2, 4, 16)  # on the CPU, PyTorch's default init
    tiny.init_buffers("cpu")
    values = {n: p.detach().clone() for n, p in tiny.named_parameters()}
    parallelize(tiny, Runtime.single("cpu"), make_config(*SETS))
    assert tiny.head.weight is tiny.embed.weight  # still one parameter
    assert all(torch.equal(dict(tiny.named_parameters())[n], v) for n, v in values.items())


def test_a_meta_model_of_your_own_uses_its_init_parameter():
    cfg = make_config(*SETS)
    module = example()
    tiny = module.tiny_decoder(cfg)
    parallelize(tiny, Runtime.single("cpu"), cfg)
    expected = torch.empty(50, 32)
    tiny.init_parameter(expected, "embed.weight")
    assert torch.equal(tiny.embed.weight, expected) and torch.equal(tiny.ln_f.weight, torch.ones(32))
    assert tiny.positions.abs().sum() > 0  # init_buffers ran on the real device
