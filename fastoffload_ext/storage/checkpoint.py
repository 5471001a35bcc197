"""Where every tensor of a safetensors checkpoint lives: file, byte offset, byte count, dtype, shape.

A checkpoint is one ``.safetensors`` file, a sharded checkpoint named by its ``*.index.json``, or a
folder holding either (a diffusers component folder such as ``transformer/``, or a transformers model
folder). The format's metadata comes from the ``safetensors`` library itself: it validates the header
when a file is opened (a truncated or padded file is refused there), lists the tensors in file order
(``offset_keys``) and gives each one's dtype and shape. The library also guarantees that the data
section is covered exactly, tensor after tensor, with no gap, so each tensor's offset is the sum of the
sizes before it and the data section starts ``sum(sizes)`` bytes before the end of the file.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastoffload_ext.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["Checkpoint", "TensorEntry", "open_checkpoint", "prefetch_headers", "safetensors_module"]

# Preferred names when a folder holds several candidates (diffusers first, then transformers).
_INDEX_NAMES = ("diffusion_pytorch_model.safetensors.index.json", "model.safetensors.index.json")
_FILE_NAMES = ("diffusion_pytorch_model.safetensors", "model.safetensors")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: bytes [offset, offset + nbytes) of ``path``."""

    name: str
    path: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Checkpoint:
    """Every tensor of a checkpoint by name, and the files it spans (with their sizes when read)."""

    source: str
    entries: dict[str, TensorEntry]
    file_sizes: dict[str, int]
    # (size, modification time in ns, inode) of each file, taken before its header was parsed.
    file_stamps: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    def get(self, name: str) -> TensorEntry | None:
        return self.entries.get(name)

    def check_unchanged(self, path: str) -> None:
        """Raises when ``path`` is no longer the file whose header was parsed: enable would otherwise mix
        the tensors of two versions (the reader checks each later read against the file it opened)."""
        stamp = self.file_stamps.get(path)
        if stamp is None:
            return
        try:
            now = _stamp(path)
        except OSError as error:
            raise CheckpointError(f"fastoffload: checkpoint file {path} disappeared while enable read it ({error}); "
                                  "enable again once the checkpoint is in place") from error
        if now != stamp:
            raise CheckpointError(f"fastoffload: checkpoint file {path} changed while enable read it (it had "
                                  f"{stamp[0]} bytes when its header was parsed, now {now[0]}, or it was rewritten); "
                                  "its tensors could mix two versions. Wait until the file is fully written, then "
                                  "enable again")

    @property
    def total_bytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries.values())


