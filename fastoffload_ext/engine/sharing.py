"""Ranks of one host share one host copy of the offloaded weights.

Why: under ``torchrun`` every rank holds the whole transformer and offloads it layerwise, and each rank
used to pin its own full copy: an 8-GPU node with a 60 GiB DiT needed 480 GiB of locked RAM. With
``enable_layerwise_offload(..., share_host_copy=...)`` one process per host (the *owner*: the lowest
global rank of that host) packs each block once into a POSIX shared-memory segment; the other ranks of
the host map the same pages (no copy) and register them with CUDA themselves. Every rank keeps its own
device slots, streams and events, so only host memory is shared.

This module does the coordination, and only that: who owns, the segment names, the barriers and the
unlinking. The mechanics (shm_open, mmap, pinning) are in ``csrc/shared_segment.cpp`` and the pool.

The protocol, three ``all_gather_object`` calls over the process group:

1. ``negotiate``: every rank sends (hostname, pid, rank, a random token, and for each offloaded block the
   name, dtype, shape and stride of each parameter plus a sampled fingerprint of its values). From that
   every rank computes the same verdict with no further message: share, do not share ("auto" and a
   mismatch), or raise (``True`` and a mismatch; the rank that differs names the first differing
   parameter, the others name that rank). The owner then sweeps ``/dev/shm`` of segments whose owner
   pid is dead (left by a kill -9 during an earlier enable).
2. The owner packs block *i* into ``/fastoffload-<owner pid>-<token>-<i>``; then "owner packed".
3. The other ranks map the segments; then "all attached". The owner unlinks every name right after:
   the mappings stay valid, the names are gone, so a crash or kill -9 of any rank from here on leaves
   nothing behind in /dev/shm (the kernel frees the pages with the last mapping).

Steps 2 and 3 carry each rank's status, so a failure on any rank (a layout the owner did not expect,
/dev/shm full, Ctrl-C) makes every rank roll back and raise instead of waiting for a peer that gave up;
the owner unlinks on that path too, in an ``atexit`` handler, and in the C++ segment's destructor.

Contract and limits:
- ``enable_layerwise_offload`` is then a collective: every rank of the group must call it, in the same
  order, with the same model (same parameter names, dtypes, shapes, strides and values). With NCCL the
  object collectives use the current CUDA device: call ``torch.cuda.set_device(local_rank)`` first, as
  torchrun scripts do.
- ``mutate_params_scope`` is refused on a shared block (``SHARED_MUTATION_ERROR``): a LoRA merged by one
  rank would change the weights of every rank of the host under them. Merge before enabling offload,
  or enable with ``share_host_copy=False``.
- Ranks are grouped by hostname. Containers that share a hostname but not /dev/shm are not supported.
- A rank that dies *during* enable leaves the others waiting in the collective until the process
  group's timeout; if it was the owner, its segments stay until the next owner start sweeps them.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import os
import secrets
import socket
from typing import Any

import torch
from torch import nn

from fastoffload_ext.engine.messages import SHARED_MUTATION_ERROR
from fastoffload_ext.errors import OffloadConfigError

logger = logging.getLogger(__name__)

# Values sampled per parameter for the fingerprint: enough to tell different seeds, tensor-parallel shards
# or a per-rank adapter apart, cheap enough for thousands of parameters.
FINGERPRINT_SAMPLES = 64

# Owner prefixes whose names may still be linked; unlinked at interpreter exit whatever happened.
_PENDING: dict[str, int] = {}


def _unlink_pending(prefix: str | None = None) -> None:
    """Unlinks the names under ``prefix`` (default: every pending prefix); missing names are fine."""
    from fastoffload_ext import _backend

    core = _backend._C
    for pending in [prefix] if prefix is not None else list(_PENDING):
        for index in range(_PENDING.pop(pending, 0)):
            if core is not None:
                core.unlink_shared_segment(f"{pending}-{index}")


atexit.register(_unlink_pending)


def _fingerprint(tensor: torch.Tensor) -> str:
    """A digest of up to FINGERPRINT_SAMPLES evenly spaced values (their raw bytes)."""
    flat = tensor.detach().reshape(-1)
    count = flat.numel()
    if count == 0:
        return ""
    samples = min(count, FINGERPRINT_SAMPLES)
    # Integer arithmetic: a float linspace rounds count - 1 up past the end once count exceeds 2**24.
    index = torch.arange(samples, device=flat.device, dtype=torch.int64) * (count - 1) // max(samples - 1, 1)
    sample = flat[index].cpu().contiguous().view(torch.uint8)
    return hashlib.blake2b(sample.numpy().tobytes(), digest_size=8).hexdigest()


def block_signature(block: nn.Module) -> list[tuple[str, str, tuple[int, ...], tuple[int, ...], str]]:
    """(name, dtype, shape, stride, fingerprint) of each parameter: what the packed layout depends on."""
    return [(name, str(p.dtype), tuple(p.shape), tuple(p.stride()), _fingerprint(p))
            for name, p in block.named_parameters()]


def _shm_free_bytes() -> int | None:
    """Bytes an unprivileged process may still write to /dev/shm; None where it cannot be read."""
    try:
        info = os.statvfs("/dev/shm")
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def _packed_bytes_bound(blocks: list[nn.Module]) -> int:
    """An upper bound of the shared segments' size: every parameter, each padded to a page."""
    return sum(p.numel() * p.element_size() + 4096 for block in blocks for p in block.parameters())


