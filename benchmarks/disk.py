"""Section disk: building from a checkpoint, and the disk tier, against the disk's measured bandwidth.

The checkpoint (random weights, bf16) is written in the run to ``$FASTOFFLOAD_BENCH_DISK_DIR`` (default:
``build/disk_bench`` under the repository, i.e. on the machine's disk, not a RAM-backed /tmp), and the
page cache must not flatter any figure: every reader runs with O_DIRECT where the file system allows it,
and every file is evicted from the page cache (``posix_fadvise(DONTNEED)``) before each measurement
anyway; the ``direct`` column says which reads bypassed the cache.

Tables:
- read: sequential read of the whole checkpoint by the package's reader (O_DIRECT; buffered after
  eviction) and, when ``kvikio`` is importable, by kvikio on the same file (into device memory when
  there is a GPU). The checkpoint is deleted at the end unless FASTOFFLOAD_BENCH_KEEP_CHECKPOINT is set. The reader's O_DIRECT figure
  is the bandwidth the other tables are measured against. Every reader reads 256 MiB pieces, two in
  flight (each into its own buffer; the package's reader lands them in place, O_DIRECT with no bounce
  copy, as the disk tier lands its blocks), so that its queue never runs dry between pieces: a checkpoint
  load queues its blocks back to back, and a bandwidth measured one piece at a time (the drain at
  each piece's end counted) would flatter the rows judged against it.
- startup: ``enable_layerwise_offload(meta model, weights=...)`` in a fresh process (all blocks in host
  memory, and half of them): peak RSS over the pre-enable base <= 1.10 x (pinned host bytes + staging +
  read buffers + what stays on the host), wall time <= 1.2 x bytes read / read bandwidth, where the
  bytes read ("GiB read") are exactly what enable must read: the host tier's blocks, every tensor
  outside the offloaded blocks and the safetensors headers. The disk-tier blocks are not read at enable:
  the staging ring's first fill is queued last and runs after enable returns, so it is not counted.
  Each budget runs STARTUP_REPEATS children; each is judged against the mean of the reader's sequential
  reads (of the checkpoint's first BRACKET_BYTES) right before and right after it, since a shared
  disk's speed drifts between minutes; the row is the median run ("x bound" = enable / bound), with the
  range of the runs. "x file bound" holds enable to 1.2 x the whole checkpoint's bytes / read bandwidth
  instead, the looser form: the same where every block is in host memory, far looser with a disk tier.
  "reader idle s" is the wall time from the reader's creation (early in enable) to the end with no
  read request in flight, "reads in flight" their mean over that time (worst-RSS run).
  What the bound leaves out and enable still does: parsing the headers' JSON and checking them against
  the model, making the reader, pinning the host tier's regions and the staging ring, registering the
  blocks; so the row also says where the time went (run at the median enable time; every run's figures
  in the JSON, "phases_ms" and "timeline_ms"): "head ms" from enable's start to the first read request,
  "reads x read/bw" the host tier's read window against its bytes at the bandwidth (above 1: the disk
  was not kept busy, e.g. reads waiting for pins), "tail ms" from the last read's end to enable's
  return, and in the note the build's phases (``CheckpointSource.phases``) and the deferred pins' cost.
- stream: a model at twice its host budget (and once more under a device budget of half its blocks,
  where the planner keeps blocks resident knowing the disk tier: "plan ms" its prediction, "x plan"
  the step against it), step time against max(compute, H2D of every offloaded block,
  disk-tier bytes / read bandwidth) (target <= 1.05 x), the disk-tier stream rate against the read
  bandwidth (target >= 0.90 when the step is disk-bound) and bit-exactness against the resident model (the
  first step and one after the timed ones).
  The steps run in rounds, each bracketed by sequential reads of the bytes a step reads from the disk
  tier (the disk-tier blocks' tensors in the checkpoint, or the spill file when compressed: the same
  place on the disk, with the same reader settings) and judged against their mean ("bw"): the median
  round, with the range over rounds. The note also judges the row against the read table's O_DIRECT
  figure, measured once at the section's start. What explains a miss: "reader idle" (share of the timed
  steps with no read request in flight), "reads in flight" (their mean), "host wait ms" (per step, the
  thread that enqueues compute waiting for disk reads), "in place" (the share of the reads that landed
  straight in their staging buffer, O_DIRECT with no bounce copy) and "idle in waits ms" (the reader idle while
  the host waited: the pipeline's own fault; 0 means the disk was busy whenever the step waited on
  it, so a low stream/bw is the disk's speed, not the pipeline).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.utils import Column, Context, GiB, Table, spawn_child

TITLE = "disk: start-up from a checkpoint and the disk tier, against the disk's read bandwidth"

TABLES = {
    "read": Table(
        title="sequential read of the checkpoint (page cache evicted first)",
        columns=[Column("reader", "reader"), Column("gib", "GiB", ".2f"), Column("s", "s", ".3f"),
                 Column("gb_s", "GB/s", ".2f"), Column("threads", "threads"), Column("request_mib", "request MiB"),
                 Column("direct", "O_DIRECT / path")],
    ),
    "startup": Table(
        title="enable from a checkpoint on a meta model, fresh process",
        columns=[Column("workload", "workload"), Column("budget", "host budget"), Column("enable_s", "enable s", ".3f"),
                 Column("enable_range", "enable s range"),
                 Column("read_gib", "GiB read", ".3f"), Column("bw_gb_s", "bw GB/s", ".2f"),
                 Column("read_bound_s", "1.2 x read/bw s", ".3f"), Column("x_read_bound", "x bound", ".3f"),
                 Column("time_ok", "time ok"), Column("x_file_bound", "x file bound", ".3f"),
                 Column("rss_over_base_gib", "peak RSS-base GiB", ".3f"), Column("rss_bound_gib", "bound GiB", ".3f"),
                 Column("rss_ok", "RSS ok"), Column("direct_share", "O_DIRECT share", ".2f"),
                 Column("reader_idle_s", "reader idle s", ".3f"), Column("in_flight", "reads in flight", ".2f"),
                 Column("head_ms", "head ms", ".1f"), Column("reads_x", "reads x read/bw", ".3f"),
                 Column("tail_ms", "tail ms", ".1f")],
    ),
    "stream": Table(
        title="disk tier at twice the host budget",
        columns=[Column("workload", "workload"), Column("resident", "resident"), Column("disk_blocks", "disk blocks"),
                 Column("step_ms", "step ms", ".2f"), Column("pred_ms", "plan ms", ".1f"), Column("x_pred", "x plan", ".3f"),
                 Column("compute_ms", "compute ms", ".2f"), Column("h2d_ms", "H2D ms", ".2f"),
                 Column("bw_gb_s", "bw GB/s", ".2f"), Column("disk_ms", "disk ms", ".2f"),
                 Column("x_bound", "x max(...)", ".3f"), Column("x_bound_range", "x range"),
                 Column("step_ok", "<= 1.05"), Column("stream_ratio", "stream/bw", ".3f"),
                 Column("stream_range", "stream range"), Column("stream_ok", ">= 0.90"),
                 Column("reader_idle", "reader idle", ".3f"), Column("in_flight", "reads in flight", ".2f"),
                 Column("in_place_share", "in place", ".2f"), Column("wait_ms", "host wait ms", ".1f"),
                 Column("idle_in_waits_ms", "idle in waits ms", ".1f"),
                 Column("exact", "bit-exact")],
    ),
}

RESULT_PREFIX = "DISK_RESULT "


def _spec(cuda: bool, quick: bool):
    from benchmarks.workloads import WORKLOADS, StackSpec
    if cuda:
        return WORKLOADS["W4" if quick else "W1"]
    d = 512 if quick else 768
    return StackSpec(f"W1-cpu-{d}", d=d, blocks=16, tokens=32, n_norms=4, character="W1 shape, host-sized")


def checkpoint_dir() -> Path:
    default = Path(__file__).resolve().parent.parent / "build" / "disk_bench"
    folder = Path(os.environ.get("FASTOFFLOAD_BENCH_DISK_DIR", default))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def evict(path: Path) -> None:
    """Drops ``path`` from the page cache, so that a buffered read goes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write_checkpoint(spec: Any, cuda: bool) -> Path:
    import torch
    from safetensors.torch import save_file

    from benchmarks.workloads import build_stack_on_host
    path = checkpoint_dir() / f"{spec.name}.safetensors"
    if not path.exists():  # kept from an earlier run with FASTOFFLOAD_BENCH_KEEP_CHECKPOINT=1
        model = build_stack_on_host(spec, seed=3, init_device="cuda" if cuda else "cpu")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path) + ".part")
        os.replace(str(path) + ".part", path)
        del model
        torch.cuda.empty_cache() if cuda else None
    evict(path)
    return path


