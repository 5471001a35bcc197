"""Ranks of one host share one host copy of the offloaded weights.

Why: under ``torchrun`` every rank holds the whole transformer and offloads it layerwise, and each rank
used to pin its own full copy: an 8-GPU node with a 60 GiB DiT needed 480 GiB of locked RAM. With
``enable_layerwise_offload(..., share_host_copy=...)`` one process per host (the *owner*: the lowest
global rank of that host) packs each block once into a POSIX shared-memory segment; the other ranks of
the host map the same pages read-only (no copy) and register them with CUDA themselves. Every rank keeps
its own device slots, streams and events, so only host memory is shared.

This module does the coordination, and only that: who owns, the segment names, the exchanges and the
unlinking. The mechanics (shm_open, mmap, flock, pinning, digests) are in ``csrc/shared_segment.cpp``,
``csrc/digest.cpp`` and the pool.

The protocol: whenever ``torch.distributed`` is initialized with more than one rank, ``share_host_copy``
is not False and the backend is not "python", ``enable_layerwise_offload`` is a collective, and every
rank makes the same ``all_gather_object`` calls in the same order whatever happens on it. Each message
carries the sender's status first, so a rank that failed locally still takes part and every rank raises
together, naming the failing rank and its error.

1. ``negotiate``: every rank sends its status (None, or the error that stopped it before this point),
   its hostname, rank, a proposal of names (a random job token and one random token per block, from
   ``secrets``), and for each offloaded block the name, dtype, shape and stride of each parameter. From
   that every rank computes the same verdict with no further message: raise (a rank failed; ``True``
   and the layouts differ), do not share ("auto" and a mismatch, one rank per host, /dev/shm too small),
   or share using the owner's names.
2. The owner takes the job lock (``/fastoffload-<job>-lock``, flock'ed), creates every segment of the
   host copy at once, then packs each block into its segment, hashing the bytes as it copies them. The
   other ranks meanwhile hash their own parameters (the same 64-bit digest of the full contents, see
   ``csrc/digest.h``). Everyone sends (status, digests). The verdict: raise (a rank failed; ``True``
   and a parameter's digest differs from the owner's, naming it), fall back to one copy per rank on
   every rank ("auto" and a digest differs, or the owner could not create the lock or a segment, e.g. a
   name taken or /dev/shm full), or share. On a fall-back the owner moves what it packed to private
   memory and the others pack their own copy, as with ``share_host_copy=False``. A rank's weights are
   only replaced by the owner's copy after the digests matched.
3. The other ranks map the segments read-only; then every rank sends its status. The owner unlinks
   every name and its lock right after: the mappings stay valid, the names are gone, so a crash or kill
   -9 of any rank from here on leaves nothing behind in /dev/shm (the kernel frees the pages with the
   last mapping).

A failure after step 1 (a layout the owner did not expect, Ctrl-C) makes every rank roll back and raise
instead of waiting for a peer that gave up; the owner unlinks on that path too, in an ``atexit``
handler, and in the C++ segment's destructor. An owner killed before it unlinked leaves names behind;
the next owner's sweep removes them, and only them: the names of a job whose lock is free (its owner is
dead, whatever its PID namespace) and that belong to this user.

Compression (``compress=True`` or "auto"): the owner encodes each block and its segment holds the
compressed bytes; every rank sends its codec settings in step 1 (a difference is a mismatch like a
layout's), the owner sends each block's compressed size and checksum in step 2, and the other ranks
check the segment against them (and the checksum against the bytes) before they decode from it.

Contract and limits:
- Every rank of the group must call ``enable_layerwise_offload`` then, in the same order, with the same
  model (same parameter names, dtypes, shapes, strides and values). With NCCL the object collectives use
  the current CUDA device: call ``torch.cuda.set_device(local_rank)`` first, as torchrun scripts do.
- ``mutate_params_scope`` is refused on a shared block (``SHARED_MUTATION_ERROR``): a LoRA merged by one
  rank would change the weights of every rank of the host under them. Merge before enabling offload,
  or enable with ``share_host_copy=False``. Host views of a shared block (``cpu_named_parameters``) are
  copies: a write into one is refused at the block's next forward, as it cannot reach the model.
- Ranks are grouped by hostname. Containers that share a hostname but not /dev/shm are not supported.
- A rank that dies *during* enable leaves the others waiting in the collective until the process
  group's timeout.
"""
from __future__ import annotations

