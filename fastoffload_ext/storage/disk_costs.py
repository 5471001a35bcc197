"""The disk tier's figures for the planner, before enable reads anything.

With ``weights=`` and a budget the plan is made before the checkpoint is read. When the offloaded
blocks could exceed the host budget (every block offloaded, against the budget "auto" or given), the
planner gets a :class:`~fastoffload_ext.planning.costs.DiskCosts`: the host budget, the staging ring,
and the disk's read rate from a short probe: ``PROBE_BYTES`` of block tensors read with the reader
enable will use (its threads, request size and O_DIRECT mode) into memory faulted in beforehand. The
rate is kept per file system and read mode for the process. So each candidate resident set is scored
with the reads it would leave to the disk, and the planner keeps blocks resident rather than prefetch
deeper when that saves reads. Once enable has read the host tier, the plan is scored again with the
rate measured over those reads (``planning.replan.with_disk_tier``).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fastoffload_ext import _backend
from fastoffload_ext.planning.costs import DiskCosts
from fastoffload_ext.storage.checkpoint import Checkpoint, open_checkpoint
from fastoffload_ext.storage.options import DiskOptions
from fastoffload_ext.storage.source import CheckpointSource
from fastoffload_ext.storage.tiers import resolve_host_budget

logger = logging.getLogger(__name__)

__all__ = ["PROBE_BYTES", "planned_disk_costs", "probe_read_gbps"]

PROBE_BYTES = 128 << 20
_ALIGN = 4096
_PROBE_CACHE: dict[tuple[int, str], float] = {}  # (st_dev, read mode) -> GB/s


def planned_disk_costs(weights: Any, block_names: Sequence[str], blocks: nn.ModuleList, host_budget: object,
                       options: DiskOptions | None, device: torch.device) -> DiskCosts | None:
    """The disk tier the planner should count, or None when every block fits the host budget anyway.
    ``blocks`` in ring order, ``block_names`` each one's name in the model."""
    options = options if options is not None else DiskOptions()
    checkpoint = open_checkpoint(weights)
    everything = list(range(len(blocks)))
    sources, sizes = CheckpointSource._block_sources(checkpoint, block_names, blocks, everything)
    prefixes = tuple(f"{name}." for name in block_names)
    # What the build keeps in host memory beside the blocks (the rest of the model, on the host device),
    # and what the blocks hold there now: as the build counts them for "auto".
    other = sum(e.nbytes for name, e in checkpoint.entries.items() if not name.startswith(prefixes)) \
        if device.type == "cpu" else 0
    credit = sum(p.numel() * p.element_size() for block in blocks for p in block.parameters()
                 if p.device.type == "cpu")
    budget = resolve_host_budget(host_budget, other, credit)
    if budget.bytes is None or sum(sizes) <= budget.bytes:
        return None
    entries = [entry for source in sources for entry in source.entries]
    gbps = probe_read_gbps(checkpoint, entries, options)
    logger.info("fastoffload: the blocks may not all fit %s: planning with a disk tier read at %.2f GB/s (probe)",
                budget.source, gbps)
    return DiskCosts(read_gbps=gbps, host_budget=int(budget.bytes), staging_buffers=options.staging_buffers)


def probe_read_gbps(checkpoint: Checkpoint, entries: list[Any], options: DiskOptions) -> float:
    """The read rate (GB/s) of up to PROBE_BYTES of ``entries`` (block tensors, from the middle of the
    list on), as enable's reader reads them; cached per file system and read mode."""
    if not entries:
        return 0.0
    start = len(entries) // 2
    chosen, total = [], 0
    for entry in entries[start:] + entries[:start]:
        if total >= PROBE_BYTES:
            break
        chosen.append(entry)
        total += entry.nbytes
    path = chosen[0].path
    key = (os.stat(path).st_dev, options.read_mode)
    if key in _PROBE_CACHE:
        return _PROBE_CACHE[key]
    core = _backend.require_ext()
    reader = core.DiskReader(options.read_threads, options.chunk_bytes, options.read_mode)
    files = {p: reader.open(p) for p in sorted({e.path for e in chosen})}
    spans, offset = [], 0
    for entry in chosen:  # aligned, and never more than PROBE_BYTES in all (a tensor may be larger)
        begin = entry.offset // _ALIGN * _ALIGN
        end = min(checkpoint.file_sizes[entry.path], -(-(entry.offset + entry.nbytes) // _ALIGN) * _ALIGN,
                  begin + max(_ALIGN, PROBE_BYTES - offset))
        spans.append((files[entry.path], begin, end - begin, offset))
        offset += end - begin
    buffer = torch.zeros(offset, dtype=torch.uint8)  # faulted in: the clock times the reads alone
    started = time.perf_counter()
    reader.read(spans, buffer)
    seconds = time.perf_counter() - started
    gbps = offset / max(seconds, 1e-9) / 1e9
    _PROBE_CACHE[key] = gbps
    return gbps
