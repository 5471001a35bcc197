"""A step of the offload pipeline, simulated: compute-stream and copy-stream timelines with slot reuse.

It replays what the hooks ask the engine for, in the order they ask (per offloaded block: acquire,
then prefetch of the next ``depth`` offloaded blocks; release after the block ran, then, where other
compute follows it, the prefetch into the slot it freed: ``schedule.py``) against a model of
the engine's slot ring: ``depth + 1`` slots; a copy goes into an empty slot, else the least recently
touched cached one, else the least recently touched ready one, never into one in use; a copy into a
slot waits for the slot's "free" event (the end of the compute that last used it) and for the copies
issued before it (one copy stream). A block whose slot still holds it costs no copy. Without host
figures the host is assumed to run ahead of the device, so only the two device timelines constrain
each other. Steps run back to back, as a denoising loop without a readback runs them: a copy is never
held for its step's start, only for its slot (the host, a step ahead, issued it long before). With
``host_waits`` the host meets the device at every step's start instead (a readback after each step,
as a calibration's timed repeats do), and no copy a step issues starts before that step begins.

The blocks run in ``costs.run_order`` where the table has one (a model that runs its lists in another
order than it registered them): the hooks prefetch along it, as the engine does once its first forward
learned the order, and the disk tier reads its blocks in it; the timeline is indexed by list position.

Several steps are simulated back to back and the last is reported, so the cyclic wrap-around (the
last block prefetching the first of the next step) is in its steady state. Compute outside the block
list (``other_ms``) runs between steps, where the wrap-around copy can hide behind it.

Each offloaded block also pays ``block_overhead_ms`` on the compute timeline before its kernels (the
hook and the engine call; resident blocks have no hook). A compressed copy (``transfer_bytes`` below
``block_bytes``) occupies the copy stream for its compressed bytes and is "ready" after the decode
that follows it on the decode stream.

With ``overlap=False`` (the host-as-device engine) a copy is a memcpy on the one host timeline: it
runs when it is issued and delays the compute after it (a host decode too).

With host figures in the table (``host_ms``, ``host_other_ms``, ``host_overhead_ms``; a calibration on
CUDA measures them) the host gets a timeline of its own: it dispatches each block in ``host_ms`` and
runs each offloaded block's hooks in ``host_overhead_ms`` before that; it goes on from step to step
without waiting (with ``host_waits``: it meets the device between steps). A block's kernels cannot
start before the host began dispatching them nor end before it finished; a copy, the synchronous load and the prefetches alike, cannot start before the host reached
the hook that issues it. A launch-bound model (many small blocks) is then as slow as its host, and each
offloaded block adds its hooks' host time to it. Without host figures the host runs ahead and the
step is what the device timelines alone give.

With a disk tier in the table (``disk``) the offloaded blocks beyond the host budget are read every
step, as the engine's staging ring reads them: one reader timeline at the disk's bandwidth, in the
disk blocks' order, wrapping around; a read goes into the staging buffer that the copy
``staging_buffers`` disk copies earlier read out of, so it starts once that copy has ended (the first
reads at the start), and a disk block's copy starts once its read has ended. The reads do not wait for
the step's start: the reader runs ahead of the host. The host's own wait for a read (an acquire whose
block is still being read) is left to the copy's wait.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection

from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning.costs import BlockCosts
from fastoffload_ext.planning.schedule import acquire_targets, release_target

logger = logging.getLogger(__name__)

STEADY_STEPS = 3
_EMPTY, _READY, _IN_USE, _CACHED = 0, 1, 2, 3
_RANK = {_EMPTY: 0, _CACHED: 1, _READY: 2}


@dataclasses.dataclass(frozen=True)
class StepTimeline:
    """The last simulated step: its length and where the time went (ms, relative to the step start)."""

    step_ms: float
    compute_ms: float        # block compute + other_ms
    exposed_ms: float        # step_ms - compute_ms: time compute waited (for copies; with host figures, the host)
    copies: int              # copies issued in the step
    copied_bytes: int
    block_start: tuple[float, ...]
    block_end: tuple[float, ...]
    host_ms: float = 0.0     # the host's busy time in the step (dispatch and hooks; 0: no host figures)
    disk_reads: int = 0      # disk-tier reads the step's copies consumed (one per disk block copied)
    read_bytes: int = 0      # their bytes


class _Ring:
    """The slot ring's choice and bookkeeping, as in the compiled core."""

    def __init__(self, num_slots: int) -> None:
        self.block = [-1] * num_slots
        self.state = [_EMPTY] * num_slots
        self.touched = [0] * num_slots
        self.free_at = [0.0] * num_slots
        self.ready_at = [0.0] * num_slots
        self.where: dict[int, int] = {}
        self.clock = 0

    def touch(self, slot: int) -> None:
        self.clock += 1
        self.touched[slot] = self.clock

    def choose(self) -> int:
        best, best_key = -1, (9, 0)
        for slot, state in enumerate(self.state):
            rank = _RANK.get(state)
            if rank is None:
                continue
            key = (rank, self.touched[slot])
            if best < 0 or key < best_key:
                best, best_key = slot, key
        return best