import atexit
import logging
import os
import secrets
import socket
from typing import Any

from torch import nn

from fastoffload_ext.codec import codec_settings
from fastoffload_ext.engine.messages import SHARED_MUTATION_ERROR
from fastoffload_ext.errors import OffloadConfigError, OffloadStateError

logger = logging.getLogger(__name__)

# Random bytes per name: 128 bits, so that no process watching /dev/shm can guess the next one.
TOKEN_BYTES = 16

# Names this process created that may still be linked, per job token; unlinked at interpreter exit.
_PENDING: dict[str, list[str]] = {}


def _unlink_pending(job: str | None = None) -> None:
    """Unlinks the names of ``job`` (default: of every pending job); missing names are fine."""
    from fastoffload_ext import _backend

    core = _backend._C
    for pending in [job] if job is not None else list(_PENDING):
        for name in _PENDING.pop(pending, []):
            if core is not None:
                core.unlink_shared_segment(name)


atexit.register(_unlink_pending)


def block_layout(block: nn.Module) -> list[tuple[str, str, tuple[int, ...], tuple[int, ...]]]:
    """(name, dtype, shape, stride) of each parameter: what the packed layout depends on."""
    return [(name, str(p.dtype), tuple(p.shape), tuple(p.stride())) for name, p in block.named_parameters()]


def block_digests(block: nn.Module) -> list[int]:
    """The 64-bit digest of each parameter's full contents, as the owner computes while packing."""
    from fastoffload_ext import _backend

    named = list(block.named_parameters())
    # The owner hashes the bytes it packs, where negative and conjugate views are resolved: hash the values
    # too, not the storage (a negative view's storage holds minus its values; no copy without the bit).
    values = [p.detach().resolve_conj().resolve_neg() for _, p in named]
    return list(_backend.require_ext().tensor_digests([n for n, _ in named], values))


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


def _describe(rank: int, error: BaseException) -> str:
    return f"rank {rank}: {type(error).__name__}: {error}"


def _first_difference(mine: list[Any], owners: list[Any], list_name: str, first_index: int, rank: int) -> str | None:
    """The first way the layout ``mine`` differs from the owner's, naming the parameter; None if equal.

    Layouts number the offloaded blocks from 0; parameters are named by their index in the block
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
            return (f"parameter '{prefix}{extra[0]}' of rank {rank} is not on the owner" if extra
                    else f"parameter '{prefix}{missing[0]}' is missing on rank {rank}" if missing
                    else f"parameter '{prefix}{first}' comes in a different order")
        for (name, dtype, shape, stride), (_, o_dtype, o_shape, o_stride) in zip(block, owner_block):
            if (dtype, shape, stride) != (o_dtype, o_shape, o_stride):
                return (f"parameter '{prefix}{name}' is {dtype} of shape {list(shape)}, stride {list(stride)} on rank "
                        f"{rank} but {o_dtype} of shape {list(o_shape)}, stride {list(o_stride)} on the owner")
    return None


def _codec_difference(mine: Any, owners: Any, rank: int) -> str | None:
    """How the codec settings of ``rank`` differ from the owner's (the owner encodes for all); None if equal."""
    if mine is None or owners is None or tuple(mine) == tuple(owners):
        return None
    words = {"off": "False", "on": "True", "auto": "'auto'"}

    def describe(settings: Any) -> str:
        mode, version, max_ratio, min_bytes = settings
        return f"compress={words.get(mode, mode)} (format {version}, max_ratio {max_ratio}, min_bytes {min_bytes})"

    return (f"rank {rank} asked for {describe(mine)} but the owner for {describe(owners)}; pass the same compress= "
            "on every rank (under a device_budget, each rank's own plan turns compress='auto' into True or False: "
            "give every rank the same budgets too)")


