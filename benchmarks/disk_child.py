"""The disk section's measurements that need a fresh process (peak RSS only goes up; pinning is first-time).

``python -m benchmarks.disk --child '{json}'`` runs one of:
- startup: a meta model filled by ``enable_layerwise_offload(weights=...)``, with every block in host
  memory (budget "all") or half of them (budget "half");
- stream: the model at half its block bytes of host budget, steps timed against the resident model's
  forward, the H2D of every offloaded block and the disk tier's bytes at the measured read bandwidth.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

RESULT_PREFIX = "DISK_RESULT "


def _setup(config: dict[str, Any]) -> tuple[Any, Any, Any]:
    import torch

    from benchmarks.disk import _spec
    cuda = config["cuda"] and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        torch.empty(1, device=device)  # context creation is not enable's cost
    return torch, device, _spec(cuda, config["quick"])


def _meta_model(spec: Any) -> Any:
    import torch

    from benchmarks.workloads import DTYPE, BlockStack
    with torch.device("meta"):
        return BlockStack(spec.d, spec.blocks, spec.n_norms).to(DTYPE).eval()


def _block_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())


def _startup(config: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.disk import evict
    from benchmarks.utils import RssSampler, rss_bytes
    from fastoffload_ext import enable_layerwise_offload
    from fastoffload_ext.storage import DiskOptions
    torch, device, spec = _setup(config)
    path = Path(config["path"])
    model = _meta_model(spec)
    blocks_bytes = _block_bytes(model) * spec.blocks
    budget = None if config["budget"] == "all" else blocks_bytes // 2
    options = DiskOptions(staging_buffers=2)
    gc.collect()
    evict(path)
    base_rss = rss_bytes()
    with RssSampler() as sampler:
        started = time.perf_counter()
        group = enable_layerwise_offload(model, device=device, weights=path, host_budget=budget, disk_options=options)
        if device.type == "cuda":
            torch.cuda.synchronize()
        enable_s = time.perf_counter() - started
    pool = group.engine.pool.stats()
    reader = group.engine.reader.stats()
    disk = group.engine.disk_stats()
    staging = disk["staging_count"] * disk["staging_bytes"]
    bounce = reader["threads"] * reader["chunk_bytes"]
    host_tier = pool["in_use_bytes"] - staging
    outside = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("blocks."))
    on_host = outside if device.type == "cpu" else 0
    bound = 1.10 * (host_tier + staging + bounce + on_host)
    counted = enable_read_bytes(group.checkpoint)
    read_bytes = sum(counted.values())
    result = {"enable_s": enable_s, "rss_over_base_gib": (sampler.peak - base_rss) / (1 << 30),
              "rss_bound_gib": bound / (1 << 30), "rss_ok": sampler.peak - base_rss <= bound,
              "host_tier_bytes": host_tier, "staging_bytes": staging, "bounce_bytes": bounce,
              "bytes_read": read_bytes, "read_gib": read_bytes / (1 << 30), **counted,
              # The disk tier's first staging fill is queued last and runs after enable returns: not counted.
              "staging_read_ahead_bytes": staging if disk["staging_count"] else 0,
              "reader_bytes_at_return": reader["bytes_read"],
              "direct_share": reader["direct_bytes"] / max(reader["bytes_read"], 1),
              "disk_blocks": sum(1 for s in group.states if s.on_disk)}
    return result  # the parent judges the time against the bandwidth it measures around this child


def enable_read_bytes(source: Any) -> dict[str, int]:
    """What enable must read from the checkpoint, by kind: the host tier's blocks, every tensor outside
    the offloaded blocks, and the safetensors headers (validation). The disk tier's blocks are not
    read at enable (their first staging fill runs after it returns)."""
    host_tier = sum(e.nbytes for block in source.blocks if not block.on_disk for e in block.entries)
    resident = sum(e.nbytes for e in source.resident.values())
    data = {path: 0 for path in source.checkpoint.file_sizes}
    for entry in source.checkpoint.entries.values():
        data[entry.path] += entry.nbytes
    headers = sum(size - data[path] for path, size in source.checkpoint.file_sizes.items())
    return {"host_tier_read_bytes": host_tier, "resident_read_bytes": resident, "header_bytes": headers}


def _time_steps(torch: Any, device: Any, fn: Any, iters: int, before: Any = None) -> float:
    """Median milliseconds of ``fn`` (synchronised), after two warm-up calls; ``before`` runs untimed."""
    from benchmarks.utils import median
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return median(times)


def _h2d_bytes_per_s(torch: Any, device: Any) -> float:
    size = (1 << 30) if device.type == "cuda" else (256 << 20)
    source = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty(size, dtype=torch.uint8, device=device)
    ms = _time_steps(torch, device, lambda: target.copy_(source, non_blocking=True), 5)
    return size / (ms / 1e3)


def _stream(config: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import load_file

    from benchmarks.disk import evict
    from benchmarks.workloads import DTYPE
    from fastoffload_ext import enable_layerwise_offload
    from fastoffload_ext.storage import DiskOptions
    torch, device, spec = _setup(config)
    path = Path(config["path"])
    resident = _meta_model(spec)
    resident.load_state_dict(load_file(str(path), device=str(device)), assign=True)
    torch.manual_seed(0)
    x = torch.randn(1, spec.tokens, spec.d, dtype=DTYPE, device=device)
    iters = 5 if config["quick"] else 10
    with torch.no_grad():
        expected = resident(x)
        compute_ms = _time_steps(torch, device, lambda: resident(x), iters)
    del resident
    gc.collect()
    h2d = _h2d_bytes_per_s(torch, device)
    model = _meta_model(spec)
    blocks_bytes = _block_bytes(model) * spec.blocks
    compress = config.get("compress", False)
    group = enable_layerwise_offload(model, device=device, weights=path, host_budget=blocks_bytes // 2,
                                     disk_options=DiskOptions(staging_buffers=3), compress=compress)
    disk_states = [s for s in group.states if s.on_disk]
    # Compressed: the disk tier reads each block's compressed region from the spill file instead.
    disk_bytes = sum(group.engine.codec_info(s.handle)["compressed_bytes"] or s.weight_bytes() for s in disk_states)
    files = [path] + ([Path(group.engine.spill_path)] if group.engine.spill_path else [])
    with torch.no_grad():
        exact = bool(torch.equal(model(x), expected))
        buffered = group.engine.reader.stats()["buffered_bytes"] > 0
        # Reads through the page cache (O_DIRECT refused) would hit the cache from the second step on.
        evict_first = (lambda: [evict(f) for f in files]) if buffered else None
        before = group.engine.reader.stats()["bytes_read"]
        step_ms = _time_steps(torch, device, lambda: model(x), iters, before=evict_first)
        read = group.engine.reader.stats()["bytes_read"] - before
    bandwidth = config["bandwidth"]
    h2d_ms = blocks_bytes / h2d * 1e3
    result: dict[str, Any] = {"disk_blocks": len(disk_states), "step_ms": step_ms, "compute_ms": compute_ms,
                              "h2d_ms": h2d_ms, "exact": exact, "disk_bytes_per_step": disk_bytes,
                              "bytes_read_timed": read, "h2d_gb_s": h2d / 1e9,
                              "disk_waits": group.engine.disk_stats()["waits"], "evicted_each_step": buffered,
                              "spill_bytes": group.engine.spill_bytes}
    if compress:
        result["note"] = (f"compress=True: disk blocks read {disk_bytes / 2**30:.3f} GiB/step from a "
                          f"{group.engine.spill_bytes / 2**30:.3f} GiB spill file")
    if bandwidth:
        disk_ms = disk_bytes / bandwidth * 1e3
        bound = max(compute_ms, h2d_ms, disk_ms)
        result.update(disk_ms=disk_ms, x_bound=step_ms / bound, step_ok=step_ms <= 1.05 * bound,
                      stream_ratio=disk_ms / step_ms)
        # The stream target applies when the disk is what sets the pace.
        result["stream_ok"] = result["stream_ratio"] >= 0.90 if disk_ms >= max(compute_ms, h2d_ms) else None
    return result


def main_child(argv: list[str]) -> int:
    config = json.loads(argv[argv.index("--child") + 1])
    try:
        result = _startup(config) if config["mode"] == "startup" else _stream(config)
    except Exception as error:  # report, do not crash silently: the parent turns this into an error row
        result = {"child_error": f"{type(error).__name__}: {error}"}
    from benchmarks.utils import sanitize
    print(RESULT_PREFIX + json.dumps(sanitize(result)), flush=True)
    sys.stderr.flush()
    os._exit(0)  # no teardown of pinned memory: the process exit returns it at once


if __name__ == "__main__":
    sys.exit(main_child(sys.argv))