def _first_difference(mine: list[Any], owners: list[Any], list_name: str, first_index: int, rank: int) -> str | None:
    """The first way ``mine`` differs from the owner's signature, naming the parameter; None if equal.

    Signatures number the offloaded blocks from 0; parameters are named by their index in the block
    list (``first_index`` is the number of resident blocks before them).
    """
    if len(mine) != len(owners):
        return f"{len(mine)} offloaded blocks on rank {rank} but {len(owners)} on the owner"
    for index, (block, owner_block) in enumerate(zip(mine, owners)):
        prefix = f"{list_name}.{first_index + index}."
        names = [entry[0] for entry in block]
        owner_names = [entry[0] for entry in owner_block]
        if names != owner_names:
            extra = [n for n in names if n not in owner_names]
            missing = [n for n in owner_names if n not in names]
            first = next((a for a, b in zip(names, owner_names) if a != b), None)
            detail = (f"parameter '{prefix}{extra[0]}' of rank {rank} is not on the owner" if extra
                      else f"parameter '{prefix}{missing[0]}' is missing on rank {rank}" if missing
                      else f"parameter '{prefix}{first}' comes in a different order")
            return detail
        for (name, dtype, shape, stride, digest), (_, o_dtype, o_shape, o_stride, o_digest) in zip(block, owner_block):
            if (dtype, shape, stride) != (o_dtype, o_shape, o_stride):
                return (f"parameter '{prefix}{name}' is {dtype} of shape {list(shape)}, stride {list(stride)} on rank "
                        f"{rank} but "
                        f"{o_dtype} of shape {list(o_shape)}, stride {list(o_stride)} on the owner")
            if digest != o_digest:
                return (f"parameter '{prefix}{name}' holds different values on rank {rank} than on the owner (tensor-parallel "
                        "shards, a different seed or checkpoint, or a per-rank adapter cannot share one host copy)")
    return None


class HostShare:
    """One enable's share of a host copy, seen from one rank (made by ``negotiate``)."""

    def __init__(self, group: Any, rank: int, owner_rank: int, local_ranks: list[int], prefix: str,
                 num_blocks: int) -> None:
        self.group = group
        self.rank = rank
        self.owner_rank = owner_rank
        self.local_ranks = local_ranks
        self.prefix = prefix  # "/fastoffload-<owner pid>-<token>"
        self.num_blocks = num_blocks
        self.pool: Any = None
        self._packed: bool | None = None    # step 2 done: did it succeed everywhere?
        self._attached: bool | None = None  # step 3 done

    @property
    def owner(self) -> bool:
        return self.rank == self.owner_rank

    @property
    def shared_by(self) -> int:
        """How many ranks of this host map the copy."""
        return len(self.local_ranks)

    def segment_name(self, index: int) -> str:
        return f"{self.prefix}-{index}"

    def _statuses(self, error: BaseException | None) -> list[str]:
        import torch.distributed as dist

        mine = None if error is None else f"rank {self.rank}: {type(error).__name__}: {error}"
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        return [status for status in gathered if status is not None]

    def before_attach(self) -> None:
        """Non-owners: wait until every owner has packed its blocks (step 2). Owners: nothing yet."""
        if self.owner:
            return
        failures = self._statuses(None)
        self._packed = not failures
        if failures:
            raise RuntimeError("fastoffload: sharing the host copy failed on another rank, so this rank did not "
                               "attach: " + "; ".join(failures))

    def after_attach(self) -> None:
        """Owners: report packing (step 2). All: report attaching (step 3); the owner unlinks the names."""
        if self.owner:
            failures = self._statuses(None)
            self._packed = not failures
            if failures:
                raise RuntimeError("fastoffload: sharing the host copy failed on another rank while packing: "
                                   + "; ".join(failures))
        failures = self._statuses(None)
        self._attached = not failures
        self._unlink()
        if failures:
            raise RuntimeError("fastoffload: another rank of the group could not attach the shared host copy, so "
                               "every rank rolled back: " + "; ".join(failures))

    def abort(self, error: BaseException) -> None:
        """This rank failed during enable: tell the others (so nobody waits forever), then unlink."""
        try:
            if self._packed is None:
                self._packed = False
                self._statuses(error)
            elif self._packed and self._attached is None:
                self._attached = False
                self._statuses(error)
        except Exception as collective_error:  # the group itself may be broken (a peer died)
            logger.warning("fastoffload: could not tell the other ranks that this rank failed (%s)", collective_error)
        finally:
            self._unlink()

    def _unlink(self) -> None:
        if not self.owner:
            return
        if self.pool is not None:
            self.pool.unlink_shared()
        _unlink_pending(self.prefix)  # also a name whose block failed half-way, if any


