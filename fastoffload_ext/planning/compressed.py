"""The bytes a compressed block will move, estimated before the engine has encoded it.

A plan is made before enable packs anything, but with ``compress=True`` the copies move the coded
bytes, not the packed ones. Encoding every block to learn its size would double enable's encode time
(~7 GB/s), so each tensor is sampled instead: a strided sample of at most ``SAMPLE_BYTES`` goes
through the compiled core's own encoder with the engine's settings, and the tensor is taken to code
at that ratio. A strided sample sees the same exponent histogram as the whole tensor, and the
histogram is what the ratio depends on. Tensors the codec leaves raw (not bf16, below its minimum
size, or not paying) count raw. Each tensor is charged a descriptor and alignment on top, so the
estimate errs high; once the engine has encoded, the plan is checked against the real sizes
(``replan.recheck``) and every calibration plans with the engine's figures.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from fastoffload_ext.codec.options import MAX_RATIO, MIN_BYTES
from fastoffload_ext.planning.costs import PACK_ALIGNMENT, packed_bytes

logger = logging.getLogger(__name__)

SAMPLE_BYTES = 256 * 1024
# The encoder's settings, the engine's own (codec.options): tensors below MIN_BYTES and tensors that would keep
# more than MAX_RATIO of their bytes travel raw.
# Per coded tensor: its segment descriptor and the 16-byte alignment of its planes, rounded up.
SEGMENT_OVERHEAD_BYTES = 256
HEADER_BYTES = 256


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    values = SAMPLE_BYTES // flat.element_size()
    if flat.numel() > values:
        flat = flat[:: flat.numel() // values][:values]
    # A negative view keeps its values behind a lazy bit that a byte view refuses; the engine packs the
    # values it means (the sign bit alone differs, so the ratio is the same): resolve the sample only.
    return flat.to("cpu").contiguous().resolve_neg().view(torch.uint8)


def tensor_ratio(tensor: torch.Tensor) -> float:
    """The coded / raw ratio the engine's codec reaches on ``tensor`` (1.0: it travels raw)."""
    from fastoffload_ext import _backend

    nbytes = tensor.numel() * tensor.element_size()
    # Without the compiled core nothing is compressed (enable refuses compress=True there itself); a meta
    # tensor (weights= builds from a checkpoint) has no values to sample: it counts raw until the encode.
    if (tensor.dtype != torch.bfloat16 or nbytes < MIN_BYTES or not _backend.ext_available()
            or tensor.device.type == "meta"):
        return 1.0
    core = _backend.require_ext()
    raw = _sample(tensor)
    coded = core.codec_encode(raw, [(0, raw.numel(), True)], max_ratio=MAX_RATIO, min_bytes=MIN_BYTES)
    ratio = coded.numel() / raw.numel()  # the sample's header and descriptor included: errs high
    return ratio if ratio <= MAX_RATIO else 1.0


def estimate_block(block: nn.Module) -> int:
    """The bytes one copy of ``block`` is expected to move once encoded (its packed bytes if none pay)."""
    return estimate_tensors([p for p in block.parameters() if not isinstance(p, nn.parameter.UninitializedParameter)])


def estimate_tensors(params: Sequence[torch.Tensor]) -> int:
    """The coded size of a block made of ``params`` (in packing order), as :func:`estimate_block`."""
    sizes = [p.numel() * p.element_size() for p in params]
    raw = packed_bytes(sizes)
    coded, any_coded = HEADER_BYTES, False
    for param, nbytes in zip(params, sizes):
        ratio = tensor_ratio(param)
        any_coded = any_coded or ratio < 1.0
        coded += (int(nbytes * ratio) + SEGMENT_OVERHEAD_BYTES) if ratio < 1.0 else (
            -(-nbytes // PACK_ALIGNMENT) * PACK_ALIGNMENT)
    return coded if any_coded and coded < raw else raw


def estimate_transfer_bytes(blocks: Sequence[nn.Module]) -> list[int]:
    sizes = [estimate_block(block) for block in blocks]
    logger.debug("estimated compressed block bytes: %s", sizes)
    return sizes


__all__ = ["SAMPLE_BYTES", "estimate_block", "estimate_tensors", "estimate_transfer_bytes", "tensor_ratio"]
