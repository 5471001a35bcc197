"""The disk section's measurements that need a fresh process (peak RSS only goes up; pinning is first-time).

``python -m benchmarks.disk --child '{json}'`` runs one of:
- startup: a meta model filled by ``enable_layerwise_offload(weights=...)``, with every block in host
  memory (budget "all") or half of them (budget "half");
- stream: the model at half its block bytes of host budget, steps timed in rounds against the resident
  model's forward, the H2D of every offloaded block and the disk tier's bytes at the read bandwidth
  measured around each round, with the reader's counters over the timed steps (idle share, mean reads
  in flight, host waits for reads and the reader's idle time inside them).
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
    bounce = reader["bounce_bytes"]  # the workers' O_DIRECT buffers, as allocated
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
              # Since the reader was made (early in enable): whether the disk was kept busy.
              "reader_idle_s": reader["idle_seconds"], "in_flight": reader["read_seconds"] / reader["wall_seconds"],
              "reader_wall_s": reader["wall_seconds"],
              "disk_blocks": sum(1 for s in group.states if s.on_disk)}
    result.update(startup_phases(group, started, enable_s))
    return result  # the parent judges the time against the bandwidth it measures around this child


def startup_phases(group: Any, started: float, enable_s: float) -> dict[str, Any]:
    """Where a start-up's time went: the build's own phases (``CheckpointSource.phases``, ms) and what
    enable spent outside them ("other": argument and model checks, the engine, the hooks), and the
    host tier's reads placed in it from the reader's counters: "head" from the call to the first read
    request, "reads" from the first request to the last one's end, "tail" from then to the return.
    With a disk tier the reader's counters are the ones taken when its staging ring started, i.e.
    before the ring's first fill, which is not part of the start-up. "pins" are the pool's deferred
    pins, summed over the threads that ran them (faulting the pages in, then registering them)."""
    source = group.checkpoint
    reader = group.engine.reader.stats()
    disk = group.engine.disk_stats()
    ring = disk["staging_count"] > 0
    made = source.reader_made_at - started  # the reader's clock starts here, in enable's
    first = reader["first_read_seconds"]
    last = disk["start_reader_last_read_end_seconds"] if ring else reader["last_read_end_seconds"]
    read_bytes = disk["start_reader_bytes"] if ring else reader["bytes_read"]
    phases = {name: seconds * 1e3 for name, seconds in source.phases.items()}
    phases["other"] = enable_s * 1e3 - sum(phases.values())
    pool = group.engine.pool.stats()
    timeline = {"head": (made + first) * 1e3 if first >= 0 else None,
                "reads": (last - first) * 1e3 if first >= 0 and last >= 0 else None,
                "tail": (enable_s - made - last) * 1e3 if last >= 0 else None}
    return {"phases_ms": phases, "timeline_ms": timeline, "reader_bytes_at_start": read_bytes,
            "pins": {"count": pool["deferred_pins"], "populate_ms": pool["populate_seconds"] * 1e3,
                     "register_ms": pool["register_seconds"] * 1e3, "pin_total_ms": pool["pin_seconds"] * 1e3}}


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


def _time_steps(torch: Any, device: Any, fn: Any, iters: int) -> float:
    """Median milliseconds of ``fn`` (synchronised), after two warm-up calls."""
    from benchmarks.utils import median
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
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


# The stream row's rounds: each is one untimed step (the staging ring, full after the bracketing read,
# would flatter the next step) and then the timed ones; every round is bracketed by sequential reads.
ROUNDS = 3


def _wait_reader_idle(reader: Any, quiet_s: float = 0.05, timeout_s: float = 10.0) -> None:
    """Returns once ``reader`` has had no read in flight for ``quiet_s`` (the staging ring's read-ahead
    is done), so that a bracketing read has the disk to itself."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        before = reader.stats()["idle_seconds"]
        time.sleep(quiet_s)
        if reader.stats()["idle_seconds"] - before >= 0.9 * quiet_s:
            return


def _counters(group: Any) -> dict[str, float]:
    reader, disk = group.engine.reader.stats(), group.engine.disk_stats()
    return {"bytes": reader["bytes_read"], "in_place": reader["in_place_bytes"], "wall": reader["wall_seconds"],
            "idle": reader["idle_seconds"], "read": reader["read_seconds"], "waits": disk["waits"], "wait_s": disk["wait_seconds"],
            "idle_waits_s": disk["idle_in_waits_seconds"], "out_of_order": disk["out_of_order"],
            "copy_wait_s": disk["copy_wait_seconds"]}


