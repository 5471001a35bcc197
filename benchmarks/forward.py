"""Section 2, forward: one offloaded forward per workload and backend, against the floor.

Per workload (W1..W4 of docs/DESIGN.md, "Workloads and targets", and a transformers Llama), the rows are:
- ``floor``: max(resident forward, offloaded weight bytes / peak pinned H2D), both from this run;
- ``resident``: the whole model on the GPU, no offload (and the reference output);
- ``ext`` / ``python``: ``enable_layerwise_offload(backend=...)``, with ``--prefetch-depth`` and
  ``--resident-blocks``;
- ``diffusers``: ``apply_group_offloading(block_level, num_blocks_per_group=1, use_stream=True)``, the
  like-for-like peer; ``diffusers leaf``: ``apply_group_offloading(leaf_level, use_stream=True)``, its
  fastest setting on W3 (``--quick``: both on W1, W3 and the Llama only);
- ``accelerate``: ``cpu_offload`` (slow: skipped under ``--quick``).

Each offload row starts from a fresh host copy of the same weights (a deepcopy of one host master),
and its output must equal the resident output bit for bit (``torch.equal``), both on the first
forward (block 0 loaded synchronously) and on a steady-state forward after the timed ones (every
block prefetched): a race between a prefetch and the compute reading it shows up only in the latter.
Peak GPU memory is ``max_memory_allocated`` over the row's build and first forward, above what was
allocated before; the bound beside it is (k+1) x largest block + activations + 64 MiB, activations
read off the resident row.

Timing (docs/DESIGN.md, "Measuring on a noisy host"): resident, ext, python and the diffusers peers are
alive at once and timed in interleaved rounds (``benchmarks.interleave.run_interleaved``), so that a
drift of the host's speed hits every configuration alike. A row's ``ms`` is the median of its round
medians with ``spread`` beside it; ``x floor`` and ``x resident`` are medians of per-round ratios, with
their lowest and highest in ``x_floor_range`` and ``x_resident_range``. accelerate (about 8x floor) is
timed on its own afterwards.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.interleave import Interleaved, run_interleaved
from benchmarks.utils import (
    GB,
    Column,
    Context,
    MiB,
    Table,
    device_allocated,
    device_peak,
    empty_host_cache,
    free_memory,
    gbps,
    median,
    module_bytes,
    reset_device_peak,
    try_import,
)
from benchmarks.workloads import Workload, llama_workload, move_non_block_modules, stack_workload
from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload

TITLE = "forward: median forward time per workload and backend"

TABLES = {
    "forward": Table(
        title="Forward (bf16, batch 1, inference_mode): median ms; floor = max(resident, offloaded bytes / peak H2D)",
        columns=[
            Column("workload", "workload"),
            Column("backend", "backend"),
            Column("ms", "ms", ".2f"),
            Column("x_floor", "x floor", ".3f"),
            Column("x_resident", "x resident", ".3f"),
            Column("spread", "spread", ".3f"),
            Column("gbps", "GB/s", ".1f"),
            Column("peak_mib", "peak MiB", ".0f"),
            Column("mem_ok", "mem<=bound"),
            Column("bit_equal", "bit-equal"),
            Column("target", "target"),
            Column("pass", "pass"),
        ],
    ),
}

# diffusers' group offloading, by row name: offload_type (both with use_stream=True).
DIFFUSERS_VARIANTS = {"diffusers": "block_level", "diffusers leaf": "leaf_level"}
BACKENDS = ("resident", "ext", "python", *DIFFUSERS_VARIANTS, "accelerate")
QUICK_SKIP_DIFFUSERS = ("W2", "W4")
# Interleaved rounds per workload; each round times every live configuration once (>= 5 forwards).
ROUNDS = {"full": 5, "quick": 3}
MEM_SLACK_BYTES = 64 * MiB


def _workloads(ctx: Context) -> list[tuple[str, Workload | None, str]]:
    items: list[tuple[str, Workload | None, str]] = []
    keys = ("W1", "W2", "W3", "W4")
    for key in keys:
        workload = stack_workload(key, cpu=not ctx.cuda)
        items.append((workload.name, workload, ""))
    llama, reason = llama_workload("cpu" if not ctx.cuda else "quick" if ctx.quick else "full")
    items.append((llama.name if llama is not None else "Llama (transformers)", llama, reason))
    return items


def peak_h2d_gbps(ctx: Context) -> float | None:
    """The run's peak: from the bandwidth section if it ran, else one 1 GiB pinned copy measured here."""
    if ctx.options.peak_h2d_gbps:
        return ctx.options.peak_h2d_gbps
    if not ctx.cuda:
        return None
    from benchmarks.bandwidth import measure_copy_ms
    src = torch.empty(1024 * MiB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1024 * MiB, dtype=torch.uint8, device=ctx.device)
    ms = measure_copy_ms(dst, src, warmup=2, iters=5)
    del src, dst
    peak = gbps(1024 * MiB, ms)
    ctx.note(f"peak H2D {peak:.1f} GB/s measured here (1 GiB torch-pinned copy): the bandwidth section did not run")
    ctx.meta("peak_h2d_gbps", peak)
    return peak


