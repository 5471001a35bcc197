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


def resolve_compress(compress: bool | str, backend: str, sharing: bool | None) -> str:
    """The engine's mode for ``compress``: "off", "on" or "auto".

    ``sharing``: whether the ranks of this host share one host copy (None: not decided yet, which
    only "auto" leaves open). A shared copy is one set of bytes for every rank, so it stays raw.
    """
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
    if sharing is not False and compress is True:
        raise OffloadConfigError("fastoffload: compress=True cannot be combined with a host copy shared across the "
                                 "ranks of this host (share_host_copy=True): pass share_host_copy=False to compress "
                                 "each rank's copy, or compress='auto' (shared blocks then travel raw)")
    if sharing:
        return "off"
    return "on" if compress is True else "auto"


def configure_engine(engine: Any, mode: str) -> None:
    verify = os.environ.get(VERIFY_ENV, "").strip() not in ("", "0")
    engine.set_compression(mode, verify=verify)
