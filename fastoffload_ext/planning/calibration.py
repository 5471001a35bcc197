"""Measuring the cost table on this machine: per-block compute, the step, activations, H2D bandwidth.

Host speed on shared machines drifts by tens of percent between processes and over minutes, so one
timing is not a measurement. Each figure here is the median of several repeats, and when the repeats
spread more than ``SPREAD_LIMIT`` more are taken (up to ``max_repeats``); the spread is reported with
the figure so a caller can tell a calm calibration from a noisy one.

Per-block compute is timed by a second forward hook on every block, placed after the offload hook: its
start mark is taken once the block's weights are bound (on CUDA, an event recorded after the compute
stream waited for the block's copy), so a block's time is its own compute whether its copy was
exposed or not. Resident blocks are timed the same way. On CUDA the marks are events on the compute
stream; with the host as the device they are ``perf_counter`` readings.

Every mark also reads the host clock. On CUDA the calibration step runs an offloaded model, where the
device waits for copies and the host runs ahead, so the events see only the device's time; a
launch-bound model (many small blocks) is set by the host's dispatch instead, which only the host
readings show: each block's dispatch, the step from ``step()`` called to returned, and the host gaps
between blocks where the offload hooks run. On CUDA a host pass adds steps that drain the device after
every block, so a host that ran far ahead and waited for a full launch queue is not taken for a slow
host; each host figure is the smaller of the timed steps' and the host pass's, since a dispatch right
after a drain reads slow too. With the host as the device the two clocks are one.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

from fastoffload_ext.engine.hooks import ForwardHook, ModuleHookManager
from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning.costs import BlockCosts

logger = logging.getLogger(__name__)

SPREAD_LIMIT = 0.25
BANDWIDTH_PROBE_BYTES = 64 * 1024**2
_BANDWIDTH_CACHE: dict[str, float] = {}


class _Mark:
    """A point on the device's compute timeline (a CUDA event) and on the host clock.

    Both are taken on CUDA: the event says when the device got there, the host reading when the host
    dispatched it (on a launch-bound model the host, not the device, sets the step). With the host as
    the device there is one clock, and both readings are the same ``perf_counter`` value.
    """

    def __init__(self, device: torch.device) -> None:
        self.event = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        self.host = 0.0
        self.resumed: float | None = None  # the host clock after a drain (the host pass), else None

    def record(self) -> None:
        self.host = time.perf_counter()
        if self.event is not None:
            self.event.record()

    def ms_until(self, later: _Mark) -> float:
        if self.event is not None and later.event is not None:
            return float(self.event.elapsed_time(later.event))
        return self.host_ms_until(later)

    def host_ms_until(self, later: _Mark) -> float:
        return (later.host - self.host) * 1e3


class BlockTimer(ForwardHook):
    """Marks the start and end of one block's forward, once per call (a block may run several times).

    With ``drain`` set (the host pass, CUDA) it waits for the device after each block's end mark and
    reads the host clock again: the next block is then dispatched into an empty launch queue, so its
    host span is its dispatch alone, never a wait for a queue the device has not emptied yet.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.spans: list[tuple[_Mark, _Mark]] = []
        self.drain = False

    @classmethod
    def name(cls) -> str:
        return "FastOffloadBlockTimer"

    @torch.compiler.disable
    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        start, end = _Mark(self.device), _Mark(self.device)
        start.record()
        self.spans.append((start, end))
        return args, kwargs

    @torch.compiler.disable
    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.spans:
            end = self.spans[-1][1]
            end.record()
            if self.drain:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                end.resumed = time.perf_counter()
        return output


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Medians over the repeats of a calibration (ms, bytes) and how far the repeats spread.

    The ``host_`` figures are the same spans on the host clock: each block's dispatch (its forward as
    the host ran it), the step from ``step()`` called to returned (before the sync), the host's time
    outside the blocks, and the gaps between blocks (where the offload hooks run); on CUDA all but the
    step come from the host pass (``measure_blocks``). With the host as the device they equal the
    device figures.
    """

    block_ms: tuple[float, ...]
    step_ms: float
    other_ms: float
    activation_bytes: int | None  # None where it cannot be measured (the host as device)
    repeats: int
    spread: float                 # (slowest - fastest) / median step
    gap_ms: tuple[float, ...] | None = None  # per block: the end of the one before it to its start (None: not run once each)
    host_block_ms: tuple[float, ...] | None = None
    host_step_ms: float | None = None
    host_other_ms: float | None = None
    host_gap_ms: tuple[float, ...] | None = None
    # The order the blocks ran in, where every timed step ran each once in that same order and it is not
    # list order (BlockCosts.run_order); None otherwise.
    run_order: tuple[int, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def spread_of(values: Sequence[float]) -> float:
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle > 0 else 0.0


def _attach_timers(blocks: Sequence[nn.Module], device: torch.device) -> list[BlockTimer]:
    timers = []
    for block in blocks:
        manager = ModuleHookManager.get_from_or_default(block)
        if manager.get_forward_hook(BlockTimer.name()) is not None:
            manager.remove_forward_hook(BlockTimer.name())
        timer = BlockTimer(device)
        manager.append_forward_hook(timer)
        timers.append(timer)
    return timers


def _detach_timers(blocks: Sequence[nn.Module]) -> None:
    for block in blocks:
        manager = ModuleHookManager.get_from(block)
        if manager is None or manager.get_forward_hook(BlockTimer.name()) is None:
            continue
        manager.remove_forward_hook(BlockTimer.name())
        if not manager.forward_hooks:
            ModuleHookManager.remove_from_manager(block)


@dataclasses.dataclass(frozen=True)
class _Clock:
    """One repeat's figures on one clock (the device's or the host's)."""

    block_ms: list[float]
    step_ms: float
    other_ms: float
    gaps: list[float] | None
    order: tuple[int, ...] | None = None  # the order the blocks ran in (None: some block ran twice or never)