@dataclasses.dataclass
class WorkloadRun:
    """One workload's shared state: the host master, its inputs, its byte counts and the reference output."""

    ctx: Context
    workload: Workload
    master: nn.Module
    args: tuple
    kwargs: dict
    block_bytes: list[int]
    prefetch_depth: int
    n_resident: int
    peak_gbps: float | None
    build_s: float
    reference: torch.Tensor | None = None
    resident_peak: int | None = None

    @property
    def all_bytes(self) -> int:
        return module_bytes(self.master)

    @property
    def offloaded_bytes(self) -> int:
        return sum(self.block_bytes[self.n_resident:])

    @property
    def transfer_ms(self) -> float | None:
        """Offloaded bytes at the run's peak H2D: the transfer half of the floor (GPU only)."""
        if not (self.ctx.cuda and self.peak_gbps):
            return None
        return self.offloaded_bytes / (self.peak_gbps * GB) * 1e3

    def labels(self, backend: str) -> dict[str, Any]:
        return {"workload": self.workload.name, "backend": backend}


@dataclasses.dataclass
class Candidate:
    """One configuration of a workload (resident, an offloader), alive until its row is written."""

    backend: str
    build: Callable[[WorkloadRun, Candidate], None] | None = None
    skipped: str = ""
    interleave: bool = True  # timed in the interleaved rounds; else on its own afterwards
    engine_bound: bool = False  # the (k+1) x largest block memory bound applies
    model: nn.Module | None = None
    forward: Callable[[], Any] | None = None
    stats: Callable[[], dict[str, Any]] | None = None
    stats_before: dict[str, Any] | None = None
    moved_bytes: int = 0
    result: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: BaseException | None = None
    cleanup: Callable[[], None] | None = None


def _host_master(ctx: Context, workload: Workload, cache: dict[str, Any], prefetch_depth: int,
                 n_resident: int, peak: float | None) -> WorkloadRun:
    """The workload's host master (the previous workload's when the weights match) and its inputs."""
    started = time.perf_counter()
    key = workload.info.get("cache_key")
    if key is not None and cache.get("key") == key:
        master = cache["master"]
    else:
        cache.clear()
        free_memory()
        master = workload.build_host()
        if key is not None:
            cache.update(key=key, master=master)
    args, kwargs = workload.make_inputs(ctx.device)
    block_bytes = [module_bytes(block) for block in workload.blocks(master)]
    return WorkloadRun(ctx, workload, master, args, kwargs, block_bytes, prefetch_depth, n_resident, peak,
                       build_s=time.perf_counter() - started)


def _forward_fn(model: nn.Module, args: tuple, kwargs: dict) -> Callable[[], Any]:
    def forward() -> Any:
        with torch.inference_mode():
            return model(*args, **kwargs)
    return forward


# builders: each makes cand.model ready to run ---------------------------------------------------------

def _build_resident(run: WorkloadRun, cand: Candidate) -> None:
    cand.model = copy.deepcopy(run.master).to(run.ctx.device)


