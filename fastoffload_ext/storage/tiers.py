"""The host budget the disk tier is planned under: bytes, None, or "auto".

With ``host_budget="auto"`` (the default) it is what this process may really use (``planning.memory``:
the cgroup v2 limit and MemAvailable, minus a margin), less what the build itself puts in host memory
beside the blocks, so a checkpoint larger than the host's RAM runs with the rest on disk. Which blocks
then stay on disk is ``planning.tiers.plan_tiers`` (re-exported here).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning import memory
from fastoffload_ext.planning.budgets import AUTO, format_bytes
from fastoffload_ext.planning.tiers import TierPlan, plan_tiers

logger = logging.getLogger(__name__)

__all__ = ["HostBudget", "TierPlan", "check_host_budget", "plan_tiers", "resolve_host_budget"]


@dataclass(frozen=True)
class HostBudget:
    """The host budget the tiers are planned under, and what to call it in a refusal."""

    bytes: int | None  # None: no limit
    source: str


def check_host_budget(value: object) -> int | None:
    """``host_budget`` as a byte count (None: no limit)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise OffloadConfigError(f"fastoffload: host_budget must be None or a byte count >= 0, got {value!r}")
    return value


def resolve_host_budget(value: object, other_host_bytes: int = 0, credit_bytes: int = 0) -> HostBudget:
    """``host_budget`` (bytes, None or "auto") as the bytes the tiers may pin.

    other_host_bytes: what the build puts in host memory besides the pinned blocks (the resident
        weights when the device is the host); "auto" leaves room for it.
    credit_bytes: host bytes the offloaded blocks hold now, which the build frees block by block.
    """
    if value != AUTO:
        budget = check_host_budget(value)
        return HostBudget(budget, f"host_budget={budget} bytes")
    host = memory.probe_host()
    usable = max(0, host.usable + credit_bytes - other_host_bytes)
    logger.info("host_budget='auto': %d bytes for the offloaded blocks (%s; %d bytes kept for the rest of the "
                "model, %d bytes of blocks freed by the build)", usable, host.describe(), other_host_bytes,
                credit_bytes)
    return HostBudget(usable, f"the host memory this process may use ({format_bytes(usable)}: "
                              f"{host.describe()}, less {format_bytes(other_host_bytes)} for the weights kept on "
                              "the host)")
