"""Section 8, ranks: several ranks of one host offloading the same model, with and without a shared host copy.

Configurations: 1 rank; 2 ranks each pinning its own copy (``share_host_copy=False``); 2 ranks sharing
one copy (``share_host_copy=True``); 2 ranks sharing one compressed copy (``compress=True`` too: the
owner encodes, every rank decodes the same bytes). Each runs under ``torch.distributed.run`` (torchrun) in
fresh processes: NCCL and one GPU per rank when the host has enough GPUs, gloo and the host device
(scaled-down workload) without a GPU; 2-rank rows on a 1-GPU host say why they were skipped.

Per configuration: the host copy's bytes on the node (the engine pools' reserved bytes, pinned on a GPU
host; a shared segment counted once), the node's proportional
set size (every rank's PSS summed: a page mapped by two ranks counts once), each rank's H2D GB/s from a
1 GiB pinned buffer while all ranks copy at once (one PCIe link each, or shared?), each rank's forward
time while all ranks run at once against the 1-rank run, and bit-equality with each rank's resident
model. The worker half of this file is what torchrun starts: ``python -m benchmarks.ranks``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.utils import GiB, Column, Context, Table, gbps, median, pss_bytes, rss_bytes

TITLE = "ranks: 1 and 2 ranks of one host, own host copy vs one shared host copy"

TABLES = {
    "ranks": Table(
        title="W1 (bf16) on every rank; node = all ranks of the host; GB/s and ms are per rank, all ranks at once",
        columns=[
            Column("ranks", "ranks"),
            Column("share", "host copy"),
            Column("node_host_gib", "node host copy GiB", ".2f"),
            Column("copies", "x model", ".2f"),
            Column("node_pss_gib", "node PSS GiB", ".2f"),
            Column("rank_rss_gib", "max rank RSS GiB", ".2f"),
            Column("h2d_gbps", "H2D GB/s per rank"),
            Column("forward_ms", "forward ms per rank"),
            Column("x_one_rank", "x 1 rank", ".3f"),
            Column("bit_equal", "bit-equal"),
        ],
    ),
}

CONFIGS = ((1, "own"), (2, "own"), (2, "shared"), (2, "shared+compress"))
LAUNCH_TIMEOUT_S = 300


def run(ctx: Context) -> None:
    ctx.progress.add(len(CONFIGS))
    gpus = torch.cuda.device_count() if ctx.cuda else 0
    one_rank_ms: list[float] = []
    for ranks, share in CONFIGS:
        labels = {"ranks": ranks, "share": share}
        if ctx.cuda and gpus < ranks:
            ctx.skip("ranks", labels, f"needs {ranks} GPUs on one host, this one has {gpus} "
                                      "(the nvidia-h200-x2 machine runs it)")
            continue

        def row(ranks: int = ranks, share: str = share) -> dict[str, Any]:
            result = launch(ranks, share, ctx.cuda, ctx.quick)
            if ranks == 1:
                one_rank_ms.extend(result["forward_ms"])
            result["x_one_rank"] = max(result["forward_ms"]) / one_rank_ms[0] if one_rank_ms else None
            for key in ("h2d_gbps", "forward_ms"):
                result[key] = " / ".join(f"{v:.2f}" for v in result[key]) if result[key] else None
            return result

        ctx.run_row("ranks", labels, row)


def launch(ranks: int, share: str, cuda: bool, quick: bool) -> dict[str, Any]:
    """Runs one configuration under torchrun and folds the ranks' reports into node figures."""
    with tempfile.TemporaryDirectory(prefix="fastoffload-ranks-") as tmp:
        report = Path(tmp) / "report.json"
        env = {**os.environ, "FASTOFFLOAD_RANKS_REPORT": str(report), "FASTOFFLOAD_RANKS_SHARE": share,
               "FASTOFFLOAD_RANKS_DEVICE": "cuda" if cuda else "cpu", "FASTOFFLOAD_RANKS_QUICK": "1" if quick else "0",
               "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   "-m", "benchmarks.ranks"]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
                              cwd=Path(__file__).resolve().parent.parent)
        if done.returncode != 0 or not report.exists():
            lines = (done.stdout + done.stderr).strip().splitlines()
            # The ranks' own exceptions, not torchrun's summary of them.
            errors = [line for line in lines if "Error" in line or "fastoffload:" in line][-6:] or lines[-12:]
            raise RuntimeError(f"torchrun with {ranks} rank(s) failed (rc {done.returncode}): " + " | ".join(errors))
        reports = json.loads(report.read_text())
    weight_bytes = reports[0]["weight_bytes"]
    # A shared segment is mapped (and pinned) by every rank, but it is one set of pages: count it at its owner.
    node_host = sum(r["host_reserved_bytes"] - r["shared_bytes"] + r["shared_owned_bytes"] for r in reports)
    node_pinned = sum(r["pinned_bytes"] - r["shared_bytes"] + r["shared_owned_bytes"] for r in reports) if cuda else 0
    return {
        "node_host_gib": node_host / GiB,
        "copies": node_host / weight_bytes if weight_bytes else None,
        "node_pinned_gib": node_pinned / GiB,
        "node_pss_gib": sum(r["pss_bytes"] for r in reports) / GiB,
        "rank_rss_gib": max(r["rss_bytes"] for r in reports) / GiB,
        "h2d_gbps": [r["h2d_gbps"] for r in reports if r["h2d_gbps"] is not None],
        "forward_ms": [r["forward_ms"] for r in reports],
        "bit_equal": all(r["bit_equal"] for r in reports),
        "per_rank": reports,
        "note": f"{reports[0]['workload']}, {reports[0]['weight_bytes'] / GiB:.2f} GiB of block weights; "
                f"shared by {max(r['shared_by'] for r in reports)} rank(s)" if share.startswith("shared") else
                f"{reports[0]['workload']}, {reports[0]['weight_bytes'] / GiB:.2f} GiB of block weights",
    }


