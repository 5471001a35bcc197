"""The cost table the planner works from: per-block compute time and bytes, and the copy bandwidth.

It is plain data, so a table can come from a calibration step on this machine (``calibration.py``),
from a benchmark, or be written by hand in a test.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Collection, Sequence

from torch import nn

from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning.tiers import plan_tiers

logger = logging.getLogger(__name__)

# The compiled core packs each tensor of a block at this alignment (PinnedPool::kAlignment), so a slot
# and a block's host copy are the sum of the rounded-up tensor sizes.
PACK_ALIGNMENT = 256
# The device decoder of compressed copies runs at HBM speed (docs/DESIGN.md, "Compressed host copies"):
# an assumption until measured, and only the time from landing to "ready" depends on it.
DEFAULT_DECODE_GBPS = 550.0
# The engine double-buffers coded copies in device staging (the next copy lands while one decodes).
STAGING_BUFFERS = 2


def _finite(value: object) -> bool:
    """A real number that is not NaN nor infinite (True is no time nor rate)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: object) -> bool:
    """A whole number of bytes: an integer (numpy's too) or a float without a fraction; not a bool."""
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Integral) or (_finite(value) and float(value) == int(value))  # type: ignore[arg-type]


def packed_bytes(tensor_bytes: Sequence[int]) -> int:
    """A block's packed size from its tensors' sizes (what a slot must hold)."""
    return sum(-(-int(n) // PACK_ALIGNMENT) * PACK_ALIGNMENT for n in tensor_bytes)


@dataclasses.dataclass(frozen=True)
class DiskCosts:
    """The disk tier a cost table predicts with (a checkpoint larger than the host budget).

    read_gbps: the disk's read bandwidth for the tier's reads (decimal GB/s), measured on this machine.
    host_budget: bytes the host tier may pin: the host copies of the offloaded blocks that keep one,
        plus the staging ring; the offloaded blocks beyond it are read from disk every step
        (``planning.tiers.plan_tiers`` says which, for each resident set).
    staging_buffers: the staging ring's buffers (``DiskOptions.staging_buffers``): how far the reads run
        ahead of the copies out of them.
    """

    read_gbps: float
    host_budget: int
    staging_buffers: int = 2

    def __post_init__(self) -> None:
        if not self.read_gbps > 0:
            raise OffloadConfigError(f"fastoffload: DiskCosts read_gbps must be > 0 (GB/s), got {self.read_gbps!r}")
        if isinstance(self.host_budget, bool) or not isinstance(self.host_budget, int) or self.host_budget < 0:
            raise OffloadConfigError(f"fastoffload: DiskCosts host_budget must be bytes >= 0, got {self.host_budget!r}")
        if isinstance(self.staging_buffers, bool) or not isinstance(self.staging_buffers, int) or \
                self.staging_buffers < 1:
            raise OffloadConfigError(f"fastoffload: DiskCosts staging_buffers must be an integer >= 1, got "
                                     f"{self.staging_buffers!r}")

    def read_ms(self, nbytes: int) -> float:
        return nbytes / (self.read_gbps * 1e6)


@dataclasses.dataclass(frozen=True)
class BlockCosts:
    """Measured (or given) costs of one model's block list on one machine.

    compute_ms: each block's compute time per step, in execution order.
    block_bytes: each block's packed weight bytes (one copy per offloaded block per step).
    h2d_gbps: host-to-device copy bandwidth, decimal GB/s.
    other_ms: compute per step outside the block list (embeddings, head); overlaps the wrap-around copy.
    activation_bytes: device bytes a step needs besides weights and slots (the activation reserve).
    copy_latency_ms: fixed cost per copy on top of bytes / bandwidth.
    overlap: copies run beside compute (a CUDA copy stream). False for the host-as-device engine,
        whose copies are memcpys on the one host timeline.
    calibrated: the compute column was measured (False: bytes only, compute assumed free).
    block_overhead_ms: fixed cost on the compute timeline of each offloaded block per step (the offload
        hook's acquire and release, the engine call, the wait on the block's "ready" event); resident
        blocks carry no hook and pay none. Calibration fits it from the gaps between blocks.
    transfer_bytes: the bytes each block's copy moves over PCIe, which are also its pinned host copy
        (compressed blocks: the compressed region); None: the packed bytes (``block_bytes``). A slot and
        a resident block always hold ``block_bytes``.
    decode_gbps: output rate of the device decoder (GB/s) for blocks whose ``transfer_bytes`` differ from
        ``block_bytes``; the decode runs on its own stream after the copy and delays "ready" only.
    host_ms: each block's dispatch time on the host (its forward as the host runs it, launching the
        kernels), in execution order; None: not measured, the host is taken to run ahead of the device.
    host_other_ms: the host's time per step outside the block list.
    host_overhead_ms: the host's cost of the offload hooks per offloaded block per step (acquire, the
        prefetch calls, release); resident blocks have no hook. Calibration fits it from the host gaps
        between blocks. With all three absent (None, 0, 0) the host timeline is left out, and so it is
        with ``overlap=False``, where the compute timeline is the host's already.
    disk: the disk tier (:class:`DiskCosts`); None: every offloaded block has a pinned host copy.
    run_order: the order a forward runs the blocks in (every index once), where it is not their order in
        the list (a model that runs its lists in another order than it registered them, or interleaves
        them); None: list order. Calibration measures it. The simulation walks this order (the engine
        prefetches along it once its first forward learned it), and the planner spreads resident blocks
        along it. The per-block columns stay indexed by list position.
    """

    compute_ms: tuple[float, ...]
    block_bytes: tuple[int, ...]
    h2d_gbps: float
    other_ms: float = 0.0
    activation_bytes: int = 0
    copy_latency_ms: float = 0.0
    overlap: bool = True
    calibrated: bool = True
    block_overhead_ms: float = 0.0
    transfer_bytes: tuple[int, ...] | None = None
    decode_gbps: float = DEFAULT_DECODE_GBPS
    host_ms: tuple[float, ...] | None = None
    host_other_ms: float = 0.0
    host_overhead_ms: float = 0.0
    disk: DiskCosts | None = None
    run_order: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_run_order()
        object.__setattr__(self, "compute_ms", tuple(float(c) for c in self.compute_ms))
        self._check_host()
        object.__setattr__(self, "block_bytes", tuple(int(b) for b in self.block_bytes))
        if self.transfer_bytes is not None:
            moved = tuple(int(b) for b in self.transfer_bytes)
            object.__setattr__(self, "transfer_bytes", None if moved == self.block_bytes else moved)
            if len(moved) != len(self.block_bytes) or any(b < 0 for b in moved):
                raise OffloadConfigError(f"fastoffload: BlockCosts transfer_bytes needs one size >= 0 per block: got "
                                         f"{list(moved)} for {len(self.block_bytes)} blocks")
        if self.block_overhead_ms < 0 or self.copy_latency_ms < 0:
            raise OffloadConfigError(f"fastoffload: BlockCosts block_overhead_ms and copy_latency_ms must be >= 0, got "
                                     f"{self.block_overhead_ms} and {self.copy_latency_ms}")
        if not self.decode_gbps > 0:
            raise OffloadConfigError(f"fastoffload: BlockCosts decode_gbps must be > 0 (GB/s), got "
                                     f"{self.decode_gbps!r}")
        if len(self.compute_ms) != len(self.block_bytes):
            raise OffloadConfigError(f"fastoffload: BlockCosts needs one compute time per block: got "
                                     f"{len(self.compute_ms)} compute times for {len(self.block_bytes)} blocks")
        if any(c < 0 for c in self.compute_ms) or any(b < 0 for b in self.block_bytes) or self.other_ms < 0:
            raise OffloadConfigError("fastoffload: BlockCosts compute times and bytes must be >= 0, got "
                                     f"compute {list(self.compute_ms)}, bytes {list(self.block_bytes)}, "
                                     f"other {self.other_ms}")
        if not self.h2d_gbps > 0:
            raise OffloadConfigError(f"fastoffload: BlockCosts h2d_gbps must be > 0 (GB/s), got {self.h2d_gbps!r}")

    def _check_numbers(self) -> None:
        # NaN passes every ">= 0" check below and then makes the planner's comparisons arbitrary (or fail
        # in round()); an infinite time or rate, a bool or a fraction of a byte is a mistake as well.
        for name in ("compute_ms", "block_bytes", "transfer_bytes", "host_ms"):
            if getattr(self, name) is not None:  # read once: a generator is used up by the checks
                object.__setattr__(self, name, tuple(getattr(self, name)))
        # (The host figures are checked with their own message, in _check_host.)
        if not all(map(_finite, self.compute_ms)):
            raise OffloadConfigError(f"fastoffload: BlockCosts compute_ms must be finite numbers (ms), got "
                                     f"{list(self.compute_ms)}")
        for name in ("h2d_gbps", "other_ms", "copy_latency_ms", "block_overhead_ms", "decode_gbps"):
            if not _finite(getattr(self, name)):
                raise OffloadConfigError(f"fastoffload: BlockCosts {name} must be a finite number, got "
                                         f"{getattr(self, name)!r}")
        sizes = {"block_bytes": list(self.block_bytes), "transfer_bytes": list(self.transfer_bytes or ())}
        for name, values in sizes.items():
            if not all(map(_whole, values)):
                raise OffloadConfigError(f"fastoffload: BlockCosts {name} must be whole numbers of bytes, got {values}")
        if not _whole(self.activation_bytes) or self.activation_bytes < 0:
            raise OffloadConfigError(f"fastoffload: BlockCosts activation_bytes must be bytes >= 0, got "
                                     f"{self.activation_bytes!r}")
        object.__setattr__(self, "activation_bytes", int(self.activation_bytes))
        for name in ("overlap", "calibrated"):
            if not isinstance(getattr(self, name), bool):
                raise OffloadConfigError(f"fastoffload: BlockCosts {name} must be True or False, got "
                                         f"{getattr(self, name)!r}")

    def _check_run_order(self) -> None:
        if self.run_order is None:
            return
        order = tuple(self.run_order)
        if any(isinstance(b, bool) or not isinstance(b, numbers.Integral) for b in order) or \
                sorted(order) != list(range(len(self.compute_ms))):
            raise OffloadConfigError(f"fastoffload: BlockCosts run_order must list every block index 0.."
                                     f"{len(self.compute_ms) - 1} once, in the order they run; got {list(order)}")
        order = tuple(int(b) for b in order)
        object.__setattr__(self, "run_order", None if order == tuple(range(len(order))) else order)

    def order(self) -> tuple[int, ...]:
        """The blocks in the order a forward runs them."""
        return self.run_order if self.run_order is not None else tuple(range(self.blocks))

    def in_run_order(self) -> tuple[BlockCosts, tuple[int, ...]]:
        """This table with its blocks renumbered in the order they run (position ``p`` is block ``order[p]``),
        and that order. The disk tier's placement is the list order's: the renumbered table's is an
        approximation, for choosing candidates, not for scoring them."""
        order = self.order()
        if self.run_order is None:
            return self, order

        def pick(column: Sequence[float] | Sequence[int] | None) -> tuple | None:
            return None if column is None else tuple(column[b] for b in order)

        return dataclasses.replace(self, compute_ms=pick(self.compute_ms), block_bytes=pick(self.block_bytes),
                                   transfer_bytes=pick(self.transfer_bytes), host_ms=pick(self.host_ms),
                                   run_order=None), order

    def _check_host(self) -> None:
        if self.host_ms is not None:
            object.__setattr__(self, "host_ms", tuple(float(h) for h in self.host_ms))
            if len(self.host_ms) != len(self.block_bytes) or any(not (_finite(h) and h >= 0) for h in self.host_ms):
                raise OffloadConfigError("fastoffload: BlockCosts host_ms needs one dispatch time >= 0 (ms) per "
                                         f"block: got {list(self.host_ms)} for {len(self.block_bytes)} blocks; pass "
                                         "None when the host was not timed")
        if not all(_finite(ms) and ms >= 0 for ms in (self.host_other_ms, self.host_overhead_ms)):
            raise OffloadConfigError(f"fastoffload: BlockCosts host_other_ms and host_overhead_ms must be >= 0 (ms), "
                                     f"got {self.host_other_ms} and {self.host_overhead_ms}")

    @property
    def blocks(self) -> int:
        return len(self.block_bytes)

    @property
    def host_timed(self) -> bool:
        """The step has a host timeline to simulate: host figures given and copies beside compute."""
        return self.overlap and (self.host_ms is not None or self.host_other_ms > 0 or self.host_overhead_ms > 0)

    def host_dispatch_ms(self, block: int) -> float:
        return 0.0 if self.host_ms is None else self.host_ms[block]

    def device_only(self) -> BlockCosts:
        """This table without its host figures: the step as the device timelines alone give it."""
        if not (self.host_ms is not None or self.host_other_ms or self.host_overhead_ms):
            return self
        return dataclasses.replace(self, host_ms=None, host_other_ms=0.0, host_overhead_ms=0.0)

    def window_ms(self, block: int) -> float:
        """How long an offloaded ``block`` runs, what the next copy can hide behind: its compute, or
        with host figures its dispatch and hooks when the host is slower."""
        if not self.host_timed:
            return self.compute_ms[block]
        return max(self.compute_ms[block], self.host_dispatch_ms(block) + self.host_overhead_ms)

    def total_host_ms(self) -> float:
        """The host's dispatch time of a step with every block resident (no hooks)."""
        return (sum(self.host_ms) if self.host_ms is not None else 0.0) + self.host_other_ms

    @property
    def compressed(self) -> bool:
        """Some block moves fewer bytes than it holds (compressed host copies)."""
        return self.transfer_bytes is not None

    def moved_bytes(self, block: int) -> int:
        """Bytes one copy of ``block`` moves over PCIe (and its pinned host copy holds)."""
        return self.block_bytes[block] if self.transfer_bytes is None else self.transfer_bytes[block]

    def is_coded(self, block: int) -> bool:
        return self.transfer_bytes is not None and self.transfer_bytes[block] != self.block_bytes[block]

    def copy_ms(self, block: int) -> float:
        """Time the copy stream is busy with one copy of ``block``."""
        nbytes = self.moved_bytes(block)
        return 0.0 if nbytes == 0 else self.copy_latency_ms + nbytes / (self.h2d_gbps * 1e6)

    def decode_ms(self, block: int) -> float:
        """Time from a coded block's landing to its "ready" (the device decoder); 0 for raw copies."""
        return self.block_bytes[block] / (self.decode_gbps * 1e6) if self.is_coded(block) else 0.0

    def staging_bytes(self, offloaded: Sequence[int]) -> int:
        """Device staging the engine keeps for coded copies: two buffers of the largest coded block (none
        with the host as the device, which decodes straight from the host copy)."""
        if not self.overlap:
            return 0
        coded = [self.moved_bytes(b) for b in offloaded if self.is_coded(b)]
        return STAGING_BUFFERS * max(coded) if coded else 0

    def disk_blocks(self, resident: Collection[int]) -> tuple[int, ...]:
        """The offloaded blocks (indices, in order) that the disk tier reads every step when ``resident``
        stay on the device: as the build places them (``plan_tiers`` over the offloaded blocks' raw
        bytes). Raises OffloadConfigError when the host budget cannot hold the staging ring."""
        if self.disk is None:
            return ()
        kept = frozenset(resident)
        offloaded = [b for b in range(self.blocks) if b not in kept]
        tiers = plan_tiers([self.block_bytes[b] for b in offloaded], self.disk.host_budget, self.disk.staging_buffers)
        return tuple(offloaded[position] for position in tiers.disk)

    def disk_ms(self, resident: Collection[int]) -> float:
        """The disk tier's reads per step (what it moves, compressed where the blocks are) at its bandwidth."""
        if self.disk is None:
            return 0.0
        return sum(self.disk.read_ms(self.moved_bytes(b)) for b in self.disk_blocks(resident))

    def total_compute_ms(self) -> float:
        return sum(self.compute_ms) + self.other_ms

    def with_activation_bytes(self, activation_bytes: int) -> BlockCosts:
        return dataclasses.replace(self, activation_bytes=int(activation_bytes))


def _sized(module: nn.Module) -> list[nn.Parameter]:
    # A lazy module's parameters have no size yet; enable refuses them with its own message later.
    return [p for p in module.parameters() if not isinstance(p, nn.parameter.UninitializedParameter)]


def module_packed_bytes(module: nn.Module) -> int:
    """The packed size of a block's parameters (what one copy of it moves)."""
    return packed_bytes([p.numel() * p.element_size() for p in _sized(module)])


def module_host_bytes(module: nn.Module) -> int:
    """Bytes of the block's parameters that sit in host memory now."""
    return sum(p.numel() * p.element_size() for p in _sized(module) if p.device.type == "cpu")


def module_device_bytes(module: nn.Module, device: object) -> int:
    """Bytes of the block's parameters already on ``device``."""
    return sum(p.numel() * p.element_size() for p in _sized(module) if p.device == device)


__all__ = ["DEFAULT_DECODE_GBPS", "PACK_ALIGNMENT", "STAGING_BUFFERS", "BlockCosts", "module_device_bytes", "module_host_bytes", "module_packed_bytes",
           "packed_bytes"]
