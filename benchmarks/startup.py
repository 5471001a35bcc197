"""Section 3, startup: what ``enable_layerwise_offload`` costs, per backend, on a several-GiB model.

Each backend runs in a fresh process (``python -m benchmarks.startup --child ...``), because both
figures that matter are first-time costs a second run in the same process would hide: pinning
(torch's caching host allocator keeps freed pinned blocks and hands them out again) and peak RSS
(the high-water mark of a process only goes up). In the child: import and CUDA init, read the base
RSS, build W1 on the host, then time ``enable_layerwise_offload`` (synchronised) while a thread
samples VmRSS (and VmHWM, reset through ``/proc/self/clear_refs`` where allowed). ``--quick`` uses W3 instead
of W1 (half the bytes to build and pin).

Figures, against docs/DESIGN.md's targets ("Workloads and targets"):
- enable wall time, ext <= 0.5 x python;
- pinned host bytes / weight bytes <= 1.01 (python: torch's host allocator, which rounds every
  parameter up to a power of two; read from ``torch.cuda.memory.host_memory_stats()`` where this torch
  has it, else estimated by rounding each parameter, and the table says which);
- peak RSS during enable above the pre-model base <= 1.10 x (weights + largest block).
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from benchmarks.utils import Column, Context, GiB, Table, spawn_child

TITLE = "startup: enable_layerwise_offload wall time, pinned bytes, peak RSS"

TABLES = {
    "startup": Table(
        title="enable_layerwise_offload, fresh process per backend",
        columns=[
            Column("workload", "workload"),
            Column("backend", "backend"),
            Column("enable_s", "enable s", ".3f"),
            Column("x_python", "x python", ".2f"),
            Column("pinned_gib", "pinned GiB", ".3f"),
            Column("pinned_ratio", "pinned/weights", ".3f"),
            Column("pinned_source", "pinned from"),
            Column("rss_over_base_gib", "peak RSS-base GiB", ".2f"),
            Column("rss_bound_gib", "RSS bound GiB", ".2f"),
            Column("rss_ok", "RSS ok"),
            Column("pinned_ok", "pinned ok"),
        ],
    ),
}

RESULT_PREFIX = "STARTUP_RESULT "


def _spec(cpu: bool, quick: bool):
    from benchmarks.workloads import WORKLOADS, StackSpec
    if not cpu:
        # --quick: W3 (1.5 GiB, 136 params per block: the worst case for per-parameter pinning) to stay
        # inside the 2-minute budget; the full run uses W1 (3.4 GiB).
        return WORKLOADS["W3" if quick else "W1"]
    # Big enough that RSS and timing are not noise, small enough for a 2-core CI host.
    d = 768 if quick else 1024
    return StackSpec(f"W1-cpu-{d}", d=d, blocks=16, tokens=32, n_norms=4, character="W1 shape, host-sized")


def run(ctx: Context) -> None:
    backends = ["python", "ext"]
    ctx.progress.add(len(backends))
    spec = _spec(not ctx.cuda, ctx.quick)
    if not ctx.cuda:
        ctx.note(f"no CUDA device: startup measured with device='cpu' on {spec.name} "
                 f"({spec.weight_bytes() / GiB:.2f} GiB); nothing is pinned on the host device")
    timeout = (60 if ctx.quick else 120) * (1 if ctx.cuda else 2)
    results: dict[str, dict[str, Any]] = {}
    for backend in backends:
        config = {"backend": backend, "cuda": ctx.cuda, "quick": ctx.quick,
                  "prefetch_depth": ctx.options.prefetch_depth, "resident_blocks": ctx.options.resident_blocks}

        def row(config: dict[str, Any] = config) -> dict[str, Any]:
            result = _spawn(config, timeout)
            results[config["backend"]] = result
            python = results.get("python")
            if config["backend"] == "python":
                result["x_python"] = 1.0
            elif python and python.get("enable_s"):
                result["x_python"] = result["enable_s"] / python["enable_s"]
                if ctx.cuda:
                    result["time_ok"] = result["x_python"] <= 0.5
                    result["note"] = "enable time " + ("meets" if result["time_ok"] else "MISSES") + " <= 0.5 x python"
            return result

        ctx.run_row("startup", {"workload": spec.name, "backend": backend}, row)
    python, ext = results.get("python"), results.get("ext")
    if python and ext and python.get("enable_s") and ext.get("enable_s"):
        ratio = ext["enable_s"] / python["enable_s"]
        ctx.meta("ext_over_python_enable", ratio)
        ctx.note(f"ext enable time = {ratio:.2f} x python's (target <= 0.50): "
                 + (("meets" if ratio <= 0.5 else "MISSES") + " the target" if ctx.cuda
                    else "the target is about pinning, which the host device does not do"))
        if python.get("pinned_bytes") is not None and ext.get("pinned_bytes") is not None:
            ctx.note(f"pinned bytes: python {python['pinned_bytes'] / GiB:.3f} GiB "
                     f"({python.get('pinned_source')}), ext {ext['pinned_bytes'] / GiB:.3f} GiB")


def _spawn(config: dict[str, Any], timeout: float) -> dict[str, Any]:
    return spawn_child("benchmarks.startup", config, timeout, RESULT_PREFIX)


# --------------------------------------------------------------------------------------------------
# Child process
# --------------------------------------------------------------------------------------------------

def _child(config: dict[str, Any]) -> dict[str, Any]:
    import gc

    import torch

    from benchmarks.utils import (
        RssSampler,
        module_bytes,
        next_pow2,
        rss_bytes,
        torch_host_pinned_bytes,
    )
    from fastoffload_ext import enable_layerwise_offload as enable
    from benchmarks.workloads import build_stack_on_host

    cuda = config["cuda"] and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        torch.empty(1, device=device)  # context creation is not enable's cost
    spec = _spec(not cuda, config["quick"])
    gc.collect()
    base_rss = rss_bytes()
    model = build_stack_on_host(spec, seed=1)
    gc.collect()
    model_rss = rss_bytes()
    weight_bytes = module_bytes(model)
    largest_block = max(module_bytes(block) for block in model.blocks)
    pow2_bytes = sum(next_pow2(p.numel() * p.element_size()) for p in model.parameters())
    host_before = torch_host_pinned_bytes() if cuda else None

    with RssSampler() as sampler:
        started = time.perf_counter()
        group = enable(model, backend=config["backend"], device=device, prefetch_depth=config["prefetch_depth"],
                       resident_blocks=config["resident_blocks"])
        if cuda:
            torch.cuda.synchronize()
        enable_s = time.perf_counter() - started
    if group is None:
        raise RuntimeError("enable_layerwise_offload returned None")
    stats = dict(group.stats())
    host_after = torch_host_pinned_bytes() if cuda else None

    result: dict[str, Any] = {
        "enable_s": enable_s, "weight_bytes": weight_bytes, "largest_block_bytes": largest_block,
        "base_rss": base_rss, "model_rss": model_rss, "peak_rss": sampler.peak, "rss_samples": sampler.samples,
        "hwm_reset": sampler.hwm_reset, "stats": stats, "pow2_estimate_bytes": pow2_bytes,
        "device": str(device),
    }
    if not cuda:
        result["pinned_bytes"] = int(stats.get("pinned_bytes") or 0)
        result["pinned_source"] = "none (host device)"
    elif config["backend"] == "ext":
        result["pinned_bytes"] = int(stats.get("pinned_bytes") or 0)
        result["pinned_source"] = "engine pool stats"
        result["host_reserved_bytes"] = stats.get("host_reserved_bytes")
    elif host_before is not None and host_after is not None:
        result["pinned_bytes"] = host_after["reserved"] - host_before["reserved"]
        result["pinned_source"] = "torch host_memory_stats"
        result["torch_host_active_bytes"] = host_after["allocated"] - host_before["allocated"]
    else:
        result["pinned_bytes"] = pow2_bytes
        result["pinned_source"] = "estimate: params rounded to pow2"
    result["pinned_gib"] = result["pinned_bytes"] / GiB
    result["pinned_ratio"] = result["pinned_bytes"] / weight_bytes if cuda else None
    result["pinned_ok"] = result["pinned_ratio"] <= 1.01 if cuda else None
    result["rss_over_base_gib"] = (sampler.peak - base_rss) / GiB
    bound = 1.10 * (weight_bytes + largest_block)
    result["rss_bound_gib"] = bound / GiB
    result["rss_ok"] = (sampler.peak - base_rss) <= bound
    return result


def main_child(argv: list[str]) -> int:
    config = json.loads(argv[argv.index("--child") + 1])
    try:
        result = _child(config)
    except Exception as error:  # report, do not crash silently: the parent turns this into an error row
        result = {"child_error": f"{type(error).__name__}: {error}"}
    from benchmarks.utils import sanitize
    print(RESULT_PREFIX + json.dumps(sanitize(result)), flush=True)
    sys.stderr.flush()
    # No interpreter teardown: freeing the model's pinned copies one by one takes seconds and measures
    # nothing; the process exit returns them at once.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main_child(sys.argv))