class _Reader:
    """The disk tier's reader and staging ring: reads in the disk blocks' order, each into the buffer the
    copy ``staging_buffers`` disk copies earlier read out of."""

    def __init__(self, costs: BlockCosts, blocks: tuple[int, ...]) -> None:
        assert costs.disk is not None
        self.costs = costs
        self.order = blocks
        self.blocks = frozenset(blocks)
        self.buffers = costs.disk.staging_buffers
        self.at = 0.0                    # the reader is busy until here
        self.ends: list[float] = []      # read k's end (read k reads order[k % len(order)])
        self.copy_ends: list[float] = []  # disk copy k's end: it frees the buffer read k + buffers goes into

    def read_end(self, block: int) -> float:
        """When the read for the next disk copy (of ``block``) ends: the reads before it are done in order."""
        k = len(self.copy_ends)
        while len(self.ends) <= k:
            j = len(self.ends)
            free = self.copy_ends[j - self.buffers] if j >= self.buffers else 0.0
            nbytes = self.costs.moved_bytes(self.order[j % len(self.order)])
            self.at = max(self.at, free) + self.costs.disk.read_ms(nbytes)  # type: ignore[union-attr]
            self.ends.append(self.at)
        return self.ends[k]

    def copied(self, end: float) -> None:
        self.copy_ends.append(end)

    def consumed_since(self, first: int) -> tuple[int, int]:
        """(reads, bytes) that the disk copies from copy ``first`` on consumed: one read per copy."""
        done = range(first, len(self.copy_ends))
        return len(done), sum(self.costs.moved_bytes(self.order[j % len(self.order)]) for j in done)


