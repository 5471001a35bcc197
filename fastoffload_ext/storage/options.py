"""Knobs of the disk reader and the disk tier, validated once."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.storage.checkpoint import prefetch_headers

__all__ = ["READ_MODES", "DiskOptions", "check_storage_arguments"]

READ_MODES = ("auto", "direct", "buffered")


def _positive_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise OffloadConfigError(f"fastoffload: DiskOptions.{name} must be an integer between {low} and {high}, "
                                 f"got {value!r}")


@dataclass(frozen=True)
class DiskOptions:
    """How checkpoint bytes are read.

    staging_buffers: pinned buffers of the largest block that the disk tier reads ahead into (the
        look-ahead, in blocks); they count against ``host_budget``.
    read_threads: read requests in flight at once (the reader runs twice as many worker threads, so that
        one copying a finished request out of its buffer never leaves the disk a request short).
    chunk_bytes: the largest single read request.
    read_mode: "auto" (O_DIRECT where the file system accepts it, else buffered), "direct" (O_DIRECT or
        an error) or "buffered" (through the page cache).
    spill_dir: with compression on, the directory of the spill file that holds the disk tier's
        compressed blocks (None: the checkpoint's directory). Created at enable, removed at detach.
    """

    staging_buffers: int = 2
    read_threads: int = 4
    chunk_bytes: int = 8 << 20
    read_mode: str = "auto"
    spill_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.spill_dir is not None and not isinstance(self.spill_dir, (str, os.PathLike)):
            raise OffloadConfigError(f"fastoffload: DiskOptions.spill_dir must be a directory path or None, got "
                                     f"{type(self.spill_dir).__name__}")
        _positive_int("staging_buffers", self.staging_buffers, 1, 64)
        _positive_int("read_threads", self.read_threads, 1, 256)
        _positive_int("chunk_bytes", self.chunk_bytes, 4096, 1 << 30)
        if self.read_mode not in READ_MODES:
            raise OffloadConfigError(f"fastoffload: DiskOptions.read_mode must be one of "
                                     f"{', '.join(map(repr, READ_MODES))}, got {self.read_mode!r}")


def check_storage_arguments(weights: Any, disk_options: Any, backend: str, share_host_copy: bool | str) -> bool | str:
    """Refusals of ``weights``/``disk_options`` before anything changes; returns the ``share_host_copy`` to
    use (building from a checkpoint gives each process its own host copy)."""
    if weights is None:
        if disk_options is not None:
            raise OffloadConfigError("fastoffload: disk_options needs weights=: the blocks that do not fit in host "
                                     "memory are read from the checkpoint file")
        return share_host_copy
    if not isinstance(weights, (str, os.PathLike)):
        raise OffloadConfigError(f"fastoffload: weights= takes the path of a safetensors checkpoint (a .safetensors "
                                 f"file, a sharded checkpoint's *.index.json, or a folder holding one), got "
                                 f"{type(weights).__name__}. To offload a model from tensors in memory (a state "
                                 "dict), load them into the model first and enable without weights=")
    if backend != "ext":
        raise OffloadConfigError("fastoffload: weights= needs the compiled core (backend 'ext'); the python backend "
                                 "builds from a materialized model: load the state dict first")
    if share_host_copy is True:
        raise OffloadConfigError("fastoffload: weights= and share_host_copy=True cannot be combined yet: each rank "
                                 "reads its own host copy from the checkpoint")
    if disk_options is not None and not isinstance(disk_options, DiskOptions):
        raise OffloadConfigError(f"fastoffload: disk_options must be a fastoffload_ext.storage.DiskOptions, got "
                                 f"{type(disk_options).__name__}")
    if isinstance(weights, (str, os.PathLike)):
        # The headers' reads start now and run while enable checks the model, before they are parsed.
        prefetch_headers(weights)
    return False
