"""The benchmark's device-memory peaks: measured against a base taken after a garbage collection.

A dropped offloaded model is freed only by the cycle collector. When the collector ran inside a measured
region instead of before it, the dropped model's slots counted in the base and came off the peak: a
Wan-1.3B budgets row whose two slots take 190 MB read a 24 MiB peak, and "within the budget" was
checked against that.
"""
from __future__ import annotations

import ast
import gc
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks import utils
from benchmarks.utils import device_allocated, device_peak, reset_device_peak
from fastoffload_ext import enable_layerwise_offload

ROOT = Path(__file__).resolve().parents[1]
COUNTERS = {"memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "memory_reserved",
            "max_memory_reserved"}


class _Tracked:
    """Stands in for device bytes held by an object that only the cycle collector frees."""

    live = 0

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.cycle = self
        _Tracked.live += nbytes

    def __del__(self) -> None:
        _Tracked.live -= self.nbytes


def test_the_base_does_not_count_what_only_the_collector_frees(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: _Tracked.live)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    ctx = types.SimpleNamespace(cuda=True)
    gc.disable()
    try:
        kept = _Tracked(7)
        dropped = _Tracked(100)
        del dropped
        assert _Tracked.live == 107  # still alive: only the collector frees it
        assert device_allocated(ctx) == 7
        del kept
    finally:
        gc.enable()
        gc.collect()


def test_without_cuda_nothing_is_read() -> None:
    ctx = types.SimpleNamespace(cuda=False)
    assert device_allocated(ctx) == 0
    reset_device_peak(ctx)
    assert device_peak(ctx) == 0


def test_sections_read_the_device_counters_only_through_the_helpers() -> None:
    """A section that read ``torch.cuda.memory_allocated`` itself would take its base without the collection."""
    offenders = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        if path.name in ("utils.py", "phases.py"):  # the helpers; the phase log only prints the figure
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in COUNTERS:
                offenders.append(f"{path.name}:{node.lineno} {node.attr}")
    assert offenders == []


class _Stack(nn.Module):
    def __init__(self, width: int = 1024, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.cuda
def test_a_peak_counts_the_slots_when_a_dropped_offloaded_model_is_collected_inside_the_region() -> None:
    ctx = types.SimpleNamespace(cuda=True)
    x = torch.randn(8, 1024, device="cuda")
    slot_bytes = 1024 * 1024 * 4 + 1024 * 4
    gc.collect()
    gc.disable()
    try:
        first = _Stack()
        enable_layerwise_offload(first, device="cuda")
        with torch.inference_mode():
            first(x)
        del first  # its two slots stay allocated until the collector runs
        base = device_allocated(ctx)
        reset_device_peak(ctx)
        second = _Stack()
        enable_layerwise_offload(second, device="cuda")
        gc.collect()  # where the collector would have run on its own
        with torch.inference_mode():
            second(x)
        assert device_peak(ctx) - base >= 2 * slot_bytes
        del second
    finally:
        gc.enable()
        gc.collect()


def test_the_steady_reserve_is_the_allocator_s_peak_above_an_emptied_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    state = {"reserved": 300, "peak": 0}

    def reserved() -> int:
        calls.append("reserved")
        return state["reserved"]

    def run(forward: object, count: int) -> list[float]:
        calls.append(f"run {count}")
        state["peak"] = 1000  # what the forwards reserved at their peak
        return [1.0] * count

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", reserved)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: state["peak"])
    monkeypatch.setattr(utils, "time_back_to_back", run)
    assert utils.steady_reserve(lambda: None, 4) == 700
    assert calls == ["sync", "empty", "reserved", "reset", "run 4", "sync"]


@pytest.mark.cuda
def test_the_steady_reserve_counts_what_a_host_running_ahead_freed_but_the_device_still_uses() -> None:
    # A forward that allocates a 64 MiB buffer on a side stream and frees it while the compute stream still has
    # work queued that uses it, as an offloader that allocates each prefetched block afresh does. With the host
    # ahead of the device, each forward's buffer is still held when the next is allocated: the allocated count
    # holds one buffer, the reserve all of them.
    side, size = torch.cuda.Stream(), 64 * 2**20

    def forward() -> None:
        torch.cuda._sleep(200_000_000)  # the device falls behind the host (about 0.1 s a forward)
        with torch.cuda.stream(side):
            buffer = torch.empty(size, dtype=torch.uint8, device="cuda")
        torch.cuda.current_stream().wait_stream(side)
        buffer.record_stream(torch.cuda.current_stream())
        buffer.fill_(1)
        del buffer

    allocated_before = torch.cuda.memory_allocated()
    reserve = utils.steady_reserve(forward, 4)
    assert torch.cuda.max_memory_allocated() - allocated_before <= size
    assert reserve >= 3 * size  # the first buffer may be done with by the time the fourth is allocated
