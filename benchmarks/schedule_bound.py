"""The fastest a (k+1)-slot layerwise schedule can be, from per-block compute and copy times.

The transfer floor max(resident, offloaded bytes / peak H2D) assumes every copy can hide behind any
compute. With k+1 slots it cannot: the copy of offloaded block j may start only once a slot is free
(block j-k-1 has ended; the hooks issue it then), so a copy-bound block's excess copy time is not
covered by a compute-bound block's slack further on. On FLUX.1 at 9216 tokens the double-stream
blocks copy for ~14 ms and compute for ~9, the single-stream ones ~4 against ~6: the floor is
unreachable at depth 1, and the best depth-1 forward is about sum_i max(gap_i, copy_{i+1}).

:class:`BlockClock` measures the per-block compute of the resident model with CUDA events (host
clocks on the host), as one more configuration inside the interleaved rounds; :func:`schedule_ms`
replays the copies and computes of a few forwards in a row with the slot rule above and returns the
steady-state length of one forward. Everything outside the blocks (embeddings, norms, the output
projection) is one compute step at the end of the forward.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

# One compute step in execution order: (compute ms, copy ms of its weights, or None when resident).
Step = tuple[float, float | None]
STEADY_FORWARDS = 4  # the ring's first forward starts with nothing prefetched; the last is steady


def schedule_ms(steps: Sequence[Step], prefetch_depth: int, forwards: int = STEADY_FORWARDS) -> float:
    """Length of one steady-state forward: copies in order on one stream, the copy of the m-th offloaded
    step issued as offloaded step m - depth - 1 ends computing and frees its slot (the hooks issue it then:
    at step m - depth's start, or at step m - depth - 1's release where other compute follows it), each
    compute step waiting for its own copy and for the step before it."""
    if prefetch_depth < 1:
        raise ValueError(f"fastoffload: prefetch_depth must be >= 1, got {prefetch_depth}")
    sequence = list(steps) * forwards
    offloaded_ends: list[float] = []  # compute end of every offloaded step so far: its slot is free then
    copy_end = compute_end = 0.0
    ends: list[float] = []
    for compute, copy in sequence:
        ready = compute_end
        if copy is not None:
            issued = offloaded_ends[-prefetch_depth - 1] if len(offloaded_ends) > prefetch_depth else 0.0
            copy_end = max(copy_end, issued) + copy
            ready = max(ready, copy_end)
        compute_end = ready + compute
        if copy is not None:
            offloaded_ends.append(compute_end)
        ends.append(compute_end)
    per_forward = len(steps)
    return ends[-1] - ends[-1 - per_forward] if forwards > 1 else ends[-1]


def steps_for(block_ms: Sequence[float], total_ms: float, copy_ms: Sequence[float | None]) -> list[Step]:
    """Blocks in execution order, then everything else as one step (total less the blocks' sum)."""
    rest = max(0.0, total_ms - sum(block_ms))
    return [*zip(block_ms, copy_ms), (rest, None)]


class BlockClock:
    """Times each block of a resident model inside its forward: a configuration for the interleaved rounds.

    The hooks are installed for the clock's own forwards only, so the plain resident configuration beside
    it runs without them. Every call of the timer is one round; :attr:`rounds` keeps, per round, the
    order the blocks ran in (indices into ``blocks``), their per-block medians in that order and the
    median forward.
    """

    def __init__(self, blocks: Sequence[nn.Module], cuda: bool) -> None:
        self.blocks = list(blocks)
        self.cuda = cuda
        self.rounds: list[tuple[list[int], list[float], float]] = []

    def timer(self, forward: Callable[[], Any], iters: int) -> Callable[[], list[float]]:
        def measure() -> list[float]:
            per_iteration: list[list[float]] = []
            totals: list[float] = []
            order: list[int] = []
            for _ in range(iters):
                order, blocks_ms, total = self._one(forward)
                per_iteration.append(blocks_ms)
                totals.append(total)
            per_block = [float(statistics.median(values)) for values in zip(*per_iteration)]
            self.rounds.append((order, per_block, float(statistics.median(totals))))
            return totals
        return measure

    def _stamp(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter_ns()

    def _elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) if self.cuda else (end - start) / 1e6

    def _one(self, forward: Callable[[], Any]) -> tuple[list[int], list[float], float]:
        marks: list[tuple[int, Any, Any]] = []
        opened: dict[int, Any] = {}
        index = {id(block): position for position, block in enumerate(self.blocks)}

        def before(module: nn.Module, args: Any) -> None:
            opened[id(module)] = self._stamp()

        def after(module: nn.Module, args: Any, output: Any) -> None:
            marks.append((index[id(module)], opened.pop(id(module)), self._stamp()))

        handles = [hook for block in self.blocks
                   for hook in (block.register_forward_pre_hook(before), block.register_forward_hook(after))]
        try:
            start = self._stamp()
            forward()
            end = self._stamp()
        finally:
            for handle in handles:
                handle.remove()
        if self.cuda:
            end.synchronize()
        return ([position for position, _, _ in marks], [self._elapsed_ms(a, b) for _, a, b in marks],
                self._elapsed_ms(start, end))

    def round_bounds(self, copy_ms: Sequence[float | None], prefetch_depth: int) -> list[float]:
        """The schedule bound of each round from that round's per-block medians; ``copy_ms`` is per block,
        in the order of ``blocks`` (None: the block stays resident)."""
        return [schedule_ms(steps_for(blocks, total, [copy_ms[position] for position in order]), prefetch_depth)
                for order, blocks, total in self.rounds]

    def block_medians(self) -> list[float]:
        """Per block (order of ``blocks``), the median over rounds: for the notes."""
        by_block: dict[int, list[float]] = {}
        for order, blocks, _ in self.rounds:
            for position, value in zip(order, blocks):
                by_block.setdefault(position, []).append(value)
        return [float(statistics.median(by_block.get(position, [0.0]))) for position in range(len(self.blocks))]
