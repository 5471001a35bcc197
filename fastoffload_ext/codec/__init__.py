"""Lossless compressed host copies: ``enable_layerwise_offload(..., compress=False | True | "auto")``.

The codec itself is in the compiled core (csrc/codec.{h,cpp}: format, multi-threaded encoder, host
decoder; csrc/codec_decode.cu: the GPU decoder in the copy pipeline). This package only checks the
argument, configures the engine and reports per-block figures for ``LayerwiseOffloadGroup.stats()``.
See docs/DESIGN.md, "Compressed host copies".
"""
from __future__ import annotations

from fastoffload_ext.codec.options import VERIFY_ENV, codec_settings, configure_engine, resolve_compress
from fastoffload_ext.codec.stats import block_stats, summarize

__all__ = ["VERIFY_ENV", "block_stats", "codec_settings", "configure_engine", "resolve_compress", "summarize"]
