"""RNG state to (tensors, JSON) and back, through a real safetensors file and json text: the
streams replay exactly. (Optimizer state: test_checkpoint_logical.py.)"""

import json
import random

import numpy as np
import torch
from safetensors.torch import load_file

from teratrain.checkpoint.io import write_safetensors
from teratrain.checkpoint.state import rng_state, set_rng_state


def through_disk(tensors: dict, meta: dict, tmp_path) -> tuple[dict, dict]:
    """What a checkpoint does to the state: safetensors for tensors, JSON text for the rest."""
    write_safetensors(tmp_path / "state.safetensors", tensors)
    return load_file(tmp_path / "state.safetensors"), json.loads(json.dumps(meta))


def draw() -> tuple:
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.randn(),
            torch.rand(4).tolist(), torch.randint(0, 1000, (3,)).tolist())


def test_rng_state_round_trip(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.randn()  # leave a cached Gaussian in Python's and NumPy's state
    tensors, meta = through_disk(*rng_state(), tmp_path)
    expected = draw()
    draw()  # move every stream further on
    set_rng_state(tensors, meta)
    assert draw() == expected
