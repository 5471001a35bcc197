"""The residency planner: from a cost table and budgets to an :class:`OffloadPlan`.

It is a pure function of its inputs. Every candidate (resident set, depth) is scored by the pipeline
simulation (``simulate.py``) and must fit: resident bytes + (depth + 1) slots of the largest offloaded
block (+ staging for compressed copies) + the activation reserve within the device budget, and the
offloaded blocks' host copies within the host budget. The fastest predicted candidate wins. Equal
predictions go to the one predicted fastest with copies 10 % slower (slack in the copy windows), then
to the one that keeps more bytes resident (what the simulation leaves out, the copies' pressure on
memory bandwidth, only ever favours residency), then to the shortest run of offloaded blocks in a row,
then to less device memory, then to the shallower prefetch. With ``cuda_graph`` a layout's slots are the
more of depth + 1 and a captured graph's fixed ones (``slots.py``).

Which candidates: every subset when the list is short (``exhaustive_limit`` blocks), else for each
count of resident blocks the evenly spread sets (with uniform blocks, spreading the resident ones lets
each remaining copy hide behind the compute of the blocks before it), the same spread over only the
copy-bound blocks (a ring of two kinds of block), the prefixes of the copy-heaviest blocks, and a
greedy chain that adds the block whose residency saves the most predicted
time. The candidate list does not depend on the budget, so a larger budget never predicts slower.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Collection, Iterable

from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning.budgets import format_bytes
from fastoffload_ext.planning.costs import BlockCosts
from fastoffload_ext.planning.plan import OffloadPlan
from fastoffload_ext.planning.simulate import simulate_step
from fastoffload_ext.planning.slots import planned_slot_count

logger = logging.getLogger(__name__)

DEFAULT_MAX_DEPTH = 3
EXHAUSTIVE_LIMIT = 8
GREEDY_LIMIT = 32
_TIE_MS = 1e-6  # predictions closer than this are equal (float noise of the simulation)
# Equal predictions go to the layout that loses least when copies run this much slower: several
# layouts often tie (every copy hidden, or the step bound by the same total), and the one with slack
# in its copy windows is the one a drifting host does not push over.
SLOW_COPY_FACTOR = 1.1


def _memory(costs: BlockCosts, resident: frozenset[int], depth: int,
            cuda_graph: bool = False) -> tuple[int, int, int, int]:
    """(resident bytes, slot bytes, device bytes, host bytes) of one candidate.

    Slots hold decoded blocks (``block_bytes``); coded copies add the engine's two staging buffers on
    the device, and the host holds what the copies move (``transfer_bytes``). ``cuda_graph``: the slots
    are the more of eager offload's and a captured graph's fixed ones (``slots.planned_slot_count``).
    """
    resident_bytes = sum(costs.block_bytes[b] for b in resident)
    offloaded = [b for b in range(costs.blocks) if b not in resident]
    slot = max((costs.block_bytes[b] for b in offloaded), default=0)
    slots = planned_slot_count(len(offloaded), depth, cuda_graph)
    device = resident_bytes + slots * slot + costs.staging_bytes(offloaded) + costs.activation_bytes
    return resident_bytes, slot, device, sum(costs.moved_bytes(b) for b in offloaded)


def _run_depth(costs: BlockCosts, resident: frozenset[int], depth: int) -> int:
    """The depth the engine runs ``depth`` at: no further ahead than there are offloaded blocks (enable's
    ``effective_prefetch_depth``), so a deeper one costs that many slots, not depth + 1."""
    offloaded = costs.blocks - len(resident)
    return min(depth, offloaded) if offloaded else depth


@functools.lru_cache(maxsize=1 << 16)
def _score(costs: BlockCosts, chosen: frozenset[int], depth: int, cyclic: bool) -> float:
    return simulate_step(costs, chosen, depth, cyclic=cyclic).step_ms


def _longest_run(resident: frozenset[int], n: int) -> int:
    """The most offloaded blocks in a row (around the wrap): among equal predictions the layout whose
    copies each have a resident block's compute nearby is the one real jitter hurts least. Only for
    measured tables: a bytes-only plan keeps the first blocks, as ``resident_blocks=N`` does."""
    longest = run = 0
    for index in range(2 * n):  # twice round, so a run across the wrap is counted whole
        run = 0 if (index % n) in resident else run + 1
        longest = max(longest, min(run, n))
    return longest


def _even(n: int, count: int, offset: float) -> frozenset[int]:
    if count <= 0:
        return frozenset()
    return frozenset(min(n - 1, int((i + offset) * n / count)) for i in range(count))


def _spread_sets(n: int) -> Iterable[frozenset[int]]:
    for count in range(n + 1):
        for offset in (0.0, 0.5):
            yield _even(n, count, offset)
            # The complement view: the offloaded blocks evenly spread among resident ones.
            yield frozenset(range(n)) - _even(n, n - count, offset)


def _bound_spread_sets(costs: BlockCosts) -> Iterable[frozenset[int]]:
    """Resident sets spread evenly over the copy-bound blocks (copy slower than their compute, or than the
    host's dispatch and hooks where the host is slower), then those
    plus spread others: with two kinds of block in one ring (Flux's copy-bound double-stream blocks and
    compute-bound single-stream ones) a resident compute-bound block saves little while copy-bound ones
    are still copied, and spreading over the whole ring would put most resident blocks among the wrong kind."""
    n = costs.blocks
    bound = [b for b in range(n) if costs.copy_ms(b) > costs.window_ms(b)]
    if not bound or len(bound) == n:
        return
    rest = sorted(set(range(n)) - set(bound))
    m = len(bound)
    for count in range(1, m + 1):
        for offset in (0.0, 0.5):
            yield frozenset(bound[i] for i in _even(m, count, offset))
            yield frozenset(bound) - frozenset(bound[i] for i in _even(m, m - count, offset))
    for count in range(1, len(rest) + 1):
        for offset in (0.0, 0.5):
            yield frozenset(bound) | frozenset(rest[i] for i in _even(len(rest), count, offset))


def _heaviest_prefixes(costs: BlockCosts) -> Iterable[frozenset[int]]:
    order = sorted(range(costs.blocks), key=lambda b: (-costs.copy_ms(b), -costs.block_bytes[b], b))
    for count in range(costs.blocks + 1):
        yield frozenset(order[:count])


def _greedy_chain(costs: BlockCosts, depth: int, cyclic: bool) -> Iterable[frozenset[int]]:
    chosen: frozenset[int] = frozenset()
    yield chosen
    while len(chosen) < costs.blocks:
        best: tuple[float, int, int] | None = None
        for block in range(costs.blocks):
            if block in chosen:
                continue
            ms = _score(costs, chosen | {block}, depth, cyclic)
            key = (round(ms / _TIE_MS), -costs.block_bytes[block], block)
            if best is None or key < best:
                best = key
        assert best is not None
        chosen = chosen | {best[2]}
        yield chosen


# Budget-independent, so a budget sweep over one table (the benchmark, a re-plan) builds them once.
@functools.lru_cache(maxsize=64)
def candidate_sets(costs: BlockCosts, depth: int, *, cyclic: bool = True,
                   exhaustive_limit: int = EXHAUSTIVE_LIMIT) -> tuple[frozenset[int], ...]:
    """The resident sets the planner scores at ``depth`` (independent of any budget)."""
    n = costs.blocks
    if n <= exhaustive_limit:
        return tuple(frozenset(c) for r in range(n + 1) for c in itertools.combinations(range(n), r))
    sets = dict.fromkeys(itertools.chain(_spread_sets(n), _bound_spread_sets(costs), _heaviest_prefixes(costs)))
    if costs.run_order is not None:
        # Spread along the order the blocks run in, too: made on the table renumbered in that order, then named
        # by list position again. (List-order spreads stay: where lists interleave, one kept in pairs of
        # neighbours that run apart can beat an even spread in running order; the simulation, which walks the
        # run order, scores both.)
        ran, order = costs.in_run_order()
        ran_sets = itertools.chain(_spread_sets(n), _bound_spread_sets(ran))
        sets.update(dict.fromkeys(frozenset(order[p] for p in chosen) for chosen in ran_sets))
    if n <= GREEDY_LIMIT:
        sets.update(dict.fromkeys(_greedy_chain(costs, depth, cyclic)))
    return tuple(sets)


def _refusal(costs: BlockCosts, device_budget: int | None, host_budget: int | None, depths: list[int],
             fixed: frozenset[int] | None, cuda_graph: bool = False, tied: bool = False) -> OffloadConfigError:
    """Why nothing fits, with the numbers of the cheapest layout and what to change. ``tied``: ``fixed``
    is the blocks whose tied weights keep them resident, not a set the caller chose."""
    depth = min(depths)
    reserve = format_bytes(costs.activation_bytes)
    graph = " (with a CUDA graph's fixed slots)" if cuda_graph else ""
    if fixed is not None:
        depth = _run_depth(costs, fixed, depth)
        resident_bytes, slot, device, host = _memory(costs, fixed, depth, cuda_graph)
        slots = planned_slot_count(costs.blocks - len(fixed), depth, cuda_graph)
        staging = costs.staging_bytes([b for b in range(costs.blocks) if b not in fixed])
        if device_budget is not None and device > device_budget:
            what = (f"{format_bytes(resident_bytes)}: blocks {', '.join(map(str, sorted(fixed)))}, whose weights are "
                    "tied to another block or to the rest of the model" if tied else format_bytes(resident_bytes))
            advice = ("untie those weights (clone one) to let the planner offload those blocks, or raise device_budget"
                      if tied else "keep fewer blocks resident, use resident_blocks='auto', or raise device_budget")
            return OffloadConfigError(
                f"fastoffload: device_budget {format_bytes(device_budget)} is too small for {len(fixed)} resident "
                f"blocks ({what}) + {slots} slots{graph} x {format_bytes(slot)} + "
                + (f"{format_bytes(staging)} staging for compressed copies + " if staging else "")
                + f"{reserve} activation reserve = {format_bytes(device)}; {advice}")
        return OffloadConfigError(
            f"fastoffload: host_budget {format_bytes(host_budget)} cannot hold the {format_bytes(host)} of pinned host "
            f"copies that the {costs.blocks - len(fixed)} offloaded blocks need; keep more blocks resident, "
            "or raise host_budget")
    depth = _run_depth(costs, frozenset(), depth)
    slot = max(costs.block_bytes, default=0)
    slots = planned_slot_count(costs.blocks, depth, cuda_graph)
    staging = costs.staging_bytes(range(costs.blocks))
    need = slots * slot + staging + costs.activation_bytes
    if device_budget is not None and device_budget < need:
        return OffloadConfigError(
            f"fastoffload: device_budget {format_bytes(device_budget)} is smaller than what offload needs at least: "
            f"{slots} slots{graph} x {format_bytes(slot)} (the largest block) + "
            + (f"{format_bytes(staging)} staging for compressed copies + " if staging else "")
            + f"{reserve} activation reserve = {format_bytes(need)}. Raise device_budget to at least {format_bytes(need)}, lower prefetch_depth, or "
            "lower activation_reserve")
    return OffloadConfigError(
        f"fastoffload: host_budget {format_bytes(host_budget)} is too small: no resident set that fits device_budget "
        f"{format_bytes(device_budget)} leaves the offloaded blocks' pinned copies within it (all "
        f"{costs.blocks} blocks need {format_bytes(sum(map(costs.moved_bytes, range(costs.blocks))))}). Raise host_budget (free host memory), "
        "or raise device_budget so that more blocks stay resident")


def _host_clause(costs: BlockCosts, offloaded: int, host_ms: float, device_ms: float) -> str | None:
    """The sentence for a step the host sets (None when the device does, or the host was not timed)."""
    if not costs.host_timed or host_ms <= device_ms:
        return None
    hooks = costs.host_overhead_ms * offloaded
    return (f"host-bound: the host dispatches the step in {host_ms:.3f} ms"
            + (f" ({hooks:.3f} ms of it the hooks of {offloaded} offloaded blocks, {1e3 * costs.host_overhead_ms:.0f} "
               "us each)" if hooks > 0 else "")
            + f", the GPU computes it in {device_ms:.3f} ms")


def _disk_clause(costs: BlockCosts, resident: frozenset[int], copy_ms: float) -> str | None:
    """The sentence for a disk tier (None without one): how many blocks it reads a step, and whether the
    reads set the step."""
    if costs.disk is None:
        return None
    blocks = costs.disk_blocks(resident)
    if not blocks:
        return f"every offloaded block fits host_budget {format_bytes(costs.disk.host_budget)}: no disk reads"
    disk_ms = costs.disk_ms(resident)
    nbytes = sum(costs.moved_bytes(b) for b in blocks)
    bound = disk_ms > max(costs.total_compute_ms(), copy_ms)
    return (f"{'disk-bound: ' if bound else ''}{len(blocks)} offloaded blocks beyond host_budget "
            f"{format_bytes(costs.disk.host_budget)} are read from disk every step, {format_bytes(nbytes)} at "
            f"{costs.disk.read_gbps:.2f} GB/s = {disk_ms:.1f} ms" + ("; each block kept resident saves one read"
                                                                     if bound else ""))


def _why(costs: BlockCosts, plan_resident: frozenset[int], depth: int, step_ms: float, ideal_ms: float,
         copy_ms: float, budget: int | None, host: str | None = None, disk: str | None = None,
         cached: bool = False) -> str:
    n = costs.blocks
    compute = costs.total_compute_ms()
    if not costs.calibrated:
        return "; ".join(([disk] if disk else []) + [
            "not calibrated (compute not measured yet): keeps the most bytes resident that the budget allows, "
            f"depth {depth}; call group.calibrate(step) to measure this machine and re-plan"])
    if len(plan_resident) == n:
        return "; ".join(["every block fits the budget: nothing is copied"] + ([host] if host else []))
    regime = "transfer-bound" if copy_ms > compute else "compute-bound"
    parts = [f"{regime}: compute {compute:.3f} ms vs copies of the offloaded bytes {copy_ms:.3f} ms"]
    if host:
        parts.insert(0, host)
    if disk:
        parts.insert(0, disk)
    if cached:
        parts.append(f"the {n - len(plan_resident)} offloaded blocks fit the {depth + 1} slots: each is copied once, "
                     "not every step")
    elif regime == "compute-bound" and not plan_resident:
        parts.append("every copy hides behind compute")
    elif plan_resident:
        parts.append(f"{len(plan_resident)} resident blocks cut the copied bytes"
                     + (" and are spread so each remaining copy hides behind the compute before it"
                        if 0 < len(plan_resident) < n - 1 else ""))
    if depth > 1:
        parts.append(f"depth {depth} lets short windows borrow from longer ones")
    offloaded = [b for b in range(n) if b not in plan_resident]
    coded = [b for b in offloaded if costs.is_coded(b)]
    if coded:
        raw = sum(costs.block_bytes[b] for b in offloaded)
        moved = sum(costs.moved_bytes(b) for b in offloaded)
        parts.append(f"compressed: {len(coded)} of {len(offloaded)} offloaded blocks move coded bytes, "
                     f"{format_bytes(moved)} of {format_bytes(raw)} ({moved / raw if raw else 1.0:.3f}x) cross PCIe "
                     "and sit in pinned host memory")
    overhead = costs.block_overhead_ms * len(offloaded)
    exposed = step_ms - max(ideal_ms, 0.0)
    parts.append(f"predicted {step_ms:.3f} ms = {step_ms / ideal_ms if ideal_ms > 0 else 1.0:.3f}x the ideal "
                 f"{ideal_ms:.3f} ms" + (f" ({exposed:.3f} ms exposed" if exposed > _TIE_MS * 1e3 else "")
                 + (f", of which up to {overhead:.3f} ms is the hooks' fixed {1e3 * costs.block_overhead_ms:.0f} us "
                    f"per offloaded block)" if exposed > _TIE_MS * 1e3 and overhead > 0 else
                    ")" if exposed > _TIE_MS * 1e3 else ""))
    if costs.run_order is not None:
        parts.append("the forward runs the blocks in another order than the list holds them: planned along it")
    if budget is None:
        parts.append("no device budget given")
    return "; ".join(parts)


def _check_inputs(costs: BlockCosts, device_budget: int | None, host_budget: int | None,
                  resident: Collection[int] | None, prefetch_depth: int | None, max_depth: int) -> None:
    for name, value in (("device_budget", device_budget), ("host_budget", host_budget)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise OffloadConfigError(f"fastoffload: plan_offload's {name} must be None or bytes >= 0 (parse strings "
                                     f"with planning.parse_size), got {value!r}")
    if prefetch_depth is not None and (isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int)
                                       or prefetch_depth < 0):
        raise OffloadConfigError(f"fastoffload: plan_offload's prefetch_depth must be None or an integer >= 0, got "
                                 f"{prefetch_depth!r}")
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
        raise OffloadConfigError(f"fastoffload: plan_offload's max_depth must be an integer >= 1, got {max_depth!r}")
    if resident is not None and (not isinstance(resident, Collection) or isinstance(resident, (str, bytes))):
        # A generator would be used up by the check below and then read as no resident block at all.
        raise OffloadConfigError(f"fastoffload: plan_offload's resident must be None or a collection of block indices "
                                 f"(a list, tuple, set or range; the first N blocks: range(N)), got {resident!r}")
    if resident is not None:
        _check_indices(costs, resident, "resident")


def _check_indices(costs: BlockCosts, indices: Collection[int], name: str) -> None:
    if not isinstance(indices, Collection) or isinstance(indices, (str, bytes)):
        raise OffloadConfigError(f"fastoffload: plan_offload's {name} must be a collection of block indices, got "
                                 f"{indices!r}")
    bad = [b for b in indices if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < costs.blocks]
    if bad:
        raise OffloadConfigError(f"fastoffload: {name} block indices must be integers in 0..{costs.blocks - 1}, "
                                 f"got {sorted(indices, key=repr)!r}")


def _make_plan(costs: BlockCosts, chosen: frozenset[int], depth: int, ms: float, scored: int,
               device_budget: int | None, host_budget: int | None, cyclic: bool, cuda_graph: bool) -> OffloadPlan:
    """The plan for the layout the search chose, with its memory, its ideal and why."""
    resident_bytes, slot, device, host = _memory(costs, chosen, depth, cuda_graph)
    timeline = simulate_step(costs, chosen, depth, cyclic=cyclic)
    # Offloaded blocks that all fit the slots stay there after the first step: the step copies none, so
    # no copy sets its floor (the ideal counted them, and read above the step predicted without them).
    copy_ms = sum(costs.copy_ms(b) for b in range(costs.blocks) if b not in chosen) if timeline.copies else 0.0
    compute = costs.total_compute_ms()
    disk_blocks, disk_ms = costs.disk_blocks(chosen), costs.disk_ms(chosen)
    # No schedule beats the host's own dispatch of the step either (a launch-bound model), nor the disk.
    # (With the host as the device the copies are memcpys on the compute's timeline; the reads run on
    # the reader's threads either way.)
    ideal = (max(compute, copy_ms, costs.total_host_ms(), disk_ms) if costs.overlap
             else max(compute + copy_ms, disk_ms))
    offloaded = [b for b in range(costs.blocks) if b not in chosen]
    host_ms = timeline.host_ms
    device_ms = _score(costs.device_only(), chosen, depth, cyclic)
    plan = OffloadPlan(
        blocks=costs.blocks, resident=tuple(sorted(chosen)), prefetch_depth=depth,
        num_slots=planned_slot_count(len(offloaded), depth, cuda_graph), slot_bytes=slot,
        resident_bytes=resident_bytes,
        host_bytes=host, activation_bytes=costs.activation_bytes, device_bytes=device,
        device_budget=device_budget, host_budget=host_budget, predicted_step_ms=ms, ideal_ms=ideal,
        compute_ms=compute, copy_ms=copy_ms, candidates=scored,
        raw_offloaded_bytes=sum(costs.block_bytes[b] for b in offloaded),
        compressed_blocks=sum(1 for b in offloaded if costs.is_coded(b)),
        staging_bytes=costs.staging_bytes(offloaded), overhead_ms=costs.block_overhead_ms * len(offloaded),
        host_ms=host_ms, device_ms=device_ms,
        host_hooks_ms=costs.host_overhead_ms * len(offloaded) if costs.host_timed else 0.0,
        disk_blocks=len(disk_blocks), disk_ms=disk_ms,
        why=_why(costs, chosen, depth, ms, ideal, copy_ms, device_budget,
                 _host_clause(costs, len(offloaded), host_ms, device_ms), _disk_clause(costs, chosen, copy_ms),
                 cached=bool(offloaded) and not timeline.copies),
        costs=costs, cuda_graph=cuda_graph)
    return plan


def plan_offload(costs: BlockCosts, device_budget: int | None = None, *, host_budget: int | None = None,
                 resident: Collection[int] | None = None, prefetch_depth: int | None = None,
                 max_depth: int = DEFAULT_MAX_DEPTH, cyclic: bool = True,
                 exhaustive_limit: int = EXHAUSTIVE_LIMIT, cuda_graph: bool = False,
                 keep_resident: Collection[int] = ()) -> OffloadPlan:
    """The fastest predicted (resident set, depth) for ``costs`` within the budgets (bytes, None: no limit).

    ``resident`` or ``prefetch_depth`` fix that half of the plan; the other is searched (depths
    1..``max_depth``). ``keep_resident``: blocks every searched resident set includes (enable passes
    the blocks whose weights are tied to another block or to the rest of the model, which cannot be
    offloaded); a fixed ``resident`` is taken as given. Raises :class:`OffloadConfigError` with the
    numbers when nothing fits.
    ``cuda_graph``: the model will be captured with ``OffloadedCUDAGraph``, whose fixed slots can be
    more than ``depth + 1`` (``slots.cyclic_slot_count``); the memory counts them, so the capture
    stays within ``device_budget``. The predicted step is the eager one either way.
    """
    _check_inputs(costs, device_budget, host_budget, resident, prefetch_depth, max_depth)
    _check_indices(costs, keep_resident, "keep_resident")
    keep = frozenset(keep_resident)
    for name, flag in (("cyclic", cyclic), ("cuda_graph", cuda_graph)):
        if not isinstance(flag, bool):  # cyclic="no" is truthy: it would silently plan the cyclic schedule
            raise OffloadConfigError(f"fastoffload: plan_offload's {name} must be True or False, got {flag!r}")
    fixed = frozenset(resident) if resident is not None else None
    depths = [prefetch_depth] if prefetch_depth is not None else list(range(1, max_depth + 1))
    best: tuple[tuple[float, float, int, int, int, int, tuple[int, ...]], frozenset[int], int, float] | None = None
    slow = dataclasses.replace(costs, h2d_gbps=costs.h2d_gbps / SLOW_COPY_FACTOR)
    ran_at = {b: p for p, b in enumerate(costs.order())}  # each block's position in the order they run
    scored = 0
    no_staging: OffloadConfigError | None = None  # a disk tier whose staging ring the host budget cannot hold
    for asked in depths:
        sets = [fixed] if fixed is not None else dict.fromkeys(
            chosen | keep for chosen in candidate_sets(costs, asked, cyclic=cyclic, exhaustive_limit=exhaustive_limit))
        for chosen in sets:
            depth = _run_depth(costs, chosen, asked)
            resident_bytes, _, device, host = _memory(costs, chosen, depth, cuda_graph)
            if (device_budget is not None and device > device_budget) or (host_budget is not None
                                                                          and host > host_budget):
                continue
            try:
                ms = _score(costs, chosen, depth, cyclic)
            except OffloadConfigError as error:
                no_staging = error
                continue
            scored += 1
            key = (round(ms / _TIE_MS) * _TIE_MS, round(_score(slow, chosen, depth, cyclic) / _TIE_MS) * _TIE_MS,
                   -resident_bytes,
                   _longest_run(frozenset(ran_at[b] for b in chosen), costs.blocks) if costs.calibrated else 0,
                   device, depth,
                   tuple(sorted(chosen)))
            if best is None or key < best[0]:
                best = (key, chosen, depth, ms)
    if best is None:
        if no_staging is not None:
            raise no_staging
        if fixed is None and keep:
            raise _refusal(costs, device_budget, host_budget, depths, keep, cuda_graph, tied=True)
        raise _refusal(costs, device_budget, host_budget, depths, fixed, cuda_graph)
    _, chosen, depth, ms = best
    plan = _make_plan(costs, chosen, depth, ms, scored, device_budget, host_budget, cyclic, cuda_graph)
    logger.debug("%s", plan)
    return plan


__all__ = ["DEFAULT_MAX_DEPTH", "EXHAUSTIVE_LIMIT", "candidate_sets", "plan_offload"]
