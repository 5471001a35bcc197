"""Test configuration: the ``cuda`` marker.

Collection never touches CUDA: ``torch.cuda.is_available()`` is asked only when a marked test is about
to run, so the CPU suite imports nothing that initialises a device.
"""
from __future__ import annotations

import pytest
import torch


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (marker 'cuda'); run scripts/gpu_check.sh on a GPU machine")
