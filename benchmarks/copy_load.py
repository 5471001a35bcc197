"""Copy interference: the resident model's forward while pinned host-to-device copies stream on a side stream.

No offload is involved, yet on the H200 a resident DiT forward runs a few percent slower while copies stream
(docs/DESIGN.md, "Measured facts behind the defaults"): every layerwise offloader copies while the model
computes, so that share of an offloaded step is out of every offloader's reach. The models section times this
as one more configuration in its interleaved rounds, and reports each ext row against
max(resident with copies streaming, bytes / peak H2D) beside the usual floor. ``scripts/copy_interference.py``
is the same measurement on its own.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.utils import time_back_to_back

__all__ = ["CHUNK_BYTES", "CopyLoad"]

CHUNK_BYTES = 64 * 2**20  # one copy: as large as a DiT block's, so it runs at the PCIe peak
COVER_GBPS = 60e9  # above the measured peak (55 GB/s): the queued copies outlast the forward


class CopyLoad:
    """Pinned copies to queue on a side stream of ``device`` ahead of a timed forward."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.source = torch.empty(CHUNK_BYTES, dtype=torch.uint8).pin_memory()
        self.targets = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, device=device) for _ in range(2)]
        self.stream = torch.cuda.Stream(device)

    def copies_for(self, forward_ms: float) -> int:
        """How many copies outlast a forward of ``forward_ms`` at any reachable bandwidth."""
        return math.ceil(forward_ms * 1e-3 * COVER_GBPS / CHUNK_BYTES) + 4

    def queue(self, copies: int) -> None:
        """Queues ``copies`` copies on the side stream; returns at once (they run behind the host)."""
        with torch.cuda.stream(self.stream):
            for i in range(copies):
                self.targets[i % len(self.targets)].copy_(self.source, non_blocking=True)

    def time(self, forward: Callable[[], Any], copies: int) -> tuple[float, float]:
        """(device ms, host ms) of one ``forward`` with ``copies`` copies queued first (0: alone). The copies
        left when the forward ends finish outside the timed window."""
        torch.cuda.synchronize(self.device)
        self.queue(copies)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host_started = time.perf_counter()
        start.record()
        forward()
        end.record()
        host_ms = (time.perf_counter() - host_started) * 1e3
        end.synchronize()
        device_ms = start.elapsed_time(end)
        torch.cuda.synchronize(self.device)
        return device_ms, host_ms

    def timer(self, forward: Callable[[], Any], iters: int) -> Callable[[], list[float]]:
        """A round timer (``benchmarks/interleave.py``) timed like the other configurations of the models section
        (``benchmarks/steady.py``): a lead forward and ``iters`` more back to back, with copies queued first for
        all of them; returns the ``iters``. The number of copies per forward is set from the first forward's own
        time."""
        per_forward: list[int] = []

        def measure() -> list[float]:
            if not per_forward:
                per_forward.append(self.copies_for(self.time(forward, 0)[0]))
            torch.cuda.synchronize(self.device)
            self.queue(per_forward[0] * (iters + 1))
            times = time_back_to_back(forward, iters + 1)[1:]
            torch.cuda.synchronize(self.device)  # the copies left run off the clock, before the next turn
            return times
        return measure