# --------------------------------------------------------------------------------------------------
# Worker: one rank, started by torchrun
# --------------------------------------------------------------------------------------------------

def _h2d_gbps(device: torch.device, line_up: Callable[[], None]) -> float:
    """H2D GB/s of 1 GiB pinned -> device copies, all ranks at once: ``line_up`` (a barrier) runs once the buffers
    exist. Pinning 1 GiB takes a rank a varying fraction of a second, longer than its copies: lined up before it,
    one rank could be done copying before another started, and the figure would be a lone rank's."""
    from benchmarks.bandwidth import measure_copy_ms

    src = torch.empty(GiB, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(GiB, dtype=torch.uint8, device=device)
    line_up()
    return gbps(GiB, measure_copy_ms(dst, src, warmup=1, iters=5))


def worker() -> None:
    import torch.distributed as dist

    import fastoffload_ext as fo
    from benchmarks.workloads import move_non_block_modules, stack_workload

    cuda = os.environ["FASTOFFLOAD_RANKS_DEVICE"] == "cuda"
    share = os.environ["FASTOFFLOAD_RANKS_SHARE"].startswith("shared")
    compress = os.environ["FASTOFFLOAD_RANKS_SHARE"] == "shared+compress"
    quick = os.environ.get("FASTOFFLOAD_RANKS_QUICK") == "1"
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device("cuda", local_rank) if cuda else None)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    workload = stack_workload("W1", cpu=not cuda)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    model = workload.build_host()
    inputs = workload.make_inputs(device)[0]
    with torch.inference_mode():
        want = model.to(device)(*inputs).cpu()
    model.to("cpu")
    move_non_block_modules(model, device)
    fo.enable_layerwise_offload(model, device=device, share_host_copy=share, compress=compress)
    stats = fo.get_offload_group(model).stats()

    if cuda:
        h2d: float | None = _h2d_gbps(device, dist.barrier)
    else:
        dist.barrier()
        h2d = None
    iters = 5 if quick else 12
    with torch.inference_mode():
        equal = torch.equal(model(*inputs).cpu(), want)
        model(*inputs)
        sync()
        dist.barrier()
        times = []
        for _ in range(iters):
            started = time.perf_counter()
            model(*inputs)
            sync()
            times.append((time.perf_counter() - started) * 1e3)
        equal = equal and torch.equal(model(*inputs).cpu(), want)
    mine = {
        "rank": dist.get_rank(), "workload": workload.name, "weight_bytes": stats["weight_bytes"],
        "pinned_bytes": stats["pinned_bytes"], "host_reserved_bytes": stats["host_reserved_bytes"],
        "shared_bytes": stats["shared_bytes"],
        "shared_owned_bytes": stats["shared_owned_bytes"], "shared_by": stats["shared_by"],
        "rss_bytes": rss_bytes(), "pss_bytes": pss_bytes(),
        "h2d_gbps": h2d, "forward_ms": median(times), "bit_equal": equal,
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        Path(os.environ["FASTOFFLOAD_RANKS_REPORT"]).write_text(json.dumps(everyone))
    fo.disable_layerwise_offload(model)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker()
