"""LazyModule's release while the loaded component is still referenced elsewhere: the next use gets that same
instance, never a second, different copy built by the loader.

Each test compares with the component used without the proxy, bit for bit, and was wrong before its fix.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from fastoffload_ext.errors import OffloadStateError
from fastoffload_ext.pipeline.lazy import LazyModule


class _Loader:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> nn.Linear:
        self.calls += 1
        torch.manual_seed(0)
        return nn.Linear(4, 4)


def test_a_component_still_held_after_release_comes_back_as_the_same_instance(
        caplog: pytest.LogCaptureFixture) -> None:
    """The next use ran a second copy from the loader, without what was done to the held one after the release."""
    loader = _Loader()
    proxy = LazyModule("text_encoder", loader)
    held = proxy.materialize()
    with caplog.at_level(logging.WARNING, logger="fastoffload_ext.pipeline.lazy"):
        assert proxy.release() is True
    assert "still referenced" in caplog.text
    assert proxy.is_materialized is False
    with torch.no_grad():
        held.weight.mul_(2)
    x = torch.randn(2, 4)
    assert torch.equal(proxy(x), held(x))
    assert proxy.materialize() is held and loader.calls == 1
    # The change made through the held reference still counts as a change since the load.
    with pytest.warns(RuntimeWarning, match=r"^fastoffload: deferred module text_encoder was not released"):
        assert proxy.release() is False


def test_a_component_nobody_holds_is_loaded_again_after_release() -> None:
    loader = _Loader()
    proxy = LazyModule("vae", loader)
    proxy(torch.randn(1, 4))
    assert proxy.release() is True
    proxy(torch.randn(1, 4))
    assert loader.calls == 2


def test_a_transform_registered_while_a_released_component_is_held_applies_to_it() -> None:
    loader = _Loader()
    proxy = LazyModule("transformer", loader)
    held = proxy.materialize()
    proxy.release()

    def double(module: nn.Linear) -> nn.Linear:
        with torch.no_grad():
            module.weight.mul_(2)
        return module

    proxy.set_materialize_transform(double)
    torch.manual_seed(0)
    reference = double(nn.Linear(4, 4))
    x = torch.randn(2, 4)
    assert torch.equal(proxy(x), reference(x)) and torch.equal(held(x), reference(x))
    assert proxy.materialize() is held and loader.calls == 1


def test_a_copy_of_a_proxy_whose_released_but_held_component_changed_is_refused() -> None:
    proxy = LazyModule("vae", _Loader())
    held = proxy.materialize()
    proxy.release()
    held.half()
    with pytest.raises(OffloadStateError, match=r"^fastoffload: cannot copy or pickle deferred module vae"):
        copy.deepcopy(proxy)