@dataclasses.dataclass(frozen=True)
class _Sample:
    device: _Clock
    host: _Clock
    peak: int | None


def _run_order(timers: list[BlockTimer]) -> tuple[int, ...] | None:
    """The order the blocks ran in (list positions, by start on the host clock) when every block ran once;
    else None: the gap before a block that ran twice, or not at all, belongs to no single block, and the
    gaps are not measured."""
    if any(len(t.spans) != 1 for t in timers):
        return None
    return tuple(sorted(range(len(timers)), key=lambda b: timers[b].spans[0][0].host))


def _gaps(timers: list[BlockTimer], span: Callable[[_Mark, _Mark], float]) -> list[float] | None:
    """Per block (list position), the time from the end of the block that ran before it to its start (0
    for the first one to run); None unless every block ran once (``_run_order``)."""
    order = _run_order(timers)
    if order is None:
        return None
    gaps = [0.0] * len(timers)
    for previous, block in zip(order, order[1:]):
        gaps[block] = span(timers[previous].spans[0][1], timers[block].spans[0][0])
    return gaps


def _clock(timers: list[BlockTimer], begin: _Mark, end: _Mark, span: Callable[[_Mark, _Mark], float]) -> _Clock:
    block_ms = [sum(span(s, e) for s, e in timer.spans) for timer in timers]
    step_ms = span(begin, end)
    first = min((t.spans[0][0] for t in timers), key=lambda m: span(begin, m))
    last = max((t.spans[-1][1] for t in timers), key=lambda m: span(begin, m))
    other = max(0.0, step_ms - span(first, last))
    return _Clock(block_ms, step_ms, other, _gaps(timers, span), _run_order(timers))


def _one_repeat(step: Callable[[], Any], timers: list[BlockTimer], device: torch.device) -> _Sample:
    """One step timed on both clocks, with its activation peak (CUDA)."""
    for timer in timers:
        timer.spans.clear()
    begin, end = _Mark(device), _Mark(device)
    baseline = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    begin.record()
    step()
    end.record()  # before the sync: its host reading is when the host finished dispatching the step
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - (baseline or 0)
    for index, timer in enumerate(timers):
        if not timer.spans:
            raise OffloadConfigError(f"fastoffload: calibration step never ran block {index}; the step must run one "
                                     "full forward of the offloaded model")
    return _Sample(_clock(timers, begin, end, _Mark.ms_until), _clock(timers, begin, end, _Mark.host_ms_until), peak)


