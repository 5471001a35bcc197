"""Which offloaded blocks keep a host copy and which stay on disk, under a host-memory budget.

The budget covers what offload pins in host memory for the block list: the host-tier blocks' packed
regions plus the disk tier's staging ring (``staging_buffers`` buffers of the largest block). With
``host_budget="auto"`` (the default) it is what this process may really use (``planning.memory``: the
cgroup v2 limit and MemAvailable, minus a margin), less what the build itself puts in host memory
beside the blocks, so a checkpoint larger than the host's RAM runs with the rest on disk. The
disk-tier blocks are spread evenly over the forward instead of bunched at the end: each disk read then
has the compute and copy time of the host blocks before it to hide behind, and the reader is never
idle for long stretches while the staging ring is full.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning import memory
from fastoffload_ext.planning.budgets import AUTO, format_bytes

logger = logging.getLogger(__name__)

__all__ = ["HostBudget", "TierPlan", "check_host_budget", "plan_tiers", "resolve_host_budget"]


@dataclass(frozen=True)
class TierPlan:
    """Block positions (0 = first offloaded block) per tier, and the host bytes the plan pins."""

    host: tuple[int, ...]
    disk: tuple[int, ...]
    staging_buffers: int
    staging_bytes: int  # all staging buffers together
    host_bytes: int     # host-tier regions + staging

    def on_disk(self, position: int) -> bool:
        return position in self.disk


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


def _spread(count: int, chosen: int) -> list[int]:
    """``chosen`` positions out of ``count``, evenly spaced."""
    if chosen <= 0:
        return []
    return sorted({min(count - 1, int((j + 0.5) * count / chosen)) for j in range(chosen)})


def plan_tiers(block_bytes: Sequence[int], host_budget: int | None, staging_buffers: int,
               source: str | None = None) -> TierPlan:
    """Every block in the host tier when it fits; otherwise as many as fit beside the staging ring.

    source: how a refusal names the budget (default ``host_budget=N bytes``).
    """
    total = sum(block_bytes)
    everything = tuple(range(len(block_bytes)))
    if host_budget is None or total <= host_budget or not block_bytes:
        return TierPlan(everything, (), 0, 0, total)
    staging = min(staging_buffers, len(block_bytes)) * max(block_bytes)
    if staging > host_budget:
        raise OffloadConfigError(
            f"fastoffload: {source or f'host_budget={host_budget} bytes'} cannot hold even the disk tier's staging "
            f"ring ({staging_buffers} buffer(s) of the largest block, {max(block_bytes)} bytes each = {staging}); "
            "raise host_budget (or free host memory), or lower DiskOptions.staging_buffers (at least 1)")
    for keep in range(len(block_bytes) - 1, -1, -1):
        host = _spread(len(block_bytes), keep)
        host_bytes = sum(block_bytes[i] for i in host)
        if host_bytes + staging <= host_budget:
            disk = tuple(i for i in everything if i not in host)
            buffers = min(staging_buffers, len(disk))
            staging = buffers * max(block_bytes[i] for i in disk)  # what the engine allocates
            plan = TierPlan(tuple(host), disk, buffers, staging, host_bytes + staging)
            logger.info("Disk tier: %d of %d blocks stay on disk (host budget %d bytes, %d pinned)", len(disk),
                        len(block_bytes), host_budget, plan.host_bytes)
            return plan
    raise AssertionError("unreachable: zero host blocks always fit once the staging ring does")
