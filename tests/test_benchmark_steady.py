"""The models section's round timer: a lead forward after a wait, then steady forwards back to back."""
from __future__ import annotations

import pytest
import torch

from benchmarks.steady import SteadyTimer
from benchmarks.utils import time_back_to_back


def test_on_the_host_each_forward_is_timed_alone_with_no_lead() -> None:
    calls: list[int] = []
    timer = SteadyTimer(lambda: calls.append(1), iters=3, cuda=False)
    times = timer()
    assert len(times) == 3 and all(ms >= 0 for ms in times)
    assert len(calls) == 3 and timer.leads == []


def test_counts_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="iters must be >= 1, got 0"):
        SteadyTimer(lambda: None, iters=0, cuda=False)
    with pytest.raises(ValueError, match="count must be >= 1, got 0"):
        time_back_to_back(lambda: None, 0)


@pytest.mark.cuda
def test_the_lead_follows_a_wait_and_the_steady_forwards_do_not() -> None:
    # Each forward finds the stream idle only where the host waited for the device before it: a kernel far
    # longer than the host's loop between two forwards keeps the stream busy at every call after the lead.
    idle: list[bool] = []

    def forward() -> None:
        idle.append(torch.cuda.current_stream().query())
        torch.cuda._sleep(20_000_000)

    timer = SteadyTimer(forward, iters=3, cuda=True)
    for _ in range(2):
        times = timer()
        assert len(times) == 3 and all(ms > 0 for ms in times)
    assert idle == [True, False, False, False] * 2
    assert len(timer.leads) == 2 and all(ms > 0 for ms in timer.leads)
    assert torch.cuda.current_stream().query()  # the timer waited for its last forward


def test_the_steady_reserve_is_the_allocator_s_peak_above_an_emptied_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import steady
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
    monkeypatch.setattr(steady, "time_back_to_back", run)
    assert steady.steady_reserve(lambda: None, 4) == 700
    assert calls == ["sync", "empty", "reserved", "reset", "run 4", "sync"]


@pytest.mark.cuda
def test_the_steady_reserve_counts_what_a_host_running_ahead_freed_but_the_device_still_uses() -> None:
    # A forward that allocates a 64 MiB buffer on a side stream and frees it while the compute stream still has
    # work queued that uses it, as an offloader that allocates each prefetched block afresh does. With the host
    # ahead of the device, each forward's buffer is still held when the next is allocated: the allocated count
    # holds one buffer, the reserve all of them.
    from benchmarks.steady import steady_reserve
    side, size = torch.cuda.Stream(), 64 * 2**20

    def forward() -> None:
        torch.cuda._sleep(20_000_000)  # the device falls behind the host
        with torch.cuda.stream(side):
            buffer = torch.empty(size, dtype=torch.uint8, device="cuda")
        torch.cuda.current_stream().wait_stream(side)
        buffer.record_stream(torch.cuda.current_stream())
        buffer.fill_(1)
        del buffer

    allocated_before = torch.cuda.memory_allocated()
    reserve = steady_reserve(forward, 4)
    assert torch.cuda.max_memory_allocated() - allocated_before <= size
    assert reserve >= 4 * size
