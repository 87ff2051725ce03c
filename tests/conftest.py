"""The markers (pyproject.toml): ``gpu`` tests are skipped where torch sees no CUDA device,
``hopper`` tests (the kernels', which are built for sm_90a) where the current one is not Hopper."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    cuda = torch.cuda.is_available()
    hopper = cuda and torch.cuda.get_device_capability() == (9, 0)
    skips = {"gpu": None if cuda else pytest.mark.skip(reason="CUDA is not available"),
             "hopper": None if hopper else pytest.mark.skip(reason="needs a Hopper GPU (sm_90)")}
    for item in items:
        for marker, skip in skips.items():
            if skip is not None and item.get_closest_marker(marker) is not None:
                item.add_marker(skip)
                break
