"""Compare configurations in interleaved rounds, in one process.

Host speed on the benchmark machines drifts by tens of percent between processes and over minutes, so
two configurations timed one after the other can differ by more than anything the configurations do.
Here every configuration is alive at once and each round times every configuration once, in an order
that rotates from round to round (A B C, B C A, C A B, ...). A ratio is then taken *within* each round,
where the host speed was nearly the same for both sides, and the figure reported is the median of
those per-round ratios with their spread beside it.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# One round's measurement of one configuration: a list of per-iteration milliseconds.
Timer = Callable[[], Sequence[float]]


def _median(values: Sequence[float]) -> float:
    """The median, NaN when any value is: a configuration that failed in some round (its timer gives NaN
    there) has no figure, where ``statistics.median`` would return a plausible one from the other rounds."""
    return math.nan if any(math.isnan(v) for v in values) else float(statistics.median(values))


@dataclasses.dataclass(frozen=True)
class Interleaved:
    """Per-configuration round medians (ms), in the order the rounds ran; ``leads``, for configurations timed
    with a lead forward (``benchmarks/steady.py``), that forward's ms in each round."""

    rounds: dict[str, list[float]]
    leads: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def median_ms(self, name: str) -> float:
        return _median(self.rounds[name])

    def spread(self, name: str) -> float:
        """(slowest round - fastest round) / median round, for ``name``."""
        values = self.rounds[name]
        median = _median(values)
        return math.nan if math.isnan(median) else (max(values) - min(values)) / median

    def ratios(self, name: str, reference: str) -> list[float]:
        """``name`` over ``reference``, round by round."""
        return [a / b for a, b in zip(self.rounds[name], self.rounds[reference])]

    def ratio(self, name: str, reference: str) -> float:
        """Median of the per-round ratios of ``name`` to ``reference``."""
        return _median(self.ratios(name, reference))

    def ratio_spread(self, name: str, reference: str) -> tuple[float, float]:
        """(lowest, highest) per-round ratio of ``name`` to ``reference``."""
        values = self.ratios(name, reference)
        if any(math.isnan(v) for v in values):
            return math.nan, math.nan
        return float(min(values)), float(max(values))

    def as_dict(self) -> dict[str, Any]:
        return {name: {"ms": self.median_ms(name), "spread": self.spread(name), "rounds_ms": list(values)}
                for name, values in self.rounds.items()}


def run_interleaved(timers: Mapping[str, Timer], rounds: int) -> Interleaved:
    """Runs every timer once per round, rotating the order; keeps each round's median per timer."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(timers)
    result: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            result[name].append(_median(timers[name]()))
    return Interleaved(result)
