"""How much memory this process may really use: the host (cgroup v2 and MemAvailable) and the device.

The host figure is the lower of the cgroup v2 headroom (``memory.max`` minus ``memory.current`` of this
process's cgroup) and ``MemAvailable`` (psutil), minus a margin. A container's limit is often far
below what ``/proc/meminfo`` shows, and going over it gets the process OOM-killed instead of refused;
where no cgroup file is readable (a v1 host, a sandbox) ``MemAvailable`` alone decides.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import psutil
import torch

logger = logging.getLogger(__name__)

CGROUP_ROOT = "/sys/fs/cgroup"
# Kept free for everything else the process allocates after enable (activations on a host device,
# the allocator's own slack, the page cache a checkpoint load needs).
HOST_MARGIN_FRACTION = 0.05
HOST_MARGIN_MIN_BYTES = 512 * 1024**2


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """What the host probe found; ``usable`` is what a budget may take."""

    mem_available: int
    cgroup_headroom: int | None  # None: no cgroup v2 limit readable
    cgroup_path: str | None
    margin: int

    @property
    def usable(self) -> int:
        limit = self.mem_available if self.cgroup_headroom is None else min(self.mem_available, self.cgroup_headroom)
        return max(0, limit - self.margin)

    def describe(self) -> str:
        cgroup = ("no cgroup v2 limit readable" if self.cgroup_headroom is None
                  else f"cgroup {self.cgroup_path} headroom {self.cgroup_headroom} B")
        return f"MemAvailable {self.mem_available} B, {cgroup}, margin {self.margin} B"


def _own_cgroup_dir(root: str) -> str | None:
    """This process's cgroup v2 directory (the ``0::/path`` line of /proc/self/cgroup), if it exists."""
    try:
        with open("/proc/self/cgroup") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            path = os.path.join(root, line[3:].lstrip("/"))
            return path if os.path.isdir(path) else None
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as handle:
            text = handle.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def cgroup_headroom(root: str = CGROUP_ROOT) -> tuple[int | None, str | None]:
    """(bytes the cgroup still allows, its directory), the tightest over this cgroup and its parents."""
    start = _own_cgroup_dir(root)
    candidates = [start] if start else []
    # Walk up to the root: a limit set on a parent binds as well.
    while candidates and os.path.abspath(candidates[-1]) != os.path.abspath(root):
        candidates.append(os.path.dirname(candidates[-1]))
    if os.path.abspath(root) not in map(os.path.abspath, candidates):
        candidates.append(root)
    best: tuple[int | None, str | None] = (None, None)
    for directory in candidates:
        limit = _read_int(os.path.join(directory, "memory.max"))
        if limit is None:
            continue
        used = _read_int(os.path.join(directory, "memory.current")) or 0
        headroom = max(0, limit - used)
        if best[0] is None or headroom < best[0]:
            best = (headroom, directory)
    return best


def probe_host(root: str = CGROUP_ROOT) -> HostMemory:
    available = int(psutil.virtual_memory().available)
    headroom, path = cgroup_headroom(root)
    limit = available if headroom is None else min(available, headroom)
    margin = max(HOST_MARGIN_MIN_BYTES, int(limit * HOST_MARGIN_FRACTION))
    return HostMemory(mem_available=available, cgroup_headroom=headroom, cgroup_path=path, margin=margin)


def device_free_bytes(device: torch.device) -> int:
    """Free memory on ``device`` now: ``cudaMemGetInfo``'s free plus what torch's allocator caches.

    With ``device="cpu"`` the host-as-device engine's "device" is host memory: the host probe.
    """
    if device.type == "cpu":
        return probe_host().usable
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(0, cached))


__all__ = ["HostMemory", "cgroup_headroom", "device_free_bytes", "probe_host"]
