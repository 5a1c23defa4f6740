"""Unit tests compute on tiny tensors: one intra-op thread is as fast, and keeps them fast when other
processes busy the CPU (OpenMP workers spin-waiting for a core stretched this tier 3x). No result here
depends on the thread count.

Each test file starts with no compiled code: a file that compiled the model's frames at other shapes
would leave dynamo to recompile them with dynamic shapes, and a dynamic graph's partition keeps other
tensors than the static one the planner's compiled counts are read off (planner/compiled.py)."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def _no_compiled_code_from_other_files():
    torch._dynamo.reset()
    yield
