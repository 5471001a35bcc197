"""Progress lines with wall time, host RSS and GPU memory, for sections that handle models of tens of GB.

A section that holds several host copies of a 28 GB model can be killed by the kernel (host OOM) or by
the command's time limit with no row written. Each :meth:`PhaseLog.mark` prints one timestamped line to
stderr at once (so a killed run still shows where it was and how much memory it held) and keeps it
for the section's notes.
"""
from __future__ import annotations

import sys
import time

import torch

from benchmarks.utils import GB, rss_bytes, rss_high_water_bytes


class PhaseLog:
    """Timestamped phase lines: ``[name HH:MM:SS +s] rss X GB (high-water Y GB) gpu Z GB: text``."""

    def __init__(self, name: str, echo: bool = True) -> None:
        self.name = name
        self.echo = echo
        self.started = time.monotonic()
        self.lines: list[str] = []
        self.peak_rss = 0

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def mark(self, text: str) -> str:
        rss, high = rss_bytes(), rss_high_water_bytes()
        self.peak_rss = max(self.peak_rss, rss, high)
        gpu = ""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            gpu = f" gpu {torch.cuda.memory_allocated() / GB:.1f} GB"
        line = (f"[{self.name} {time.strftime('%H:%M:%S')} +{self.elapsed_s():.0f}s] rss {rss / GB:.1f} GB "
                f"(high-water {high / GB:.1f} GB){gpu}: {text}")
        self.lines.append(line)
        if self.echo:
            print(line, file=sys.stderr, flush=True)
        return line

    def summary(self) -> str:
        """One line for the notes: every phase's RSS, and the largest seen."""
        # Without the wall-clock stamp (the elapsed seconds say when) and the section name.
        return f"{self.name}: host RSS peak {self.peak_rss / GB:.1f} GB; phases: " + " | ".join(
            line.split(" ", 2)[-1].replace("] ", " ", 1) for line in self.lines)