def _build_layerwise(run: WorkloadRun, cand: Candidate) -> None:
    model = copy.deepcopy(run.master)
    cand.model = model
    move_non_block_modules(model, run.ctx.device)
    started = time.perf_counter()
    group = enable_layerwise_offload(model, backend=cand.backend, device=run.ctx.device,
                                     prefetch_depth=run.prefetch_depth, resident_blocks=run.n_resident or None)
    if run.ctx.cuda:
        torch.cuda.synchronize()
    cand.result["enable_s"] = time.perf_counter() - started
    if group is None:
        raise RuntimeError("enable_layerwise_offload returned None (offload skipped)")
    cand.stats = group.stats
    cand.cleanup = lambda: disable_layerwise_offload(model)
    cand.moved_bytes = run.offloaded_bytes
    cand.engine_bound = True


def _build_diffusers(run: WorkloadRun, cand: Candidate) -> None:
    from diffusers.hooks import apply_group_offloading
    offload_type = DIFFUSERS_VARIANTS[cand.backend]
    cand.model = copy.deepcopy(run.master)
    started = time.perf_counter()
    grouping = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
    apply_group_offloading(cand.model, onload_device=run.ctx.device, offload_type=offload_type, use_stream=True,
                           **grouping)
    torch.cuda.synchronize()
    cand.result["enable_s"] = time.perf_counter() - started
    cand.moved_bytes = run.all_bytes


def _build_accelerate(run: WorkloadRun, cand: Candidate) -> None:
    from accelerate import cpu_offload
    cand.model = copy.deepcopy(run.master)
    started = time.perf_counter()
    cpu_offload(cand.model, execution_device=run.ctx.device)
    cand.result["enable_s"] = time.perf_counter() - started
    cand.moved_bytes = run.all_bytes


def _candidates(ctx: Context, workload: Workload, reasons: dict[str, str]) -> list[Candidate]:
    """Every row of a workload in table order, each with its builder or the reason it is skipped."""
    needs_gpu = "" if ctx.cuda else "needs a CUDA device"
    quick_peer = ("skipped under --quick (W1 and W3 show the transfer-bound and host-bound cases)"
                  if ctx.quick and workload.name in QUICK_SKIP_DIFFUSERS else "")
    cands = [Candidate("resident", _build_resident), Candidate("ext", _build_layerwise),
             Candidate("python", _build_layerwise)]
    for backend in DIFFUSERS_VARIANTS:
        cands.append(Candidate(backend, _build_diffusers, skipped=needs_gpu or reasons["diffusers"] or quick_peer))
    slow = "slow baseline (~8x floor): skipped under --quick" if ctx.quick else ""
    cands.append(Candidate("accelerate", _build_accelerate, interleave=False,
                           skipped=needs_gpu or reasons["accelerate"] or slow))
    return cands


# measuring ------------------------------------------------------------------------------------------

def _prepare(run: WorkloadRun, cand: Candidate) -> None:
    """Builds the candidate and checks its first forward; an exception is kept for its row."""
    ctx = run.ctx
    baseline = device_allocated(ctx)
    reset_device_peak(ctx)
    try:
        cand.build(run, cand)
        cand.forward = _forward_fn(cand.model, run.args, run.kwargs)
        output = run.workload.output(cand.forward()).detach().to("cpu", copy=True)  # also the warm-up
        if ctx.cuda:
            peak = device_peak(ctx)
            cand.result["peak_bytes"] = peak - baseline
            cand.result["peak_mib"] = (peak - baseline) / MiB
        if cand.backend == "resident":
            run.reference = output
            run.resident_peak = cand.result.get("peak_bytes")
        elif run.reference is not None:
            cand.result["bit_equal_first"] = bool(torch.equal(output, run.reference))
            cand.result["_first"] = output
        if cand.stats is not None:
            cand.stats_before = dict(cand.stats())
    except Exception as error:  # the row reports it; the other candidates still run
        cand.error = error
        _dispose(cand)


def _timer(ctx: Context, cand: Candidate, iters: int) -> Callable[[], list[float]]:
    def measure() -> list[float]:
        if cand.error is not None:
            return [float("nan")]
        try:
            return ctx.time_ms(cand.forward, warmup=1, iters=iters)
        except Exception as error:  # one configuration failing mid-round costs only its own row
            cand.error = error
            return [float("nan")]
    return measure