def _drained_host_clock(timers: list[BlockTimer], begin: _Mark, end: _Mark) -> _Clock:
    """One host-pass step on the host clock, the drains left out: each block's dispatch, the gaps from
    the previous block's drain to the next block's start (the hooks), the host before the first block
    and after the last one; its step is the sum of those, the host's busy time."""
    block_ms = [sum(s.host_ms_until(e) for s, e in timer.spans) for timer in timers]
    gaps = None
    order = _run_order(timers)
    if order is not None:
        gaps = [0.0] * len(timers)
        for previous, block in zip(order, order[1:]):
            gaps[block] = 1e3 * (timers[block].spans[0][0].host - _resumed(timers[previous].spans[0][1]))
    first = min(t.spans[0][0].host for t in timers)
    last = max(_resumed(t.spans[-1][1]) for t in timers)
    other = max(0.0, 1e3 * (first - begin.host)) + max(0.0, 1e3 * (end.host - last))
    return _Clock(block_ms, sum(block_ms) + sum(gaps or ()) + other, other, gaps, order)


def _resumed(mark: _Mark) -> float:
    return mark.resumed if mark.resumed is not None else mark.host


def _host_pass(step: Callable[[], Any], timers: list[BlockTimer], device: torch.device, repeats: int) -> list[_Clock]:
    """``repeats`` steps with the device drained after every block (see ``BlockTimer``), on the host clock."""
    clocks = []
    for timer in timers:
        timer.drain = True
    try:
        for _ in range(repeats):
            for timer in timers:
                timer.spans.clear()
            begin, end = _Mark(device), _Mark(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            begin.record()
            step()
            end.record()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            clocks.append(_drained_host_clock(timers, begin, end))
    finally:
        for timer in timers:
            timer.drain = False
    return clocks


def _medians(clocks: list[_Clock], blocks: int) -> tuple[tuple[float, ...], float, float, tuple[float, ...] | None]:
    """(per-block ms, step ms, other ms, gaps) as medians over the repeats of one clock."""
    block_ms = tuple(statistics.median(c.block_ms[i] for c in clocks) for i in range(blocks))
    gap_samples = [c.gaps for c in clocks if c.gaps is not None]
    gaps = (tuple(statistics.median(g[i] for g in gap_samples) for i in range(blocks))
            if len(gap_samples) == len(clocks) else None)
    return (block_ms, statistics.median(c.step_ms for c in clocks), statistics.median(c.other_ms for c in clocks),
            gaps)


def _least_host(drained: tuple[tuple[float, ...], float, float, tuple[float, ...] | None],
                block_ms: tuple[float, ...], other_ms: float,
                gaps: tuple[float, ...] | None) -> tuple[tuple[float, ...], float, tuple[float, ...] | None]:
    """The host figures of the timed steps and of the host pass, the smaller of the two for each.

    Both read high, never low, and for different reasons: a timed step's dispatch may have waited for
    a full launch queue, and a drained step's dispatch starts cold after each drain (on the H200 a
    prediction from the drained figures alone ran 1.1-1.25x the measured step). So the smaller one is
    the closer of two upper bounds of the same dispatch."""
    drained_block, _, drained_other, drained_gaps = drained
    least_block = tuple(min(a, b) for a, b in zip(block_ms, drained_block))
    least_gaps = (tuple(min(a, b) for a, b in zip(gaps, drained_gaps)) if gaps is not None and drained_gaps is not None
                  else drained_gaps)
    return least_block, min(other_ms, drained_other), least_gaps


def measure_blocks(blocks: Sequence[nn.Module], step: Callable[[], Any], device: torch.device, *,
                   repeats: int = 5, max_repeats: int = 15, warmup: int = 1,
                   host_pass: bool | None = None) -> Measurement:
    """Runs ``step`` (one forward of the model that holds ``blocks``) and times every block.

    ``host_pass`` (default: on CUDA) also times ``repeats`` more steps that drain the device after every
    block: in the timed steps a host far ahead of a device waiting for copies can fill the launch queue
    and wait inside a block's dispatch, which would read as host time. Each host figure is then the
    smaller of the two (see ``_least_host``). The host step (``step()`` called to returned) is always
    the timed steps'. Without it (and with the host as the device, one clock) the host figures come from
    the timed steps themselves.
    """
    if repeats < 1 or max_repeats < repeats:
        raise OffloadConfigError(f"fastoffload: calibration needs 1 <= repeats <= max_repeats, got repeats={repeats}, "
                                 f"max_repeats={max_repeats}")
    timers = _attach_timers(blocks, device)
    samples: list[_Sample] = []
    drained: list[_Clock] | None = None
    try:
        with torch.inference_mode():
            for _ in range(warmup):
                step()
            while len(samples) < repeats or (spread_of([s.device.step_ms for s in samples]) > SPREAD_LIMIT
                                             and len(samples) < max_repeats):
                samples.append(_one_repeat(step, timers, device))
            drained = (_host_pass(step, timers, device, repeats)
                       if (device.type == "cuda" if host_pass is None else host_pass) else None)
    finally:
        _detach_timers(blocks)
    block_ms, step_ms, other_ms, gaps = _medians([s.device for s in samples], len(blocks))
    host_block, host_step, host_other, host_gaps = _medians([s.host for s in samples], len(blocks))
    if drained is not None:
        host_block, host_other, host_gaps = _least_host(_medians(drained, len(blocks)), host_block, host_other,
                                                        host_gaps)
    peaks = [s.peak for s in samples if s.peak is not None]
    orders = {s.device.order for s in samples}
    order = orders.pop() if len(orders) == 1 else None
    return Measurement(block_ms=block_ms, step_ms=step_ms, other_ms=other_ms,
                       activation_bytes=max(peaks) + ALLOCATOR_SLACK_BYTES if peaks else None, repeats=len(samples),
                       spread=spread_of([s.device.step_ms for s in samples]), gap_ms=gaps, host_block_ms=host_block,
                       host_step_ms=host_step, host_other_ms=host_other, host_gap_ms=host_gaps,
                       run_order=order if order != tuple(range(len(blocks))) else None)


# The caching allocator's peak moves by a block or two (0.1-0.75 MiB seen on the H200) from one
# step to the next with the same shapes, so a reserve of exactly the measured peak let 3 of 16 planned
# steps end up to 0.75 MiB over their budget. The planner keeps this much more than it measured.
ALLOCATOR_SLACK_BYTES = 2 * 1024 * 1024


def probe_bytes_for(block_bytes: Sequence[int]) -> int:
    """The probe size that copies like the blocks do: the median block, within 1 MiB..256 MiB.

    Bandwidth depends on the copy size (about 43 GB/s at 1 MiB, 49 at 16 MiB, 52 at 1 GiB on an H200),
    and the per-copy fixed cost is in the rate measured at the block's own size.
    """
    sizes = [b for b in block_bytes if b > 0]
    middle = int(statistics.median(sizes)) if sizes else BANDWIDTH_PROBE_BYTES
    return min(max(middle, PROBE_MIN_BYTES), PROBE_MAX_BYTES)


PROBE_MIN_BYTES = 1024**2
PROBE_MAX_BYTES = 256 * 1024**2


def measure_h2d_gbps(device: torch.device, *, nbytes: int = BANDWIDTH_PROBE_BYTES, repeats: int = 5,
                     refresh: bool = False) -> float:
    """Pinned host-to-device copy bandwidth (GB/s), median of ``repeats``; cached per device and size.

    With the host as the device it is the host's memcpy bandwidth, which is what that engine's copies are.
    """
    key = f"{device}/{nbytes}"
    if key in _BANDWIDTH_CACHE and not refresh:
        return _BANDWIDTH_CACHE[key]
    cuda = device.type == "cuda"
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for index in range(repeats + 1):
        begin, end = _Mark(device), _Mark(device)
        begin.record()
        target.copy_(source, non_blocking=cuda)
        end.record()
        if cuda:
            torch.cuda.synchronize(device)
        if index:  # the first copy pays first-touch and mapping costs
            times.append(begin.ms_until(end))
    gbps = nbytes / (statistics.median(times) * 1e6)
    _BANDWIDTH_CACHE[key] = gbps
    _BANDWIDTH_CACHE[str(device)] = gbps  # the latest figure for this device, for bytes-only plans
    return gbps



# Before any calibration: what a bytes-only plan assumes for a copy. The choice of a bytes-only plan does
# not depend on it (compute is taken as free, so every layout is copy-bound); only its prediction does.
ASSUMED_H2D_GBPS = 25.0


def cached_h2d_gbps(device: torch.device) -> float:
    """The bandwidth measured earlier in this process for ``device``, else ``ASSUMED_H2D_GBPS``."""
    return _BANDWIDTH_CACHE.get(str(device), ASSUMED_H2D_GBPS)


def fit_block_overhead(costs: BlockCosts, measured: Measurement, resident: Collection[int], depth: int,
                       cyclic: bool = True) -> float:
    """The hooks' fixed cost per offloaded block (ms), from the gaps between blocks of the calibration step.

    The step was run with ``resident`` kept and ``depth``: the simulation of that layout without any
    overhead predicts each gap (the wait for a copy); what the measured gap has on top is the hook, the
    engine call and the event wait. Blocks whose copy the simulation hides tell it best, so their median
    residual is taken; when every copy is exposed (transfer-bound), the smallest residual, since there
    the gap also carries any error of the bandwidth figure. It includes the timers' own marks, a few
    microseconds, so it errs on the side of residency.
    """
    if measured.gap_ms is None or depth < 0:
        return 0.0
    from fastoffload_ext.planning.simulate import simulate_step

    bare = dataclasses.replace(costs, block_overhead_ms=0.0)
    # The timed repeats synchronize before each step: the host met the device at every step's start.
    timeline = simulate_step(bare, resident, depth, cyclic=cyclic, host_waits=True)
    keep = set(resident)
    residual: list[tuple[float, float]] = []  # (simulated gap, measured - simulated) per offloaded block
    order = costs.order()
    for previous, block in zip(order, order[1:]):
        if block in keep:
            continue
        simulated = timeline.block_start[block] - timeline.block_end[previous]
        residual.append((simulated, measured.gap_ms[block] - simulated))
    if not residual:
        return 0.0
    hidden = [r for simulated, r in residual if simulated <= HIDDEN_GAP_MS]
    value = statistics.median(hidden) if hidden else min(r for _, r in residual)
    return max(0.0, value)


def fit_host_overhead(measured: Measurement, resident: Collection[int]) -> float:
    """The host's cost of the offload hooks per offloaded block (ms), from the host gaps of the calibration step.

    The host gap before a block runs from the previous block's forward returning to this one's starting:
    the previous block's release, this block's acquire and prefetch calls, and the model's own code in
    between. Between two offloaded blocks it holds one block's worth of hooks; between two resident
    blocks (no hook) only the model's code, the baseline subtracted. Medians, so one slow gap does not
    move it. Without resident pairs the whole gap counts (the model's code and the timers' own marks,
    a few microseconds, err towards residency, as ``fit_block_overhead`` does).
    """
    gaps = measured.host_gap_ms
    if gaps is None:
        return 0.0
    keep = set(resident)
    order = measured.run_order or tuple(range(len(gaps)))
    pairs = list(zip(order, order[1:]))  # (the block that ran before, the block)
    hooked = [gaps[b] for a, b in pairs if b not in keep and a not in keep]
    bare = [gaps[b] for a, b in pairs if b in keep and a in keep]
    if not hooked:
        return 0.0
    return max(0.0, statistics.median(hooked) - (statistics.median(bare) if bare else 0.0))


def with_host_figures(costs: BlockCosts, measured: Measurement, resident: Collection[int] | None) -> BlockCosts:
    """``costs`` with the host's timeline from ``measured``: per-block dispatch, the host outside the
    blocks, and (``resident`` given: the layout the step ran) the hooks' host cost per offloaded block.

    Only where copies run beside compute: with the host as the device, the compute timeline already is
    the host's, and a second one would count the same time twice.
    """
    if not costs.overlap or measured.host_block_ms is None:
        return costs
    overhead = fit_host_overhead(measured, resident) if resident is not None else 0.0
    return dataclasses.replace(costs, host_ms=measured.host_block_ms, host_other_ms=measured.host_other_ms or 0.0,
                               host_overhead_ms=overhead)


DECODE_PROBE_BYTES = 8 * 1024**2


def measure_host_decode_gbps(*, nbytes: int = DECODE_PROBE_BYTES, repeats: int = 3) -> float:
    """The host decoder's output rate (GB/s), median of ``repeats``: what a compressed copy costs with the
    host as the device. Cached per process. (On CUDA the decode kernel runs at HBM speed beside the copy,
    and the cost table keeps its default.)"""
    key = f"decode/{nbytes}"
    if key in _BANDWIDTH_CACHE:
        return _BANDWIDTH_CACHE[key]
    from fastoffload_ext import _backend

    core = _backend.require_ext()
    generator = torch.Generator().manual_seed(0)
    values = (torch.randn(nbytes // 2, generator=generator) * 0.02).to(torch.bfloat16).view(torch.uint8)
    coded = core.codec_encode(values, [(0, values.numel(), True)])
    times = []
    for index in range(repeats + 1):
        begin = time.perf_counter()
        core.codec_decode(coded)
        if index:  # the first decode pays first-touch of its output
            times.append(time.perf_counter() - begin)
    gbps = nbytes / (statistics.median(times) * 1e9)
    _BANDWIDTH_CACHE[key] = gbps
    return gbps


def time_step_ms(step: Callable[[], Any], device: torch.device, repeats: int = 3) -> float:
    """Median wall time of ``step`` (ms), the device drained before and after each run, after one
    untimed run: the step as a caller timing its loop sees it. Under ``inference_mode`` as the
    measurement ran it (``measure_blocks``): in grad mode an offloaded block whose parameters require
    grad refuses to run, and the time would count autograd's bookkeeping."""

    def drain() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    with torch.inference_mode():
        step()
        for _ in range(max(1, repeats)):
            drain()
            begin = time.perf_counter()
            step()
            drain()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


# A simulated gap this short means the block's copy was ready when the block before it ended.
HIDDEN_GAP_MS = 1e-3


def calibrate_costs(blocks: Sequence[nn.Module], step: Callable[[], Any], device: torch.device,
                    block_bytes: Sequence[int], *, activation_reserve: int | None = None,
                    h2d_gbps: float | None = None, repeats: int = 5, max_repeats: int = 15,
                    transfer_bytes: Sequence[int] | Callable[[], Sequence[int]] | None = None,
                    resident: Collection[int] = (),
                    depth: int | None = None, cyclic: bool = True) -> tuple[BlockCosts, Measurement]:
    """The cost table of ``blocks`` measured on this machine by running ``step`` (one forward).

    ``resident`` and ``depth`` are the layout ``step`` runs with (an offloaded model's); with ``depth``
    given, the hooks' fixed cost per offloaded block is fitted from the gaps between blocks, on the
    device's clock and (CUDA) on the host's. On CUDA the table also gets each block's host dispatch
    time, so the planner sees a step the host sets (``simulate.py``).
    ``transfer_bytes``: what each block's copy moves (compressed host copies), default its packed bytes;
    a callable is asked after the step ran (a codec in "auto" mode decides while it runs).
    """
    measured = measure_blocks(blocks, step, device, repeats=repeats, max_repeats=max_repeats)
    if callable(transfer_bytes):
        transfer_bytes = transfer_bytes()
    moved = tuple(transfer_bytes) if transfer_bytes is not None else tuple(block_bytes)
    bandwidth = h2d_gbps if h2d_gbps is not None else measure_h2d_gbps(device, nbytes=probe_bytes_for(moved))
    activation = activation_reserve if activation_reserve is not None else (measured.activation_bytes or 0)
    costs = BlockCosts(measured.block_ms, tuple(block_bytes), bandwidth, other_ms=measured.other_ms,
                       activation_bytes=activation, overlap=device.type == "cuda", calibrated=True,
                       transfer_bytes=moved, run_order=measured.run_order)
    if costs.compressed and device.type == "cpu":
        costs = dataclasses.replace(costs, decode_gbps=measure_host_decode_gbps())
    # The host's figures first: the device gaps they explain (a starved device) are no device overhead.
    costs = with_host_figures(costs, measured, resident if depth is not None else None)
    if depth is not None:
        overhead = fit_block_overhead(costs, measured, resident, depth, cyclic)
        costs = dataclasses.replace(costs, block_overhead_ms=overhead)
    logger.info("calibrated %d blocks: step %.3f ms (spread %.0f %% over %d repeats), compute %.3f ms, H2D %.1f GB/s, "
                "hook overhead %.1f us per offloaded block; host step %.3f ms, dispatch %.3f ms, hooks %.1f us per "
                "offloaded block", len(blocks), measured.step_ms, 100 * measured.spread, measured.repeats,
                costs.total_compute_ms(), bandwidth, 1e3 * costs.block_overhead_ms, measured.host_step_ms or 0.0,
                costs.total_host_ms(), 1e3 * costs.host_overhead_ms)
    return costs, measured


__all__ = ["ASSUMED_H2D_GBPS", "BANDWIDTH_PROBE_BYTES", "SPREAD_LIMIT", "BlockTimer", "Measurement",
           "cached_h2d_gbps", "calibrate_costs", "fit_block_overhead", "fit_host_overhead", "measure_blocks",
           "measure_h2d_gbps", "measure_host_decode_gbps", "probe_bytes_for", "spread_of", "time_step_ms",
           "with_host_figures"]
