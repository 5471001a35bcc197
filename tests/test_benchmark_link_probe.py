"""The models section's per-round link probe: its copy, its speeds and the floor at each round's link."""
from __future__ import annotations

import pytest
import torch

from benchmarks.link_probe import PROBE_BYTES, LinkProbe, describe_link, link_floors, link_gbps
from benchmarks.utils import GB, MiB


def test_a_round_s_link_speed_and_floor_come_from_that_round_s_probe() -> None:
    assert link_gbps(PROBE_BYTES, [5.0, 10.0]) == pytest.approx([PROBE_BYTES / 5e-3 / GB, PROBE_BYTES / 10e-3 / GB])
    # Twice the probe's bytes: twice its time, unless the resident forward is longer in that round.
    assert link_floors([10.0, 60.0, 30.0], 2 * PROBE_BYTES, PROBE_BYTES, [20.0, 25.0, 20.0]) == [40.0, 60.0, 40.0]
    with pytest.raises(ValueError, match="one probe per round: 2 rounds of the forward, 1 of the probe"):
        link_floors([10.0, 60.0], PROBE_BYTES, PROBE_BYTES, [20.0])


def test_the_link_is_described_against_the_section_s_peak() -> None:
    nbytes = int(55 * GB * 1e-3)  # 55 GB/s at 1 ms
    text = describe_link(nbytes, [1.0, 1.1, 1.0 * 55 / 50], peak_gbps=55.0)
    assert text == "50.0 GB/s [50.0, 55.0] over 3 rounds, 0.909x the section's peak probe (55.0 GB/s)"
    assert describe_link(nbytes, [1.0], None) == "55.0 GB/s [55.0, 55.0] over 1 rounds"


def test_the_probe_copies_its_whole_buffer() -> None:
    probe = LinkProbe(torch.device("cpu"), nbytes=3 * MiB)
    probe.source.copy_(torch.arange(3 * MiB, dtype=torch.int64).to(torch.uint8))
    probe.copy()
    assert torch.equal(probe.target, probe.source) and probe.nbytes == 3 * MiB
    with pytest.raises(ValueError, match="positive size, got 0 bytes"):
        LinkProbe(torch.device("cpu"), nbytes=0)


@pytest.mark.cuda
def test_the_probe_copies_from_pinned_memory_into_device_memory() -> None:
    probe = LinkProbe(torch.device("cuda"))
    assert probe.source.is_pinned() and probe.target.is_cuda
    probe.source.fill_(7)
    probe.copy()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    probe.copy()
    end.record()
    end.synchronize()
    assert bool((probe.target == 7).all()) and start.elapsed_time(end) > 0