def _time_all(run: WorkloadRun, cands: list[Candidate]) -> Interleaved:
    """Interleaved rounds over the live candidates, then the ones timed on their own."""
    ctx = run.ctx
    iters = ctx.iters(5, quick=5)
    live = [c for c in cands if c.forward is not None and c.error is None]
    rounds = ROUNDS["quick" if ctx.quick else "full"]
    timed = run_interleaved({c.backend: _timer(ctx, c, iters) for c in live if c.interleave}, rounds)
    for cand in live:
        if not cand.interleave:
            timed.rounds.update(run_interleaved({cand.backend: _timer(ctx, cand, iters)}, 1).rounds)
    return timed


def _round_ratios(run: WorkloadRun, timed: Interleaved, name: str) -> tuple[list[float], list[float]]:
    """Per-round ratios of ``name`` to the resident forward and to the floor of the same round."""
    mine = timed.rounds[name]
    resident = timed.rounds.get("resident", [])
    if len(resident) != len(mine):
        # Not interleaved with the resident rounds (accelerate): against the resident median.
        resident = [median(resident)] * len(mine) if resident else []
    x_resident = [m / r for m, r in zip(mine, resident)]
    if not run.ctx.cuda:
        return x_resident, []
    transfer = run.transfer_ms
    floors = [max(r, transfer or 0.0) for r in resident] if resident else [transfer] * len(mine) if transfer else []
    return x_resident, [m / f for m, f in zip(mine, floors)]


def _steady_check(run: WorkloadRun, cand: Candidate) -> None:
    """A forward after the timed ones (every block prefetched) must equal the reference too."""
    result = cand.result
    first = result.pop("_first", None)
    if run.reference is None or cand.backend == "resident":
        return
    last = run.workload.output(cand.forward()).detach().to("cpu", copy=True)
    result["bit_equal_last"] = bool(torch.equal(last, run.reference))
    equal_first = bool(result.get("bit_equal_first"))
    result["bit_equal"] = equal_first and result["bit_equal_last"]
    if not result["bit_equal"]:
        outputs = [out for out in (first, last) if out is not None]
        result["max_abs_diff"] = max(float((out.float() - run.reference.float()).abs().max()) for out in outputs)
        mismatch = (f"output != resident: first forward {'equal' if equal_first else 'differs'}, steady-state "
                    f"{'equal' if result['bit_equal_last'] else 'differs'}, max |diff| {result['max_abs_diff']:.3g}")
        result["note"] = "; ".join(filter(None, [result.get("note"), mismatch]))


def _steady_counters(cand: Candidate) -> None:
    """Engine counters over the warm-up and timed forwards (the very first load of block 0 is synchronous)."""
    if cand.stats is None or cand.stats_before is None:
        return
    before, after = cand.stats_before, dict(cand.stats())
    cand.result["stats"] = after
    cand.result["steady"] = {key: after[key] - before[key]
                             for key in ("copies", "bytes_copied", "sync_loads", "prefetch_hits", "cache_hits")
                             if isinstance(after.get(key), (int, float)) and isinstance(before.get(key), (int, float))}
    steady_sync = cand.result["steady"].get("sync_loads")
    if steady_sync:
        cand.result["note"] = f"{steady_sync} synchronous load(s) in warm-up + timed forwards"


def _judge(run: WorkloadRun, cand: Candidate, floor_ms: float | None, x_floor: float | None,
           x_resident: float | None) -> None:
    ctx, result = run.ctx, cand.result
    result.update(moved_bytes=cand.moved_bytes, x_floor=x_floor, x_resident=x_resident,
                  floor_ms=floor_ms if ctx.cuda else None)
    result["gbps"] = gbps(cand.moved_bytes, result["ms"]) if (ctx.cuda and cand.moved_bytes) else None
    target = run.workload.target
    if target is not None and ctx.cuda:
        kind, factor = target
        result["target"] = f"<={factor:.2f}x {kind}"
        ratio = x_floor if kind == "floor" else x_resident
        if ratio is not None:
            result["pass"] = ratio <= factor
    elif target is not None:
        result["target"] = "n/a (cpu)"
    if cand.engine_bound and run.resident_peak is not None and result.get("peak_bytes") is not None:
        activations = max(0, run.resident_peak - run.all_bytes)
        largest = max(run.block_bytes)
        non_block = run.all_bytes - sum(run.block_bytes)
        bound = ((run.prefetch_depth + 1) * largest + activations + non_block + sum(run.block_bytes[:run.n_resident])
                 + MEM_SLACK_BYTES)
        result["mem_bound_bytes"] = bound
        result["mem_ok"] = result["peak_bytes"] <= bound
    if run.reference is not None and cand.backend != "resident" and result.get("bit_equal") is None:
        result["bit_equal"] = False


