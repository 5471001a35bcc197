"""The planner's answer: which blocks stay resident, how deep to prefetch, what it costs and why.

``enable_layerwise_offload(model, plan=plan)`` applies one; ``group.stats()["plan"]`` reports the
plan a group runs with.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from typing import Any

from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning.budgets import format_bytes
from fastoffload_ext.planning.costs import BlockCosts

logger = logging.getLogger(__name__)

STEP_TIME_ERROR = ("fastoffload: a measured step must be a time in milliseconds > 0 (the wall time of one forward, the "
                   "device drained), got {value!r}")


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """A resident set and a prefetch depth for one block list, with the figures behind the choice.

    device_bytes = resident_bytes + num_slots x slot_bytes + staging_bytes + activation_bytes: what a
    step may hold on the device (never above ``device_budget``). num_slots is the eager ring's
    ``prefetch_depth + 1``; with ``cuda_graph`` (``plan_offload(..., cuda_graph=True)``) it also covers the
    fixed slots of an ``OffloadedCUDAGraph`` capture, more where ``prefetch_depth + 1`` does not divide
    the offloaded blocks (``slots.py``); a capture that needs more than a budgeted plan counts and does
    not fit its budget is refused. host_bytes: the offloaded blocks' pinned host copies, which are also
    the bytes a step copies (compressed where the blocks are: ``compressed_blocks`` of them, against
    ``raw_offloaded_bytes`` uncompressed). predicted_step_ms
    comes from the pipeline simulation; ideal_ms is max(compute of the step, moved bytes / bandwidth),
    the floor no schedule can beat with this resident set (with host figures also the host's dispatch of
    the step); overhead_ms is the hooks' fixed cost per step that the prediction includes and the ideal
    does not. host_ms is the host's predicted time to dispatch a step (hooks included) and device_ms the
    step the device timelines alone give; the larger sets the prediction (``host_bound``). With a
    disk tier in the costs, disk_blocks are the offloaded blocks read from disk every step and disk_ms
    that reading's time at the disk's bandwidth (``disk_bound`` when it sets the ideal).
    """

    blocks: int
    resident: tuple[int, ...]
    prefetch_depth: int
    num_slots: int
    slot_bytes: int
    resident_bytes: int
    host_bytes: int
    activation_bytes: int
    device_bytes: int
    device_budget: int | None
    host_budget: int | None
    predicted_step_ms: float
    ideal_ms: float
    compute_ms: float
    copy_ms: float
    candidates: int
    why: str
    costs: BlockCosts = dataclasses.field(repr=False, compare=False)
    raw_offloaded_bytes: int = 0
    compressed_blocks: int = 0
    staging_bytes: int = 0
    overhead_ms: float = 0.0
    host_ms: float = 0.0    # the host's predicted time to dispatch a step, hooks included (0: not timed)
    device_ms: float = 0.0  # the step the device timelines alone give (compute, exposed copies)
    host_hooks_ms: float = 0.0  # of host_ms, the offload hooks' host cost per step
    disk_blocks: int = 0    # offloaded blocks the disk tier reads every step (costs.disk)
    disk_ms: float = 0.0    # their reads per step at the disk's bandwidth
    tolerance: float = 0.15  # a measured step this far off the reference calls for a re-plan
    # The step as timed right after a calibration applied this plan (0: never timed). Drift is judged
    # against it when there is one: the prediction carries the calibration's bias and the host's drift
    # (a host-bound model's measured step was 0.52-1.35 of it on the H200), which must not read as a
    # resolution change every step.
    measured_step_ms: float = 0.0
    cuda_graph: bool = False  # num_slots and device_bytes count a CUDA-graph capture's fixed slots

    @property
    def offloaded(self) -> tuple[int, ...]:
        resident = set(self.resident)
        return tuple(b for b in range(self.blocks) if b not in resident)

    @property
    def compressed(self) -> bool:
        """The plan counts compressed copies: fewer bytes move (and sit pinned) than the blocks hold."""
        return self.compressed_blocks > 0

    @property
    def host_bound(self) -> bool:
        """The host's dispatch, not the device, sets the predicted step."""
        return self.host_ms > 0 and self.host_ms > self.device_ms

    @property
    def disk_bound(self) -> bool:
        """The disk tier's reads, not the copies or the compute, set the step's floor."""
        return self.disk_ms > 0 and self.disk_ms >= self.ideal_ms

    @property
    def calibrated(self) -> bool:
        return self.costs.calibrated

    @property
    def reference_step_ms(self) -> float:
        """What a measured step is compared with: the step timed after the plan was applied, else the
        prediction."""
        return self.measured_step_ms if self.measured_step_ms > 0 else self.predicted_step_ms

    def drifted(self, measured_step_ms: float) -> bool:
        """Whether a measured step is further from :attr:`reference_step_ms` than ``tolerance`` (relative)."""
        if isinstance(measured_step_ms, bool) or not isinstance(measured_step_ms, numbers.Real) or \
                not math.isfinite(measured_step_ms) or measured_step_ms <= 0:
            # NaN compares as no drift and a negative time as drift: neither is a step to judge the plan by.
            raise OffloadConfigError(STEP_TIME_ERROR.format(value=measured_step_ms))
        if not self.calibrated or self.reference_step_ms <= 0:
            return True
        return abs(measured_step_ms / self.reference_step_ms - 1.0) > self.tolerance

    def same_layout(self, other: OffloadPlan) -> bool:
        """Same resident set and depth: applying ``other`` instead of this one changes nothing."""
        return self.resident == other.resident and self.prefetch_depth == other.prefetch_depth

    def as_dict(self) -> dict[str, Any]:
        return {
            "blocks": self.blocks, "resident": list(self.resident), "prefetch_depth": self.prefetch_depth,
            "num_slots": self.num_slots, "slot_bytes": self.slot_bytes, "resident_bytes": self.resident_bytes,
            "host_bytes": self.host_bytes, "activation_bytes": self.activation_bytes,
            "device_bytes": self.device_bytes, "device_budget": self.device_budget,
            "host_budget": self.host_budget, "predicted_step_ms": self.predicted_step_ms,
            "ideal_ms": self.ideal_ms, "compute_ms": self.compute_ms, "copy_ms": self.copy_ms,
            "calibrated": self.calibrated, "candidates": self.candidates, "why": self.why,
            "compressed": self.compressed, "compressed_blocks": self.compressed_blocks,
            "raw_offloaded_bytes": self.raw_offloaded_bytes, "staging_bytes": self.staging_bytes,
            "overhead_ms": self.overhead_ms, "host_ms": self.host_ms, "device_ms": self.device_ms,
            "host_hooks_ms": self.host_hooks_ms, "host_bound": self.host_bound,
            "measured_step_ms": self.measured_step_ms, "tolerance": self.tolerance,
            "disk_blocks": self.disk_blocks, "disk_ms": self.disk_ms, "disk_bound": self.disk_bound,
            "cuda_graph": self.cuda_graph,
        }

    def explain(self) -> str:
        """The plan in a few lines: layout, memory, bytes moved (compressed or raw), the host's dispatch where
        it was timed, prediction and why."""
        moved = (f"{format_bytes(self.host_bytes)} compressed from {format_bytes(self.raw_offloaded_bytes)} "
                 f"({self.compressed_blocks} coded blocks, {format_bytes(self.staging_bytes)} device staging)"
                 if self.compressed else f"{format_bytes(self.host_bytes)} raw")
        # The eager ring's slots (num_slots may also count a capture's fixed ones, which the prediction does not).
        if self.offloaded and self.prefetch_depth + 1 >= len(self.offloaded):
            moved = f"none after the first step ({format_bytes(self.host_bytes)} stays in the slots)"
        lines = [
            f"resident {len(self.resident)} of {self.blocks} blocks {list(self.resident)}, prefetch_depth "
            f"{self.prefetch_depth}, {self.num_slots} slots x {format_bytes(self.slot_bytes)}"
            + (" (counting a CUDA graph's fixed slots)" if self.cuda_graph else ""),
            f"device {format_bytes(self.device_bytes)} of budget {format_bytes(self.device_budget)} (activation "
            f"reserve {format_bytes(self.activation_bytes)}); host pinned "
            + (f"at most {format_bytes(self.costs.disk.host_budget)} (host tier and staging ring)"
               if self.disk_blocks and self.costs.disk is not None else format_bytes(self.host_bytes)),
            f"moved per step: {moved}",
            f"predicted {self.predicted_step_ms:.3f} ms/step, ideal {self.ideal_ms:.3f} ms, hook overhead "
            f"{self.overhead_ms:.3f} ms"
            + (f", measured {self.measured_step_ms:.3f} ms/step once applied" if self.measured_step_ms > 0 else "")
            + f"; {self.why}",
        ]
        if self.disk_blocks:
            disk = self.costs.disk
            lines.insert(3, f"disk: {self.disk_blocks} offloaded blocks read every step, {self.disk_ms:.1f} ms at "
                            f"{disk.read_gbps if disk is not None else 0.0:.2f} GB/s"
                            + (": disk-bound" if self.disk_bound else ""))
        if self.host_ms > 0:
            lines.insert(3, f"host: dispatches a step in {self.host_ms:.3f} ms ({self.host_hooks_ms:.3f} ms of it the "
                            f"hooks), the device's timelines alone {self.device_ms:.3f} ms"
                            + (": host-bound" if self.host_bound else ""))
        return "\n".join(lines)

    def __str__(self) -> str:
        return (f"OffloadPlan: {len(self.resident)} of {self.blocks} blocks resident {list(self.resident)}, "
                f"prefetch_depth {self.prefetch_depth} ({self.num_slots} slots x {format_bytes(self.slot_bytes)}), "
                f"device {format_bytes(self.device_bytes)} of {format_bytes(self.device_budget)}, predicted "
                f"{self.predicted_step_ms:.3f} ms/step (ideal {self.ideal_ms:.3f} ms)"
                + (f", {self.compressed_blocks} blocks compressed" if self.compressed else "") + f". {self.why}")


__all__ = ["STEP_TIME_ERROR", "OffloadPlan"]
