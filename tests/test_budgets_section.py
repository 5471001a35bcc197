"""The budgets benchmark section's grid and summary (pure parts; the section itself runs in the suite)."""
from __future__ import annotations

from benchmarks.budgets import grid, summarize
from fastoffload_ext.planning import BlockCosts

MiB = 1024**2


def test_grid_holds_only_configurations_that_fit_and_runs_each_once() -> None:
    costs = BlockCosts([1.0] * 8, [10 * MiB] * 8, 50.0, activation_bytes=MiB)
    configs = grid(costs, 2 * 10 * MiB + MiB)  # room for two slots and nothing else
    # Deeper prefetch does not fit; first-0 runs the same as spread-0, so it is not run twice.
    assert configs == {"spread0/d1": {"resident_blocks": (), "prefetch_depth": 1}}
    roomy = grid(costs, 100 * 10 * MiB)
    # Every block fits at every depth: one configuration, whatever its depth.
    assert list(roomy) == ["spread8/d1"]
    mid = grid(costs, 6 * 10 * MiB + MiB)
    assert mid == {"spread4/d1": {"resident_blocks": (1, 3, 5, 7), "prefetch_depth": 1},
                   "spread3/d2": {"resident_blocks": (1, 4, 6), "prefetch_depth": 2},
                   "spread2/d3": {"resident_blocks": (2, 6), "prefetch_depth": 3},
                   "first4/d1": {"resident_blocks": 4, "prefetch_depth": 1}}


def test_summary_lines() -> None:
    rows = [{"workload": "W1", "budget": "50%", "plan": "8/16 d1", "ms": 35.0, "x_best": 1.01, "best": "plan",
             "x_ideal": 1.02, "x_floor": 0.52, "pass": True},
            {"workload": "W1", "depth": 2, "x_depth1": 0.99, "ratio_lo": 0.98, "ratio_hi": 1.01}]
    assert summarize(rows) == [
        "W1 50%: plan 8/16 d1 35.00 ms = 1.010x best grid (plan), 1.020x ideal, 0.520x floor, pass True",
        "W1 depth 2: 0.990x depth 1 (rounds 0.980..1.010)"]
