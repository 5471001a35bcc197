"""Forwards timed the way a denoising loop runs them: back to back, the host never waiting for the device.

A pipeline's denoising loop calls the transformer once a step and reads nothing back until the loop ends, so the
host runs ahead of the device, and an offloader's copies for the next step can start while this one computes.
Each turn of a configuration in the interleaved rounds (``benchmarks/interleave.py``) therefore runs one lead
forward and then ``iters`` timed ones back to back, each between two CUDA events on the current stream, and
waits once, at the end. The lead starts right after that wait of the turn before it, as a step after a readback
(``output.cpu()``) does: the host meets the device there, and only copies already queued run ahead of the step.
Its time is kept too (:attr:`SteadyTimer.leads`), so a table can show both kinds of step. The steady forwards
are the ones the targets are set on.

On the host (no CUDA) the host is the device: each forward is timed alone and there is no lead.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.utils import time_back_to_back

__all__ = ["SteadyTimer"]


class SteadyTimer:
    """A round timer: a lead forward, then ``iters`` steady ones, timed back to back; returns the steady ones.

    ``leads`` gets the lead's milliseconds at every call, one per round (nothing on the host)."""

    def __init__(self, forward: Callable[[], Any], iters: int, cuda: bool) -> None:
        if iters < 1:
            raise ValueError(f"iters must be >= 1, got {iters}")
        self.forward = forward
        self.iters = iters
        self.cuda = cuda
        self.leads: list[float] = []

    def __call__(self) -> list[float]:
        if not self.cuda:
            times = []
            for _ in range(self.iters):
                started = time.perf_counter_ns()
                self.forward()
                times.append((time.perf_counter_ns() - started) / 1e6)
            return times
        torch.cuda.current_stream().synchronize()  # the step after a readback starts here
        lead, *steady = time_back_to_back(self.forward, self.iters + 1)
        self.leads.append(lead)
        return steady
