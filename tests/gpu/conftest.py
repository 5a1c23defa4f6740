"""GPU tests: each says how many GPUs it needs with `@pytest.mark.gpu(n)`, and is skipped where fewer
are visible (CI has none). One command runs them all on a GPU machine: `pytest -m gpu tests/gpu`."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        mark = item.get_closest_marker("gpu")
        if mark is not None and visible < (mark.args[0] if mark.args else 1):
            item.add_marker(pytest.mark.skip(reason=f"needs {mark.args[0] if mark.args else 1} GPUs, {visible} visible"))
