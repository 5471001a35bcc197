"""The ``compress`` argument: validation, and the engine setting it maps to."""
from __future__ import annotations

import logging
import os
from typing import Any

from fastoffload_ext.errors import OffloadConfigError

logger = logging.getLogger(__name__)

# Set to 1 to check every compressed block's checksum whenever the host decodes it (tests, debugging:
# corrupted bytes then raise a clear error instead of decoding to wrong values).
VERIFY_ENV = "FASTOFFLOAD_VERIFY_CODEC"


# The encoder's settings (csrc/codec.h, EncodeOptions): set explicitly so that the ranks sharing one host
# copy can check that they agree on them (engine/sharing.py).
MAX_RATIO = 0.9
MIN_BYTES = 4096


def resolve_compress(compress: bool | str, backend: str) -> str:
    """The engine's mode for ``compress``: "off", "on" or "auto"."""
    if compress is False:
        return "off"
    if compress is not True and compress != "auto":
        raise OffloadConfigError(f"fastoffload: compress must be False, True or 'auto', got {compress!r}")
    if backend != "ext":
        if compress is True:
            raise OffloadConfigError(f"fastoffload: compress=True needs the compiled core (backend 'ext'), but the "
                                     f"{backend!r} backend was chosen; build the extension or pass compress=False")
        logger.info("compress='auto' has no effect with the %r backend: blocks travel raw", backend)
        return "off"
    return "on" if compress is True else "auto"


def codec_settings(mode: str) -> tuple[str, int, float, int]:
    """What the compressed bytes depend on besides the weights: mode, format version and encoder settings.

    A host copy shared across ranks is encoded once, by the owner: every rank must have asked for the
    same settings, so the ranks compare these before sharing.
    """
    from fastoffload_ext import _backend

    return (mode, int(_backend.require_ext().CODEC_VERSION), MAX_RATIO, MIN_BYTES)


def configure_engine(engine: Any, mode: str) -> None:
    verify = os.environ.get(VERIFY_ENV, "").strip() not in ("", "0")
    engine.set_compression(mode, verify=verify, max_ratio=MAX_RATIO, min_bytes=MIN_BYTES)
