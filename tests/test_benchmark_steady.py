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

