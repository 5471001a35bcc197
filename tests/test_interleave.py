"""Interleaved rounds: order rotates, per-round ratios are taken within a round."""
from __future__ import annotations

import pytest

from benchmarks.interleave import run_interleaved


def test_rounds_rotate_the_order_and_ratios_are_taken_within_a_round() -> None:
    order: list[str] = []
    drift = iter([1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0])  # the host slows down round by round

    def timer(name: str, cost: float):
        def run() -> list[float]:
            order.append(name)
            return [cost * next(drift)]
        return run

    result = run_interleaved({"a": timer("a", 10.0), "b": timer("b", 20.0), "c": timer("c", 5.0)}, rounds=3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert result.rounds == {"a": [10.0, 20.0, 30.0], "b": [20.0, 40.0, 60.0], "c": [5.0, 10.0, 15.0]}
    assert result.ratio("b", "a") == 2.0 and result.ratio_spread("b", "a") == (2.0, 2.0)
    assert result.median_ms("a") == 20.0 and result.spread("a") == 1.0


def test_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        run_interleaved({"a": lambda: [1.0]}, rounds=0)


def test_a_configuration_that_failed_in_a_round_has_no_figure() -> None:
    """Its timer gives NaN from the failing round on: every figure over those rounds is NaN (its own and every
    ratio to it), never a plausible median of the rounds that happened to run."""
    import math

    calls = {"n": 0}

    def failing() -> list[float]:
        calls["n"] += 1
        return [10.0] if calls["n"] < 3 else [float("nan")]  # fails in the last round

    result = run_interleaved({"ref": failing, "b": lambda: [12.0]}, rounds=3)
    assert result.rounds["ref"][:2] == [10.0, 10.0] and math.isnan(result.rounds["ref"][2])
    assert math.isnan(result.median_ms("ref")) and math.isnan(result.spread("ref"))
    assert math.isnan(result.ratio("b", "ref")) and all(math.isnan(v) for v in result.ratio_spread("b", "ref"))
    assert result.median_ms("b") == 12.0 and result.spread("b") == 0.0