def _digest_difference(mine: list[list[int]], owners: list[list[int]], layouts: list[Any], list_name: str,
                       first_index: int, rank: int) -> str | None:
    """The first parameter whose digest on ``rank`` differs from the owner's; None if all match."""
    for index, (block, owner_block, layout) in enumerate(zip(mine, owners, layouts)):
        for digest, owner_digest, entry in zip(block, owner_block, layout):
            if digest != owner_digest:
                return (f"parameter '{list_name}.{first_index + index}.{entry[0]}' holds different values on rank "
                        f"{rank} than on the owner (tensor-parallel shards, a different seed or checkpoint, or a "
                        "per-rank adapter cannot share one host copy)")
    return None


def resolve(share_host_copy: bool | str, backend: str, process_group: Any) -> bool | None:
    """Validates ``share_host_copy``; True/False when decided now, None when "auto" needs the gather."""
    if not (share_host_copy is True or share_host_copy is False or share_host_copy == "auto"):
        raise OffloadConfigError("fastoffload: share_host_copy must be True, False or 'auto', got "
                                 f"{share_host_copy!r}")
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


def collective_expected(share_host_copy: Any, backend: Any, process_group: Any) -> bool:
    """Whether enable is a collective for these arguments. Never raises: decided before any check."""
    if share_host_copy is False or backend == "python":
        return False
    try:
        import torch.distributed as dist

        return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1)
    except Exception:  # an unusable group: the argument checks that follow say what is wrong
        return False


def _gather(group: Any, message: Any) -> list[Any]:
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, message, group=group)
    return gathered