def resolve(share_host_copy: bool | str, backend: str, process_group: Any) -> bool | None:
    """Validates ``share_host_copy``; True/False when decided now, None when "auto" needs the gather."""
    if not (share_host_copy is True or share_host_copy is False or share_host_copy == "auto"):
        raise OffloadConfigError(f"share_host_copy must be True, False or 'auto', got {share_host_copy!r}")
    if share_host_copy is False:
        return False
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    if share_host_copy is True:
        if not initialized:
            raise RuntimeError("fastoffload: share_host_copy=True shares the host copy between the ranks of a "
                               "torch.distributed process group, but none is initialized: call "
                               "torch.distributed.init_process_group(...) on every rank first (torchrun sets the "
                               "environment for it), or pass share_host_copy=False")
        if backend != "ext":
            raise RuntimeError(f"fastoffload: share_host_copy=True needs the compiled core (backend 'ext'), but the "
                               f"{backend!r} backend was chosen; build the extension (pip install "
                               "--no-build-isolation .) or pass share_host_copy=False")
        return True
    if not initialized or backend != "ext":
        return False
    return None if dist.get_world_size(process_group) > 1 else False


def negotiate(share_host_copy: bool | str, backend: str, process_group: Any, blocks: list[nn.Module],
              list_name: str, first_index: int) -> HostShare | None:
    """Step 1 (collective when sharing may happen): who owns, the names, and whether the ranks agree."""
    decided = resolve(share_host_copy, backend, process_group)
    if decided is False or not blocks:
        return None
    import torch.distributed as dist

    group = process_group
    rank = dist.get_rank()
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "rank": rank, "token": secrets.token_hex(6),
            "blocks": [block_signature(block) for block in blocks], "shm_free": _shm_free_bytes(),
            "needed": _packed_bytes_bound(blocks)}
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)

    owners: dict[str, dict[str, Any]] = {}
    for info in everyone:
        if info["host"] not in owners or info["rank"] < owners[info["host"]]["rank"]:
            owners[info["host"]] = info
    differences = {}
    for info in everyone:
        owner = owners[info["host"]]
        if info is owner:
            continue
        difference = _first_difference(info["blocks"], owner["blocks"], list_name, first_index, info["rank"])
        if difference is not None:
            differences[info["rank"]] = (difference, owner["rank"])
    # /dev/shm must hold the whole host copy (a Docker default is 64 MiB): judged on each host's owner.
    short = {host: owner for host, owner in owners.items()
             if owner["shm_free"] is not None and owner["shm_free"] < owner["needed"]
             and sum(info["host"] == host for info in everyone) > 1}
    if short:
        where = "; ".join(f"host {host}: {o['needed'] / 2**30:.2f} GiB needed, {o['shm_free'] / 2**30:.2f} GiB free"
                          for host, o in sorted(short.items()))
        if decided is None:
            logger.warning("fastoffload: share_host_copy='auto': not sharing the host copy, /dev/shm is too small (%s); "
                           "each rank pins its own copy", where)
            return None
        raise RuntimeError(f"fastoffload: cannot share the host copy: /dev/shm is too small ({where}). Enlarge it "
                           "(in Docker: --shm-size; or remount the tmpfs larger), or enable with share_host_copy=False")
    local_ranks = sorted(info["rank"] for info in everyone if info["host"] == mine["host"])
    # "auto" shares only where some host runs several ranks, and only when every rank agrees: the
    # verdict must be the same on every rank, since the next steps are collectives too.
    alone_everywhere = len(owners) == len(everyone)
    if decided is None and (alone_everywhere or differences):
        if differences:
            logger.warning("fastoffload: share_host_copy='auto': not sharing the host copy, the ranks' blocks differ "
                           "(%s)", "; ".join(f"rank {r}: {d}" for r, (d, _) in sorted(differences.items())))
        return None
    if differences:
        if rank in differences:
            difference, owner_rank = differences[rank]
            raise RuntimeError(f"fastoffload: cannot share the host copy with rank {owner_rank} (the owner on this "
                               f"host): {difference}. Build the same model on every rank, "
                               "or enable with share_host_copy=False")
        raise RuntimeError("fastoffload: cannot share the host copy: other ranks built different blocks ("
                           + "; ".join(f"rank {r}: {d}"
                                       for r, (d, _) in sorted(differences.items()))
                           + "). Build the same model on every rank, or enable with share_host_copy=False")

    from fastoffload_ext import _backend

    core = _backend.require_ext()
    owner = owners[mine["host"]]
    # The compiled core checks every segment name against its prefix: take the prefix from there.
    share = HostShare(group, rank, owner["rank"], local_ranks, f"/{core.SEGMENT_PREFIX}{owner['pid']}-{owner['token']}",
                      len(blocks))
    if share.owner:
        removed = core.sweep_stale_segments()
        if removed:
            logger.info("fastoffload: removed %d stale shared segment(s) of dead processes from /dev/shm", removed)
        _PENDING[share.prefix] = len(blocks)
    return share


__all__ = ["HostShare", "SHARED_MUTATION_ERROR", "block_signature", "negotiate", "resolve"]