def safetensors_module() -> Any:
    """The safetensors package (imported on first use: offload without weights= does not need it)."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError as error:
        raise CheckpointError("fastoffload: weights= reads safetensors checkpoints and needs the safetensors package: "
                              "pip install safetensors") from error
    return safetensors


def _stamp(path: str) -> tuple[int, int, int]:
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns, info.st_ino


def _one_file(path: str) -> tuple[dict[str, TensorEntry], tuple[int, int, int]]:
    st = safetensors_module()
    SafetensorError, safe_open, _getdtype = st.SafetensorError, st.safe_open, st.torch._getdtype
    try:
        stamp = _stamp(path)  # before the parse: a file rewritten while it is parsed shows as changed later
        size = stamp[0]
        with safe_open(path, framework="pt") as handle:
            names = list(handle.offset_keys())
            slices = [handle.get_slice(name) for name in names]
            specs = [(piece.get_dtype(), tuple(piece.get_shape())) for piece in slices]
    except FileNotFoundError as error:
        raise CheckpointError(f"fastoffload: checkpoint file {path} does not exist; check the weights= path "
                              "(a sharded checkpoint's index names every shard, which must sit beside it)") from error
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"fastoffload: {path} is not a readable safetensors file ({error}); it may be "
                              "truncated or still being written: re-download or re-save it") from error
    sizes = []
    entries: dict[str, TensorEntry] = {}
    for name, (dtype_name, shape) in zip(names, specs):
        try:
            dtype = _getdtype(dtype_name)
        except KeyError as error:
            raise CheckpointError(f"fastoffload: tensor '{name}' in {path} has dtype {dtype_name}, which torch "
                                  "cannot hold; convert the checkpoint") from error
        sizes.append(math.prod(shape) * dtype.itemsize)
        entries[name] = TensorEntry(name, path, 0, sizes[-1], dtype, shape)
    offset = size - sum(sizes)
    for name, nbytes in zip(names, sizes):
        entries[name] = TensorEntry(name, path, offset, nbytes, entries[name].dtype, entries[name].shape)
        offset += nbytes
    return entries, stamp


def _index_files(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except FileNotFoundError as error:
        raise CheckpointError(f"fastoffload: checkpoint index {index} does not exist; check the weights= path") from error
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"fastoffload: {index} is not a safetensors index (a JSON object with a "
                              f"'weight_map'): {error}") from error
    if not isinstance(weight_map, dict) or not all(isinstance(shard, str) and shard for shard in weight_map.values()):
        raise CheckpointError(f"fastoffload: {index} is not a safetensors index: its 'weight_map' must map each "
                              "tensor name to the file name of its shard (a JSON object of strings); re-save the "
                              "checkpoint or fix the index")
    return sorted({str(index.parent / shard) for shard in weight_map.values()})


def _pick(folder: Path, pattern: str, preferred: tuple[str, ...]) -> list[Path]:
    found = sorted(folder.glob(pattern))
    for name in preferred:
        if folder / name in found:
            return [folder / name]
    return found


def _files_of(path: Path) -> list[str]:
    if path.name.endswith(".index.json"):
        return _index_files(path)
    if not path.is_dir():
        if not path.exists():
            raise CheckpointError(f"fastoffload: checkpoint {path} does not exist; pass weights= a .safetensors file, "
                                  "an *.index.json of a sharded checkpoint, or a folder holding one")
        return [str(path)]
    indexes = _pick(path, "*.safetensors.index.json", _INDEX_NAMES)
    if len(indexes) == 1:
        shards = _index_files(indexes[0])
        # A whole-model file beside an index it does not name: diffusers would read the index and transformers
        # the file, so which one is meant is not clear from the folder (one of them is often left over).
        single = [path / name for name in _FILE_NAMES if (path / name).is_file() and str(path / name) not in shards]
        if single:
            raise CheckpointError(f"fastoffload: folder {path} holds both the sharded checkpoint {indexes[0].name} "
                                  f"and {single[0].name}, which that index does not name; pass weights= the one to "
                                  "use (the index or the file), or remove the one that is left over")
        return shards
    files = _pick(path, "*.safetensors", _FILE_NAMES)
    if len(indexes) > 1 or (len(files) > 1 and not indexes):
        listed = ", ".join(p.name for p in (indexes or files))
        raise CheckpointError(f"fastoffload: folder {path} holds several checkpoints ({listed}); pass weights= the "
                              "one to use")
    if not files:
        raise CheckpointError(f"fastoffload: folder {path} holds no .safetensors file or *.safetensors.index.json; "
                              "pass weights= a checkpoint")
    return [str(files[0])]


# How much of each file's start prefetch_headers asks for: the 8-byte length and the JSON header of a
# checkpoint of thousands of tensors (a few hundred KiB).
_HEADER_PREFETCH_BYTES = 1 << 20


def prefetch_headers(path: str | os.PathLike[str]) -> None:
    """Asks the kernel to start reading the start of every file of the checkpoint at ``path`` into the
    page cache (``POSIX_FADV_WILLNEED`` returns at once), so that the disk's latency for the headers
    passes while the caller checks the model, instead of inside ``open_checkpoint``. Best effort: a
    path that is not a checkpoint is left for ``open_checkpoint`` to refuse, with its message."""
    try:
        files = _files_of(Path(path))
    except (CheckpointError, OSError):
        return
    for file in files:
        try:
            fd = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, _HEADER_PREFETCH_BYTES, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):  # AttributeError: a platform without posix_fadvise
            pass
        finally:
            os.close(fd)


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Reads the metadata of every file of the checkpoint at ``path`` (no tensor data)."""
    # Absolute: the reader opens the files again and checks them by name before every read, for as long as
    # offload runs, and a relative name would point elsewhere (or nowhere) once the process changes directory.
    files = _files_of(Path(os.path.abspath(path)))
    entries: dict[str, TensorEntry] = {}
    stamps: dict[str, tuple[int, int, int]] = {}
    for file in files:
        found, stamps[file] = _one_file(file)
        for name, entry in found.items():
            if name in entries:
                raise CheckpointError(f"fastoffload: tensor '{name}' is in both {entries[name].path} and {file}; "
                                      "the checkpoint's shards overlap")
            entries[name] = entry
    logger.info("Checkpoint %s: %d tensors in %d file(s)", path, len(entries), len(files))
    return Checkpoint(str(path), entries, {file: stamp[0] for file, stamp in stamps.items()}, stamps)
