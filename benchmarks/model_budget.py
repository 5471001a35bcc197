"""The least device budget at which the planner reaches the floor target where depth 1 cannot.

Where ext with every list offloaded misses ``EXT_TARGET`` x floor because the depth-k schedule bound
is above it (``benchmarks/schedule_bound.py``), the fix is to keep some blocks resident, which costs
device memory. This finds the smallest ``device_budget`` whose plan (``plan_offload`` on the cost table
measured in the same rounds: the block clock's per-block compute, the blocks' bytes, peak H2D) is
predicted at or under the target, by bisection over the budget (a larger budget never plans slower).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning import BlockCosts, OffloadPlan, module_packed_bytes, plan_offload

BISECTION_STEPS = 14  # the budget to within (all blocks / 2^14): a few MiB on a 24 GB model


def block_costs(blocks: Sequence[nn.Module], compute_ms: Sequence[float], other_ms: float, h2d_gbps: float,
                activation_bytes: int) -> BlockCosts:
    return BlockCosts(compute_ms=tuple(compute_ms), block_bytes=tuple(module_packed_bytes(b) for b in blocks),
                      h2d_gbps=h2d_gbps, other_ms=max(0.0, other_ms), activation_bytes=activation_bytes)


def _plan(costs: BlockCosts, budget: int) -> OffloadPlan | None:
    try:
        return plan_offload(costs, budget)
    except OffloadConfigError:  # nothing fits this budget
        return None


def least_budget_plan(costs: BlockCosts, target_ms: float) -> OffloadPlan | None:
    """The plan at the smallest device budget predicted at or under ``target_ms``; None when even every
    block resident is not."""
    high = sum(costs.block_bytes) + costs.activation_bytes + 2 * max(costs.block_bytes)
    best = _plan(costs, high)
    if best is None or best.predicted_step_ms > target_ms:
        return None
    low = costs.activation_bytes
    for _ in range(BISECTION_STEPS):
        middle = (low + high) // 2
        plan = _plan(costs, middle)
        if plan is not None and plan.predicted_step_ms <= target_ms:
            high, best = middle, plan
        else:
            low = middle
    return best
