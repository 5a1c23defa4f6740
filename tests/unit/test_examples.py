"""Every example config a user may copy validates, and the offload example is the shape benchmarked."""

from pathlib import Path

import pytest

from teratrain.config import load_config
from teratrain.models.transformer import count_params

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.toml"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates(path):
    cfg = load_config(path)
    assert cfg.train.global_batch % cfg.train.micro_batch == 0


def test_offload_example_exceeds_one_gpu_with_plain_adamw():
    cfg = load_config(Path(EXAMPLES[0]).parent / "offload-10b.toml")
    n = count_params(cfg.model)["total"]
    assert 16 * n > 139.8 * 2**30  # plain mixed-precision AdamW state alone exceeds an H200
