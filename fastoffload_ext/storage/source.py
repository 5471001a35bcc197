"""Building an offload from a checkpoint instead of from a materialized model.

``enable_layerwise_offload(model, weights=PATH)`` accepts a model built on the meta device (or with
empty weights) and fills it from ``PATH``:
- every offloaded block is packed straight from the file into its pinned region by the compiled core's
  reader (host tier), or registered to be read every step (disk tier, when ``host_budget`` is smaller
  than the blocks); no pageable copy of a block ever exists;
- every other parameter and every buffer (the resident blocks, embeddings, norms outside the list) is
  read from the file onto the offload device directly; a real buffer the file does not hold (a table the
  model computes when it is built, such as a rotary or position embedding) keeps its values and moves
  to the device with the rest.

Everything the checkpoint must provide is checked before anything changes: a tensor missing from it,
or with another shape or dtype than the model's, is refused with an error naming the tensor and the
file. A failure later (a short read, Ctrl-C) undoes what was loaded, so the model is as it was.
"""
from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fastoffload_ext import _backend
from fastoffload_ext.engine.state import parameter_names
from fastoffload_ext.errors import CheckpointError, CheckpointReadError
from fastoffload_ext.planning.budgets import AUTO
from fastoffload_ext.planning.tiers import region_bytes
from fastoffload_ext.storage.checkpoint import Checkpoint, TensorEntry, open_checkpoint, safetensors_module
from fastoffload_ext.storage.options import DiskOptions
from fastoffload_ext.storage.tiers import TierPlan, plan_tiers, resolve_host_budget

logger = logging.getLogger(__name__)

__all__ = ["PHASES", "BlockSource", "CheckpointSource"]


@dataclass(frozen=True)
class BlockSource:
    """Where one offloaded block's parameters are in the checkpoint."""

    names: tuple[str, ...]     # the block's parameter names (relative to the block)
    entries: tuple[TensorEntry, ...]
    on_disk: bool

    def shapes(self) -> list[list[int]]:
        return [list(entry.shape) for entry in self.entries]


def _mismatch(entry: TensorEntry, tensor: torch.Tensor, kind: str) -> CheckpointError:
    return CheckpointError(
        f"fastoffload: tensor '{entry.name}' in {entry.path} has shape {list(entry.shape)} and dtype {entry.dtype}, "
        f"but the model's {kind} has shape {list(tensor.shape)} and dtype {tensor.dtype}; build the model with "
        "the checkpoint's config and dtype (e.g. torch_dtype=...), or pass the matching checkpoint")


def _missing(checkpoint: Checkpoint, name: str, kind: str) -> CheckpointError:
    sample = ", ".join(sorted(checkpoint.entries)[:3])
    return CheckpointError(
        f"fastoffload: the model's {kind} '{name}' is not in checkpoint {checkpoint.source} ({len(checkpoint.entries)} "
        f"tensors, e.g. {sample}); the checkpoint does not match the model (another architecture, or names with "
        "another prefix)")


