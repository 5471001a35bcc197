"""How many device slots a layout holds: eager offload's ring, and the fixed slots of a captured graph.

Eager offload puts a copy in whichever of its ``prefetch_depth + 1`` slots is free (``SlotRing``), so
that many always suffice. A CUDA graph bakes in addresses, so each block needs the same slot on every
step, and any ``prefetch_depth + 1`` blocks in a row (around the wrap) need different ones: a proper
colouring of the cycle's power, which takes at least one slot more whenever ``prefetch_depth + 1`` does
not divide the block count (an odd cycle cannot be two-coloured: 5 blocks at depth 1 take 3 slots, not 2;
7 at depth 3 take 7). The planner counts the eager ring unless asked to count a capture
(``plan_offload(..., cuda_graph=True)``); ``engine/graphs.py`` refuses a capture whose extra slots a
device budget cannot hold. Pure functions, no torch: the planner and the capture set-up share them.
"""
from __future__ import annotations

from fastoffload_ext.errors import OffloadConfigError

__all__ = ["cyclic_slot_assignment", "cyclic_slot_count", "eager_slot_count", "planned_slot_count"]


def cyclic_slot_count(n_blocks: int, prefetch_depth: int) -> int:
    """The slots :func:`cyclic_slot_assignment` uses: ``ceil(L / floor(L / (depth + 1)))`` for ``L`` blocks
    (``depth + 1`` when it divides ``L``, else more), or ``L`` when ``L <= depth + 1``; 0 for no block."""
    if n_blocks < 1:
        return 0
    window = prefetch_depth + 1
    if n_blocks <= window:
        return n_blocks
    return -(-n_blocks // (n_blocks // window))


def cyclic_slot_assignment(n_blocks: int, prefetch_depth: int) -> tuple[list[int], int]:
    """A fixed slot for each of ``n_blocks`` blocks and the number of slots.

    Any ``prefetch_depth + 1`` cyclically consecutive blocks get different slots: the running block
    and the ones being prefetched never share one. The cycle is cut into
    ``groups = n_blocks // window`` runs of ``ceil(n_blocks / groups)`` or one fewer blocks, each run
    numbered from 0, so every run is at least a window long and no window sees a slot twice.

    That is ``prefetch_depth + 1`` slots only when it divides ``n_blocks`` (or ``n_blocks`` is smaller):
    otherwise MORE slots than eager offload and the planner's ``OffloadPlan.num_slots`` count, e.g.
    5 blocks at depth 1 take 3 (:func:`cyclic_slot_count`).
    """
    if n_blocks < 1:
        raise OffloadConfigError(f"fastoffload: n_blocks must be >= 1, got {n_blocks}")
    num_slots = cyclic_slot_count(n_blocks, prefetch_depth)
    if n_blocks <= prefetch_depth + 1:
        return list(range(n_blocks)), num_slots
    groups = n_blocks // (prefetch_depth + 1)
    full = n_blocks - groups * (num_slots - 1)  # runs of num_slots blocks; the rest have one fewer
    assignment: list[int] = []
    for run in range(groups):
        assignment.extend(range(num_slots if run < full else num_slots - 1))
    return assignment, num_slots


def eager_slot_count(offloaded: int, prefetch_depth: int) -> int:
    """The slots eager offload allocates for ``offloaded`` blocks at the depth it runs (already clamped to
    the offloaded blocks, ``planner._run_depth``): ``depth + 1``, none without an offloaded block."""
    return prefetch_depth + 1 if offloaded else 0


def planned_slot_count(offloaded: int, prefetch_depth: int, cuda_graph: bool = False) -> int:
    """The slots a plan counts. With ``cuda_graph`` the more of the eager ring (what enable allocates, and
    what every step before the capture holds) and the capture's fixed slots."""
    eager = eager_slot_count(offloaded, prefetch_depth)
    return max(eager, cyclic_slot_count(offloaded, prefetch_depth)) if cuda_graph else eager
