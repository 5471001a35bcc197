"""Which copies each offloaded block's hooks issue: the engine's wiring and the planner's simulation share it.

Offloaded blocks are numbered in the order they run (``0 .. count - 1``). As block ``i`` starts it
prefetches the next ``depth`` of them (wrapping around into the next step when ``cyclic``). Where other
compute runs between block ``i`` and the next offloaded block (resident blocks between them, or at the
wrap-around the rest of the forward), block ``i`` also prefetches, as it releases, the one block the
next offloaded block would prefetch: the slot it frees then fills while that compute runs, rather than
idle until the next offloaded block starts. With ``depth + 1`` slots that copy always has a slot (the one
just freed), so the device memory is what it was.

Only a backend whose acquire waits for its own copy alone does the second kind (the ext engine: a slot's
ready event); FastVideo's python algorithm waits for every copy in flight, where an early copy would hold
up the block before it.

Under activation checkpointing the backward pass runs the blocks again, last first: there block ``i``
prefetches the ``depth`` blocks before it instead (never wrapping: the next forward starts with the blocks
the backward ran last, still in their slots). Pure functions, no torch.
"""
from __future__ import annotations

from collections.abc import Sequence

__all__ = ["acquire_targets", "backward_targets", "release_target"]


def acquire_targets(i: int, count: int, depth: int, cyclic: bool) -> list[int]:
    """The offloaded blocks block ``i`` of ``count`` prefetches as it starts, in order, without repeats."""
    targets: list[int] = []
    for step in range(1, depth + 1):
        if not cyclic and i + step >= count:
            break
        target = (i + step) % count
        if target not in targets:
            targets.append(target)
    return targets


def release_target(i: int, positions: Sequence[int], depth: int, cyclic: bool) -> int | None:
    """The offloaded block block ``i`` prefetches as it releases, or None.

    ``positions``: each offloaded block's index in the block list, in running order. None when the next
    offloaded block runs right after block ``i`` (its own acquire issues that copy as early), or when every
    offloaded block fits the slots at once (nothing is ever evicted)."""
    count = len(positions)
    last = i == count - 1
    if count <= depth + 1 or (not last and positions[i + 1] == positions[i] + 1):
        return None
    ahead = i + depth + 1
    return ahead % count if cyclic or ahead < count else None


def backward_targets(i: int, depth: int) -> list[int]:
    """The offloaded blocks block ``i`` prefetches as a backward pass runs it again: the ``depth`` before it."""
    return [i - step for step in range(1, depth + 1) if i - step >= 0]