class _Pipeline:
    def __init__(self, costs: BlockCosts, resident: Collection[int], depth: int, cyclic: bool,
                 host_waits: bool = False) -> None:
        self.costs = costs
        self.host_waits = host_waits
        self.depth = depth
        self.cyclic = cyclic
        self.resident = frozenset(resident)
        # The blocks as the forward runs them (costs.run_order): the hooks prefetch along that order.
        self.order = costs.order()
        ran_at = {b: p for p, b in enumerate(self.order)}
        self.offloaded = [b for b in self.order if b not in self.resident]
        self.position = {b: j for j, b in enumerate(self.offloaded)}
        count = len(self.offloaded)
        self.acquire_targets = [[self.offloaded[t] for t in acquire_targets(j, count, depth, cyclic)]
                                for j in range(count)]
        running = [ran_at[b] for b in self.offloaded]
        released = [release_target(j, running, depth, cyclic) for j in range(count)]
        self.release_target = [None if t is None else self.offloaded[t] for t in released]
        self.ring = _Ring(depth + 1)
        self.compute_at = 0.0  # end of the last compute on the compute stream (the host, without overlap)
        self.copy_at = 0.0     # end of the last copy on the copy stream
        self.copies = 0
        self.copied_bytes = 0
        self.step_begin = 0.0  # with host_waits: no copy of a step starts before the step does
        # Without host figures the host timeline is not kept at all, so such tables predict what they did
        # before it existed, to the last bit.
        self.host = costs.host_timed
        self.host_at = 0.0     # where the host is (with host figures)
        self.host_busy = 0.0
        # The tier holds the blocks the build placed there (list order); it reads them in the order they run.
        disk = frozenset(costs.disk_blocks(self.resident)) if costs.disk is not None else None
        self.disk = _Reader(costs, tuple(b for b in self.order if b in disk)) if disk is not None else None

    def now(self) -> float:
        """The end of everything so far: the device's work and, with host figures, the host's."""
        return max(self.compute_at, self.host_at) if self.host else self.compute_at

    def issue(self, block: int, hook_at: float = 0.0) -> bool:
        ring = self.ring
        slot = ring.choose()
        if slot < 0:
            return False
        old = ring.block[slot]
        if old >= 0:
            ring.where.pop(old, None)
        start = max(self.copy_at, ring.free_at[slot], self.step_begin)
        if self.host:
            start = max(start, hook_at)
        on_disk = self.disk is not None and block in self.disk.blocks
        if on_disk:
            start = max(start, self.disk.read_end(block))
        if not self.costs.overlap:
            start = max(start, self.compute_at)
        end = start + self.costs.copy_ms(block)
        self.copy_at = end
        if on_disk:
            self.disk.copied(end)
        # A coded copy is decoded into the slot on its own stream: only "ready" waits for it.
        ready = end + self.costs.decode_ms(block)
        if not self.costs.overlap:
            self.compute_at = ready
        ring.block[slot], ring.state[slot], ring.ready_at[slot] = block, _READY, ready
        ring.where[block] = slot
        ring.touch(slot)
        self.copies += 1
        self.copied_bytes += self.costs.moved_bytes(block)
        return True

    def dispatch(self, block: int, start: float, hooks_ms: float = 0.0) -> tuple[float, float]:
        """With host figures: the host runs ``hooks_ms`` then dispatches ``block``; returns the earliest
        start of its kernels (``start`` or later) and the host time their dispatch ends."""
        if not self.host:
            return start, 0.0
        self.host_at += hooks_ms
        begin = self.host_at
        self.host_at += self.costs.host_dispatch_ms(block)
        self.host_busy += hooks_ms + self.costs.host_dispatch_ms(block)
        return max(start, begin), self.host_at

    def run_resident(self, block: int, compute: float) -> tuple[float, float]:
        start, dispatched = self.dispatch(block, self.compute_at)
        end = max(start + compute, dispatched) if self.host else start + compute
        self.compute_at = end
        return start, end

    def run_offloaded(self, block: int, compute: float) -> tuple[float, float]:
        ring = self.ring
        hook_at = self.host_at  # the host reaches this block's hook: its copies are issued from here on
        if block not in ring.where:
            issued = self.issue(block, hook_at)
            assert issued, "one block runs at a time, so a slot that is not in use always exists"
        slot = ring.where[block]
        # The hook's fixed cost comes before the block's kernels, whether its copy was ready or not.
        self.compute_at += self.costs.block_overhead_ms
        start = max(self.compute_at, ring.ready_at[slot])
        ring.state[slot] = _IN_USE
        ring.touch(slot)
        j = self.position[block]
        for target in self.acquire_targets[j]:
            if target not in ring.where:
                self.issue(target, hook_at)
        start, dispatched = self.dispatch(block, start, self.costs.host_overhead_ms)
        if not self.costs.overlap:
            start = max(start, self.compute_at)
        end = max(start + compute, dispatched) if self.host else start + compute
        self.compute_at = end
        ring.state[slot] = _CACHED
        ring.free_at[slot] = end
        ring.touch(slot)
        target = self.release_target[j]
        if target is not None and target not in ring.where:
            self.issue(target, self.host_at)  # the release hook runs once the host dispatched the block
        return start, end

    def begin_step(self) -> None:
        if self.host:
            if self.host_waits:
                # The host waits for the device between steps; the device then waits for the host to dispatch.
                self.host_at = self.compute_at = self.now()
                self.step_begin = self.host_at
            # Else the host goes on from where it is: a step ahead of a slower device, whose copies then
            # wait for their slots alone (the hooks that issue them ran long before).
            self.host_at += self.costs.host_other_ms
            self.host_busy += self.costs.host_other_ms
            self.compute_at = max(self.compute_at + self.costs.other_ms, self.host_at)
            return
        if self.host_waits:
            self.step_begin = self.compute_at
        self.compute_at += self.costs.other_ms

    def step(self) -> tuple[list[float], list[float]]:
        """Each block's start and end in this step, by list position."""
        self.begin_step()
        starts, ends = [0.0] * self.costs.blocks, [0.0] * self.costs.blocks
        for block in self.order:
            run = self.run_resident if block in self.resident else self.run_offloaded
            starts[block], ends[block] = run(block, self.costs.compute_ms[block])
        return starts, ends