def _aligned(nbytes: int, alignment: int) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor read by ``safe_open`` that owns its memory. On the CPU, safetensors returns views of a
    private mapping of the checkpoint file: a later in-place write to the file would change the model's
    weights under it, and a truncation would kill the process (SIGBUS) at the next read. A copy holds the
    bytes as they were read (the check after the read says they were the ones the header described)."""
    return tensor.clone() if tensor.device.type == "cpu" else tensor


def _laid_out_as(old: torch.Tensor, loaded: torch.Tensor) -> torch.Tensor:
    """``loaded`` (contiguous, as read) with the strides of the tensor it replaces, as ``load_state_dict``
    (which copies into the existing tensor) leaves them: the kernels that run on a tensor, and so the
    last bits of their results, can depend on its layout."""
    if old.stride() == loaded.stride() or old.is_contiguous():
        return loaded
    laid_out = torch.empty_like(old, device=loaded.device)  # keeps a dense layout, else contiguous
    return laid_out.copy_(loaded) if laid_out.stride() != loaded.stride() else loaded


# The start-up's phases, in the order they run (see CheckpointSource.phases).
PHASES = ("checkpoint", "match", "reader", "spill", "resident", "attach", "finish")


class CheckpointSource:
    """The plan for filling one model from one checkpoint; ``enable_layerwise_offload`` drives it."""

    def __init__(self, checkpoint: Checkpoint, blocks: list[BlockSource], resident: dict[str, TensorEntry],
                 tiers: TierPlan, options: DiskOptions) -> None:
        self.checkpoint = checkpoint
        self.blocks = blocks
        self.resident = resident  # model-level name -> entry, for everything that is not offloaded
        self.tiers = tiers
        self.options = options
        self.reader: Any = None
        self.file_index: dict[str, int] = {}
        self._undo: list[tuple[nn.Module, str, str, Any]] = []  # (module, kind, key, old value)
        self._replaced: dict[int, torch.Tensor] = {}  # tied parameters and buffers get one new tensor
        self._loaded: set[str] = set()  # resident names already read
        self.block_buffers: set[str] = set()  # resident names that are buffers of offloaded blocks
        self.kept: list[str] = []  # real buffers outside the offloaded blocks that the checkpoint does not hold
        self._next_block = 0
        # For promotions (next_block): each block's packed bytes, the budget, the engine's codec mode.
        self.block_bytes: list[int] = []
        self.host_budget: int | None = None
        self.compress = "off"
        # Seconds spent in each phase of the build (PHASES), so that a slow start-up says where its time
        # went: "checkpoint" opening the files and parsing their headers, "match" checking them against
        # the model and planning the tiers, "reader" making the reader (its threads) and opening the
        # files, "spill" creating the compressed disk tier's file, "resident" reading the tensors outside
        # the offloaded blocks onto the device, "attach" registering the blocks (allocating their regions
        # and queueing their reads), "finish" the staging ring and the wait for the host tier's reads and
        # pins. The reader's own counters (first and last read) place the reads inside that time.
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.reader_made_at: float | None = None  # time.perf_counter() when the reader was made

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phases[phase] += time.perf_counter() - started

    # Before anything changes.
    @classmethod
    def prepare(cls, model: nn.Module, block_names: Sequence[str], blocks: nn.ModuleList, offloaded: list[int],
                weights: Any, host_budget: object, options: DiskOptions | None,
                device: torch.device | None = None) -> CheckpointSource:
        """``blocks`` in ring order (every block of every offloaded list) and ``block_names``, each one's name in
        the model (``single_transformer_blocks.3``), under which the checkpoint holds its tensors."""
        options = options if options is not None else DiskOptions()
        started = time.perf_counter()
        checkpoint = open_checkpoint(weights)
        opened = time.perf_counter()
        sources, block_bytes = cls._block_sources(checkpoint, block_names, blocks, offloaded)
        cls._check_layouts(block_names, blocks, offloaded)
        resident = cls._resident_entries(checkpoint, model, blocks, offloaded)
        cls._warn_unused(checkpoint, model)
        budget = resolve_host_budget(host_budget, *cls._host_use(blocks, offloaded, resident, device, host_budget))
        tiers = plan_tiers(block_bytes, budget.bytes, options.staging_buffers, budget.source)
        if tiers.disk:
            logger.info("Disk tier: %d of %d offloaded blocks stay on disk (%s; %d bytes pinned)", len(tiers.disk),
                        len(block_bytes), budget.source, tiers.host_bytes)
        sources = [BlockSource(s.names, s.entries, tiers.on_disk(i)) for i, s in enumerate(sources)]
        source = cls(checkpoint, sources, resident, tiers, options)
        source.block_bytes, source.host_budget = list(block_bytes), budget.bytes
        prefixes = tuple(f"{block_names[i]}." for i in offloaded)
        source.block_buffers = {name for name in resident if name.startswith(prefixes)}
        # Attaching a block moves its own buffers; the others are moved with the resident tensors.
        source.kept = [name for name, tensor, kind in cls._named_tensors(model)
                       if kind == "buffer" and name not in resident and not tensor.is_meta
                       and not name.startswith(prefixes)]
        source.phases["checkpoint"] = opened - started
        source.phases["match"] = time.perf_counter() - opened
        return source

    @classmethod
    def _warn_unused(cls, checkpoint: Checkpoint, model: nn.Module) -> None:
        """Says which tensors of the checkpoint the model has no name for: load_state_dict refuses them, and a
        model built with another config than the checkpoint's (fewer blocks, say) would otherwise run without
        them, with no sign of it."""
        names = {name for name, _, _ in cls._named_tensors(model)}
        unused = sorted(name for name in checkpoint.entries if name not in names)
        if unused:
            logger.warning("fastoffload: checkpoint %s holds %d tensor(s) that the model has no parameter or buffer "
                           "for (e.g. %s); they are not read. Check that the model was built with the checkpoint's "
                           "config", checkpoint.source, len(unused), ", ".join(unused[:3]))

    @staticmethod
    def _host_use(blocks: nn.ModuleList, offloaded: list[int], resident: dict[str, TensorEntry],
                  device: torch.device | None, host_budget: object) -> tuple[int, int]:
        """(bytes the build adds to host memory beside the pinned blocks, bytes the blocks hold there now
        and the build frees): what a measured host budget must leave room for, and may count as free."""
        if host_budget != AUTO:
            return 0, 0  # a given budget is taken as it is
        # On the host device the resident weights land in host memory too, beside the pinned blocks.
        # Each tensor once: the names of a tied weight share one entry.
        unique = {entry.name: entry for entry in resident.values()}
        on_host = sum(e.nbytes for e in unique.values()) if device is not None and device.type == "cpu" else 0
        credit = sum(p.numel() * p.element_size() for i in offloaded for p in blocks[i].parameters()
                     if p.device.type == "cpu")
        return on_host, credit

    @staticmethod
    def _check_layouts(block_names: Sequence[str], blocks: nn.ModuleList, offloaded: list[int]) -> None:
        """Every parameter of an offloaded block has the contiguous layout of its shape."""
        for index in offloaded:
            for name, param in blocks[index].named_parameters():
                key = f"{block_names[index]}.{name}"
                if not param.is_contiguous():
                    raise CheckpointError(
                        f"fastoffload: parameter '{key}' has strides {list(param.stride())}, not the contiguous "
                        f"layout of its shape {list(param.shape)}; a block built from weights= is packed in the "
                        "checkpoint's row-major order, so the parameter would change its layout and its block "
                        "could compute other results than the resident model. Build the model with contiguous "
                        "parameters, keep that block resident (resident_blocks), or load the model and enable "
                        "without weights=")

    @staticmethod
    def _block_sources(checkpoint: Checkpoint, block_names: Sequence[str], blocks: nn.ModuleList,
                       offloaded: list[int]) -> tuple[list[BlockSource], list[int]]:
        alignment = int(_backend.require_ext().build_info()["alignment"])
        sources, sizes = [], []
        for index in offloaded:
            names, entries = [], []
            # A weight tied inside the block may be stored under any one of its names; held under several, the
            # last one load_state_dict would copy is the value it keeps.
            aliases = parameter_names(blocks[index], f"{block_names[index]}.")
            for name, param in blocks[index].named_parameters():
                key = f"{block_names[index]}.{name}"
                held = [found for found in map(checkpoint.get, aliases[id(param)]) if found is not None]
                entry = held[-1] if held else None
                if entry is None:
                    raise _missing(checkpoint, key, "parameter")
                if entry.dtype != param.dtype or tuple(entry.shape) != tuple(param.shape):
                    raise _mismatch(entry, param, "parameter")
                names.append(name)
                entries.append(entry)
            sources.append(BlockSource(tuple(names), tuple(entries), False))
            sizes.append(sum(_aligned(entry.nbytes, alignment) for entry in entries))
        return sources, sizes

    @staticmethod
    def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, str]]:
        for name, param in model.named_parameters(remove_duplicate=False):
            yield name, param, "parameter"
        for name, buffer in model.named_buffers(remove_duplicate=False):
            if buffer is not None:
                yield name, buffer, "buffer"

    @classmethod
    def _resident_entries(cls, checkpoint: Checkpoint, model: nn.Module, blocks: nn.ModuleList,
                          offloaded_indices: list[int]) -> dict[str, TensorEntry]:
        # By identity, not by name: a block list reached by a second name (self.stages = self.blocks)
        # holds the offloaded parameters under that name too, and reading them there would put real
        # values in place of the engine's, so the block would never be offloaded.
        offloaded = {id(param) for i in offloaded_indices for param in blocks[i].parameters()}
        resident: dict[str, TensorEntry] = {}
        # A tensor held under several names (tied weights) needs only one of them in the checkpoint:
        # safetensors' save_model, and the libraries built on it, keep one name of each tie. Held under several,
        # it takes the last one's values, as load_state_dict (which copies every name in that order) leaves it.
        stored: dict[int, TensorEntry] = {}
        # A real buffer that its module does not save (non-persistent: a table computed when the model is
        # built) keeps its values, as load_state_dict leaves it, even when an older checkpoint holds one
        # under its name; a meta one has no values and is read from the checkpoint when it is there.
        computed = {f"{prefix}.{key}" if prefix else key
                    for prefix, module in model.named_modules(remove_duplicate=False)
                    for key in module._non_persistent_buffers_set
                    if module._buffers.get(key) is not None and not module._buffers[key].is_meta}
        for name, tensor, _ in cls._named_tensors(model):
            entry = checkpoint.get(name)
            if entry is not None:
                stored[id(tensor)] = entry
        for name, tensor, kind in cls._named_tensors(model):
            if (kind == "parameter" and id(tensor) in offloaded) or (kind == "buffer" and name in computed):
                continue
            entry = stored.get(id(tensor))
            if entry is None:
                # A parameter must come from the checkpoint even when it holds values (random init, empty
                # weights): kept, it would run with values that are not the checkpoint's, without an error.
                if tensor.is_meta or kind == "parameter":
                    if kind == "buffer":
                        raise CheckpointError(
                            f"fastoffload: buffer '{name}' is on the meta device and not in checkpoint "
                            f"{checkpoint.source}, so it has no values; build the model with its buffers on the "
                            "CPU (e.g. accelerate's init_empty_weights(include_buffers=False))")
                    raise _missing(checkpoint, name, kind)
                continue  # a real tensor the checkpoint does not hold (a computed buffer): kept as it is
            if entry.dtype != tensor.dtype or tuple(entry.shape) != tuple(tensor.shape):
                raise _mismatch(entry, tensor, kind)
            resident[name] = entry
        return resident

    # Changes, each undone by roll_back().
    def open_files(self, engine: Any) -> None:
        """The reader of the engine, with every file of the checkpoint opened (size and mtime recorded)."""
        core = _backend.require_ext()
        opts = self.options
        with self.timed("reader"):
            self.reader_made_at = time.perf_counter()
            self.reader = core.DiskReader(opts.read_threads, opts.chunk_bytes, opts.read_mode)
            try:
                for path in sorted({entry.path for block in self.blocks for entry in block.entries}):
                    self.file_index[path] = self.reader.open(path)
                    self.checkpoint.check_unchanged(path)  # the reader checks every later read against this file
                engine.set_reader(self.reader)
            except BaseException:
                # Nothing holds the reader but this source, which the traceback keeps: its threads and the files
                # it opened go now.
                self.reader = None
                self.file_index.clear()
                raise

    def open_spill(self, engine: Any, compress: str) -> None:
        """With compression and a disk tier: the spill file the disk-tier blocks are encoded into."""
        self.compress = compress
        if compress == "off" or not self.tiers.disk:
            return
        opts = self.options
        first = min(entry.path for block in self.blocks for entry in block.entries)
        # Absolute, as the checkpoint's files are: the reader checks the spill file by name before every read.
        folder = os.path.abspath(opts.spill_dir) if opts.spill_dir is not None else os.path.dirname(first)
        # A name of this process alone; the engine creates it exclusively and removes it at detach.
        with self.timed("spill"):
            try:
                engine.set_spill_file(os.path.join(folder, f".fastoffload-spill-{os.getpid()}-{secrets.token_hex(8)}"))
            except BaseException:
                # The enable stops here, before any block: the engine lets go of the reader's threads and files
                # now, not once the traceback that holds it goes.
                engine.close()
                raise

    def spans(self, block: BlockSource) -> list[tuple[int, int, int]]:
        return [(self.file_index[e.path], e.offset, e.nbytes) for e in block.entries]

    def next_block(self, engine: Any = None) -> BlockSource:
        """The next block to attach (the blocks before it are in the engine already)."""
        index = self._next_block
        self._next_block += 1
        if self._promotes(index, engine):
            self.blocks[index] = replace(self.blocks[index], on_disk=False)
            logger.info("Disk tier: block %d moves to the host tier (the compressed host blocks left room)", index)
        return self.blocks[index]

    def _promotes(self, index: int, engine: Any) -> bool:
        """Whether a disk-tier block fits in host memory after all: the tier plan counts raw bytes, but with
        compression the host blocks before it hold fewer. Counted conservatively: what the pool holds now,
        this block's raw region (it exists while it is encoded), the raw regions of every later host block,
        and the staging ring."""
        block = self.blocks[index]
        if not block.on_disk or self.compress == "off" or engine is None or self.host_budget is None:
            return False
        # The encoder trails the reads (the engine encodes a block once later reads are queued): let it
        # catch up, so that the pool holds the host blocks before this one at their compressed size.
        engine.finish_loading()
        later = sum(region_bytes(self.block_bytes[i]) for i in range(index + 1, len(self.blocks))
                    if not self.blocks[i].on_disk)
        held = int(engine.pool.stats()["in_use_bytes"])
        return held + region_bytes(self.block_bytes[index]) + later + self.tiers.staging_bytes <= self.host_budget

    def load_block_buffers(self, model: nn.Module, device: torch.device) -> None:
        """The buffers inside the offloaded blocks, read onto ``device``: attaching a block moves its
        buffers to the device, so they need their values before the blocks are attached."""
        self._load(model, device, sorted(self.block_buffers - self._loaded))

    def load_resident(self, model: nn.Module, device: torch.device) -> None:
        """Every non-offloaded parameter and every buffer not read yet, from the checkpoint onto
        ``device``, and the buffers the checkpoint does not hold, moved there with their values. Called
        once the blocks are attached, so that it runs while their reads do."""
        self._load(model, device, [name for name in self.resident if name not in self._loaded])
        moved: dict[int, torch.Tensor] = {}  # a buffer held under several names stays one tensor

        def move(buffer: torch.Tensor) -> torch.Tensor:
            if id(buffer) not in moved:
                moved[id(buffer)] = buffer.to(device)
            return moved[id(buffer)]

        with torch.inference_mode(False):
            for name in self.kept:
                prefix, _, leaf = name.rpartition(".")
                buffer = model.get_submodule(prefix)._buffers[leaf]
                if buffer is not None and buffer.device != device:
                    self._assign(model, name, lambda b=buffer: move(b), {})
        logger.info("Loaded %d resident tensors from %s onto %s", len(self.resident), self.checkpoint.source, device)

    def _load(self, model: nn.Module, device: torch.device, names: list[str]) -> None:
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.resident[name].path, []).append(name)
        safe_open = safetensors_module().safe_open
        # Ordinary tensors, also when enable is called in inference mode: the model keeps them for good, and
        # inference tensors would refuse every later in-place update (load_state_dict) and autograd outside it.
        with self.timed("resident"), torch.inference_mode(False):
            for path, in_file in by_file.items():
                with safe_open(path, framework="pt", device=str(device)) as handle:
                    for name in in_file:
                        key = self.resident[name].name  # another name of a tied tensor may hold its values
                        self._assign(model, name, lambda k=key: _owned(handle.get_tensor(k)), self._replaced)
                        self._loaded.add(name)
                self.checkpoint.check_unchanged(path)  # what was just read is the file the header described

    def _assign(self, model: nn.Module, name: str, load: Any, replaced: dict[int, torch.Tensor]) -> None:
        prefix, _, leaf = name.rpartition(".")
        module = model.get_submodule(prefix)
        if leaf in module._parameters:
            old = module._parameters[leaf]
            new = replaced.get(id(old))
            if new is None:
                new = nn.Parameter(_laid_out_as(old, load()), requires_grad=old.requires_grad)
                replaced[id(old)] = new
            self._undo.append((module, "parameter", leaf, old))
            module._parameters[leaf] = new
        else:
            old = module._buffers[leaf]
            # A buffer held under several names (one running statistic or table shared by modules) stays one
            # tensor, as load_state_dict (which copies into it) leaves it: an in-place update through one name
            # must reach the others.
            buffer = replaced.get(id(old))
            if buffer is None:
                buffer = _laid_out_as(old, load())
                replaced[id(old)] = buffer
            self._undo.append((module, "buffer", leaf, old))
            module._buffers[leaf] = buffer

    def start(self, engine: Any) -> None:
        """Waits for the host tier's reads and pins, and starts the disk tier, if any.

        The blocks' reads were only queued while the blocks were attached; with a disk tier, its staging
        ring is allocated and pinned while they still run, and the engine waits for them after that.
        """
        with self.timed("finish"):
            try:
                if any(block.on_disk for block in self.blocks):  # not all promoted to the host tier (next_block)
                    engine.start_disk_tier(self.tiers.staging_buffers)
                else:
                    engine.finish_loading()
            except CheckpointReadError:
                # The reader checks a job's files before and after its reads; a file written meanwhile is said
                # as enable's own checks say it.
                for path in sorted(self.file_index):
                    self.checkpoint.check_unchanged(path)
                raise
        logger.info("Start-up from %s, ms per phase: %s", self.checkpoint.source,
                    ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in self.phases.items()))

    def commit(self) -> None:
        """Enable succeeded: forgets the tensors load_resident replaced. The group's finalizer holds the
        states until the model dies and the states reach this source, so a record that names the model
        (a tensor on the model itself) would keep it alive for good."""
        self._undo.clear()
        self._replaced.clear()

    def roll_back(self) -> None:
        """Puts back every tensor that load_resident replaced (the offloaded blocks undo their own)."""
        for module, kind, key, old in reversed(self._undo):
            (module._parameters if kind == "parameter" else module._buffers)[key] = old
        self._undo.clear()
        self._replaced.clear()
        self._loaded.clear()
