"""What ``enable_layerwise_offload`` set up on one model, kept on the model as one attribute."""
from __future__ import annotations

import weakref
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from fastoffload_ext import codec
from fastoffload_ext.engine import sharing
from fastoffload_ext.engine.messages import COPY_ERROR, STALE_GROUP_ERROR
from fastoffload_ext.engine.run_order import RunOrderWatch
from fastoffload_ext.engine.state import BlockOffloadState, host_values_of
from fastoffload_ext.engine.weak import WeakModule
from fastoffload_ext.errors import OffloadStateError
from fastoffload_ext.planning import replan as replanning
from fastoffload_ext.planning.costs import BlockCosts
from fastoffload_ext.planning.plan import OffloadPlan

__all__ = ["GROUP_ATTRIBUTE", "LayerwiseOffloadGroup", "get_offload_group"]

GROUP_ATTRIBUTE = "_fastoffload_group"


class LayerwiseOffloadGroup:
    """What ``enable_layerwise_offload`` set up on one model: its states, engine and settings."""

    model_ref = WeakModule()  # held weakly: the model holds the group
    # Cuts the states' prefetch ring when the model is collected (set once enabled: free_with).
    finalizer: weakref.finalize | None = None

    def __reduce_ex__(self, protocol: object) -> Any:
        raise OffloadStateError(COPY_ERROR)  # see messages.COPY_ERROR

    def __init__(self, model: nn.Module, list_name: str, blocks: nn.ModuleList, device: torch.device, backend: str,
                 prefetch_depth: int, resident_blocks: int | Collection[int], cyclic: bool, engine: Any = None) -> None:
        self.model_ref = model
        self.list_name = list_name
        self.blocks = blocks
        self.list_names: list[str] = [list_name]  # the attribute names of the offloaded lists, in ring order
        self.device = device
        self.backend = backend
        self.prefetch_depth = prefetch_depth
        # Indices of the blocks kept on the device, never hooked (an int: the first N); the others are
        # offloaded, and prefetched, in execution order.
        self.resident = (tuple(range(resident_blocks)) if isinstance(resident_blocks, int)
                         else tuple(sorted(resident_blocks)))
        self.resident_blocks = len(self.resident)
        self.offloaded_indices = tuple(i for i in range(len(blocks)) if i not in set(self.resident))
        self.cyclic = cyclic
        self.engine = engine
        self.plan: OffloadPlan | None = None  # the planner's plan this group runs, when a budget or "auto" chose it
        self.costs: BlockCosts | None = None  # the last calibration's cost table
        self.enable_kwargs: dict[str, Any] = {}  # what enable was given, for a re-plan
        self.share: sharing.HostShare | None = None  # set when the ranks of this host share the host copy
        self.compress_mode = "off"  # the engine's codec mode: "off", "on" or "auto" (fastoffload_ext.codec)
        self.states: list[BlockOffloadState] = []
        self.original_devices: list[torch.device] = []
        self.checkpoint: Any = None  # storage.source.CheckpointSource when built with weights=
        self.model_hooks: Any = None  # state_dict.ModelStateDictHooks: a refused load_state_dict changes nothing
        self.run_order: RunOrderWatch | None = None  # the order the first pass ran the blocks in

    def free_with(self, model: nn.Module) -> None:
        """Frees the host copy and the device slots as soon as ``model`` is collected while still offloaded
        (``disable_layerwise_offload`` runs it at once). Nothing of the offload refers to the model strongly
        (weak.py), so that is when its last reference goes, as for any module."""
        self.finalizer = weakref.finalize(model, _unlink, list(self.states))
        self.finalizer.atexit = False  # at exit the process frees everything anyway

    def stats(self) -> dict[str, Any]:
        """Sizes and counters of this offload, for logs and benchmarks."""
        self._check_current()
        result: dict[str, Any] = {
            "backend": self.backend,
            "device": str(self.device),
            "blocks": len(self.blocks),
            "offloaded_blocks": len(self.states),
            "resident_blocks": self.resident_blocks,
            "resident": list(self.resident),
            "prefetch_depth": self.prefetch_depth,
            "cyclic": self.cyclic,
            "weight_bytes": sum(state.weight_bytes() for state in self.states),
            "host_bytes": sum(state.host_bytes() for state in self.states),
        }
        result.update(self._engine_stats() if self.engine is not None else self._python_stats(result["host_bytes"]))
        result["plan"] = self.plan.as_dict() if self.plan is not None else None
        # "ring": the blocks ran in the order enable ringed them; "rewired": in another, which the prefetches now
        # follow; "watching": no full pass yet; "not learned": passes that skipped or repeated blocks (run_order.py).
        result["run_order"] = self.run_order.outcome if self.run_order is not None else "ring"
        return result

    def calibrate(self, step: Callable[[], Any], *, replan: bool = True, repeats: int = 5,
                  h2d_gbps: float | None = None) -> BlockCosts:
        """Measures this model's cost table by running ``step`` (one forward) and, with ``replan`` and a
        planned group, re-plans from it (see :meth:`replan`). Returns the cost table."""
        return replanning.calibrate(self, step, replan=replan, repeats=repeats, h2d_gbps=h2d_gbps)

    def replan(self, costs: BlockCosts | None = None) -> LayerwiseOffloadGroup:
        """Plans again from ``costs`` (default: the last calibration) under the budgets enable was given
        and, when the resident set or depth changes, offloads again with the new plan. Returns the group
        now on the model (``self`` when nothing changed). Called from another thread while a forward
        runs, it waits for that forward to finish before it changes the layout."""
        return replanning.replan(self, costs)

    def observe_step(self, measured_ms: float, step: Callable[[], Any] | None = None) -> bool:
        """Whether a measured step (wall time of one forward, the device drained) is further than the
        plan's tolerance from the step timed when a calibration applied the plan (before any calibration:
        from its prediction), as after a resolution or batch change: then calibrate again, which re-plans.
        Given ``step`` (one forward), a drifted group calibrates with it right away; the group on the model
        may then be a new one (``get_offload_group(model)``)."""
        self._check_current()
        drifted = self.plan is not None and self.plan.drifted(measured_ms)
        if drifted and step is not None:
            self.calibrate(step)
        return drifted

    def disk_blocks(self) -> int:
        """How many offloaded blocks stream from disk every step (built with ``weights=``; 0 otherwise)."""
        return sum(1 for state in self.states if getattr(state, "on_disk", False))

    def _check_current(self) -> None:
        # A disable or re-plan took this group off its model: its figures and its plan describe a layout
        # the model no longer runs.
        if get_offload_group(self.model_ref) is not self:
            raise OffloadStateError(STALE_GROUP_ERROR)

    def _engine_stats(self) -> dict[str, Any]:
        engine_stats = dict(self.engine.stats())
        pool_stats = dict(self.engine.pool.stats())
        disk: dict[str, Any] = {}
        if self.checkpoint is not None:
            disk_stats = dict(self.engine.disk_stats())
            # disk_reads_on_demand: reads of a block the staging ring had not read ahead (it ran out of the order
            # the ring reads in): all but the first pass's mean the forward's order keeps changing.
            disk = dict(disk_blocks=self.disk_blocks(),
                        disk_reads=disk_stats["reads"], disk_waits=disk_stats["waits"],
                        disk_reads_on_demand=disk_stats["out_of_order"],
                        staging_bytes=disk_stats["staging_count"] * disk_stats["staging_bytes"],
                        bytes_read=dict(self.engine.reader.stats())["bytes_read"])
        handles = [getattr(state, "handle", None) for state in self.states]
        return disk | dict(**codec.summarize(codec.block_stats(self.engine, handles), self.compress_mode),
                    pinned_bytes=pool_stats["pinned_bytes"], host_reserved_bytes=pool_stats["reserved_bytes"],
                    pin_seconds=pool_stats["pin_seconds"], slot_bytes=engine_stats["slot_bytes"],
                    num_slots=engine_stats["num_slots"], copies=engine_stats["copies"],
                    bytes_copied=engine_stats["bytes_copied"], sync_loads=engine_stats["sync_loads"],
                    prefetch_hits=engine_stats["prefetch_hits"], cache_hits=engine_stats["cache_hits"],
                    slots_replaced=engine_stats["slots_replaced"],
                    shared_bytes=pool_stats["shared_bytes"], shared_owned_bytes=pool_stats["shared_owned_bytes"],
                    shared_by=self.share.shared_by if self.share is not None else 0,
                    shared_owner=self.share is not None and self.share.owner)

    def _python_stats(self, host_bytes: int) -> dict[str, Any]:
        # torch's caching host allocator rounds every pinned tensor up to a power of two.
        pinned = 0
        if self.device.type == "cuda":
            pinned = sum(1 << max(int(t.untyped_storage().nbytes()) - 1, 0).bit_length()
                         for state in self.states for t in host_values_of(state).values())
        return dict(pinned_bytes=pinned, host_reserved_bytes=max(pinned, host_bytes), slot_bytes=0, num_slots=0)

    def __repr__(self) -> str:
        gone = "" if get_offload_group(self.model_ref) is self else ", no longer on its model"
        return (f"<LayerwiseOffloadGroup {self.list_name}: {len(self.states)} of {len(self.blocks)} blocks offloaded "
                f"to {self.device} by backend {self.backend!r}, prefetch_depth={self.prefetch_depth}{gone}>")


def _unlink(states: list[BlockOffloadState]) -> None:
    """Cuts the states' prefetch ring, the one cycle an offload keeps (each state refers to the next ones), once
    the model was collected: the states then go as soon as nothing else holds them, and with the last of them
    the engine, its pinned host copy and its device slots. A block the caller still holds keeps its state and
    the engine, and still runs (without prefetch)."""
    for state in states:
        unlink = getattr(state, "unlink", None)  # a state built by hand may lack it
        if unlink is not None:
            unlink()


def get_offload_group(model: nn.Module) -> LayerwiseOffloadGroup | None:
    """The offload set up on ``model`` by ``enable_layerwise_offload``, or None."""
    return getattr(model, GROUP_ATTRIBUTE, None)