def simulate_step(costs: BlockCosts, resident: Collection[int], depth: int, *, cyclic: bool = True,
                  steps: int = STEADY_STEPS, host_waits: bool = False) -> StepTimeline:
    """The steady-state step of the pipeline with ``resident`` blocks kept and ``depth`` copied ahead.

    ``host_waits``: the host meets the device at every step's start, as when each step ends in a readback
    (a calibration's timed repeats synchronize so); by default steps run back to back, as a denoising loop
    runs them, and the host may be a step ahead of a slower device.
    """
    if depth < 0:
        raise OffloadConfigError(f"fastoffload: simulate_step's depth must be an integer >= 0, got {depth}")
    pipeline = _Pipeline(costs, resident, depth, cyclic, host_waits)
    if not pipeline.offloaded and not pipeline.host:
        compute = costs.total_compute_ms()
        starts, ends, total = [0.0] * costs.blocks, [0.0] * costs.blocks, 0.0
        for block in costs.order():
            starts[block] = costs.other_ms + total
            total += costs.compute_ms[block]
            ends[block] = costs.other_ms + total
        return StepTimeline(compute, compute, 0.0, 0, 0, tuple(starts), tuple(ends))
    begin = busy = 0.0
    copies = copied = 0
    starts: list[float] = []
    ends: list[float] = []
    first_read = 0
    for _ in range(max(1, steps)):
        begin, busy = pipeline.now(), pipeline.host_busy
        copies, copied = pipeline.copies, pipeline.copied_bytes
        first_read = len(pipeline.disk.copy_ends) if pipeline.disk else 0
        starts, ends = pipeline.step()
    step_ms = pipeline.now() - begin
    if pipeline.host and not host_waits:
        # A host that never waits may still be spending a lead it built up in the steps before; in the steady
        # state it is busy all the time or the device sets the pace, so the step is the longer of the two.
        step_ms = max(step_ms, pipeline.host_busy - busy)
    compute = costs.total_compute_ms()
    reads, read_bytes = pipeline.disk.consumed_since(first_read) if pipeline.disk else (0, 0)
    return StepTimeline(step_ms=step_ms, compute_ms=compute, exposed_ms=max(0.0, step_ms - compute),
                        copies=pipeline.copies - copies, copied_bytes=pipeline.copied_bytes - copied,
                        block_start=tuple(s - begin for s in starts), block_end=tuple(e - begin for e in ends),
                        host_ms=pipeline.host_busy - busy, disk_reads=reads, read_bytes=read_bytes)


__all__ = ["STEADY_STEPS", "StepTimeline", "simulate_step"]