PIECE = 256 << 20  # every reader below reads the file in pieces of this size
# Pieces in flight at once, each into a buffer of its own: one piece at a time would let the reader's
# queue run dry at the end of every piece, which a checkpoint load (its blocks queued back to back)
# never does, and the figure would flatter the start-up rows judged against it.
PIECES_IN_FLIGHT = 2


# The reads that bracket each startup child: the start of the checkpoint, enough to see the disk's speed
# of the moment at a fraction of a whole read's cost. A stream round is bracketed by reads of the very
# bytes its steps read (benchmarks.disk_child), so that the pattern and the place on the disk match.
BRACKET_BYTES = 512 << 20
ALIGN = 4096  # spans are widened to this, the O_DIRECT alignment of every file system here


def sequential_read(path: Path, mode: str = "direct", limit: int | None = None,
                    spans: list[tuple[int, int]] | None = None) -> tuple[float, bool]:
    """(seconds, every byte read with O_DIRECT) for the package's reader reading ``path`` in order (its
    first ``limit`` bytes, or the (offset, length) ``spans``, when given), after evicting it from the
    page cache, PIECES_IN_FLIGHT pieces at a time. mode: "direct" (O_DIRECT where allowed) or
    "buffered"."""
    import threading

    from fastoffload_ext._backend import require_ext
    file_size = path.stat().st_size
    if spans is None:
        spans = [(0, file_size if limit is None else min(limit, file_size))]
    pieces = [(offset, min(PIECE, start + length - offset)) for start, length in spans
              for offset in range(start, start + length, PIECE)]
    size = sum(length for _, length in pieces)
    reader = require_ext().DiskReader(READ_THREADS, CHUNK_BYTES, "auto" if mode == "direct" else "buffered")
    file = reader.open(str(path))
    lanes = min(PIECES_IN_FLIGHT, len(pieces))
    # Zero-filled, so every page is faulted in before the clock starts: reading into fresh pages would
    # time their faults too (a quarter of the figure on these machines), which no engine read pays (its
    # destinations are pinned), and the bandwidth every row is judged against would read low.
    # Page-aligned, with a page to spare, and read as scratch: each piece lands in place with O_DIRECT
    # (no bounce copy), the reader's fastest way, as the disk tier reads its blocks.
    buffers = [_page_aligned(max(length for _, length in pieces) + ALIGN) for _ in range(lanes)]
    errors: list[BaseException] = []

    def lane(k: int) -> None:  # pieces k, k + lanes, ... into buffer k (read() releases the GIL)
        try:
            for offset, length in pieces[k::lanes]:
                reader.read([(file, offset, length, 0)], buffers[k], scratch=True)
        except BaseException as error:  # re-raised on the caller's thread below
            errors.append(error)

    evict(path)
    started = time.perf_counter()
    threads = [threading.Thread(target=lane, args=(k,)) for k in range(lanes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    if errors:
        raise errors[0]
    return seconds, reader.stats()["direct_bytes"] == size


def _page_aligned(nbytes: int) -> Any:
    """A zero-filled uint8 CPU tensor of ``nbytes`` that starts on an ALIGN boundary."""
    import torch
    backing = torch.zeros(nbytes + ALIGN, dtype=torch.uint8)
    start = (-backing.data_ptr()) % ALIGN
    return backing[start:start + nbytes]


def merged_spans(ranges: list[tuple[int, int]], file_size: int) -> list[tuple[int, int]]:
    """(offset, length) ranges widened to ALIGN (within ``file_size``), sorted, overlaps merged."""
    spans: list[tuple[int, int]] = []
    for offset, length in sorted(ranges):
        start, end = offset // ALIGN * ALIGN, min(file_size, -(-(offset + length) // ALIGN) * ALIGN)
        if spans and start <= spans[-1][0] + spans[-1][1]:
            spans[-1] = (spans[-1][0], max(end, spans[-1][0] + spans[-1][1]) - spans[-1][0])
        else:
            spans.append((start, end - start))
    return spans


def _read_rows(ctx: Context, path: Path) -> float:
    """Fills the read table; returns the package reader's O_DIRECT bandwidth (bytes/s), kept in the
    results' metadata."""
    size = path.stat().st_size
    results: dict[str, float] = {}
    for mode in ("direct", "buffered"):
        def row(mode: str = mode) -> dict[str, Any]:
            seconds, direct = sequential_read(path, mode)
            results[mode] = size / seconds
            return {"gib": size / GiB, "s": seconds, "gb_s": size / seconds / 1e9, "direct": direct,
                    "threads": READ_THREADS, "request_mib": CHUNK_BYTES >> 20}
        ctx.run_row("read", {"reader": f"fastoffload {mode}"}, row)
    _kvikio_rows(ctx, path, size)
    bandwidth = results.get("direct") or results.get("buffered") or 0.0
    ctx.meta("read_bandwidth", bandwidth)
    return bandwidth


# Our reader's defaults (storage.DiskOptions); kvikio is run with the same thread count and request size.
READ_THREADS = 4
CHUNK_BYTES = 8 << 20


def _kvikio_setting(kvikio: Any, name: str, value: Any = None) -> Any:
    """kvikio.defaults' ``name`` (set to ``value`` first when given), across its old and new APIs."""
    defaults = kvikio.defaults
    if value is not None:
        if hasattr(defaults, "set"):  # newer releases: one setter for every property
            defaults.set(name, value)
        else:
            getattr(defaults, f"set_{name}" if hasattr(defaults, f"set_{name}") else f"{name}_reset")(value)
    if hasattr(defaults, "get"):
        return defaults.get(name)
    getter = getattr(defaults, name, None) or getattr(defaults, f"get_{name}")
    return getter()


def _kvikio_rows(ctx: Context, path: Path, size: int) -> None:
    """kvikio's POSIX path on the same file: into a pinned host buffer, and into device memory."""
    try:
        import kvikio
        import kvikio.defaults  # noqa: F401 - the settings below
    except Exception as error:  # ImportError, or OSError from a driver library it cannot load
        ctx.skip("read", {"reader": "kvikio"}, f"kvikio not importable: {type(error).__name__}: {error}")
        return
    import torch
    cuda = torch.cuda.is_available()
    targets = ["pinned host"] + (["device"] if cuda else [])
    for target in targets:
        ctx.run_row("read", {"reader": f"kvikio -> {target}"}, lambda t=target: _kvikio_row(kvikio, path, size, t))
    if not cuda:
        ctx.skip("read", {"reader": "kvikio -> device"}, "no CUDA device")


def _kvikio_buffer(torch: Any, n: int, target: str) -> tuple[Any, Any]:
    """(the tensor, what kvikio is handed): a torch CUDA tensor through __cuda_array_interface__, a
    pinned host tensor as a NumPy view of the same memory."""
    if target == "device":
        tensor = torch.empty(n, dtype=torch.uint8, device="cuda")
        return tensor, tensor
    tensor = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    return tensor, tensor.numpy()


def _kvikio_row(kvikio: Any, path: Path, size: int, target: str) -> dict[str, Any]:
    import torch
    threads = _kvikio_setting(kvikio, "num_threads", READ_THREADS)
    task = _kvikio_setting(kvikio, "task_size", CHUNK_BYTES)
    compat = _kvikio_setting(kvikio, "compat_mode")
    lanes = min(PIECES_IN_FLIGHT, -(-size // PIECE))  # as many pieces in flight as our reader has
    made = [_kvikio_buffer(torch, min(PIECE, size), target) for _ in range(lanes)]
    tensors, buffers = [t for t, _ in made], [b for _, b in made]
    if target == "device":
        try:
            with kvikio.CuFile(str(path), "r") as handle:
                handle.pread(buffers[0], 4096, 0).get()
        except (TypeError, ValueError) as error:
            import cupy  # the GPU machine has it; a torch tensor refused is read through cupy's view of it
            buffers = [cupy.asarray(tensor) for tensor in tensors]
            path_note = f"torch tensor refused ({error}); cupy view"
        else:
            path_note = "torch tensor via __cuda_array_interface__"
    else:
        path_note = "NumPy view of a pinned torch tensor" if torch.cuda.is_available() else "NumPy view (unpinned)"
    evict(path)
    started = time.perf_counter()
    with kvikio.CuFile(str(path), "r") as handle:
        pending: list[Any] = []
        for i, offset in enumerate(range(0, size, PIECE)):
            if len(pending) == lanes:
                pending.pop(0).get()  # the piece that used this buffer
            n = min(PIECE, size - offset)
            pending.append(handle.pread(buffers[i % lanes][:n], n, offset))
        for future in pending:
            future.get()
    if target == "device":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {"gib": size / GiB, "s": seconds, "gb_s": size / seconds / 1e9,
            "direct": f"compat_mode {compat}; {path_note}", "threads": threads, "request_mib": int(task) >> 20}


def run(ctx: Context) -> None:
    spec = _spec(ctx.cuda, ctx.quick)
    ctx.progress.add(6)
    path = _write_checkpoint(spec, ctx.cuda)
    try:
        _measure(ctx, spec, path)
    finally:
        if not os.environ.get("FASTOFFLOAD_BENCH_KEEP_CHECKPOINT"):
            path.unlink(missing_ok=True)  # several GiB on a GPU machine's small disk


def _measure(ctx: Context, spec: Any, path: Path) -> None:
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True).stdout.strip()
    # Relative where it can be: the results go into docs, which name nothing outside the repository.
    shown = os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd().resolve()) else path.name
    ctx.note(f"checkpoint {shown} ({path.stat().st_size / GiB:.2f} GiB, file system {fs or 'unknown'}); "
             "page cache evicted before every measurement")
    read_bandwidth = _read_rows(ctx, path)  # the startup and stream rows also measure it around themselves
    timeout = 300 if ctx.quick else 600
    for budget in ("all", "half"):
        config = {"mode": "startup", "path": str(path), "cuda": ctx.cuda, "quick": ctx.quick, "budget": budget}
        ctx.run_row("startup", {"workload": spec.name, "budget": budget},
                    lambda c=config: _startup_row(c, path, timeout))
    ctx.note("startup 'GiB read' = host-tier blocks + tensors outside the offloaded blocks + safetensors headers; "
             "the disk-tier blocks (budget 'half') are not read at enable: their first staging fill is queued "
             "after the host tier and runs once enable has returned")
    ctx.note("startup bound = 1.2 x 'GiB read' / the bracketing reads' bandwidth (two 256 MiB pieces in flight): it "
             "budgets reads only; what enable does besides (header parsing, model checks, pinning the host tier and "
             "the staging ring, registering blocks) must hide behind the reads or fit in the 20 %. 'head ms' (before "
             "the first read), 'reads x read/bw' (the read window against the bandwidth) and 'tail ms' (after the "
             "last read) say where it did not; the note has the phases and the pins' populate/register split")
    # compress=True: the disk tier streams the compressed blocks from a spill file next to the checkpoint.
    # device_budget_share: the planner keeps blocks resident within it, the disk tier in its table.
    for extra in ({}, {"compress": True}, {"device_budget_share": 0.5}):
        config = {"mode": "stream", "path": str(path), "cuda": ctx.cuda, "quick": ctx.quick, "compress": False,
                  **extra}
        ctx.run_row("stream", {"workload": spec.name, **extra}, lambda c=config: _stream_row(c, timeout, read_bandwidth))


# Start-up children per budget, and the stream child's rounds (benchmarks.disk_child.ROUNDS): the
# disk's speed drifts between minutes, so a row is the median of its repeats, with their spread. Three,
# so that the median is one run and not the mean of two (one slow run of two decided a row on the H200).
STARTUP_REPEATS = 3


def _startup_row(config: dict[str, Any], path: Path, timeout: float) -> dict[str, Any]:
    """STARTUP_REPEATS start-up children, each judged against the mean of the sequential reads right
    before and right after it (consecutive children share one); the median run, and the spread."""
    from benchmarks.utils import median
    size = min(BRACKET_BYTES, path.stat().st_size)
    reads = [size / sequential_read(path, limit=BRACKET_BYTES)[0]]
    runs = []
    for _ in range(STARTUP_REPEATS):
        result = _spawn(config, timeout)
        reads.append(size / sequential_read(path, limit=BRACKET_BYTES)[0])
        result["bandwidth"] = (reads[-2] + reads[-1]) / 2
        runs.append(result)
    enable = [r["enable_s"] for r in runs]
    bounds = [1.2 * r["bytes_read"] / r["bandwidth"] for r in runs]
    ratios = [e / b for e, b in zip(enable, bounds)]
    # The looser bound, over the whole file instead of what enable reads: the two agree when every block
    # is in host memory; with a disk tier the strict one holds enable's fixed costs to a smaller read.
    file_ratios = [e / (1.2 * path.stat().st_size / r["bandwidth"]) for e, r in zip(enable, runs)]
    worst = max(runs, key=lambda r: r["rss_over_base_gib"] / r["rss_bound_gib"])
    row = dict(worst)  # byte counts are the same in every run; RSS is judged on the worst one
    row.update(enable_s=median(enable), enable_range=_range(enable), enable_s_runs=enable, read_bound_s=median(bounds),
               x_read_bound=median(ratios), time_ok=median(ratios) <= 1.0, x_file_bound=median(file_ratios),
               bw_gb_s=median([r["bandwidth"] for r in runs]) / 1e9, bw_gb_s_reads=[b / 1e9 for b in reads],
               rss_ok=all(r["rss_ok"] for r in runs))
    row.update(phase_summary(runs))
    return row


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def phase_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-phase figures of the run at the (lower) median enable time, for the row, its note and the
    JSON: "head ms" (enable's start to the first read request), "reads x read/bw" (the host tier's read
    window against its bytes at the bandwidth measured around that run: above 1, the disk was not kept
    busy), "tail ms" (the last read's end to enable's return); every run's phases go to the JSON."""
    ordered = sorted((r for r in runs if "phases_ms" in r), key=lambda r: r["enable_s"])
    if not ordered:
        return {}
    run = ordered[(len(ordered) - 1) // 2]
    timeline, phases, pins = run["timeline_ms"], run["phases_ms"], run["pins"]
    ideal_ms = run["reader_bytes_at_start"] / run["bandwidth"] * 1e3
    reads_x = timeline["reads"] / ideal_ms if timeline["reads"] is not None and ideal_ms > 0 else None
    shown = ", ".join(f"{name} {ms:.1f}" for name, ms in phases.items() if ms >= 0.05 or name == "other")
    note = (f"phases ms (median run): {shown}; host-tier reads {_ms(timeline['reads'])} ms against "
            f"{ideal_ms:.1f} ms at bw, head {_ms(timeline['head'])}, tail {_ms(timeline['tail'])}; "
            f"{pins['count']} deferred pins: populate {pins['populate_ms']:.1f} + register {pins['register_ms']:.1f} ms "
            "(summed over threads)")
    return {"head_ms": timeline["head"], "tail_ms": timeline["tail"], "reads_x": reads_x, "reads_ideal_ms": ideal_ms,
            "phases_ms": phases, "timeline_ms": timeline, "pins": pins, "note": note,
            "phases_ms_runs": [r.get("phases_ms") for r in runs], "timeline_ms_runs": [r.get("timeline_ms") for r in runs]}


def _range(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def _stream_row(config: dict[str, Any], timeout: float, read_bandwidth: float) -> dict[str, Any]:
    """The stream child's row, with the note judging it against the read table's bandwidth too."""
    result = _spawn(config, timeout)
    if read_bandwidth > 0 and result.get("step_ms"):
        disk_ms = result["disk_bytes_per_step"] / read_bandwidth * 1e3
        bound = max(result["compute_ms"], result["h2d_ms"], disk_ms)
        against = (f"against the read table's {read_bandwidth / 1e9:.2f} GB/s: x max(...) "
                   f"{result['step_ms'] / bound:.3f}, stream/bw {disk_ms / result['step_ms']:.3f}")
        result["note"] = f"{result['note']}; {against}" if result.get("note") else against
    return result


def _spawn(config: dict[str, Any], timeout: float) -> dict[str, Any]:
    return spawn_child("benchmarks.disk", config, timeout, RESULT_PREFIX)


if __name__ == "__main__":
    from benchmarks.disk_child import main_child
    sys.exit(main_child(sys.argv))
