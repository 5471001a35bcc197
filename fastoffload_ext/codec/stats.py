"""Per-block codec figures for ``LayerwiseOffloadGroup.stats()``."""
from __future__ import annotations

from typing import Any


def block_stats(engine: Any, handles: list[int | None]) -> list[dict[str, Any]]:
    """One dict per live block: mode ("compressed", "raw" or "measuring"), ratio, raw/compressed/host bytes."""
    result = []
    for handle in handles:
        if handle is None or engine.is_removed(handle):
            continue
        result.append(dict(engine.codec_info(handle)))
    return result


def summarize(blocks: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    raw = sum(b["raw_bytes"] for b in blocks)
    compressed = [b for b in blocks if b["mode"] == "compressed"]
    travelling = sum(b["compressed_bytes"] if b["mode"] == "compressed" else b["raw_bytes"] for b in blocks)
    return {
        "compress": mode,
        "compressed_blocks": len(compressed),
        "compressed_bytes": sum(b["compressed_bytes"] for b in compressed),
        "transfer_ratio": travelling / raw if raw else 1.0,
        "codec": blocks,
    }