def _finish(run: WorkloadRun, cand: Candidate, timed: Interleaved) -> dict[str, Any]:
    """The row of one candidate: its rounds, ratios per round, checks and verdicts."""
    if cand.error is not None:
        raise cand.error
    name, result = cand.backend, cand.result
    rounds_ms = timed.rounds[name]
    result.update(ms=timed.median_ms(name), ms_min=min(rounds_ms), ms_max=max(rounds_ms), rounds=len(rounds_ms),
                  rounds_ms=rounds_ms, spread=timed.spread(name))
    _steady_check(run, cand)
    _steady_counters(cand)
    if name == "resident":
        transfer = run.transfer_ms
        result.update(weight_bytes=run.all_bytes, x_resident=1.0, build_s=run.build_s,
                      x_floor=result["ms"] / max(result["ms"], transfer) if transfer else None)
        return result
    x_resident, x_floor = _round_ratios(run, timed, name)
    if x_resident:
        result["x_resident_range"] = [min(x_resident), max(x_resident)]
    if x_floor:
        result["x_floor_range"] = [min(x_floor), max(x_floor)]
    _judge(run, cand, _floor_ms(run, timed), median(x_floor) if x_floor else None,
           median(x_resident) if x_resident else None)
    return result


def _floor_ms(run: WorkloadRun, timed: Interleaved) -> float | None:
    resident = timed.median_ms("resident") if "resident" in timed.rounds else None
    values = [v for v in (resident, run.transfer_ms) if v is not None]
    return max(values) if values else None


def _floor_row(run: WorkloadRun, timed: Interleaved) -> None:
    ctx = run.ctx
    floor_ms = _floor_ms(run, timed)
    if not ctx.cuda or floor_ms is None:
        ctx.skip("forward", run.labels("floor"), "needs a CUDA device" if not ctx.cuda else "resident row failed")
        ctx.progress.finish()
        return
    resident_ms = timed.median_ms("resident") if "resident" in timed.rounds else None
    transfer_ms = run.transfer_ms
    note = (f"max(resident {resident_ms:.2f} ms, {run.offloaded_bytes / GB:.2f} GB / {run.peak_gbps:.1f} GB/s = "
            f"{transfer_ms:.2f} ms)" if (resident_ms and transfer_ms) else "resident time only (no peak H2D)")
    row = {"ms": floor_ms, "x_floor": 1.0, "resident_ms": resident_ms, "transfer_ms": transfer_ms,
           "offloaded_bytes": run.offloaded_bytes, "peak_h2d_gbps": run.peak_gbps, "note": note}
    ctx.run_row("forward", run.labels("floor"), lambda: row)


def _dispose(cand: Candidate) -> None:
    try:
        if cand.cleanup is not None:
            cand.cleanup()
    finally:
        cand.cleanup = None
        cand.model = cand.forward = cand.stats = None


def _run_workload(run: WorkloadRun, reasons: dict[str, str]) -> None:
    """Builds every candidate, times the live ones in interleaved rounds, writes one row each."""
    ctx = run.ctx
    cands = _candidates(ctx, run.workload, reasons)
    try:
        for cand in cands:
            if not cand.skipped:
                _prepare(run, cand)
        timed = _time_all(run, cands)
        for cand in cands:
            if cand.skipped:
                ctx.skip("forward", run.labels(cand.backend), cand.skipped)
                ctx.progress.finish()
            else:
                ctx.run_row("forward", run.labels(cand.backend), lambda cand=cand: _finish(run, cand, timed))
            if cand.backend == "resident":
                _floor_row(run, timed)
    finally:
        for cand in cands:
            try:
                _dispose(cand)
            except Exception as error:  # a failed detach must not cost the next workload
                ctx.note(f"{run.workload.name} {cand.backend}: clean-up failed: {type(error).__name__}: {error}")
        free_memory()


