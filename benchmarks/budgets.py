"""Section budgets: the residency planner under device budgets, against a grid search and the ideal.

Per workload (W1-W4, and when diffusers is importable Wan-1.3B at a transfer-bound and a balanced token
count and Flux with both block lists in one ring, ``benchmarks/dit_workloads.py``):

1. A resident copy gives the reference output and stays alive for the workload's rows; a calibration
   step (the engine at depth 1, every block offloaded, ``group.calibrate``) gives the planner its cost
   table: per-block compute from events (median of repeats), the activation peak, bytes from the engine,
   the copy rate at the block size, and the hooks' fixed cost per offloaded block fitted from the gaps
   between blocks.
2. For each budget (0, 25, 50, 75 and 100 % of the block bytes on top of the least offload can run in:
   two slots of the largest block plus the measured activation reserve; and ``"auto"``) the planner's
   plan runs against a grid of (resident set, depth): for each depth 1..3 the most evenly spread blocks
   that fit, plus today's ``resident_blocks=N`` (the first N) at depth 1. Every configuration and the
   resident model are alive at once and timed in interleaved rounds (``benchmarks.interleave``). The
   planner's row reports its median over its prediction, and the same with the host's drift taken out
   (the plan over the resident model per round, against the predicted plan over the predicted resident
   step), over the best grid configuration's (the fastest other configuration of those rounds, timed again
   with the plan in rounds of their own; target <= 1.03), over the ideal max(resident compute,
   moved bytes / peak H2D) (target <= 1.05), the hooks' fixed cost per step (on the device's timeline
   or, host-bound, the host's) and the ideal with it (max(compute + hooks, moved / peak): what the hook
   path alone keeps a plan above), over today's floor max(compute, all block bytes / peak H2D) (at 50 %
   on W1 and W4: target <= 0.55), the per-round spread, its peak device memory measured alone (must stay
   within the budget), bit-equality with the resident output, and a note naming every target the row
   misses with the figure that explains it. Every ratio to the resident model is taken within each
   round (the resident step of that round) and the median over rounds is reported, with the lowest and
   highest round beside the ideal: the host's speed can flip mid-run, and a ratio of medians would then
   pair a fast round of one side with a slow round of the other. The resident model is also timed a
   second time in every round, as a configuration of its own ("control": the resident model against
   itself, per round): what a host-bound row's ratios can move with no offload at all. A missed ideal
   whose ratio the control's rounds reach is noted as inside that row's noise.
3. A depth sweep, every block offloaded, depth 1/2/3 interleaved: depth 2 and 3 never slower than 1
   beyond 2 %.

Compressed copies (W1 and W4 at 50 %): the raw plan, the plan with ``compress=True`` (coded bytes and the
decode's two device staging buffers counted in the budget) and the plan ``compress="auto"`` picks (the
faster predicted of the two) in the same interleaved rounds.

``BENCHMARK_BUDGETS_WORKLOADS`` (comma-separated, case-insensitive: ``W1,W2,W3,W4,wan-1.3b,flux``) runs
only those workloads, in that order, so the full section fits two GPU commands of about 450 s each:
``W1,W2,W3,W4``, then ``flux,wan-1.3b`` (Flux first: its balanced rows are the ones no earlier run has).
Unknown names are noted and ignored. Each row is in the journal as soon as it is done (a SIGTERM to
``python -m benchmarks`` keeps every row so far), and a note after each workload gives its wall time.

Timing: each configuration's turn in a round runs as a denoising loop does (``benchmarks/steady.py``): a lead
forward after a wait, then three timed back to back; eight rounds (``ROUNDS``, ``ITERS``), so 32 forwards a
configuration. Why eight short turns: a host stall lasts a few hundred milliseconds and lands on whichever
configurations run then. On the H200 one stall put a plan's turn at 61 ms against 35-40 ms in its other three
rounds, and another hit the best grid configuration's fourth. With four rounds, two spoiled ones decide the median
of per-round ratios; with eight, the median comes from rounds that no stall touched.

Time (full section, estimated from the quick run's rows on the H200: rounds x configurations x forwards a turn x
step, plus 1-3 s to build each configuration): W1 ~75 s, W2 ~120 s (a 100 ms step), W3 ~40 s, W4 ~70 s, about
320 s with start-up; Flux ~100 s (1024 tokens) + ~135 s (9216), Wan-1.3B ~60 s (1560 tokens) + ~90 s (6240),
about 400 s (estimated at 30 forwards a configuration; 32 now).

Flux stays cut to 4 double-stream + 8 single-stream blocks (``benchmarks/dit_workloads.py``): the full
19 + 38 blocks are 24 GB, so every grid configuration's own pinned host copy, the host master and the
copies being built do not fit 128 GB of host memory, and at 0.44 s a step moved at the PCIe floor the
section's rounds alone (six budgets x up to five configurations x 30 forwards) would take the whole
command. The cut keeps both block kinds, their sizes and the balanced token count, which is what the
planner's choice depends on.

``--quick``: W1 and W4 at budgets 0, 50 and 100 % and "auto"; the diffusers models at 0 and 50 % and
"auto", Flux at its transfer-bound token count only, the depth sweep once per architecture.
Without a GPU the section runs the same steps on scaled-down models with the host as the device, where
only bit-equality and the planner's choice mean anything; memory, ideal and floor columns need CUDA.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from benchmarks.dit_workloads import dit_workloads
from benchmarks.interleave import run_interleaved
from benchmarks.steady import SteadyTimer
from benchmarks.utils import (GB, Column, Context, MiB, Table, device_allocated, device_peak, free_memory,
                              reset_device_peak)
from benchmarks.workloads import Workload, move_all_but, move_non_block_modules, stack_workload

TITLE = "budgets: the residency planner under device budgets (planner vs grid search vs ideal)"
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
QUICK_FRACTIONS = (0.0, 0.5, 1.0)
QUICK_DIT_FRACTIONS = (0.0, 0.5)  # the diffusers models under --quick: 0 %, 50 % and "auto"
RESIDENT = "resident"
CONTROL = "resident again"  # the same resident model, timed once more per round: the row's noise
DEPTHS = (1, 2, 3)
TARGET_X_BEST = 1.03
TARGET_X_IDEAL = 1.05
TARGET_X_FLOOR = 0.55  # at 50 % on W1 and W4
TARGET_DEPTH = 1.02
FLOOR_WORKLOADS = ("W1", "W4")
ENV_WORKLOADS = "BENCHMARK_BUDGETS_WORKLOADS"
STACK_KEYS = ("W1", "W2", "W3", "W4")
QUICK_STACK_KEYS = ("W1", "W4")
DIT_KEYS = ("wan-1.3b", "flux")
# (full, quick): eight short turns per configuration, so that a host stall spoils few of the rounds (docstring).
ROUNDS = (8, 8)
ITERS = (3, 3)

TABLES = {
    "budgets": Table(
        title="Budgets: planner's plan vs the best grid configuration (interleaved rounds), median ms",
        columns=[
            Column("workload", "workload"), Column("budget", "budget"), Column("budget_mib", "MiB", ".0f"),
            Column("plan", "plan"), Column("predicted_ms", "pred ms", ".2f"), Column("ms", "ms", ".2f"),
            Column("x_predicted", "x pred", ".3f"), Column("x_predicted_resident", "x pred/res", ".3f"),
            Column("spread", "spread", ".1%"), Column("best", "best grid"),
            Column("x_best", "x best", ".3f"), Column("x_best_selection", "x best, choosing rounds", ".3f"),
            Column("resident_ms", "resident ms", ".2f"),
            Column("x_ideal", "x ideal", ".3f"),
            Column("x_ideal_rounds", "x ideal rounds"), Column("control", "control [rounds]"),
            Column("hooks_ms", "hooks ms", ".2f"),
            Column("x_ideal_hooks", "x ideal+hooks", ".3f"), Column("x_floor", "x floor", ".3f"),
            Column("peak_mib", "peak MiB", ".0f"), Column("mem_ok", "mem<=budget"), Column("bit_equal", "bit-equal"),
            Column("pass", "pass"),
        ],
    ),
    "compressed": Table(
        title="Compressed copies at one budget: the raw plan, compress=True (coded bytes and the decode's staging "
              "counted) and what compress='auto' picks (interleaved rounds), median ms",
        columns=[
            Column("workload", "workload"), Column("budget", "budget"), Column("budget_mib", "MiB", ".0f"),
            Column("raw_plan", "raw plan"), Column("plan", "coded plan"),
            Column("raw_moved_mib", "raw moved MiB", ".0f"), Column("moved_mib", "coded moved MiB", ".0f"),
            Column("staging_mib", "staging MiB", ".0f"), Column("raw_predicted_ms", "raw pred", ".2f"),
            Column("predicted_ms", "coded pred", ".2f"), Column("raw_ms", "raw ms", ".2f"),
            Column("ms", "coded ms", ".2f"), Column("x_raw", "coded x raw", ".3f"), Column("auto_plan", "auto picks"),
            Column("x_auto_raw", "auto x raw", ".3f"), Column("x_floor_auto", "auto x floor", ".3f"),
            Column("peak_mib", "peak MiB", ".0f"), Column("mem_ok", "mem<=budget"), Column("bit_equal", "bit-equal"),
            Column("pass", "pass"),
        ],
    ),
    "depth": Table(
        title="Prefetch depth, every block offloaded (interleaved rounds): median ms and ratio to depth 1",
        columns=[
            Column("workload", "workload"), Column("depth", "depth"), Column("ms", "ms", ".2f"),
            Column("x_depth1", "x depth 1", ".3f"), Column("ratio_lo", "lowest", ".3f"),
            Column("ratio_hi", "highest", ".3f"), Column("pass", "pass"),
        ],
    ),
}


def selected_keys(ctx: Context, wanted: str | None) -> list[str]:
    """The workload keys to run: ``wanted`` (the environment selector) or the section's default."""
    if not wanted or not wanted.strip():
        return list(QUICK_STACK_KEYS if ctx.quick else STACK_KEYS) + list(DIT_KEYS)
    known = {key.lower(): key for key in STACK_KEYS + DIT_KEYS}
    names = [name.strip().lower() for name in wanted.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown:
        ctx.note(f"{ENV_WORKLOADS}: unknown workload(s) {', '.join(unknown)} ignored; known: "
                 f"{', '.join(STACK_KEYS + DIT_KEYS)}")
    return [known[name] for name in dict.fromkeys(names) if name in known]


def _workloads(ctx: Context) -> list[tuple[str, Workload | None, str]]:
    items: list[tuple[str, Workload | None, str]] = []
    for key in selected_keys(ctx, os.environ.get(ENV_WORKLOADS)):  # in the selector's order
        if key in STACK_KEYS:
            workload = stack_workload(key, cpu=not ctx.cuda)
            items.append((workload.name, workload, ""))
        else:
            items.extend(dit_workloads(ctx, (key,)))
    return items


def _rounds(ctx: Context) -> int:
    return ROUNDS[1] if ctx.quick else ROUNDS[0]


def _iters(ctx: Context) -> int:
    return ITERS[1] if ctx.quick else ITERS[0]


def _lists(workload: Workload, model: nn.Module) -> list[str]:
    """The names of the block lists the workload offloads (one ring when there are several)."""
    from fastoffload_ext.engine.model_checks import find_block_lists

    return [name for name, _ in find_block_lists(model, workload.info.get("block_lists"))]


def _ring(workload: Workload, model: nn.Module) -> list[nn.Module]:
    return [block for name in _lists(workload, model) for block in getattr(model, name)]


def _extra(workload: Workload) -> dict[str, Any]:
    block_lists = workload.info.get("block_lists")
    return {"block_lists": block_lists} if block_lists else {}


def _rest_to_device(model: nn.Module, workload: Workload, device: torch.device) -> None:
    if not workload.info.get("block_lists"):
        move_non_block_modules(model, device)
        return
    move_all_but(model, device, [getattr(model, name) for name in _lists(workload, model)])


class Config:
    """One offload configuration of its own model copy, alive for the rounds of one budget."""

    def __init__(self, ctx: Context, master: nn.Module, workload: Workload, inputs: tuple[tuple, dict],
                 enable_kwargs: dict[str, Any]) -> None:
        from fastoffload_ext import enable_layerwise_offload

        self.ctx = ctx
        self.workload = workload
        self.model = copy.deepcopy(master)
        _rest_to_device(self.model, workload, ctx.device)
        self.args, self.kwargs = inputs
        self.base = device_allocated(ctx)  # device bytes before this configuration existed
        reset_device_peak(ctx)
        self.group = enable_layerwise_offload(self.model, device=ctx.device, **_extra(workload), **enable_kwargs)
        first = self.forward()  # the first forward allocates the slots (and loads block 0 synchronously)
        self.first = workload.output(first).detach().to("cpu", copy=True)
        del first
        self.peak_bytes = (device_peak(ctx) - self.base) if ctx.cuda else None

    def forward(self) -> Any:
        with torch.inference_mode():
            return self.model(*self.args, **self.kwargs)

    def timer(self, iters: int) -> Callable[[], list[float]]:
        return SteadyTimer(self.forward, iters, self.ctx.cuda)

    def bit_equal(self, reference: torch.Tensor) -> bool:
        last = self.workload.output(self.forward()).detach().to("cpu", copy=True)
        return bool(torch.equal(self.first, reference) and torch.equal(last, reference))

    def close(self) -> None:
        # The copy is thrown away: free its slots and pinned copy now instead of restoring gigabytes of
        # weights that nobody reads (disable would copy every block back).
        if self.group is not None and self.group.engine is not None:
            self.group.engine.close()
        self.model = None  # type: ignore[assignment]
        self.group = None


def _spread_set(n: int, count: int) -> tuple[int, ...]:
    """``count`` block indices evenly spread over ``n`` (the grid's own, independent of the planner's)."""
    return tuple(sorted({min(n - 1, (2 * i + 1) * n // (2 * count)) for i in range(count)})) if count > 0 else ()


def _fits(costs: Any, resident: tuple[int, ...], depth: int, budget: int) -> bool:
    off = [costs.block_bytes[b] for b in range(costs.blocks) if b not in resident]
    need = sum(costs.block_bytes[b] for b in resident) + ((depth + 1) * max(off) if off else 0) + costs.activation_bytes
    return need <= budget


def _key(resident: tuple[int, ...], depth: int, n: int) -> tuple[tuple[int, ...], int]:
    """Configurations that run the same: every block resident makes the depth irrelevant."""
    return (resident, depth if len(resident) < n else 0)


def grid(costs: Any, budget: int) -> dict[str, dict[str, Any]]:
    """The grid's configurations for ``budget``: most spread resident blocks that fit, per depth; first-N."""
    n = costs.blocks
    configs: dict[str, dict[str, Any]] = {}
    seen: set[tuple[tuple[int, ...], int]] = set()

    def add(name: str, resident: tuple[int, ...], depth: int, spec: Any) -> None:
        key = _key(resident, depth, n)
        if key not in seen:
            seen.add(key)
            configs[name] = {"resident_blocks": spec, "prefetch_depth": depth}

    for depth in DEPTHS:
        count = next((c for c in range(n, -1, -1) if _fits(costs, _spread_set(n, c), depth, budget)), None)
        if count is not None:  # None: not even every block offloaded fits at this depth
            add(f"spread{count}/d{depth}", _spread_set(n, count), depth, _spread_set(n, count))
    count = next((c for c in range(n, -1, -1) if _fits(costs, tuple(range(c)), 1, budget)), None)
    if count is not None:
        add(f"first{count}/d1", tuple(range(count)), 1, count)
    return configs


def _calibrate(ctx: Context, master: nn.Module, workload: Workload, inputs: tuple[tuple, dict]) -> Any:
    """The cost table the planner sees: what ``group.calibrate`` measures (copy rate at the block size,
    the hooks' fixed cost fitted from the gaps), not the run's peak H2D, which only the ideal uses."""
    config = Config(ctx, master, workload, inputs, {"prefetch_depth": 1})
    try:
        costs = config.group.calibrate(config.forward, replan=False)
    finally:
        config.close()
    return costs


def _plan_for(ctx: Context, budget: int | str, costs: Any, master: nn.Module, workload: Workload) -> tuple[Any, int]:
    from fastoffload_ext.planning import plan_offload
    from fastoffload_ext.planning.layout import resolve_layout

    if budget != "auto":
        return plan_offload(costs, int(budget)), int(budget)
    blocks = _ring(workload, master)
    plan = resolve_layout(blocks, ctx.device, "blocks", resident_blocks="auto", prefetch_depth="auto",
                          device_budget="auto", activation_reserve=costs.activation_bytes, costs=costs).plan
    return plan, plan.device_budget


def _resident_of(kwargs: dict[str, Any]) -> tuple[int, ...]:
    resident = kwargs["resident_blocks"]
    return tuple(resident) if isinstance(resident, tuple) else tuple(range(resident))


def _interleave(ctx: Context, plan: Any, budget: int, costs: Any, master: nn.Module, workload: Workload,
                inputs: tuple[tuple, dict], shared: dict[str, Any]) -> dict[str, Any]:
    """The plan, the grid for ``budget`` and the resident model, all alive, timed in interleaved rounds.

    The plan's configuration is built first, with nothing else of this budget alive, and its peak device
    memory is taken then: over enable, the first forward (synchronous load of block 0) and two more.
    The resident model runs in the same rounds, so the ideal's compute term is measured beside the plan
    (host speed drifts too much between one timing and the next to take it from an earlier one).
    """
    live: dict[str, Config] = {}
    result: dict[str, Any] = {}
    try:
        config = Config(ctx, master, workload, inputs, {"plan": plan, "device_budget": budget})
        live["plan"] = config
        worst = _peak_of(ctx, config)
        if worst is not None:
            result.update(peak_mib=worst / MiB, mem_ok=worst <= budget)
        mine = _key(plan.resident, plan.prefetch_depth, plan.blocks)
        for name, kwargs in grid(costs, budget).items():
            if _key(_resident_of(kwargs), kwargs["prefetch_depth"], plan.blocks) != mine:
                live[name] = Config(ctx, master, workload, inputs, kwargs)
        iters = _iters(ctx)
        timers = {name: c.timer(iters) for name, c in live.items()}
        timers[RESIDENT] = shared["resident_timer"](iters)
        timers[CONTROL] = shared["resident_timer"](iters)
        rounds = run_interleaved(timers, rounds=_rounds(ctx))
        best = min(live, key=rounds.median_ms)
        result.update(_against_best(rounds, best, timers, _rounds(ctx)))
        result.update(budget_mib=budget / MiB, plan=f"{len(plan.resident)}/{plan.blocks} d{plan.prefetch_depth}",
                      resident=list(plan.resident), predicted_ms=plan.predicted_step_ms, plan_ideal_ms=plan.ideal_ms,
                      ms=rounds.median_ms("plan"), spread=rounds.spread("plan"),
                      resident_ms=rounds.median_ms(RESIDENT), x_resident=rounds.ratio("plan", RESIDENT),
                      rounds=rounds.as_dict(), why=plan.why, bit_equal=live["plan"].bit_equal(shared["reference"]))
        result["x_predicted"] = result["ms"] / plan.predicted_step_ms if plan.predicted_step_ms > 0 else None
        result.update(_against_resident(rounds, plan), **control_figures(rounds.ratios(CONTROL, RESIDENT)))
        return result
    finally:
        for config in live.values():
            config.close()
        free_memory()


def _against_best(rounds: Any, best: str, timers: dict[str, Any], count: int) -> dict[str, Any]:
    """The plan against the grid's best configuration, timed in rounds of their own.

    The best is the configuration with the least median in ``rounds``. On a noisy host the least of several
    medians is lower than that configuration runs (the round that flattered it is why it was chosen), so
    the plan measured against it in the same rounds reads slower than it is. The two are therefore timed
    again, alone and interleaved, and ``x_best`` comes from those rounds; ``x_best_selection`` keeps the
    ratio from the rounds that chose. The same holds the other way: a plan that the choosing rounds put
    first may owe it to a round that flattered it, so it is timed again against the fastest of the other
    configurations, and ``x_best`` is that ratio (below 1 where the plan beat them). Only a plan with no
    other configuration to compare with is its own best (1.0).
    """
    chosen = best
    if best == "plan":
        others = [name for name in timers if name not in ("plan", RESIDENT, CONTROL)]
        if not others:
            return {"best": "plan", "best_ms": rounds.median_ms("plan"), "x_best_selection": 1.0,
                    "x_best_selection_range": [1.0, 1.0], "x_best": 1.0, "x_best_range": [1.0, 1.0],
                    "best_confirmed": False, "chosen": chosen}
        best = min(others, key=rounds.median_ms)
    selection, selection_range = rounds.ratio("plan", best), rounds.ratio_spread("plan", best)
    figures = {"best": best, "best_ms": rounds.median_ms(best), "x_best_selection": selection,
               "x_best_selection_range": list(selection_range), "chosen": chosen}
    again = run_interleaved({"plan": timers["plan"], best: timers[best]}, rounds=count)
    return {**figures, "x_best": again.ratio("plan", best), "x_best_range": list(again.ratio_spread("plan", best)),
            "best_confirmed": True, "confirm_rounds": again.as_dict()}


def round_ratios(mine: Sequence[float], reference: Sequence[float], *, add_ms: float = 0.0,
                 at_least_ms: float = 0.0) -> list[float]:
    """Round by round, ``mine`` over max(``reference`` + ``add_ms``, ``at_least_ms``).

    The host speed can flip between two levels within one run (10 and 18 ms a step seen on the H200), so
    a ratio of two medians can pair a fast round of one side with a slow round of the other; within a
    round both sides ran at nearly the same host speed (``benchmarks.interleave``).
    """
    if len(mine) != len(reference) or not mine:
        raise ValueError(f"per-round ratios need the same number of rounds on both sides, got {len(mine)} and "
                         f"{len(reference)}")
    return [m / max(r + add_ms, at_least_ms) for m, r in zip(mine, reference)]


def control_figures(ratios: Sequence[float]) -> dict[str, Any]:
    """The resident model against itself, round by round: its median, its lowest and highest round."""
    middle, (low, high) = _median_range(ratios)
    return {"x_control": middle, "x_control_range": [low, high], "control": f"{middle:.3f} [{low:.3f}..{high:.3f}]"}


def _median_range(values: Sequence[float]) -> tuple[float, list[float]]:
    return float(statistics.median(values)), [float(min(values)), float(max(values))]


def _rounds_ms(row: dict[str, Any], name: str) -> list[float]:
    return list(row["rounds"][name]["rounds_ms"])


def _against_resident(rounds: Any, plan: Any) -> dict[str, Any]:
    """The prediction as a ratio to the all-resident prediction, against the measured per-round ratio.

    The host speed can change between the calibration and the rounds (a launch-bound step ran 10 ms and
    18 ms in one process), which moves every measured step, and so ``x_predicted``, with it; the plan
    over the resident model of the same round does not move, nor does the predicted plan over the
    predicted resident step, so their quotient checks the model with the drift taken out.
    """
    from fastoffload_ext.planning import simulate_step

    resident_predicted = simulate_step(plan.costs, range(plan.blocks), 1).step_ms
    figures: dict[str, Any] = {"resident_predicted_ms": resident_predicted, "host_bound": plan.host_bound,
                               "host_ms": plan.host_ms, "host_hooks_ms": plan.host_hooks_ms}
    if resident_predicted > 0 and plan.predicted_step_ms > 0:
        figures["x_predicted_resident"] = (rounds.ratio("plan", RESIDENT)
                                           / (plan.predicted_step_ms / resident_predicted))
    return figures


def _ideals(row: dict[str, Any], plan: Any, peak_gbps: float, total_bytes: int) -> None:
    """The ideal, the ideal with the hooks' fixed cost, and today's floor, against the plan, per round.

    Each ratio is taken within a round (the plan over max(the resident model of that round, the copy))
    and the median of the rounds is reported, with the lowest and highest round beside it.
    """
    compute = row["resident_ms"]
    # The bytes that move (compressed where they are). Offloaded blocks that all fit the slots stay there
    # after the first step and move nothing (the plan's copy_ms is 0): counting them would hold the ideal
    # up by copies the step never makes and let a slow plan read under its ideal.
    moved = plan.host_bytes if plan.copy_ms > 0 else 0
    copy_ms = moved / (peak_gbps * GB) * 1e3
    all_ms = total_bytes / (peak_gbps * GB) * 1e3
    # The hooks cost time on the device's timeline and on the host's; whichever the plan is bound by.
    hooks = max(plan.overhead_ms, plan.host_hooks_ms)
    mine, resident = _rounds_ms(row, "plan"), _rounds_ms(row, RESIDENT)
    x_ideal, ideal_range = _median_range(round_ratios(mine, resident, at_least_ms=copy_ms))
    x_hooks, hooks_range = _median_range(round_ratios(mine, resident, add_ms=hooks, at_least_ms=copy_ms))
    x_floor, floor_range = _median_range(round_ratios(mine, resident, at_least_ms=all_ms))
    row.update(ideal_ms=max(compute, copy_ms), x_ideal=x_ideal, x_ideal_range=ideal_range,
               x_ideal_rounds=f"{ideal_range[0]:.3f}..{ideal_range[1]:.3f}", hooks_ms=hooks,
               ideal_hooks_ms=max(compute + hooks, copy_ms), x_ideal_hooks=x_hooks, x_ideal_hooks_range=hooks_range,
               floor_ms=max(compute, all_ms), x_floor=x_floor, x_floor_range=floor_range, copy_ms=copy_ms)


def _misses(row: dict[str, Any], label: str, workload: Workload) -> list[str]:
    """Which targets the row misses, each with the reason the figures point to."""
    notes = []
    if row["x_best"] > TARGET_X_BEST:
        notes.append(f"x best {row['x_best']:.3f}"
                     + (" in rounds of their own" if row.get("best_confirmed") else "")
                     + f": {row['best']} ran {row['best_ms']:.2f} ms; the plan was predicted "
                     f"{row['predicted_ms']:.2f} ms and ran {row['x_predicted']:.2f}x that"
                     + (f" (round spread {row['spread']:.0%})" if row["spread"] > 0.05 else ""))
    if row.get("x_ideal") is not None and row["x_ideal"] > TARGET_X_IDEAL:
        if row["copy_ms"] == 0 and row["hooks_ms"] == 0:
            # Every block resident and no hook: the row times a second resident model against the first.
            notes.append(f"x ideal {row['x_ideal']:.3f}: nothing is offloaded (no copy, no hook), so this is a "
                         "second resident model object against the first; the host runs two objects of one model "
                         "at different speeds (the control times one object against itself)")
        elif row["x_ideal_hooks"] <= TARGET_X_IDEAL:
            notes.append(f"x ideal {row['x_ideal']:.3f}: the hooks' fixed cost ({row['hooks_ms']:.2f} ms a step) "
                         "accounts for it")
        elif row.get("host_bound"):
            notes.append(f"x ideal {row['x_ideal']:.3f}: host-bound; the host was predicted to dispatch the step in "
                         f"{row['host_ms']:.2f} ms, {row['host_hooks_ms']:.2f} ms of it the offload hooks, and the "
                         f"plan ran {row['x_ideal_hooks']:.3f}x the resident model plus those hooks")
        elif row.get("plan_ideal_ms") and row["predicted_ms"] > TARGET_X_IDEAL * row["plan_ideal_ms"]:
            # The simulation itself puts the layout above the ideal: uneven blocks, not the engine.
            notes.append(f"x ideal {row['x_ideal']:.3f}: the per-block schedule; the plan was predicted "
                         f"{row['predicted_ms']:.2f} ms = {row['predicted_ms'] / row['plan_ideal_ms']:.3f}x its "
                         "ideal: copy-bound blocks expose their copies and compute-bound ones leave the copy stream "
                         "idle, and the budget keeps too few copy-bound blocks resident to even that out")
        elif row["copy_ms"] >= row["resident_ms"]:
            notes.append(f"x ideal {row['x_ideal']:.3f}: transfer-bound; copies at the block size run below the "
                         "1 GiB peak H2D the ideal counts (the section's note has the calibrated rate)")
        else:
            notes.append(f"x ideal {row['x_ideal']:.3f}: copy {row['copy_ms']:.2f} ms vs compute "
                         f"{row['resident_ms']:.2f} ms; uneven blocks leave copies exposed behind short blocks")
    if row.get("x_ideal") is not None and row["x_ideal"] > TARGET_X_IDEAL and row.get("x_control_range"):
        low, high = row["x_control_range"]
        if row["x_ideal"] <= high:
            notes.append(f"inside this row's noise: the resident model against itself ran {row['x_control']:.3f}x "
                         f"[{low:.3f}, {high:.3f}] in the same rounds")
    if row.get("mem_ok") is False:
        notes.append(f"peak {row['peak_mib']:.1f} MiB over the {row['budget_mib']:.1f} MiB budget")
    if label == "50%" and workload.name in FLOOR_WORKLOADS and row.get("x_floor", 0) > TARGET_X_FLOOR:
        notes.append(f"x floor {row['x_floor']:.3f} above {TARGET_X_FLOOR}")
    return notes


def _judge(ctx: Context, row: dict[str, Any], plan: Any, budget: int, label: str, workload: Workload,
           shared: dict[str, Any]) -> dict[str, Any]:
    checks = [row["x_best"] <= TARGET_X_BEST, row["bit_equal"]]
    if row.get("mem_ok") is not None:
        checks.append(row["mem_ok"])
    peak_gbps = shared.get("peak_gbps")
    if ctx.cuda and peak_gbps:
        _ideals(row, plan, peak_gbps, sum(shared["block_bytes"]))
        checks.append(row["x_ideal"] <= TARGET_X_IDEAL)
        if label == "50%" and workload.name in FLOOR_WORKLOADS:
            checks.append(row["x_floor"] <= TARGET_X_FLOOR)
    row["pass"] = all(checks) if ctx.cuda else None
    row["note"] = "; ".join(_misses(row, label, workload)) if ctx.cuda else ""
    return row


def _depth_rows(ctx: Context, master: nn.Module, workload: Workload, inputs: tuple[tuple, dict]) -> None:
    live: dict[str, Config] = {}
    try:
        for k in DEPTHS:
            live[f"d{k}"] = Config(ctx, master, workload, inputs, {"prefetch_depth": k})
        rounds = run_interleaved({name: c.timer(_iters(ctx)) for name, c in live.items()}, rounds=_rounds(ctx))
    except Exception as error:  # the sweep's rows say why instead of taking the section down
        for k in DEPTHS:
            ctx.skip("depth", {"workload": workload.name, "depth": k}, f"sweep failed: {type(error).__name__}: {error}")
        return
    finally:
        for config in live.values():
            config.close()
        free_memory()
    for k in DEPTHS:
        name = f"d{k}"
        ratio = rounds.ratio(name, "d1")
        lo, hi = rounds.ratio_spread(name, "d1")
        figures = {"ms": rounds.median_ms(name), "x_depth1": ratio, "ratio_lo": lo, "ratio_hi": hi,
                   "spread": rounds.spread(name), "pass": (ratio <= TARGET_DEPTH) if ctx.cuda else None}
        ctx.run_row("depth", {"workload": workload.name, "depth": k}, lambda figures=figures: figures)


def _peak_of(ctx: Context, config: Config) -> int | None:
    """The configuration's worst device peak over its first forward and two more (None without CUDA)."""
    if not ctx.cuda:
        return None
    worst = config.peak_bytes or 0
    for _ in range(2):
        reset_device_peak(ctx)
        config.forward()
        worst = max(worst, device_peak(ctx) - config.base)
    return worst


def _coded_plans(ctx: Context, master: nn.Module, workload: Workload, costs: Any, budget: int) -> dict[str, Any]:
    """The raw plan, the plan with ``compress=True`` and the one ``compress="auto"`` picks, at one budget.

    The coded plans are made as a user's would be: the calibrated table with the sampled compressed
    sizes (``planning.compressed``) and the decode's staging counted; enable then re-checks a coded plan
    with the engine's real sizes, and the row reports the re-checked plan.
    """
    from fastoffload_ext.planning import choose_codec_plan, plan_offload
    from fastoffload_ext.planning.calibration import measure_host_decode_gbps
    from fastoffload_ext.planning.compressed import estimate_transfer_bytes

    coded_costs = dataclasses.replace(costs, transfer_bytes=tuple(estimate_transfer_bytes(_ring(workload, master))))
    if not ctx.cuda:  # the host decoder is what a coded copy costs there, far below the GPU kernel's rate
        coded_costs = dataclasses.replace(coded_costs, decode_gbps=measure_host_decode_gbps())
    return {"raw": plan_offload(costs, budget), "coded": plan_offload(coded_costs, budget),
            "auto": choose_codec_plan(costs, coded_costs, budget)}


def _layout_name(plan: Any) -> str:
    return f"{'coded' if plan.compressed else 'raw'} {len(plan.resident)}/{plan.blocks} d{plan.prefetch_depth}"


def _auto_config(plans: dict[str, Any]) -> str | None:
    """The configuration the "auto" plan runs the same as (None: it needs its own)."""
    auto = plans["auto"]
    for name in ("coded", "raw"):
        if auto.same_layout(plans[name]) and auto.compressed == plans[name].compressed:
            return name
    return None


def _compressed_row(ctx: Context, master: nn.Module, workload: Workload, inputs: tuple[tuple, dict], costs: Any,
                    budget: int, shared: dict[str, Any]) -> dict[str, Any]:
    """Raw plan, ``compress=True`` plan, the ``"auto"`` choice and the resident model, in interleaved rounds."""
    plans = _coded_plans(ctx, master, workload, costs, budget)
    alias = _auto_config(plans)
    live: dict[str, Config] = {}
    try:
        live["coded"] = Config(ctx, master, workload, inputs, {"plan": plans["coded"], "device_budget": budget,
                                                               "compress": True})
        worst = _peak_of(ctx, live["coded"])
        if alias is None:
            live["auto"] = Config(ctx, master, workload, inputs, {"plan": plans["auto"], "device_budget": budget,
                                                                  "compress": "auto"})
            auto_peak = _peak_of(ctx, live["auto"])
            worst = None if worst is None or auto_peak is None else max(worst, auto_peak)
        live["raw"] = Config(ctx, master, workload, inputs, {"plan": plans["raw"], "device_budget": budget})
        auto = alias or "auto"
        if auto == "raw":  # the pick runs as the raw configuration: its peak is the pick's
            raw_peak = _peak_of(ctx, live["raw"])
            worst = None if worst is None or raw_peak is None else max(worst, raw_peak)
        iters = _iters(ctx)
        timers = {name: c.timer(iters) for name, c in live.items()}
        timers[RESIDENT] = shared["resident_timer"](iters)
        rounds = run_interleaved(timers, rounds=_rounds(ctx))
        applied = live["coded"].group.plan
        row = dict(budget_mib=budget / MiB, raw_plan=_layout_name(plans["raw"]), plan=_layout_name(applied),
                   auto_plan=_layout_name(live[auto].group.plan), raw_moved_mib=plans["raw"].host_bytes / MiB,
                   moved_mib=applied.host_bytes / MiB, compressed_blocks=applied.compressed_blocks,
                   staging_mib=applied.staging_bytes / MiB, raw_predicted_ms=plans["raw"].predicted_step_ms,
                   predicted_ms=applied.predicted_step_ms, ms=rounds.median_ms("coded"), raw_ms=rounds.median_ms("raw"),
                   x_raw=rounds.ratio("coded", "raw"), x_raw_range=rounds.ratio_spread("coded", "raw"),
                   auto_ms=rounds.median_ms(auto), auto_config=auto, x_auto_raw=rounds.ratio(auto, "raw"),
                   x_auto_coded=rounds.ratio(auto, "coded"), resident_ms=rounds.median_ms(RESIDENT),
                   rounds=rounds.as_dict(), why=applied.why, auto_why=plans["auto"].why,
                   # The coded plan and the configuration the pick ran as (the raw one when "auto" aliases it).
                   bit_equal=all(live[name].bit_equal(shared["reference"]) for name in dict.fromkeys(("coded", auto))))
        return _judge_compressed(ctx, row, worst, budget, shared)
    finally:
        for config in live.values():
            config.close()
        free_memory()


def _judge_compressed(ctx: Context, row: dict[str, Any], worst: int | None, budget: int,
                      shared: dict[str, Any]) -> dict[str, Any]:
    """The "auto" choice must be as fast as the faster of raw and coded (beyond noise), within the budget."""
    checks = [row["bit_equal"], row["x_auto_raw"] <= TARGET_DEPTH, row["x_auto_coded"] <= TARGET_DEPTH]
    if worst is not None:
        row.update(peak_mib=worst / MiB, mem_ok=worst <= budget)
        checks.append(row["mem_ok"])
    peak_gbps = shared.get("peak_gbps")
    if ctx.cuda and peak_gbps:
        all_ms = sum(shared["block_bytes"]) / (peak_gbps * GB) * 1e3
        resident = _rounds_ms(row, RESIDENT)
        row["x_floor"] = statistics.median(round_ratios(_rounds_ms(row, "coded"), resident, at_least_ms=all_ms))
        row["x_floor_auto"] = statistics.median(round_ratios(_rounds_ms(row, row.get("auto_config", "auto")),
                                                             resident, at_least_ms=all_ms))
    row["pass"] = all(checks) if ctx.cuda else None
    return row


def _budgets(ctx: Context, workload: Workload, costs: Any) -> list[tuple[str, int | str]]:
    total = sum(costs.block_bytes)
    least = 2 * max(costs.block_bytes) + costs.activation_bytes
    if ctx.quick:
        fractions = QUICK_DIT_FRACTIONS if workload.info.get("regime") else QUICK_FRACTIONS
    else:
        fractions = FRACTIONS
    budgets: list[tuple[str, int | str]] = [(f"{int(f * 100)}%", least + int(f * total)) for f in fractions]
    return budgets + [("auto", "auto")]


def _setup(ctx: Context, workload: Workload, peak: float | None) -> tuple[nn.Module, tuple[tuple, dict], Any,
                                                                         dict[str, Any]]:
    """The host master, inputs, the calibrated cost table, and what every row shares (the resident model)."""
    shared: dict[str, Any] = {"peak_gbps": peak}
    master = workload.build_host()
    inputs = workload.make_inputs(ctx.device)
    shared["block_bytes"] = [sum(p.numel() * p.element_size() for p in block.parameters())
                             for block in _ring(workload, master)]
    resident = copy.deepcopy(master).to(ctx.device)
    with torch.inference_mode():
        shared["reference"] = workload.output(resident(*inputs[0], **inputs[1])).detach().to("cpu", copy=True)

    def forward() -> Any:
        with torch.inference_mode():
            return resident(*inputs[0], **inputs[1])

    shared["resident_model"] = resident
    shared["resident_timer"] = lambda iters: SteadyTimer(forward, iters, ctx.cuda)
    costs = _calibrate(ctx, master, workload, inputs)
    return master, inputs, costs, shared


def _run_workload(ctx: Context, workload: Workload, peak: float | None, depth_sweep: bool) -> None:
    name = workload.name
    try:
        master, inputs, costs, shared = _setup(ctx, workload, peak)
    except Exception as error:
        for label in [f"{int(f * 100)}%" for f in FRACTIONS] + ["auto"]:
            ctx.skip("budgets", {"workload": name, "budget": label}, f"setup failed: {type(error).__name__}: {error}")
        free_memory()
        return
    ctx.note(f"{name}: calibrated compute {costs.total_compute_ms():.2f} ms, copies at the block size "
             f"{costs.h2d_gbps:.1f} GB/s, hooks' fixed cost {1e3 * costs.block_overhead_ms:.1f} us per offloaded block"
             + (f"; host dispatch {costs.total_host_ms():.2f} ms a step, the hooks' host cost "
                f"{1e3 * costs.host_overhead_ms:.1f} us per offloaded block" if costs.host_timed else ""))
    for label, budget in _budgets(ctx, workload, costs):
        def row(label: str = label, budget: int | str = budget) -> dict[str, Any]:
            plan, budget_bytes = _plan_for(ctx, budget, costs, master, workload)
            result = _interleave(ctx, plan, budget_bytes, costs, master, workload, inputs, shared)
            return _judge(ctx, result, plan, budget_bytes, label, workload, shared)

        ctx.run_row("budgets", {"workload": name, "budget": label}, row)
    if workload.name.split("-")[0] in FLOOR_WORKLOADS:
        label, budget = next((lb, b) for lb, b in _budgets(ctx, workload, costs) if lb == "50%")
        ctx.run_row("compressed", {"workload": name, "budget": label},
                    lambda: _compressed_row(ctx, master, workload, inputs, costs, int(budget), shared))
    shared.clear()  # the resident model goes before the depth sweep builds its three copies
    free_memory()
    if depth_sweep:
        _depth_rows(ctx, master, workload, inputs)
    del master
    free_memory()


def run(ctx: Context) -> None:
    peak: float | None = None
    if ctx.cuda:
        from benchmarks.forward import peak_h2d_gbps
        peak = peak_h2d_gbps(ctx)
    else:
        ctx.note("no CUDA device: scaled-down models on the host (device='cpu'); the planner's choice and bit-equality "
                 "are checked, peak memory, ideal and floor need a GPU and are left out; host timings are indicative")
    swept: set[str] = set()
    for name, workload, reason in _workloads(ctx):
        if workload is None:
            ctx.skip("budgets", {"workload": name, "budget": "all"}, reason)
            continue
        # Under --quick one token count per architecture sweeps the depth (the sweep is per architecture).
        sweep = not ctx.quick or name not in swept
        swept.add(name)
        started = time.perf_counter()
        _run_workload(ctx, workload, peak, sweep)
        # Per workload, so that the next run's split into commands is sized from measured times.
        elapsed = time.perf_counter() - started
        ctx.note(f"{workload.name}: {elapsed:.1f} s (set-up, budget rows, compressed row, depth sweep)")
        ctx.meta(f"elapsed_s {workload.name}", round(elapsed, 1))


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for row in rows:
        if row.get("budget") is not None and row.get("x_best") is not None:
            lines.append(f"{row['workload']} {row['budget']}: plan {row.get('plan')} {row['ms']:.2f} ms = "
                         f"{row['x_best']:.3f}x best grid ({row.get('best')})"
                         + (f", {row['x_ideal']:.3f}x ideal, {row['x_floor']:.3f}x floor" if row.get("x_ideal") else "")
                         + (f", pass {row['pass']}" if row.get("pass") is not None else "")
                         + (f" ({row['note']})" if row.get("note") else ""))
        elif row.get("x_raw") is not None:
            lines.append(f"{row['workload']} {row['budget']} compressed: compress=True {row['plan']} "
                         f"{row['ms']:.2f} ms = {row['x_raw']:.3f}x the raw plan {row['raw_plan']}"
                         + (f", {row['x_floor']:.3f}x floor" if row.get("x_floor") else "")
                         + (f"; 'auto' picks {row['auto_plan']} = {row['x_auto_raw']:.3f}x raw, "
                            f"{row['x_auto_coded']:.3f}x coded" if row.get("x_auto_raw") is not None else "")
                         + (f", pass {row['pass']}" if row.get("pass") is not None else ""))
        elif row.get("depth") in DEPTHS[1:] and row.get("x_depth1") is not None:
            lines.append(f"{row['workload']} depth {row['depth']}: {row['x_depth1']:.3f}x depth 1 "
                         f"(rounds {row['ratio_lo']:.3f}..{row['ratio_hi']:.3f})")
    return lines
