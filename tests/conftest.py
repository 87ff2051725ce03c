"""The ``gpu`` marker (pyproject.toml): where torch sees no CUDA device, its tests are skipped."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="CUDA is not available")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_gpu)
