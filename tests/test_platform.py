"""Platform queries: the answers the device policy builds on, and their fallbacks.

The CUDA and MPS answers are exercised by substituting torch's own query functions, so the branches a
Jetson or a Mac would take run here on a CPU machine; the CPU answers are checked against the real torch.
"""
from __future__ import annotations

import importlib
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fastoffload_ext import policy
from fastoffload_ext.policy import platform


def _fake_platform(monkeypatch: pytest.MonkeyPatch, *, cuda: bool, mps: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)


def _raise(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("driver exploded")


def test_import_queries_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing the module must not ask torch anything about devices (it would initialise CUDA)."""
    calls: list[str] = []

    def record(name: str) -> Any:
        def query(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} called at import")
        return query

    for name in ("is_available", "get_device_properties", "get_device_name", "init", "device_count"):
        monkeypatch.setattr(torch.cuda, name, record(f"torch.cuda.{name}"))
    monkeypatch.setattr(torch.backends.mps, "is_available", record("torch.backends.mps.is_available"))
    try:
        importlib.reload(platform)
    finally:
        monkeypatch.undo()
        importlib.reload(platform)
    assert calls == []


@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(),
                    reason="checks the real answers of a CPU-only machine; test_real_cuda_machine_answers covers CUDA")
def test_real_cpu_machine_answers() -> None:
    assert platform.is_mps() is False
    assert platform.has_unified_memory() is False
    assert platform.has_unified_memory(3) is False
    assert platform.platform_name() == "cpu"
    assert platform.device_name() == "cpu"
    assert torch.cuda.is_initialized() is False


@pytest.mark.parametrize(("cuda", "mps", "expected"), [
    (False, False, False),
    (False, True, True),
    (True, False, False),
    (True, True, False),  # a CUDA machine is a CUDA machine, whatever else it exposes
])
def test_is_mps(monkeypatch: pytest.MonkeyPatch, cuda: bool, mps: bool, expected: bool) -> None:
    _fake_platform(monkeypatch, cuda=cuda, mps=mps)
    assert platform.is_mps() is expected


def test_is_mps_query_failure_answers_false(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_available", _raise)
    with caplog.at_level(logging.DEBUG, logger="fastoffload_ext.policy.platform"):
        assert platform.is_mps() is False
    assert "Treating the platform as not MPS: the MPS availability query failed (driver exploded)" in caplog.text


def test_cuda_probe_failure_is_not_cuda(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", _raise)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with caplog.at_level(logging.DEBUG, logger="fastoffload_ext.policy.platform"):
        assert platform.platform_name() == "cpu"
        assert platform.has_unified_memory() is False
    assert "Treating CUDA as unavailable: torch.cuda.is_available() raised (driver exploded)" in caplog.text


@pytest.mark.parametrize("integrated", [True, False])
def test_has_unified_memory_reads_cuda_integrated(monkeypatch: pytest.MonkeyPatch, integrated: bool) -> None:
    _fake_platform(monkeypatch, cuda=True, mps=False)
    asked: list[int] = []

    def properties(device_id: int) -> SimpleNamespace:
        asked.append(device_id)
        return SimpleNamespace(is_integrated=integrated, name="Fake GPU")

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    assert platform.has_unified_memory(2) is integrated
    assert asked == [2]
    assert platform.has_unified_memory() is integrated
    assert asked == [2, 0]


def test_has_unified_memory_mps_is_unified(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_platform(monkeypatch, cuda=False, mps=True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", _raise)  # must not be asked on MPS
    assert platform.has_unified_memory() is True


def test_has_unified_memory_failure_answers_false(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    _fake_platform(monkeypatch, cuda=True, mps=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", _raise)
    with caplog.at_level(logging.DEBUG, logger="fastoffload_ext.policy.platform"):
        assert platform.has_unified_memory(1) is False
    assert "Treating device 1 as discrete: the unified-memory query failed (driver exploded)" in caplog.text
    assert all(record.levelno == logging.DEBUG for record in caplog.records)


def test_has_unified_memory_property_missing_answers_false(monkeypatch: pytest.MonkeyPatch) -> None:
    # A torch without is_integrated raises AttributeError: still "not unified", never an error.
    _fake_platform(monkeypatch, cuda=True, mps=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device_id: SimpleNamespace())
    assert platform.has_unified_memory() is False


def test_device_name_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_platform(monkeypatch, cuda=True, mps=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device_id: f"NVIDIA Thor #{device_id}")
    assert platform.device_name(1) == "NVIDIA Thor #1"
    assert platform.device_name() == "NVIDIA Thor #0"


def test_device_name_unnameable_cuda_falls_back(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """NVML missing on Jetson, or MIG/UUID selectors in CUDA_VISIBLE_DEVICES: the name is 'cuda', no error."""
    _fake_platform(monkeypatch, cuda=True, mps=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", _raise)
    with caplog.at_level(logging.DEBUG, logger="fastoffload_ext.policy.platform"):
        assert platform.device_name(0) == "cuda"
    assert "Naming device 0 'cuda': its name could not be read (driver exploded)" in caplog.text


@pytest.mark.parametrize(("cuda", "mps", "expected"), [(False, True, "mps"), (False, False, "cpu"),
                                                       (True, False, "cuda")])
def test_platform_name(monkeypatch: pytest.MonkeyPatch, cuda: bool, mps: bool, expected: str) -> None:
    _fake_platform(monkeypatch, cuda=cuda, mps=mps)
    assert platform.platform_name() == expected


def test_device_name_mps(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_platform(monkeypatch, cuda=False, mps=True)
    monkeypatch.setattr(torch.cuda, "get_device_name", _raise)  # MPS never asks CUDA for a name
    assert platform.device_name() == "mps"


@pytest.mark.cuda
def test_real_cuda_machine_answers() -> None:
    properties = torch.cuda.get_device_properties(0)
    assert platform.is_mps() is False
    assert platform.platform_name() == "cuda"
    assert platform.has_unified_memory(0) is bool(properties.is_integrated)
    assert platform.device_name(0) == torch.cuda.get_device_name(0)
    assert platform.has_unified_memory(torch.cuda.device_count()) is False  # no such device: "not unified"
    assert platform.device_name(torch.cuda.device_count()) == "cuda"  # no such device: the generic name


@pytest.mark.parametrize("device", ["cuda:1", torch.device("cuda", 1)])
def test_device_given_as_torch_device_or_string(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                                device: Any) -> None:
    """torch's queries take "cuda:1" and torch.device too: the device reaches torch as given, and a failed
    query still logs its line (a %d format would turn it into a logging error)."""
    _fake_platform(monkeypatch, cuda=True, mps=False)
    asked: list[Any] = []

    def properties(device_id: Any) -> SimpleNamespace:
        asked.append(device_id)
        return SimpleNamespace(is_integrated=True)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    assert platform.has_unified_memory(device) is True
    assert asked == [device]
    monkeypatch.setattr(torch.cuda, "get_device_properties", _raise)
    with caplog.at_level(logging.DEBUG, logger="fastoffload_ext.policy"):
        assert platform.has_unified_memory(device) is False
        monkeypatch.setattr(platform, "has_unified_memory", _raise)
        assert policy.has_unified_memory(device) is False
    assert caplog.text.count(f"Treating device {device} as discrete") == 2
