"""The host-to-device link's speed in every round of an interleaved session, beside the forwards it is timed with.

A transfer-bound row's floor divides the bytes moved by the peak H2D that one probe measured before the section.
On the H200 machines the link itself drifts: the same 1 GiB probe read 55.5 GB/s on one machine and 50.6 GB/s on
another the same day, and in one run the transfer-bound CUDA-graph replays took 1.27-1.32x that floor while a
standalone check of graph copies on the next machine ran at the peak. One pinned copy per round, timed like the
forwards (CUDA events on the current stream), tells a slow link from a slow offloader: the models section reports
the link's speed over its rounds, and each transfer-bound ext row against the floor at each round's own link,
max(resident, bytes x that round's time per byte), beside the floor its target is set on.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from benchmarks.utils import GB, MiB

__all__ = ["PROBE_BYTES", "LinkProbe", "describe_link", "link_floors", "link_gbps"]

PROBE_BYTES = 256 * MiB  # at the peak on the H200 (the bandwidth section: 55.3 GB/s at 256 MiB, 55.2 at 1 GiB)


class LinkProbe:
    """One pinned host buffer and its device target; :meth:`copy` moves ``nbytes`` host to device, asynchronously."""

    def __init__(self, device: torch.device, nbytes: int = PROBE_BYTES) -> None:
        if nbytes <= 0:
            raise ValueError(f"the probe needs a positive size, got {nbytes} bytes")
        self.nbytes = nbytes
        self.source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.target = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(self) -> None:
        self.target.copy_(self.source, non_blocking=True)


def link_gbps(nbytes: int, round_ms: Sequence[float]) -> list[float]:
    """Each round's link speed, GB/s, from the probe's ms in that round."""
    return [nbytes / (ms * 1e-3) / GB for ms in round_ms]


def link_floors(resident: Sequence[float], moved_bytes: int, probe_bytes: int,
                probe_ms: Sequence[float]) -> list[float]:
    """Per round: max(resident, ``moved_bytes`` at the time per byte the probe took in that round)."""
    if len(resident) != len(probe_ms):
        raise ValueError(f"one probe per round: {len(resident)} rounds of the forward, {len(probe_ms)} of the probe")
    return [max(r, moved_bytes * ms / probe_bytes) for r, ms in zip(resident, probe_ms)]


def describe_link(nbytes: int, round_ms: Sequence[float], peak_gbps: float | None) -> str:
    """The link over the rounds, against the section's probe: 'median GB/s [lowest, highest] (x the peak)'."""
    speeds = link_gbps(nbytes, round_ms)
    median = float(statistics.median(speeds))
    text = f"{median:.1f} GB/s [{min(speeds):.1f}, {max(speeds):.1f}] over {len(speeds)} rounds"
    return text + (f", {median / peak_gbps:.3f}x the section's peak probe ({peak_gbps:.1f} GB/s)" if peak_gbps else "")