def _rounds(torch: Any, device: Any, group: Any, step: Any, bracket_read: tuple[Path, list[tuple[int, int]]],
            rounds: int, timed: int) -> tuple[list[float], list[float], dict[str, float]]:
    """(median step ms per round, bracketed read bandwidth per round, counters summed over the timed
    steps). A round's bandwidth is the mean of the sequential reads right before and right after it,
    each reading ``bracket_read``'s (file, spans): the bytes a step reads from the disk tier."""
    from benchmarks.disk import sequential_read
    from benchmarks.utils import median
    path, spans = bracket_read
    nbytes = sum(length for _, length in spans)

    def bracket() -> float:
        _wait_reader_idle(group.engine.reader)
        seconds, _ = sequential_read(path, spans=spans)
        return nbytes / seconds

    totals: dict[str, float] = {}
    reads, steps = [bracket()], []
    for _ in range(rounds):
        step()  # untimed: the ring was full after the bracketing read
        times = []
        for _ in range(timed):
            if device.type == "cuda":
                torch.cuda.synchronize()
            before, started = _counters(group), time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - started) * 1e3)
            after = _counters(group)
            for key in after:
                totals[key] = totals.get(key, 0.0) + after[key] - before[key]
        steps.append(median(times))
        reads.append(bracket())
    bandwidths = [(a + b) / 2 for a, b in zip(reads, reads[1:])]
    return steps, bandwidths, totals


def _stream_setup(config: dict[str, Any]) -> dict[str, Any]:
    """The resident reference (output and compute time), the H2D rate, and the offloaded model."""
    from safetensors.torch import load_file

    from benchmarks.workloads import DTYPE
    from fastoffload_ext import enable_layerwise_offload
    from fastoffload_ext.storage import DiskOptions
    torch, device, spec = _setup(config)
    path = Path(config["path"])
    resident = _meta_model(spec)
    resident.load_state_dict(load_file(str(path), device=str(device)), assign=True)
    torch.manual_seed(0)
    x = torch.randn(1, spec.tokens, spec.d, dtype=DTYPE, device=device)
    with torch.no_grad():
        expected = resident(x)
        compute_ms = _time_steps(torch, device, lambda: resident(x), 5 if config["quick"] else 10)
    del resident
    gc.collect()
    h2d = _h2d_bytes_per_s(torch, device)
    model = _meta_model(spec)
    blocks_bytes = _block_bytes(model) * spec.blocks
    # With a device budget share: the planner keeps what fits resident, knowing the disk tier (its probe).
    share = config.get("device_budget_share")
    budget = {} if share is None else {"device_budget": int(share * blocks_bytes) + STREAM_RESERVE,
                                       "activation_reserve": STREAM_RESERVE}
    group = enable_layerwise_offload(model, device=device, weights=path, host_budget=blocks_bytes // 2,
                                     disk_options=DiskOptions(staging_buffers=3), compress=config.get("compress", False),
                                     **budget)
    offloaded = sum(state.weight_bytes() for state in group.states)
    return {"torch": torch, "device": device, "path": path, "x": x, "expected": expected, "compute_ms": compute_ms,
            "h2d": h2d, "model": model, "group": group, "blocks_bytes": offloaded}


# The activation reserve of the stream row under a device budget (W4's activations are far below it).
STREAM_RESERVE = 1 << 30