def run(ctx: Context) -> None:
    peak: float | None = None
    if ctx.cuda:
        try:
            peak = peak_h2d_gbps(ctx)
        except Exception as error:
            ctx.note(f"peak H2D could not be measured ({type(error).__name__}: {error}); floors use resident only")
    else:
        ctx.note("no CUDA device: workloads run scaled down (*-cpu) on the host with device='cpu'; floors, "
                 "GB/s, peak memory and targets need a GPU and are left out; host timings on a shared machine "
                 "are indicative only (the bit-equal column is the point here)")
    reasons = {"diffusers": try_import("diffusers")[1], "accelerate": try_import("accelerate")[1]}
    workloads = _workloads(ctx)
    ctx.progress.add(len(workloads) * (len(BACKENDS) + 1))
    master_cache: dict[str, Any] = {}  # the previous workload's host master, reused when the weights match
    k = ctx.options.prefetch_depth
    n_resident = ctx.options.resident_blocks or 0
    if k != 1 or n_resident:
        ctx.note(f"ext/python rows run with prefetch_depth={k}, resident_blocks={n_resident}")
    ctx.note(f"resident, ext, python and diffusers rows: {ROUNDS['quick' if ctx.quick else 'full']} interleaved "
             "rounds; ms = median of round medians, spread = (slowest - fastest round) / median, ratios per round")
    for name, workload, reason in workloads:
        try:
            run_state = None if workload is None else _host_master(ctx, workload, master_cache, k, n_resident, peak)
        except Exception as error:
            reason = f"could not build the model: {type(error).__name__}: {error}"
            run_state = None
        if run_state is None:
            for backend in ("floor",) + BACKENDS:
                ctx.skip("forward", {"workload": name, "backend": backend}, reason)
                ctx.progress.finish()
            continue
        _run_workload(run_state, reasons)
    master_cache.clear()
    empty_host_cache()


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    """Lines under the table: which workloads the engine meets its target on."""
    lines = []
    for row in rows:
        if row.get("backend") == "ext" and "pass" in row:
            verdict = "meets" if row["pass"] else "MISSES"
            lines.append(f"{row['workload']}: ext {row['ms']:.2f} ms {verdict} its target {row.get('target')} "
                         f"(x floor {row.get('x_floor') or float('nan'):.3f}, x resident "
                         f"{row.get('x_resident') or float('nan'):.3f})")
    python_rows = {row["workload"]: row for row in rows if row.get("backend") == "python" and row.get("ms")}
    for row in rows:
        if row.get("backend") == "ext" and row.get("ms") and row["workload"] in python_rows:
            lines.append(f"{row['workload']}: python backend (FastVideo's algorithm) / ext = "
                         f"{paired_ratio(python_rows[row['workload']], row):.2f}x")
    # The fastest other offloader that ran on each workload, whatever its correctness: ext must beat it.
    peers = ("python", *DIFFUSERS_VARIANTS, "accelerate")
    for row in rows:
        if row.get("backend") != "ext" or not row.get("ms"):
            continue
        others = [other for other in rows if other.get("workload") == row["workload"]
                  and other.get("backend") in peers and other.get("ms")]
        if others:
            best = min(others, key=lambda other: other["ms"])
            exact = "" if best.get("bit_equal") is not False else ", not bit-equal"
            lines.append(f"{row['workload']}: fastest other offloader: {best['backend']} {best['ms']:.2f} ms{exact}; "
                         f"it / ext = {paired_ratio(best, row):.2f}x")
    return lines


def paired_ratio(row: dict[str, Any], reference: dict[str, Any]) -> float:
    """``row`` over ``reference``: the median of the per-round ratios where both ran in the same interleaved rounds
    (docs/DESIGN.md, "Measuring on a noisy host"), else (accelerate, timed on its own) the ratio of their medians."""
    mine, theirs = row.get("rounds_ms"), reference.get("rounds_ms")
    if mine and theirs and len(mine) == len(theirs):
        return median([a / b for a, b in zip(mine, theirs)])
    return row["ms"] / reference["ms"]
