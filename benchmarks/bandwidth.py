"""Section 1, bandwidth: host<->device copy speed by source memory, and the cost of pinning.

Sources, each one allocation sliced for every size (so every size copies from the same pages):
- the engine's pool (``_C.PinnedPool``) with backing "host_alloc" (cudaHostAlloc slabs), "register"
  (mmap + cudaHostRegister) and "pageable" (plain memory, the fallback);
- torch pinned memory (``torch.empty(..., pin_memory=True)``: the caching host allocator, what the
  python backend pins through);
- pageable torch memory; and D2H into torch pinned and into pool memory.

The 1 GiB torch-pinned H2D figure is this run's ``peak``, the denominator of every floor in the
forward section (docs/DESIGN.md, "Workloads and targets": the floor). Copies are ``copy_(non_blocking=True)`` on the current stream,
timed with CUDA events, median of >= 5 after warm-up.

Pinning: wall time of one fresh allocation of PIN_SIZE through each path, in ms per GiB (fresh
process, so nothing is served from a cache); the pool's own ``pin_seconds`` is reported beside it.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks.utils import Column, Context, GiB, MiB, Table, gbps, median, time_cuda_ms

TITLE = "bandwidth: H2D / D2H copy speed vs size, and pinning cost"

SOURCES = [
    ("pool_host_alloc", "pool host_alloc"),
    ("pool_register", "pool register"),
    ("pool_pageable", "pool pageable"),
    ("torch_pinned", "torch pinned"),
    ("pageable", "pageable"),
]
D2H = [("d2h_torch_pinned", "D2H torch pinned"), ("d2h_pool_host_alloc", "D2H pool host_alloc")]

TABLES = {
    "copy": Table(
        title="Copy bandwidth, GB/s (median); H2D unless marked D2H",
        columns=[Column("size", "size")] + [Column(key, header, ".1f") for key, header in SOURCES + D2H],
    ),
    "pinning": Table(
        title="Pinning cost of one fresh allocation",
        columns=[
            Column("path", "path"),
            Column("gib", "GiB", ".2f"),
            Column("seconds", "wall s", ".3f"),
            Column("ms_per_gib", "ms/GiB", ".0f"),
            Column("pin_seconds", "pool pin s", ".3f"),
            Column("reserved_gib", "reserved GiB", ".2f"),
        ],
    ),
}

MAX_BYTES = 1024 * MiB


def measure_copy_ms(dst: torch.Tensor, src: torch.Tensor, *, warmup: int, iters: int) -> float:
    return median(time_cuda_ms(lambda: dst.copy_(src, non_blocking=True), warmup=warmup, iters=iters))


def _sizes(quick: bool) -> list[int]:
    if quick:
        return [1 * MiB, 16 * MiB, 256 * MiB, 1024 * MiB]
    return [2**i * MiB for i in range(11)]  # 1 MiB ... 1 GiB


def _iters(quick: bool, nbytes: int) -> int:
    if quick:
        return 5
    return 20 if nbytes <= 16 * MiB else 10 if nbytes <= 256 * MiB else 7


def run(ctx: Context) -> None:
    if not ctx.cuda:
        ctx.note("no CUDA device: copy bandwidth and pinning need a GPU (skipped)")
        ctx.skip("copy", {"size": "all"}, "no CUDA device")
        ctx.skip("pinning", {"path": "all"}, "no CUDA device")
        return
    pin_bytes = (1 if ctx.quick else 2) * GiB
    # The pinned sources of the copy table, by column key; keep_alive holds their pools and full tensors.
    sources: dict[str, torch.Tensor] = {}
    keep_alive: list[Any] = []
    core, core_reason = _compiled_core()

    paths = ["pool host_alloc", "pool register", "torch empty(pin_memory=True)", "torch tensor.pin_memory()"]
    if not ctx.quick:
        paths.append("torch pin_memory() in 1 MiB pieces")
    sizes = _sizes(ctx.quick)
    ctx.progress.add(len(paths) + 1 + len(sizes))
    device_index = ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()

    _pool_pinning_rows(ctx, core, core_reason, device_index, pin_bytes, sources, keep_alive)
    _torch_pinning_rows(ctx, pin_bytes, sources, keep_alive)
    _pool_pageable_row(ctx, core, core_reason, device_index, sources, keep_alive)
    peak = _copy_rows(ctx, sizes, sources)
    missing = [header for key, header in SOURCES if key not in sources]
    if missing:
        ctx.note("columns without a source (see the pinning table for why): " + ", ".join(missing))
    if peak is not None:
        ctx.meta("peak_h2d_gbps", peak)
        ctx.note(f"peak H2D (1 GiB torch pinned) = {peak:.1f} GB/s: the denominator of every floor in this run")
    sources.clear()
    keep_alive.clear()


def _compiled_core() -> tuple[Any, str]:
    """The compiled core with its PinnedPool, or None and why not."""
    try:
        from fastoffload_ext import _backend
        core = _backend._C
        if core is None:
            return None, f"compiled core not loaded: {_backend.REASON}"
        if not hasattr(core, "PinnedPool"):
            return None, "compiled core has no PinnedPool"
        return core, ""
    except Exception as error:
        return None, f"fastoffload_ext not importable: {error}"


def _pool_pinning_rows(ctx: Context, core: Any, core_reason: str, device_index: int, pin_bytes: int,
                       sources: dict[str, torch.Tensor], keep_alive: list[Any]) -> None:
    """Pinning ``pin_bytes`` through the engine's pool, with each of its two pinned backings."""
    for backing in ("host_alloc", "register"):
        label = {"path": f"pool {backing}"}
        if core is None:
            ctx.skip("pinning", label, core_reason)
            ctx.progress.finish()
            continue

        def pool_pin(backing: str = backing) -> dict[str, Any]:
            pool = core.PinnedPool(device_index, backing, 0, False, 0)
            started = time.perf_counter()
            tensor = pool.allocate(pin_bytes)
            seconds = time.perf_counter() - started
            stats = dict(pool.stats())
            sources[f"pool_{backing}"] = tensor[:MAX_BYTES]
            keep_alive.extend([pool, tensor])
            return {"gib": pin_bytes / GiB, "seconds": seconds, "ms_per_gib": seconds * 1e3 / (pin_bytes / GiB),
                    "pin_seconds": stats.get("pin_seconds"), "reserved_gib": stats.get("reserved_bytes", 0) / GiB,
                    "stats": stats}

        ctx.run_row("pinning", label, pool_pin)