class Rendezvous:
    """Step 1 of one ``enable_layerwise_offload`` call, seen from one rank.

    Made before any argument is checked, so that a rank that fails before the negotiation still sends
    its failure (``fail``) in the same collective the other ranks wait in (``negotiate``).
    """

    def __init__(self, share_host_copy: Any, backend: Any, process_group: Any) -> None:
        self.group = process_group
        self.collective = collective_expected(share_host_copy, backend, process_group)
        self.done = not self.collective

    def _exchange(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        self.done = True
        return _gather(self.group, message)

    def fail(self, error: BaseException) -> None:
        """This rank stopped before negotiating: tell the others, who then raise too. Never raises."""
        if self.done:
            return
        import torch.distributed as dist

        try:
            self._exchange({"error": _describe(dist.get_rank(), error)})
        except Exception as collective_error:  # the group itself may be broken
            logger.warning("fastoffload: could not tell the other ranks that this rank failed (%s)", collective_error)

    def skip(self, reason: str) -> None:
        """This rank declined to offload (no CUDA): fine if every rank did, an error on all otherwise."""
        if self.done:
            return
        import torch.distributed as dist

        rank = dist.get_rank()
        everyone = self._exchange({"error": None, "skipped": f"rank {rank}: {reason}"})
        _raise_failures(everyone, rank)
        if any(info.get("skipped") is None for info in everyone):
            raise OffloadStateError(f"fastoffload: this rank did not enable offload ({reason}) but other ranks of the "
                                    "group did, so every rank raised; give every rank the same device (or none)")

    def negotiate(self, share_host_copy: bool | str, backend: str, blocks: list[nn.Module], list_name: str,
                  first_index: int, engine: Any, compress: str = "off") -> HostShare | None:
        """Step 1 (see the module docstring); None when the ranks do not share. ``share_host_copy`` is the
        validated value; ``compress`` the engine's codec mode, which every rank must share too."""
        if not self.collective:
            self.done = True
            return None
        import torch.distributed as dist

        rank = dist.get_rank()
        try:
            decided = resolve(share_host_copy, backend, self.group)
            mine = {"error": None, "skipped": None, "host": socket.gethostname(), "rank": rank,
                    "can_share": engine is not None and bool(blocks) and decided is not False,
                    "job": secrets.token_hex(TOKEN_BYTES), "names": [secrets.token_hex(TOKEN_BYTES) for _ in blocks],
                    "blocks": [block_layout(block) for block in blocks], "shm_free": _shm_free_bytes(),
                    "needed": _packed_bytes_bound(blocks),
                    "codec": codec_settings(compress) if engine is not None else None}
        except BaseException as error:
            self.fail(error)
            raise
        everyone = self._exchange(mine)
        _raise_failures(everyone, rank)
        if any(info.get("skipped") is not None for info in everyone):
            skipped = "; ".join(info["skipped"] for info in everyone if info.get("skipped") is not None)
            raise OffloadStateError(f"fastoffload: other ranks of the group did not enable offload ({skipped}), so "
                                    "every rank raised; give every rank the same device (or none)")
        if not all(info["can_share"] for info in everyone):
            return None
        share = _verdict(self.group, everyone, mine, decided, list_name, first_index)
        if share is not None:
            share.engine = engine
        return share


def _encoded(engine: Any, handle: int) -> tuple[int, int]:
    """(compressed bytes, checksum) of a shared block as the owner stored it; (0, 0) when it is raw."""
    info = engine.codec_info(handle)
    return (int(info["compressed_bytes"]), int(info["checksum"])) if info["mode"] == "compressed" else (0, 0)


def _raise_failures(everyone: list[dict[str, Any]], rank: int) -> None:
    """Raises on a rank that did not fail itself when any rank sent a failure (its own error is raised by it)."""
    failures = [info["error"] for info in everyone if info.get("error") is not None]
    if failures:
        raise OffloadStateError("fastoffload: enable_layerwise_offload failed on another rank of the group, so this "
                                f"rank (rank {rank}) did not enable offload either: " + "; ".join(failures)
                                + ". Fix that rank (its own error is in its log) and enable again on every rank")


def _verdict(group: Any, everyone: list[dict[str, Any]], mine: dict[str, Any], decided: bool | None,
             list_name: str, first_index: int) -> HostShare | None:
    """The same decision on every rank, from the same gathered messages."""
    owners: dict[str, dict[str, Any]] = {}
    for info in everyone:
        if info["host"] not in owners or info["rank"] < owners[info["host"]]["rank"]:
            owners[info["host"]] = info
    differences = {}
    for info in everyone:
        owner = owners[info["host"]]
        if info is not owner:
            difference = (_first_difference(info["blocks"], owner["blocks"], list_name, first_index, info["rank"])
                          or _codec_difference(info["codec"], owner["codec"], info["rank"]))
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
            logger.warning("fastoffload: share_host_copy='auto': not sharing the host copy, /dev/shm is too small "
                           "(%s); each rank pins its own copy", where)
            return None
        raise OffloadStateError(f"fastoffload: cannot share the host copy: /dev/shm is too small ({where}). Enlarge it "
                                "(in Docker: --shm-size; or remount the tmpfs larger), or enable with "
                                "share_host_copy=False")
    alone_everywhere = len(owners) == len(everyone)
    if decided is None and (alone_everywhere or differences):
        if differences:
            logger.warning("fastoffload: share_host_copy='auto': not sharing the host copy, the ranks' blocks differ "
                           "(%s)", "; ".join(f"rank {r}: {d}" for r, (d, _) in sorted(differences.items())))
        return None
    if differences:
        if mine["rank"] in differences:
            difference, owner_rank = differences[mine["rank"]]
            raise OffloadStateError(f"fastoffload: cannot share the host copy with rank {owner_rank} (the owner on "
                                    f"this host): {difference}. Build the same model on every rank, or enable with "
                                    "share_host_copy=False")
        raise OffloadStateError("fastoffload: cannot share the host copy: other ranks built different blocks ("
                                + "; ".join(f"rank {r}: {d}" for r, (d, _) in sorted(differences.items()))
                                + "). Build the same model on every rank, or enable with share_host_copy=False")
    owner = owners[mine["host"]]
    local_ranks = sorted(info["rank"] for info in everyone if info["host"] == mine["host"])
    host_owner_ranks = {info["rank"]: owners[info["host"]]["rank"] for info in everyone}
    return HostShare(group, mine["rank"], owner["rank"], local_ranks,
                     owner["job"], owner["names"], auto=decided is None, layouts=mine["blocks"],
                     host_owner_ranks=host_owner_ranks, list_name=list_name, first_index=first_index)


class HostShare:
    """One enable's share of a host copy, seen from one rank (made by ``Rendezvous.negotiate``)."""

    def __init__(self, group: Any, rank: int, owner_rank: int, local_ranks: list[int], job: str, names: list[str],
                 *, auto: bool, layouts: list[Any], host_owner_ranks: dict[int, int], list_name: str,
                 first_index: int) -> None:
        self.group = group
        self.rank = rank
        self.owner_rank = owner_rank
        self.local_ranks = local_ranks
        self.job = job  # the owner's random job token: "/fastoffload-<job>-<name>" and its lock
        self.names = names
        self.auto = auto
        self.layouts = layouts
        self.host_owner_ranks = host_owner_ranks
        self.list_name = list_name
        self.first_index = first_index
        self.engine: Any = None
        self.active = True                  # False once the ranks fell back to one copy each
        self._packed: bool | None = None    # step 2 done: did it succeed everywhere?
        # From the owner in step 2: (compressed bytes, checksum) of each block's segment, (0, 0) for a raw one.
        self.encoded: list[tuple[int, int]] = []
        self._attached: bool | None = None  # step 3 done
        self._fallback: str | None = None   # why this owner could not create the host copy ("auto")
        self._lock: Any = None

    @property
    def owner(self) -> bool:
        return self.rank == self.owner_rank

    @property
    def shared_by(self) -> int:
        """How many ranks of this host map the copy."""
        return len(self.local_ranks)

    @property
    def pool(self) -> Any:
        return self.engine.pool

    def encoded_form(self, index: int) -> tuple[int, int]:
        """(compressed bytes, checksum) the owner wrote into block ``index``'s segment; (0, 0): raw bytes."""
        return self.encoded[index] if index < len(self.encoded) else (0, 0)

    def segment_name(self, index: int) -> str | None:
        """Block ``index``'s segment; None once the ranks fell back to one copy each."""
        from fastoffload_ext import _backend

        # The compiled core checks every segment name against its prefix: take the prefix from there.
        return f"/{_backend.require_ext().SEGMENT_PREFIX}{self.job}-{self.names[index]}" if self.active else None

    def before_attach(self, blocks: list[nn.Module]) -> None:
        """Owner: lock, sweep, create every segment. Others: hash their blocks, then step 2."""
        if self.owner:
            self._prepare_segments(blocks)
            return
        digests = [block_digests(block) for block in blocks]
        self._step_two(None, digests, None)

    def _prepare_segments(self, blocks: list[nn.Module]) -> None:
        from fastoffload_ext import _backend

        core = _backend.require_ext()
        pending = _PENDING.setdefault(self.job, [])
        try:
            self._lock = core.JobLock(self.job)
            removed = core.sweep_stale_segments()
            if removed:
                logger.info("fastoffload: removed %d stale shared segment(s) of dead jobs from /dev/shm", removed)
            for index, block in enumerate(blocks):
                named = list(block.named_parameters())
                nbytes = core.packed_bytes([n for n, _ in named], [p for _, p in named])
                self.pool.reserve_shared(self.segment_name(index), nbytes)
                pending.append(self.segment_name(index))  # only names this process created
        except RuntimeError as error:
            if not self.auto:
                raise
            # Told to the others in step 2, where every rank falls back together.
            self._fallback = _describe(self.rank, error)
            self._unlink()
            self.active = False

    def _step_two(self, error: BaseException | None, digests: list[list[int]] | None,
                  encoded: list[tuple[int, int]] | None) -> None:
        """Step 2: every rank's status and digests (the owner's: also what it encoded); raises, falls back
        (``active`` False) or goes on."""
        status = None if error is None else _describe(self.rank, error)
        everyone = _gather(self.group, {"error": status, "fallback": self._fallback, "digests": digests,
                                        "encoded": encoded, "rank": self.rank})
        self._packed = False
        failures = [info["error"] for info in everyone if info["error"] is not None]
        if error is not None:
            return
        if failures:
            where = "while packing" if self.owner else "so this rank did not attach"
            raise OffloadStateError(f"fastoffload: sharing the host copy failed on another rank {where}: "
                                    + "; ".join(failures))
        reasons = [info["fallback"] for info in everyone if info["fallback"] is not None]
        by_rank = {info["rank"]: info["digests"] for info in everyone}
        self.encoded = [tuple(e) for e in next(info["encoded"] for info in everyone
                                               if info["rank"] == self.owner_rank) or []]
        for info in everyone:
            owner_rank = self.host_owner_ranks[info["rank"]]
            if owner_rank != info["rank"] and by_rank[owner_rank] is not None:
                difference = _digest_difference(info["digests"], by_rank[owner_rank], self.layouts, self.list_name,
                                                self.first_index, info["rank"])
                if difference is not None:
                    reasons.append(f"rank {info['rank']}: {difference}")
        if reasons and not self.auto:
            raise OffloadStateError(f"fastoffload: cannot share the host copy: {'; '.join(reasons)}. Build the same "
                                    "model on every rank, or enable with share_host_copy=False")
        self._packed = True
        if reasons:
            logger.warning("fastoffload: share_host_copy='auto': not sharing the host copy (%s); each rank pins its "
                           "own copy", "; ".join(reasons))
            self.active = False

    def after_attach(self, states: list[Any]) -> bool:
        """Owner: step 2. All still sharing: step 3; the owner unlinks. Returns whether the copy is shared."""
        if self.owner:
            digests = ([list(self.engine.block_digests(state.handle)) for state in states] if self.active else None)
            encoded = [_encoded(self.engine, state.handle) for state in states] if self.active else None
            self._step_two(None, digests, encoded)
            if not self.active:
                self._take_back(states)
                return False
        elif not self.active:
            return False
        everyone = _gather(self.group, None)
        failures = [status for status in everyone if status is not None]
        self._attached = not failures
        self._unlink()
        if failures:
            raise OffloadStateError("fastoffload: another rank of the group could not attach the shared host copy, "
                                    "so every rank rolled back: " + "; ".join(failures))
        return True

    def _take_back(self, states: list[Any]) -> None:
        """The owner's blocks leave the shared segments (the ranks fell back after it packed)."""
        for state in states:
            if state.shared_segment is not None:
                self.engine.make_private(state.handle)
                state.shared_segment = None
        self._unlink()

    def abort(self, error: BaseException) -> None:
        """This rank failed during enable: tell the others (so nobody waits forever), then unlink.

        Before step 2 nobody has mapped a segment, so the owner unlinks first: a rank that learns of the
        failure finds none of this job's names left in /dev/shm.
        """
        try:
            if self._packed is None:
                self._unlink()
                self._step_two(error, None, None)
            elif self._packed and self.active and self._attached is None:
                self._attached = False
                _gather(self.group, _describe(self.rank, error))
        except Exception as collective_error:  # the group itself may be broken (a peer died)
            logger.warning("fastoffload: could not tell the other ranks that this rank failed (%s)", collective_error)
        finally:
            self._unlink()

    def _unlink(self) -> None:
        if not self.owner:
            return
        if self.engine is not None:
            self.pool.unlink_shared()
        _unlink_pending(self.job)  # also a name whose block failed half-way, if any
        if self._lock is not None:
            self._lock.release()
            self._lock = None


__all__ = ["HostShare", "Rendezvous", "SHARED_MUTATION_ERROR", "block_digests", "block_layout", "collective_expected",
           "resolve"]
