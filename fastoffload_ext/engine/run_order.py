"""The order the forward runs the offloaded blocks in, learned on the first pass, and the prefetches set to it.

The ring prefetches in the order enable put the blocks in: a block list's own order, and with several lists
their registration order (or the order ``block_lists`` names them). Some models register their lists in
another order than their forward runs them: Lumina2 registers ``noise_refiner`` before ``context_refiner``
and runs ``context_refiner`` first. There every prefetch at a list boundary fetches a
block that does not run next: the block that does is copied while the device waits for it, and the copy
that was issued is wasted. Outputs stay exact either way (a block not prefetched is loaded by its own
acquire), so nothing but the step time shows it.

So the hooks report each offloaded block as it starts, until every offloaded block has started once. If
they started in another order than the ring's (a rotation of a cyclic ring is the same ring), every block's
prefetch targets are wired again along the order they ran in (the last one prefetching the first, as the
ring did), and a log line says so. A cyclic ring that ran rotated keeps its targets but is wired along the
order too, so that the wrap into the next step is where the step ends (a training forward leaves it out). The
block lists, their indices, the resident set and the plan stay as enable made them; only which block each
block prefetches changes.

A block that starts twice before every block has started ends the pass (a cache that skips blocks, a
model that runs only some of them): the watch then starts over from that block, for a few passes, and
gives up, leaving the ring as it was. A pass inside a CUDA-graph capture ends the watch the same way: a
captured replay repeats the copies it recorded. After the watch ends the hooks do no more than read one
attribute.
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["RunOrderWatch"]

logger = logging.getLogger(__name__)

MAX_PASSES = 3  # passes that end early (a block started twice) before the watch gives up


class RunOrderWatch:
    """Watches the first pass of the offloaded blocks and rewires the prefetches when it differs from the ring.

    ``states``: the offloaded blocks' states in ring order; ``positions``: their indices in the ring of every
    listed block; ``names``: their names in the model, for the log; ``rewire(states, positions, disk)`` wires the
    prefetch targets along ``states`` (layerwise._wire_prefetch_targets with the group's depth and cycle) and,
    with ``disk``, sets the disk tier's read-ahead to that order.
    """

    def __init__(self, states: Sequence[Any], positions: Sequence[int], names: Sequence[str],
                 rewire: Callable[[list[Any], list[int], bool], None], device: torch.device, cyclic: bool) -> None:
        # States hold their blocks weakly and are held by the hooks; the watch is held by the hooks and the group.
        self._states = [weakref.ref(state) for state in states]
        self._rank = {id(state): i for i, state in enumerate(states)}
        self._positions = list(positions)
        self._names = list(names)
        self._rewire = rewire
        self._capture_check = device.type == "cuda"
        self._cyclic = cyclic
        self._seen: list[int] = []
        self._seen_set: set[int] = set()
        self._passes = 0
        self._hooks: list[weakref.ref] = []
        self.outcome = "watching"  # then "ring" (ran in ring order), "rewired" or "not learned"
        self.run_order: list[int] | None = None  # ring ranks in the order they ran, once learned

    def watch(self, hooks: Sequence[Any]) -> None:
        """Starts watching: each hook reports its block's start to this watch until it ends."""
        self._hooks = [weakref.ref(hook) for hook in hooks]
        for hook in hooks:
            hook.run_order_watch = self

    def started(self, state: Any) -> None:
        """Called by a hook as its block starts, before the block is acquired and its prefetches issued."""
        rank = self._rank.get(id(state))
        if rank is None:  # a state this watch does not know (swapped in by hand): nothing to learn from it
            self._end("not learned")
            return
        if self._capture_check and torch.cuda.is_current_stream_capturing():
            self._end("not learned")
            return
        if rank in self._seen_set:
            self._passes += 1
            if self._passes >= MAX_PASSES:
                self._end("not learned")
                return
            self._seen, self._seen_set = [], set()
        self._seen.append(rank)
        self._seen_set.add(rank)
        if len(self._seen) == len(self._states):
            # The pass is complete as its last block starts: wired now, that block prefetches the first one.
            self._learned(self._seen)

    def _learned(self, order: list[int]) -> None:
        self.run_order = list(order)
        count = len(order)
        # A cyclic ring started elsewhere (Wan VACE runs its VACE blocks, registered last, first) prefetches the same.
        rotation = all(order[k] == (order[0] + k) % count for k in range(count))
        states = [ref() for ref in self._states]
        if any(state is None for state in states):
            self._end("not learned")
            return
        if rotation and (self._cyclic or order[0] == 0):
            if order[0] != 0:
                # The same prefetch targets, but the step ends elsewhere: the copies that wrap into the next step
                # (left out by a training forward) and the release prefetches go where it really ends. The disk
                # tier reads ahead along the same cycle and keeps its order.
                self._rewire([states[i] for i in order], [self._positions[i] for i in order], False)
            self._end("ring")
            return
        self._rewire([states[i] for i in order], [self._positions[i] for i in order], True)
        ran = [self._names[i] for i in order]
        lists = _lists_in_order(ran)
        hint = f"; block_lists={lists!r} starts in that order" if lists is not None else ""
        logger.info("fastoffload: the forward ran the offloaded blocks in another order (%s) than the ring enable "
                    "made (%s); their prefetches now follow the order they ran in%s", _describe(ran),
                    _describe(self._names), hint)
        self._end("rewired")

    def _end(self, outcome: str) -> None:
        self.outcome = outcome
        for ref in self._hooks:
            hook = ref()
            if hook is not None and hook.__dict__.get("run_order_watch") is self:
                del hook.__dict__["run_order_watch"]
        self._hooks = []
        self._seen, self._seen_set = [], set()


def _lists_in_order(names: Sequence[str]) -> list[str] | None:
    """The lists of ``names`` (``list.index``, in the order they ran) when each ran whole, in its own order, one
    after the other: what ``block_lists`` would name; else None."""
    lists: list[str] = []
    last: tuple[str, int] | None = None
    for name in names:
        prefix, _, index = name.rpartition(".")
        i = int(index)
        if last is not None and last[0] == prefix:
            if i < last[1]:
                return None
        elif prefix in lists:
            return None
        else:
            lists.append(prefix)
        last = (prefix, i)
    return lists


def _describe(names: Sequence[str]) -> str:
    """Block names (``list.index``) as runs: ``noise_refiner.0-1, context_refiner.0-1, layers.0-25``."""
    runs: list[list[Any]] = []  # [list name, first index, last index]
    for name in names:
        prefix, _, index = name.rpartition(".")
        i = int(index)
        if runs and runs[-1][0] == prefix and runs[-1][2] == i - 1:
            runs[-1][2] = i
        else:
            runs.append([prefix, i, i])
    return ", ".join(f"{p}.{a}" if a == b else f"{p}.{a}-{b}" for p, a, b in runs)
