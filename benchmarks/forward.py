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
block prefetched): a race between a prefetch and the compute reading it shows up only in the latter. Peak GPU memory is
``max_memory_allocated`` over the row's forwards, after a reset; the DESIGN bound beside it is
(k+1) x largest block + activations + 64 MiB, activations read off the resident row.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.utils import (
    GB,
    Column,
    Context,
    MiB,
    Table,
    empty_host_cache,
    free_memory,
    gbps,
    module_bytes,
    offload_api,
    summary,
    try_import,
)
from benchmarks.workloads import Workload, llama_workload, move_non_block_modules, stack_workload

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


def _forward_fn(model: nn.Module, workload: Workload, args: tuple, kwargs: dict) -> Callable[[], Any]:
    def forward() -> Any:
        with torch.inference_mode():
            return model(*args, **kwargs)
    return forward


def _peak_reset(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_bytes(ctx: Context) -> int | None:
    if not ctx.cuda:
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _time_and_check(ctx: Context, model: nn.Module, workload: Workload, args: tuple, kwargs: dict,
                    reference: torch.Tensor | None, *, slow: bool = False,
                    stats: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    forward = _forward_fn(model, workload, args, kwargs)
    _peak_reset(ctx)
    output = workload.output(forward())  # the first forward also warms up (first loads, lazy inits)
    checked = output.detach().to("cpu", copy=True)
    del output
    equal = None if reference is None else bool(torch.equal(checked, reference))
    warmup = 1 if (ctx.quick or slow) else 2
    iters = ctx.iters(5 if slow else 10, quick=5)
    before = dict(stats()) if stats is not None else None
    times = ctx.time_ms(forward, warmup=warmup, iters=iters)
    result = {**summary(times), "peak_bytes": _peak_bytes(ctx), "bit_equal_first": equal}
    if reference is not None:
        # Also compare a steady-state forward: a race between a prefetch and the compute that reads it
        # can spare the first (synchronously loaded) forward and show up only once prefetching runs.
        last = workload.output(forward()).detach().to("cpu", copy=True)
        result["bit_equal_last"] = bool(torch.equal(last, reference))
        if not result["bit_equal_last"] or not equal:
            result["max_abs_diff"] = max(float((out.float() - reference.float()).abs().max())
                                         for out in (checked, last))
        result["bit_equal"] = bool(equal and result["bit_equal_last"])
        del last
    else:
        result["bit_equal"] = None
    if before is not None:
        after = dict(stats())
        # Counters over warm-up + timed forwards only: the very first forward's load of block 0 is
        # synchronous by design (nothing prefetched it), later ones must not be.
        result["steady"] = {key: after[key] - before[key] for key in ("copies", "bytes_copied", "sync_loads",
                                                                       "prefetch_hits", "cache_hits")
                            if isinstance(after.get(key), (int, float)) and isinstance(before.get(key), (int, float))}
    if result["peak_bytes"] is not None:
        result["peak_mib"] = result["peak_bytes"] / MiB
    result["_output"] = checked
    return result


def run(ctx: Context) -> None:
    enable = disable = None
    api_reason = ""
    try:
        enable, disable = offload_api()
    except ImportError as error:
        api_reason = str(error)

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

    diffusers, diffusers_reason = try_import("diffusers")
    accelerate, accelerate_reason = try_import("accelerate")
    workloads = _workloads(ctx)
    ctx.progress.add(len(workloads) * (len(BACKENDS) + 1))
    master_cache: dict[str, Any] = {}  # the previous workload's host master, reused when the weights match
    k = ctx.options.prefetch_depth
    n_resident = ctx.options.resident_blocks or 0
    if k != 1 or n_resident:
        ctx.note(f"ext/python rows run with prefetch_depth={k}, resident_blocks={n_resident}")

    for name, workload, reason in workloads:
        if workload is None:
            for backend in ("floor",) + BACKENDS:
                ctx.skip("forward", {"workload": name, "backend": backend}, reason)
                ctx.progress.finish()
            continue
        _run_workload(ctx, workload, enable, disable, api_reason, peak, k, n_resident,
                      diffusers, diffusers_reason, accelerate, accelerate_reason, master_cache)
    master_cache.clear()
    empty_host_cache()


def _run_workload(ctx: Context, workload: Workload, enable: Any, disable: Any, api_reason: str, peak: float | None,
                  k: int, n_resident: int, diffusers: Any, diffusers_reason: str, accelerate: Any,
                  accelerate_reason: str, master_cache: dict[str, Any]) -> None:
    labels = lambda backend: {"workload": workload.name, "backend": backend}  # noqa: E731
    shared: dict[str, Any] = {}

    def build_master() -> dict[str, Any]:
        started = time.perf_counter()
        key = workload.info.get("cache_key")
        if key is not None and master_cache.get("key") == key:
            master = master_cache["master"]
        else:
            master_cache.clear()
            free_memory()
            master = workload.build_host()
            if key is not None:
                master_cache.update(key=key, master=master)
        blocks = workload.blocks(master)
        block_bytes = [module_bytes(block) for block in blocks]
        shared.update(master=master, block_bytes=block_bytes, all_bytes=module_bytes(master),
                      offloaded_bytes=sum(block_bytes[n_resident:]), largest_block=max(block_bytes),
                      resident_block_bytes=sum(block_bytes[:n_resident]))
        shared["inputs"] = workload.make_inputs(ctx.device)
        return {"build_s": time.perf_counter() - started}

    # The floor row is filled in after the resident row (it needs the resident time); build first.
    try:
        build = build_master()
    except Exception as error:
        for backend in ("floor",) + BACKENDS:
            ctx.skip("forward", labels(backend), f"could not build the model: {type(error).__name__}: {error}")
            ctx.progress.finish()
        return
    args, kwargs = shared["inputs"]
    master: nn.Module = shared["master"]

    # resident ---------------------------------------------------------------------------------
    def resident_row() -> dict[str, Any]:
        model = copy.deepcopy(master).to(ctx.device)
        try:
            result = _time_and_check(ctx, model, workload, args, kwargs, None)
        finally:
            del model
        shared["reference"] = result.pop("_output")
        shared["resident_ms"] = result["ms"]
        shared["resident_peak"] = result.get("peak_bytes")
        result.update(weight_bytes=shared["all_bytes"], x_resident=1.0, **build)
        if ctx.cuda and peak:
            transfer = shared["offloaded_bytes"] / (peak * GB) * 1e3
            result["x_floor"] = result["ms"] / max(result["ms"], transfer)
        return result

    ctx.run_row("forward", labels("resident"), resident_row)
    resident_ms = shared.get("resident_ms")
    reference = shared.get("reference")

    # floor ------------------------------------------------------------------------------------
    transfer_ms = shared["offloaded_bytes"] / (peak * GB) * 1e3 if peak else None
    floor_ms = max(v for v in (resident_ms, transfer_ms) if v is not None) if (resident_ms or transfer_ms) else None
    if ctx.cuda and floor_ms is not None:
        floor_row = {"ms": floor_ms, "x_floor": 1.0, "resident_ms": resident_ms, "transfer_ms": transfer_ms,
                     "offloaded_bytes": shared["offloaded_bytes"], "peak_h2d_gbps": peak,
                     "note": (f"max(resident {resident_ms:.2f} ms, {shared['offloaded_bytes'] / GB:.2f} GB / "
                              f"{peak:.1f} GB/s = {transfer_ms:.2f} ms)" if (resident_ms and transfer_ms) else
                              "resident time only (no peak H2D)")}
        ctx.run_row("forward", labels("floor"), lambda: floor_row)
    else:
        ctx.skip("forward", labels("floor"), "needs a CUDA device" if not ctx.cuda else "resident row failed")
        ctx.progress.finish()
    activations = None
    if shared.get("resident_peak") is not None:
        activations = max(0, shared["resident_peak"] - shared["all_bytes"])
    non_block_bytes = shared["all_bytes"] - sum(shared["block_bytes"])

    def judge(result: dict[str, Any], moved_bytes: int, engine_bound: bool) -> dict[str, Any]:
        ms = result["ms"]
        result["moved_bytes"] = moved_bytes
        result["gbps"] = gbps(moved_bytes, ms) if ctx.cuda else None
        result["x_floor"] = ms / floor_ms if (floor_ms and ctx.cuda) else None
        result["x_resident"] = ms / resident_ms if resident_ms else None
        result["floor_ms"] = floor_ms if ctx.cuda else None
        if workload.target is not None and ctx.cuda:
            kind, factor = workload.target
            reference_ms = floor_ms if kind == "floor" else resident_ms
            result["target"] = f"<={factor:.2f}x {kind}"
            if reference_ms:
                result["pass"] = ms <= factor * reference_ms
        elif workload.target is not None:
            result["target"] = "n/a (cpu)"
        if engine_bound and activations is not None and result.get("peak_bytes") is not None:
            bound = ((k + 1) * shared["largest_block"] + activations + non_block_bytes + shared["resident_block_bytes"]
                     + MEM_SLACK_BYTES)
            result["mem_bound_bytes"] = bound
            result["mem_ok"] = result["peak_bytes"] <= bound
        if reference is not None and result.get("bit_equal") is None:
            result["bit_equal"] = False
        if result.get("bit_equal") is False and result.get("max_abs_diff") is not None:
            first = "equal" if result.get("bit_equal_first") else "differs"
            last = "equal" if result.get("bit_equal_last") else "differs"
            mismatch = (f"output != resident: first forward {first}, steady-state {last}, "
                        f"max |diff| {result['max_abs_diff']:.3g}")
            result["note"] = "; ".join(filter(None, [result.get("note"), mismatch]))
        return result

    # fastoffload_ext backends -----------------------------------------------------------------
    for backend in ("ext", "python"):
        if enable is None:
            ctx.skip("forward", labels(backend), api_reason)
            ctx.progress.finish()
            continue
        holder: dict[str, Any] = {}

        def offload_row(backend: str = backend, holder: dict[str, Any] = holder) -> dict[str, Any]:
            model = copy.deepcopy(master)
            holder["model"] = model
            move_non_block_modules(model, ctx.device)
            started = time.perf_counter()
            group = enable(model, backend=backend, device=ctx.device, prefetch_depth=k,
                           resident_blocks=n_resident or None)
            if ctx.cuda:
                torch.cuda.synchronize()
            enable_s = time.perf_counter() - started
            if group is None:
                raise RuntimeError("enable_layerwise_offload returned None (offload skipped)")
            holder["group"] = group
            result = _time_and_check(ctx, model, workload, args, kwargs, reference, stats=group.stats)
            result.pop("_output")
            result.update(enable_s=enable_s, stats=dict(group.stats()))
            steady_sync = result.get("steady", {}).get("sync_loads")
            if steady_sync:
                result["note"] = f"{steady_sync} synchronous load(s) in warm-up + timed forwards"
            return judge(result, shared["offloaded_bytes"], engine_bound=True)

        def offload_cleanup(holder: dict[str, Any] = holder) -> None:
            model = holder.pop("model", None)
            group = holder.pop("group", None)
            if model is not None and group is not None:
                disable(model)
            del model, group

        ctx.run_row("forward", labels(backend), offload_row, cleanup=offload_cleanup)

    # diffusers group offloading: block level (the like-for-like peer) and leaf level (its best on W3) --
    for backend, offload_type in DIFFUSERS_VARIANTS.items():
        if not ctx.cuda:
            ctx.skip("forward", labels(backend), "needs a CUDA device")
            ctx.progress.finish()
            continue
        if diffusers is None:
            ctx.skip("forward", labels(backend), diffusers_reason)
            ctx.progress.finish()
            continue
        if ctx.quick and workload.name in QUICK_SKIP_DIFFUSERS:
            ctx.skip("forward", labels(backend), "skipped under --quick (W1 and W3 show the transfer-bound and "
                     "host-bound cases)")
            ctx.progress.finish()
            continue

        def diffusers_row(offload_type: str = offload_type) -> dict[str, Any]:
            from diffusers.hooks import apply_group_offloading
            model = copy.deepcopy(master)
            started = time.perf_counter()
            grouping = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
            apply_group_offloading(model, onload_device=ctx.device, offload_type=offload_type, use_stream=True,
                                   **grouping)
            torch.cuda.synchronize()
            enable_s = time.perf_counter() - started
            try:
                result = _time_and_check(ctx, model, workload, args, kwargs, reference)
            finally:
                del model
            result.pop("_output")
            result["enable_s"] = enable_s
            return judge(result, shared["all_bytes"], engine_bound=False)

        ctx.run_row("forward", labels(backend), diffusers_row)

    # accelerate cpu_offload -------------------------------------------------------------------
    if not ctx.cuda:
        ctx.skip("forward", labels("accelerate"), "needs a CUDA device")
        ctx.progress.finish()
    elif accelerate is None:
        ctx.skip("forward", labels("accelerate"), accelerate_reason)
        ctx.progress.finish()
    elif ctx.quick:
        ctx.skip("forward", labels("accelerate"), "slow baseline (~8x floor): skipped under --quick")
        ctx.progress.finish()
    else:
        def accelerate_row() -> dict[str, Any]:
            from accelerate import cpu_offload
            model = copy.deepcopy(master)
            started = time.perf_counter()
            cpu_offload(model, execution_device=ctx.device)
            enable_s = time.perf_counter() - started
            try:
                result = _time_and_check(ctx, model, workload, args, kwargs, reference, slow=True)
            finally:
                del model
            result.pop("_output")
            result["enable_s"] = enable_s
            return judge(result, shared["all_bytes"], engine_bound=False)

        ctx.run_row("forward", labels("accelerate"), accelerate_row)

    shared.clear()


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
                         f"{python_rows[row['workload']]['ms'] / row['ms']:.2f}x")
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
                         f"it / ext = {best['ms'] / row['ms']:.2f}x")
    return lines