def _torch_pinning_rows(ctx: Context, pin_bytes: int, sources: dict[str, torch.Tensor], keep_alive: list[Any]) -> None:
    """Pinning through torch: one pinned allocation, a pageable tensor pinned, and (full run) 1 MiB pieces."""
    def torch_empty_pin() -> dict[str, Any]:
        started = time.perf_counter()
        tensor = torch.empty(pin_bytes, dtype=torch.uint8, pin_memory=True)
        seconds = time.perf_counter() - started
        sources["torch_pinned"] = tensor[:MAX_BYTES]
        keep_alive.append(tensor)
        return {"gib": pin_bytes / GiB, "seconds": seconds, "ms_per_gib": seconds * 1e3 / (pin_bytes / GiB)}

    ctx.run_row("pinning", {"path": "torch empty(pin_memory=True)"}, torch_empty_pin)

    def torch_pin_copy() -> dict[str, Any]:
        # What the python backend does per parameter: a pageable tensor, then .pin_memory() (alloc + copy).
        pageable = torch.ones(pin_bytes, dtype=torch.uint8)
        started = time.perf_counter()
        pinned = pageable.pin_memory()
        seconds = time.perf_counter() - started
        sources["pageable"] = pageable[:MAX_BYTES]
        keep_alive.append(pageable)
        del pinned
        return {"gib": pin_bytes / GiB, "seconds": seconds, "ms_per_gib": seconds * 1e3 / (pin_bytes / GiB),
                "note": "allocation + copy of the data"}

    ctx.run_row("pinning", {"path": "torch tensor.pin_memory()"}, torch_pin_copy)

    if not ctx.quick:
        def torch_pin_pieces() -> dict[str, Any]:
            total = 256 * MiB
            pieces = [torch.ones(MiB, dtype=torch.uint8) for _ in range(total // MiB)]
            started = time.perf_counter()
            pinned = [piece.pin_memory() for piece in pieces]
            seconds = time.perf_counter() - started
            del pinned, pieces
            return {"gib": total / GiB, "seconds": seconds, "ms_per_gib": seconds * 1e3 / (total / GiB),
                    "note": "per-parameter pinning, as the python backend does"}

        ctx.run_row("pinning", {"path": "torch pin_memory() in 1 MiB pieces"}, torch_pin_pieces)


def _pool_pageable_row(ctx: Context, core: Any, core_reason: str, device_index: int,
                       sources: dict[str, torch.Tensor], keep_alive: list[Any]) -> None:
    def pool_pageable() -> dict[str, Any]:
        if core is None:
            raise RuntimeError(core_reason)
        pool = core.PinnedPool(device_index, "pageable", 0, False, 0)
        tensor = pool.allocate(MAX_BYTES)
        tensor.fill_(1)  # fault the pages in outside the timed copies
        sources["pool_pageable"] = tensor
        keep_alive.extend([pool, tensor])
        return {"gib": MAX_BYTES / GiB, "note": "source for the 'pool pageable' column (not pinned)"}

    ctx.run_row("pinning", {"path": "pool pageable (source only)"}, pool_pageable)


def _copy_rows(ctx: Context, sizes: list[int], sources: dict[str, torch.Tensor]) -> float | None:
    """One row per size: every source copied up, two of them back down. Returns the 1 GiB pinned H2D rate."""
    if "pageable" not in sources:
        sources["pageable"] = torch.ones(MAX_BYTES, dtype=torch.uint8)
    for view in sources.values():
        if view.numel() >= MAX_BYTES:
            view[:MAX_BYTES].fill_(7)
    device_buffer = torch.empty(MAX_BYTES, dtype=torch.uint8, device=ctx.device)
    device_buffer.fill_(3)
    peak = None
    for nbytes in sizes:
        def size_row(nbytes: int = nbytes) -> dict[str, Any]:
            row: dict[str, Any] = {"bytes": nbytes}
            errors = {}
            iters = _iters(ctx.quick, nbytes)
            # (column, host buffer, H2D?): every source up, then two of them back down.
            copies = [(key, key, True) for key, _ in SOURCES]
            copies += [("d2h_torch_pinned", "torch_pinned", False), ("d2h_pool_host_alloc", "pool_host_alloc", False)]
            for key, host_key, h2d in copies:
                host = sources.get(host_key)
                if host is None:
                    continue
                device = device_buffer[:nbytes]
                dst, src = (device, host[:nbytes]) if h2d else (host[:nbytes], device)
                try:
                    ms = measure_copy_ms(dst, src, warmup=2, iters=iters)
                    row[key] = gbps(nbytes, ms)
                    row[key + "_ms"] = ms
                except Exception as error:
                    errors[key] = f"{type(error).__name__}: {error}"
            if errors:
                row["errors"] = errors
                row["note"] = "errors: " + "; ".join(f"{k}: {v}" for k, v in errors.items())
            return row

        result = ctx.run_row("copy", {"size": _size_label(nbytes)}, size_row)
        if nbytes == MAX_BYTES and result and result.get("torch_pinned"):
            peak = result["torch_pinned"]
    return peak


def _size_label(nbytes: int) -> str:
    return f"{nbytes // GiB} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB"