def _stream(config: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.disk import evict
    from benchmarks.utils import median
    run = _stream_setup(config)
    torch, device, path, group, model, x = (run[k] for k in ("torch", "device", "path", "group", "model", "x"))
    disk_states = [s for s in group.states if s.on_disk]
    # Compressed: the disk tier reads each block's compressed region from the spill file instead.
    disk_bytes = sum(group.engine.codec_info(s.handle)["compressed_bytes"] or s.weight_bytes() for s in disk_states)
    files = [path] + ([Path(group.engine.spill_path)] if group.engine.spill_path else [])
    bracket_read = _disk_tier_spans(group, path, disk_states)
    try:
        with torch.no_grad():
            exact = bool(torch.equal(model(x), run["expected"]))
            # Reads through the page cache (O_DIRECT refused) would hit the cache from the second step on.
            buffered = group.engine.reader.stats()["buffered_bytes"] > 0

            def step() -> None:
                if buffered:
                    for f in files:
                        evict(f)
                model(x)
            timed = 1 if config["quick"] else 3
            steps, bandwidths, totals = _rounds(torch, device, group, step, bracket_read, ROUNDS, timed)
            # And a steady-state step after the timed ones: the first step's staging was filled before it ran, and
            # a read landing in a slot the compute still reads shows up only once the ring streams.
            if buffered:
                for f in files:
                    evict(f)
            exact_last = bool(torch.equal(model(x), run["expected"]))
    finally:
        if group.engine.spill_path:  # the child ends with os._exit, which removes nothing
            Path(group.engine.spill_path).unlink(missing_ok=True)
    h2d_ms = run["blocks_bytes"] / run["h2d"] * 1e3
    n_timed = ROUNDS * timed
    result: dict[str, Any] = {
        "disk_blocks": len(disk_states), "step_ms": median(steps), "step_ms_rounds": steps,
        "compute_ms": run["compute_ms"], "h2d_ms": h2d_ms, "exact": exact and exact_last, "exact_first": exact,
        "exact_last": exact_last, "disk_bytes_per_step": disk_bytes,
        "bytes_read_timed": totals["bytes"], "h2d_gb_s": run["h2d"] / 1e9, "evicted_each_step": buffered,
        "spill_bytes": group.engine.spill_bytes, "bw_gb_s": median(bandwidths) / 1e9,
        "bw_gb_s_rounds": [b / 1e9 for b in bandwidths],
        # Whether the disk was kept busy while the steps ran, and what the host thread waited for.
        "reader_idle": totals["idle"] / totals["wall"], "in_flight": totals["read"] / totals["wall"],
        "wait_ms": totals["wait_s"] * 1e3 / n_timed, "idle_in_waits_ms": totals["idle_waits_s"] * 1e3 / n_timed,
        "waits_per_step": totals["waits"] / n_timed, "out_of_order": totals["out_of_order"],
        # The share of the timed steps' reads that landed in place (O_DIRECT, no bounce copy).
        "in_place_share": totals["in_place"] / totals["bytes"] if totals["bytes"] else None,
        "copy_wait_ms": totals["copy_wait_s"] * 1e3 / n_timed}
    if config.get("compress"):
        result["note"] = (f"compress=True: disk blocks read {disk_bytes / 2**30:.3f} GiB/step from a "
                          f"{group.engine.spill_bytes / 2**30:.3f} GiB spill file")
    if group.plan is not None:
        plan = group.plan
        result.update(resident=len(plan.resident), pred_ms=plan.predicted_step_ms,
                      x_pred=median(steps) / plan.predicted_step_ms if plan.predicted_step_ms > 0 else None,
                      note=f"device_budget {config['device_budget_share']:.0%} of the blocks: {len(plan.resident)} "
                           f"resident, depth {plan.prefetch_depth}, planned with the disk read at "
                           f"{plan.costs.disk.read_gbps if plan.costs.disk else 0.0:.2f} GB/s")
    else:
        result["resident"] = 0
    result.update(_judge_stream(steps, bandwidths, disk_bytes, run["compute_ms"], h2d_ms))
    return result


def _disk_tier_spans(group: Any, path: Path, disk_states: list[Any]) -> tuple[Path, list[tuple[int, int]]]:
    """(file, spans) a step reads from the disk tier: the spill file when compressed, else the disk-tier
    blocks' tensors in the checkpoint (one checkpoint file: the benchmark writes a single one)."""
    from benchmarks.disk import merged_spans
    if group.engine.spill_path:
        spill = Path(group.engine.spill_path)
        return spill, [(0, spill.stat().st_size)]
    ranges = [(e.offset, e.nbytes) for s in disk_states for e in s.block.entries]
    return path, merged_spans(ranges, path.stat().st_size)


def _judge_stream(steps: list[float], bandwidths: list[float], disk_bytes: int, compute_ms: float,
                  h2d_ms: float) -> dict[str, Any]:
    """Each round against the bandwidth measured around it; the median round, and the spread over rounds."""
    from benchmarks.utils import median
    disk_ms = [disk_bytes / bw * 1e3 for bw in bandwidths]
    x_bound = [step / max(compute_ms, h2d_ms, d) for step, d in zip(steps, disk_ms)]
    ratios = [d / step for step, d in zip(steps, disk_ms)]
    result = {"disk_ms": median(disk_ms), "x_bound": median(x_bound), "x_bound_range": _range(x_bound),
              "step_ok": median(x_bound) <= 1.05, "stream_ratio": median(ratios), "stream_range": _range(ratios)}
    # The stream target applies when the disk is what sets the pace.
    result["stream_ok"] = result["stream_ratio"] >= 0.90 if median(disk_ms) >= max(compute_ms, h2d_ms) else None
    return result


def _range(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


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
