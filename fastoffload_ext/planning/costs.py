"""The cost table the planner works from: per-block compute time and bytes, and the copy bandwidth.

It is plain data, so a table can come from a calibration step on this machine (``calibration.py``),
from a benchmark, or be written by hand in a test.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from torch import nn

from fastoffload_ext.errors import OffloadConfigError

logger = logging.getLogger(__name__)

# The compiled core packs each tensor of a block at this alignment (PinnedPool::kAlignment), so a slot
# and a block's host copy are the sum of the rounded-up tensor sizes.
PACK_ALIGNMENT = 256


def packed_bytes(tensor_bytes: Sequence[int]) -> int:
    """A block's packed size from its tensors' sizes (what a slot must hold)."""
    return sum(-(-int(n) // PACK_ALIGNMENT) * PACK_ALIGNMENT for n in tensor_bytes)


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
    """

    compute_ms: tuple[float, ...]
    block_bytes: tuple[int, ...]
    h2d_gbps: float
    other_ms: float = 0.0
    activation_bytes: int = 0
    copy_latency_ms: float = 0.0
    overlap: bool = True
    calibrated: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "compute_ms", tuple(float(c) for c in self.compute_ms))
        object.__setattr__(self, "block_bytes", tuple(int(b) for b in self.block_bytes))
        if len(self.compute_ms) != len(self.block_bytes):
            raise OffloadConfigError(f"fastoffload: BlockCosts needs one compute time per block: got "
                                     f"{len(self.compute_ms)} compute times for {len(self.block_bytes)} blocks")
        if any(c < 0 for c in self.compute_ms) or any(b < 0 for b in self.block_bytes) or self.other_ms < 0:
            raise OffloadConfigError("fastoffload: BlockCosts compute times and bytes must be >= 0, got "
                                     f"compute {list(self.compute_ms)}, bytes {list(self.block_bytes)}, "
                                     f"other {self.other_ms}")
        if not self.h2d_gbps > 0:
            raise OffloadConfigError(f"fastoffload: BlockCosts h2d_gbps must be > 0 (GB/s), got {self.h2d_gbps!r}")

    @property
    def blocks(self) -> int:
        return len(self.block_bytes)

    def copy_ms(self, block: int) -> float:
        nbytes = self.block_bytes[block]
        return 0.0 if nbytes == 0 else self.copy_latency_ms + nbytes / (self.h2d_gbps * 1e6)

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


__all__ = ["PACK_ALIGNMENT", "BlockCosts", "module_device_bytes", "module_host_bytes", "module_packed_bytes",
           "packed_bytes"]
