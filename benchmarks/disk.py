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
  is the bandwidth the other tables are measured against.
- startup: ``enable_layerwise_offload(meta model, weights=...)`` in a fresh process (all blocks in host
  memory, and half of them): peak RSS over the pre-enable base <= 1.10 x (pinned host bytes + staging +
  read buffers + what stays on the host), wall time <= 1.2 x bytes read / read bandwidth.
- stream: a model at twice its host budget, step time against max(compute, H2D of every offloaded block,
  disk-tier bytes / read bandwidth) (target <= 1.05 x), the disk-tier stream rate against the read
  bandwidth (target >= 0.90 when the step is disk-bound) and bit-exactness against the resident model.
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
                 Column("gb_s", "GB/s", ".2f"), Column("direct", "O_DIRECT")],
    ),
    "startup": Table(
        title="enable from a checkpoint on a meta model, fresh process",
        columns=[Column("workload", "workload"), Column("budget", "host budget"), Column("enable_s", "enable s", ".3f"),
                 Column("read_bound_s", "1.2 x bytes/bw s", ".3f"), Column("time_ok", "time ok"),
                 Column("rss_over_base_gib", "peak RSS-base GiB", ".3f"), Column("rss_bound_gib", "bound GiB", ".3f"),
                 Column("rss_ok", "RSS ok"), Column("direct_share", "O_DIRECT share", ".2f")],
    ),
    "stream": Table(
        title="disk tier at twice the host budget",
        columns=[Column("workload", "workload"), Column("disk_blocks", "disk blocks"), Column("step_ms", "step ms", ".2f"),
                 Column("compute_ms", "compute ms", ".2f"), Column("h2d_ms", "H2D ms", ".2f"),
                 Column("disk_ms", "disk ms", ".2f"), Column("x_bound", "x max(...)", ".3f"),
                 Column("step_ok", "<= 1.05"), Column("stream_ratio", "stream/bw", ".3f"),
                 Column("stream_ok", ">= 0.90"), Column("exact", "bit-exact")],
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


def _read_rows(ctx: Context, path: Path) -> float:
    """Fills the read table; returns the package reader's O_DIRECT bandwidth (bytes/s)."""
    import torch

    from fastoffload_ext._backend import require_ext
    core = require_ext()
    size = path.stat().st_size
    results: dict[str, float] = {}
    for mode in ("direct", "buffered"):
        def row(mode: str = mode) -> dict[str, Any]:
            reader = core.DiskReader(4, 8 << 20, "auto" if mode == "direct" else "buffered")
            file = reader.open(str(path))
            piece = 256 << 20
            dest = torch.empty(min(piece, size), dtype=torch.uint8)
            evict(path)
            started = time.perf_counter()
            for offset in range(0, size, piece):
                n = min(piece, size - offset)
                reader.read([(file, offset, n, 0)], dest)
            seconds = time.perf_counter() - started
            results[mode] = size / seconds
            return {"gib": size / GiB, "s": seconds, "gb_s": size / seconds / 1e9,
                    "direct": reader.stats()["direct_bytes"] == size}
        ctx.run_row("read", {"reader": f"fastoffload {mode}"}, row)
    import importlib.util
    if importlib.util.find_spec("kvikio") is None:
        ctx.skip("read", {"reader": "kvikio"}, "kvikio is not installed here (pip install kvikio-cu13 to compare)")
    else:
        ctx.run_row("read", {"reader": "kvikio"}, lambda: _kvikio_row(path, size))
    bandwidth = results.get("direct") or results.get("buffered") or 0.0
    ctx.meta("read_bandwidth", bandwidth)
    return bandwidth


def _kvikio_row(path: Path, size: int) -> dict[str, Any]:
    import torch
    import kvikio
    piece = 256 << 20
    cuda = torch.cuda.is_available()
    dest = torch.empty(min(piece, size), dtype=torch.uint8, device="cuda" if cuda else "cpu")
    evict(path)
    started = time.perf_counter()
    with kvikio.CuFile(str(path), "r") as handle:
        for offset in range(0, size, piece):
            n = min(piece, size - offset)
            handle.pread(dest[:n], n, offset).get()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    compat = getattr(getattr(kvikio, "defaults", None), "is_compat_mode_preferred", lambda: None)()
    return {"gib": size / GiB, "s": seconds, "gb_s": size / seconds / 1e9,
            "direct": f"{'into device memory' if cuda else 'into host memory'}, compat mode {compat}"}


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
    ctx.note(f"checkpoint {path} ({path.stat().st_size / GiB:.2f} GiB, file system {fs or 'unknown'}); "
             "page cache evicted before every measurement")
    bandwidth = _read_rows(ctx, path)
    if not bandwidth:
        ctx.note("no read bandwidth measured: the startup and stream targets cannot be judged")
    timeout = 300 if ctx.quick else 600
    for budget in ("all", "half"):
        config = {"mode": "startup", "path": str(path), "cuda": ctx.cuda, "quick": ctx.quick, "budget": budget,
                  "bandwidth": bandwidth}
        ctx.run_row("startup", {"workload": spec.name, "budget": budget}, lambda c=config: _spawn(c, timeout))
    for compress in (False, True):
        # compress=True: the disk tier streams the compressed blocks from a spill file next to the checkpoint.
        config = {"mode": "stream", "path": str(path), "cuda": ctx.cuda, "quick": ctx.quick, "bandwidth": bandwidth,
                  "compress": compress}
        labels = {"workload": spec.name} if not compress else {"workload": spec.name, "compress": True}
        ctx.run_row("stream", labels, lambda c=config: _spawn(c, timeout))


def _spawn(config: dict[str, Any], timeout: float) -> dict[str, Any]:
    return spawn_child("benchmarks.disk", config, timeout, RESULT_PREFIX)


if __name__ == "__main__":
    from benchmarks.disk_child import main_child
    sys.exit(main_child(sys.argv))
