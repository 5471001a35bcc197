"""Which offloaded blocks keep a pinned host copy and which stay on disk, under a host-memory budget.

The budget covers what offload pins in host memory for the block list: the host-tier blocks' packed
regions (``region_bytes``: a large block's with PLACE_SLACK bytes more, for the same reason as the
staging buffers' below) plus the disk tier's staging ring (``staging_buffers`` buffers of the largest block, each with
STAGING_SLACK bytes more: a block sits in its buffer at its file offsets' page alignment, so that it is
read with O_DIRECT straight into place, with a page before and after it for the reads' edges). The
disk-tier blocks are spread evenly over the forward instead of bunched at the end: each disk read then
has the compute and copy time of the host blocks before it to hide behind, and the reader is never
idle for long stretches while the staging ring is full. A pure function of sizes and the budget: the
build (``storage``) applies it, and the planner's simulation (``simulate.py``) predicts with it.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from fastoffload_ext.errors import OffloadConfigError

logger = logging.getLogger(__name__)

__all__ = ["PLACED_MIN_BYTES", "PLACE_SLACK", "STAGING_SLACK", "TierPlan", "plan_tiers", "region_bytes"]

# A placed region's bytes beyond its data (the engine's PinnedPool::kPlaceSlack): every staging buffer
# has them, and so has a host-tier block of at least PLACED_MIN_BYTES (kPlacedMinBytes); a smaller
# block's region is its bytes.
PLACE_SLACK = 3 * 4096
STAGING_SLACK = PLACE_SLACK  # per staging buffer, beyond the largest disk-tier block
PLACED_MIN_BYTES = 4 << 20


def region_bytes(nbytes: int) -> int:
    """The host bytes a host-tier block of ``nbytes`` built from a checkpoint pins."""
    return nbytes + PLACE_SLACK if nbytes >= PLACED_MIN_BYTES else nbytes


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
    total = sum(region_bytes(b) for b in block_bytes)
    everything = tuple(range(len(block_bytes)))
    if host_budget is None or total <= host_budget or not block_bytes:
        return TierPlan(everything, (), 0, 0, total)
    staging = min(staging_buffers, len(block_bytes)) * (max(block_bytes) + STAGING_SLACK)
    if staging > host_budget:
        raise OffloadConfigError(
            f"fastoffload: {source or f'host_budget={host_budget} bytes'} cannot hold even the disk tier's staging "
            f"ring ({staging_buffers} buffer(s) of the largest block, {max(block_bytes) + STAGING_SLACK} bytes each "
            f"= {staging}); "
            "raise host_budget (or free host memory), or lower DiskOptions.staging_buffers (at least 1)")
    for keep in range(len(block_bytes) - 1, -1, -1):
        host = _spread(len(block_bytes), keep)
        host_bytes = sum(region_bytes(block_bytes[i]) for i in host)
        if host_bytes + staging <= host_budget:
            disk = tuple(i for i in everything if i not in host)
            buffers = min(staging_buffers, len(disk))
            staging = buffers * (max(block_bytes[i] for i in disk) + STAGING_SLACK)  # what the engine allocates
            plan = TierPlan(tuple(host), disk, buffers, staging, host_bytes + staging)
            logger.debug("Disk tier: %d of %d blocks stay on disk (host budget %d bytes, %d pinned)", len(disk),
                         len(block_bytes), host_budget, plan.host_bytes)
            return plan
    raise AssertionError("fastoffload: internal error: zero host blocks always fit once the staging ring does; report "
                         "this with the block sizes and host_budget")
