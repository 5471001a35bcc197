"""The package's old flat module paths are the same module objects as their new homes."""
from __future__ import annotations

import importlib

import pytest

import fastoffload_ext
from fastoffload_ext import _moved
from fastoffload_ext.policy import ExecutionMode, ResolutionView  # noqa: F401  (re-exported names)


@pytest.mark.parametrize("old, new", sorted(_moved.MOVED_MODULES.items()))
def test_old_module_path_is_the_new_module(old: str, new: str) -> None:
    assert importlib.import_module(f"fastoffload_ext.{old}") is importlib.import_module(f"fastoffload_ext.{new}")
    assert getattr(fastoffload_ext, old) is importlib.import_module(f"fastoffload_ext.{new}")


def test_patching_the_old_platform_path_steers_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    import fastoffload_ext.platform
    from fastoffload_ext import policy
    from fastoffload_ext.policy import resolution

    monkeypatch.setattr(fastoffload_ext.platform, "has_unified_memory", lambda device_id=0: True)
    monkeypatch.setattr(fastoffload_ext.platform, "device_name", lambda device_id=0: "Test iGPU")
    view = resolution.ResolutionView({"engine": {"offload": {"dit_layerwise": True}}})
    assert policy.apply_unified_memory_offload_policy(view) == {"engine.offload.dit_layerwise": False}
    assert policy.has_unified_memory(0) is True


@pytest.mark.parametrize("name", sorted(fastoffload_ext.__all__))
def test_public_names_import_from_the_top(name: str) -> None:
    assert getattr(fastoffload_ext, name) is not None
