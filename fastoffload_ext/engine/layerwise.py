"""Layerwise offload of a transformer's block list: the hook, and enable/disable.

``enable_layerwise_offload(model)`` takes the first direct-child ``nn.ModuleList`` of ``model`` (Wan:
``blocks``, Flux/Cosmos/SD3: ``transformer_blocks``, HunyuanVideo: ``double_blocks``), keeps its
blocks' weights in host memory and puts a :class:`LayerwiseOffloadHook` on every block: before block
*i* runs its weights are made resident and the next ``prefetch_depth`` blocks start copying on a side
stream; after it runs its weights are dropped again. The last block prefetches the first (``cyclic``),
so the next denoising step starts warm. It is a drop-in for FastVideo's
``fastvideo.hooks.layerwise_offload``: same names, same hook name, same callers.

Two backends do the moving, with bit-identical results:
- ``"ext"``: the compiled core. One packed pinned region per block, one copy per block into static
  device slots, event-ordered reuse, parameter rebinding in C++.
- ``"python"``: FastVideo's algorithm, per-parameter pinning and copies. It is the fallback when the
  compiled core is unavailable and the baseline of every benchmark.
``"auto"`` picks ``"ext"`` when it can.

What stays where: only parameters are offloaded; buffers of the offloaded blocks (rotary tables, norm
statistics) are moved to the offload device and stay there, and modules outside the block list are the
caller's business, as with FastVideo.

Autograd: a grad-recording forward through an offloaded block whose parameters require grad raises
(see ``offload_state.GRAD_ERROR``): run inference under ``torch.no_grad()`` or ``inference_mode()``.

Several ranks of one host (torchrun): with ``share_host_copy`` (default "auto": when torch.distributed
is initialized, the backend is "ext" and the group has several ranks on this host) the ranks of a host
share one host copy in shared memory instead of one each; ``enable_layerwise_offload`` is then a
collective that every rank must call with the same model, and ``mutate_params_scope`` is refused (merge
LoRA before enabling). See ``sharing.py``.

Tied weights: a parameter shared between two offloaded blocks, or between an offloaded block and any
other part of the model, is refused at enable with an error naming both places (offloading one side
would silently turn the other into a placeholder).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fastoffload_ext import _backend
from fastoffload_ext.engine import sharing
from fastoffload_ext.engine.hooks import ForwardHook, ModuleHookManager
from fastoffload_ext.engine.offload_state import ExtLayerwiseOffloadState, LayerwiseOffloadState
from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.storage.options import DiskOptions
from fastoffload_ext.storage.source import CheckpointSource
from fastoffload_ext.storage.state import CheckpointOffloadState

logger = logging.getLogger(__name__)

GROUP_ATTRIBUTE = "_fastoffload_group"
BACKENDS = ("auto", "ext", "python")
PIN_BACKINGS = ("host_alloc", "register", "pageable")
# mmap + cudaHostRegister: measured on the H200 (2026-11-29, one fresh 1 GiB allocation) at 382 ms/GiB
# against 622 ms/GiB for cudaHostAlloc, with the same H2D bandwidth from either (55.4 vs 55.5 GB/s at
# 1 GiB, 54.5 vs 54.8 at 16 MiB).
DEFAULT_PIN_BACKING = "register"


class LayerwiseOffloadHook(ForwardHook):
    """Loads a block's weights before its forward and drops them after (FastVideo's hook)."""

    def __init__(self, state: LayerwiseOffloadState) -> None:
        self.state = state
        self.detach_device: torch.device | None = None  # where on_detach puts the parameters

    @classmethod
    def name(cls) -> str:
        return "LayerwiseOffloadHook"

    def on_attach(self, module: nn.Module) -> None:
        self.state.on_init(module)

    def on_detach(self, module: nn.Module) -> None:
        device = self.detach_device if self.detach_device is not None else self.state.device
        self.state.restore(module, device)

    # The entry points are compiler boundaries: torch.compile must not trace into host-side weight
    # movement (stream waits, copies, rebinding). Without the boundary dynamo would break the graph
    # inside the hook once per block per step, fragmenting a compiled block and blocking CUDA-graph
    # capture; with it, the hook is one opaque eager call and the block body stays one region.
    @torch.compiler.disable
    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        state = self.state
        state._acquire()
        try:
            for target in state.prefetch_targets:
                target._prefetch()
        except BaseException:
            state._release()  # the manager only cleans up hooks whose pre_forward completed
            raise
        return args, kwargs

    @torch.compiler.disable
    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self.state._release()
        return output

    @contextlib.contextmanager
    def mutate_params_scope(self) -> Iterator[None]:
        """The block's weights are on the device, as ordinary tensors, for the whole scope.

        Change them in place (LoRA merge) or replace submodules (adapter conversion adds parameters):
        on exit, the host copy is rebuilt from whatever parameters the block has then, and offload
        resumes. The rebuild also runs when the scope exits with an exception.
        """
        self.state.begin_mutation()
        try:
            yield
        finally:
            self.state.end_mutation()
            group = _group_of_state(self.state)
            if group is not None:
                group._claim(self.state)


def _group_of_state(state: LayerwiseOffloadState) -> LayerwiseOffloadGroup | None:
    return getattr(state, "_group", None)


class LayerwiseOffloadGroup:
    """What ``enable_layerwise_offload`` set up on one model: its states, engine and settings."""

    def __init__(self, model: nn.Module, list_name: str, blocks: nn.ModuleList, device: torch.device, backend: str,
                 prefetch_depth: int, resident_blocks: int, cyclic: bool, engine: Any = None) -> None:
        self.model_ref = model
        self.list_name = list_name
        self.blocks = blocks
        self.device = device
        self.backend = backend
        self.prefetch_depth = prefetch_depth
        self.resident_blocks = resident_blocks
        self.cyclic = cyclic
        self.engine = engine
        self.share: sharing.HostShare | None = None  # set when the ranks of this host share the host copy
        self.states: list[LayerwiseOffloadState] = []
        self.original_devices: list[torch.device] = []
        self._owner: dict[int, str] = {}  # id(param) -> "list.i.name", for the tied-weight check

    def _claim(self, state: LayerwiseOffloadState) -> None:
        """Re-registers the parameters of ``state``'s block (after a mutation may have changed them)."""
        index = self.states.index(state)
        prefix = f"{self.list_name}.{self.resident_blocks + index}."
        self._owner = {key: where for key, where in self._owner.items() if not where.startswith(prefix)}
        for name, param in state.module_ref.named_parameters():
            self._owner[id(param)] = prefix + name

    def stats(self) -> dict[str, Any]:
        """Sizes and counters of this offload, for logs and benchmarks."""
        weight_bytes = sum(_weight_bytes(state) for state in self.states)
        result: dict[str, Any] = {
            "backend": self.backend,
            "device": str(self.device),
            "blocks": len(self.blocks),
            "offloaded_blocks": len(self.states),
            "resident_blocks": self.resident_blocks,
            "prefetch_depth": self.prefetch_depth,
            "cyclic": self.cyclic,
            "weight_bytes": weight_bytes,
            "host_bytes": sum(state.host_bytes() for state in self.states),
        }
        if self.engine is not None:
            engine_stats = dict(self.engine.stats())
            pool_stats = dict(self.engine.pool.stats())
            result.update(pinned_bytes=pool_stats["pinned_bytes"], host_reserved_bytes=pool_stats["reserved_bytes"],
                          pin_seconds=pool_stats["pin_seconds"], slot_bytes=engine_stats["slot_bytes"],
                          num_slots=engine_stats["num_slots"], copies=engine_stats["copies"],
                          bytes_copied=engine_stats["bytes_copied"], sync_loads=engine_stats["sync_loads"],
                          prefetch_hits=engine_stats["prefetch_hits"], cache_hits=engine_stats["cache_hits"],
                          shared_bytes=pool_stats["shared_bytes"], shared_owned_bytes=pool_stats["shared_owned_bytes"],
                          shared_by=self.share.shared_by if self.share is not None else 0,
                          shared_owner=self.share is not None and self.share.owner)
        else:
            # torch's caching host allocator rounds every pinned tensor up to a power of two.
            pinned = 0
            if self.device.type == "cuda":
                pinned = sum(1 << max(int(t.untyped_storage().nbytes()) - 1, 0).bit_length()
                             for state in self.states for t in state.cpu_named_parameters.values())
            result.update(pinned_bytes=pinned, host_reserved_bytes=max(pinned, result["host_bytes"]),
                          slot_bytes=0, num_slots=0)
        return result

    def __repr__(self) -> str:
        return (f"<LayerwiseOffloadGroup {self.list_name}: {len(self.states)} of {len(self.blocks)} blocks offloaded "
                f"to {self.device} by backend {self.backend!r}, prefetch_depth={self.prefetch_depth}>")


def _weight_bytes(state: LayerwiseOffloadState) -> int:
    if isinstance(state, ExtLayerwiseOffloadState):
        if state.handle is None or state.engine.is_removed(state.handle):
            return 0
        return sum(v.numel() * v.element_size() for v in state.cpu_named_parameters.values())
    return sum(v.numel() * v.element_size() for v in state.cpu_named_parameters.values())


def get_offload_group(model: nn.Module) -> LayerwiseOffloadGroup | None:
    """The offload set up on ``model`` by ``enable_layerwise_offload``, or None."""
    return getattr(model, GROUP_ATTRIBUTE, None)


def _resolve_device(device: str | torch.device | int | None) -> torch.device | None:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return None
    if isinstance(device, int):
        device = torch.device("cuda", device)
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}") from error
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {str(device)!r}: layerwise offload moves "
                         "weights between host memory and a CUDA device ('cpu' runs the same engine with the host as "
                         "its device, for tests)")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {str(device)!r} was asked for but CUDA is not available; pass device='cpu' to run "
                           "the offload engine on the host, or None to skip offloading on machines without CUDA")
    index = resolved.index if resolved.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
    return torch.device("cuda", index)


def _choose_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    ext_usable = _backend.ext_available() and (device.type == "cpu" or _backend.ext_has_cuda())
    if backend == "ext":
        _backend.require_ext()
        if not ext_usable:
            raise RuntimeError("fastoffload_ext: backend='ext' on a CUDA device needs the compiled core built with "
                               "CUDA, but it was built CPU-only; rebuild with FASTOFFLOAD_CUDA=1 pip install "
                               "--no-build-isolation . or use backend='python'")
        return "ext"
    if backend == "python":
        return "python"
    if not ext_usable:
        logger.info("Layerwise offload uses the python backend: %s", _backend.REASON if not _backend.ext_available()
                    else "the compiled core was built without CUDA")
        return "python"
    return "ext"


def _find_block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            return name, child
    return None


def _check_tied_parameters(model: nn.Module, list_name: str, blocks: nn.ModuleList, first_offloaded: int) -> dict[int, str]:
    owner: dict[int, str] = {}
    for index in range(first_offloaded, len(blocks)):
        for name, param in blocks[index].named_parameters():
            where = f"{list_name}.{index}.{name}"
            if id(param) in owner:
                raise ValueError(f"parameter {where} is the same tensor as {owner[id(param)]}: tied weights across "
                                 "offloaded blocks are not supported (offloading one would turn the other into a "
                                 "placeholder). Untie them (clone one), or keep those blocks resident with "
                                 "resident_blocks")
            owner[id(param)] = where
    offloaded = set(owner)
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in offloaded:
            continue
        if name.startswith(f"{list_name}."):
            index = int(name[len(list_name) + 1:].split(".", 1)[0])
            if index >= first_offloaded:
                continue
        raise ValueError(f"parameter {name} is the same tensor as {owner[id(param)]}, which would be offloaded: "
                         "weights tied between an offloaded block and the rest of the model are not supported. Untie "
                         "them (clone one), or keep that block resident with resident_blocks")
    return owner


def _check_devices(blocks: list[nn.Module], offset: int, device: torch.device, from_file: bool = False) -> None:
    for index, block in enumerate(blocks):
        for name, param in block.named_parameters():
            if param.device.type == "meta" and from_file:
                continue  # filled from the checkpoint
            if param.device.type == "meta":
                raise ValueError(f"parameter {offset + index}.{name} is on the meta device and has no values to offload;"
                                 " materialize the model first (e.g. to_empty(device=...) then load_state_dict)")
            if param.device.type not in ("cpu", device.type) or (param.device.type == "cuda" and param.device != device):
                raise ValueError(f"parameter {offset + index}.{name} is on {param.device}, but offload goes to {device}: "
                                 f"move the model to the CPU or to {device} before enabling offload")


def enable_layerwise_offload(model: nn.Module, is_replace: bool = False, *, resident_blocks: int | None = None,
                             cyclic: bool = True, prefetch_depth: int = 1, backend: str = "auto",
                             device: str | torch.device | int | None = None, pin_backing: str | None = None,
                             allow_pageable_fallback: bool = False,
                             pinned_limit_bytes: int | None = None, share_host_copy: bool | str = "auto",
                             process_group: Any = None, weights: Any = None, host_budget: int | None = None,
                             disk_options: DiskOptions | None = None) -> LayerwiseOffloadGroup | None:
    """Offload the blocks of ``model``'s first direct-child ``nn.ModuleList`` layer by layer.

    Args:
        model: the transformer. Its block list may be on the CPU or already on ``device``.
        is_replace: swap an existing offload hook on every block (FastVideo's flag); raises when there is
            none.
        resident_blocks: keep the first N blocks on the device, never copied.
        cyclic: the last block prefetches the first, so the next step starts warm. Set False for
            modules that run once per request (text encoders).
        prefetch_depth: how many blocks ahead are copied while a block runs (device slots: depth + 1).
        backend: "auto", "ext" (compiled core) or "python" (FastVideo's algorithm).
        device: "cuda", "cuda:N", or "cpu" (the engine with the host as its device, for tests). None: the
            current CUDA device, or — without CUDA — a warning and no offload, as FastVideo does.
        pin_backing: ext only: "host_alloc" (cudaHostAlloc), "register" (mmap + cudaHostRegister) or
            "pageable". Default: "register" (faster to pin, same copy speed; see DEFAULT_PIN_BACKING).
        allow_pageable_fallback: ext only: when pinning fails, warn and use pageable memory instead of
            raising.
        pinned_limit_bytes: ext only: refuse (or fall back, see above) beyond this many pinned bytes.
        share_host_copy: the ranks of one host share one host copy of the weights (sharing.py). "auto":
            when torch.distributed is initialized, the backend is "ext" and several ranks of
            ``process_group`` run on this host (and all built the same blocks); True: always, raising
            when no process group is initialized or the ranks' blocks differ; False: one copy per
            process. When sharing may happen this call is a collective: every rank of the group must
            make it, with the same model. Shared blocks refuse ``mutate_params_scope``.
        process_group: the group whose ranks share (default: the default group).
        weights: a safetensors checkpoint to build the offload from (a file, a sharded checkpoint's
            ``*.index.json``, or a folder holding either, e.g. a diffusers component folder). The model may
            then be built on the meta device: block weights are read straight into pinned host memory,
            everything else onto ``device``. ext backend only; see ``fastoffload_ext.storage``.
        host_budget: with ``weights``: bytes of host memory the offloaded blocks may pin (host copies plus
            the disk tier's staging ring). Blocks beyond it stay on disk and are read every step.
        disk_options: with ``weights``: reader and staging knobs (``storage.DiskOptions``).

    Returns:
        The :class:`LayerwiseOffloadGroup` (``.stats()`` tells sizes and counters), or None when offload
        was skipped because CUDA is not available and no device was given.
    """
    resolved = _resolve_device(device)
    if resolved is None:
        logger.warning("CUDA is not available. Layerwise offloading is disabled.")
        return None
    if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 0:
        raise ValueError(f"prefetch_depth must be an integer >= 0 (blocks copied ahead), got {prefetch_depth!r}")
    if not isinstance(cyclic, bool):
        raise ValueError(f"cyclic must be True or False, got {cyclic!r}")
    if pinned_limit_bytes is not None and (isinstance(pinned_limit_bytes, bool) or not isinstance(pinned_limit_bytes, int)
                                           or pinned_limit_bytes < 0):
        raise ValueError(f"pinned_limit_bytes must be None or an integer >= 0 (bytes), got {pinned_limit_bytes!r}")
    if pin_backing is not None and pin_backing not in PIN_BACKINGS:
        raise ValueError(f"pin_backing must be one of {', '.join(map(repr, PIN_BACKINGS))}, got {pin_backing!r}")
    found = _find_block_list(model)
    if found is None:
        raise ValueError("No nn.ModuleList found in the model for layerwise offloading.")
    list_name, blocks = found
    n_resident = 0 if resident_blocks is None else resident_blocks
    if isinstance(n_resident, bool) or not isinstance(n_resident, int) or not 0 <= n_resident <= len(blocks):
        raise ValueError(f"resident_blocks must be an integer between 0 and the {len(blocks)} blocks of "
                         f"{list_name!r}, got {resident_blocks!r}")
    chosen = _choose_backend(backend, resolved)
    sharing.resolve(share_host_copy, chosen, process_group)  # argument errors before anything changes
    if weights is None and (host_budget is not None or disk_options is not None):
        raise OffloadConfigError("fastoffload: host_budget and disk_options need weights=: the blocks that do not fit "
                                 "in host memory are read from the checkpoint file")
    if weights is not None:
        if chosen != "ext":
            raise OffloadConfigError("fastoffload: weights= needs the compiled core (backend 'ext'); the python "
                                     "backend builds from a materialized model: load the state dict first")
        if share_host_copy is True:
            raise OffloadConfigError("fastoffload: weights= and share_host_copy=True cannot be combined yet: each "
                                     "rank reads its own host copy from the checkpoint")
        share_host_copy = False

    existing = get_offload_group(model)
    if is_replace:
        first = blocks[n_resident] if n_resident < len(blocks) else None
        manager = ModuleHookManager.get_from(first) if first is not None else None
        if manager is None or manager.get_forward_hook(LayerwiseOffloadHook.name()) is None:
            raise AssertionError(f"Expect hook exists in {list_name} for replacement.")
        if existing is not None:
            disable_layerwise_offload(model)
    elif existing is not None:
        raise ValueError(f"layerwise offload is already enabled on this model ({existing!r}); call "
                         "disable_layerwise_offload(model) first, or pass is_replace=True")

    offloaded = list(blocks)[n_resident:]
    # Resident blocks are moved to the device at the end: check them too, before anything changes.
    _check_devices(list(blocks), 0, resolved, from_file=weights is not None)
    owner = _check_tied_parameters(model, list_name, blocks, n_resident)
    source = (CheckpointSource.prepare(model, list_name, blocks, n_resident, weights, host_budget, disk_options)
              if weights is not None else None)

    engine = None
    if chosen == "ext" and offloaded:
        core = _backend.require_ext()
        index = -1 if resolved.type == "cpu" else resolved.index
        pool = core.PinnedPool(index, pin_backing or DEFAULT_PIN_BACKING, pinned_limit_bytes or 0, allow_pageable_fallback, 0)
        engine = core.OffloadEngine(resolved, prefetch_depth + 1, pool)
        if source is not None:
            source.open_files(engine)
    group = LayerwiseOffloadGroup(model, list_name, blocks, resolved, chosen, prefetch_depth, n_resident, cyclic, engine)
    group._owner = owner
    # Collective (when sharing may happen): every rank gets here with the same blocks.
    share = sharing.negotiate(share_host_copy, chosen, process_group, offloaded, list_name, n_resident) if engine else None
    if share is not None:
        share.pool = engine.pool
        group.share = share
    stream = torch.cuda.Stream(resolved) if (chosen == "python" and resolved.type == "cuda") else None
    was_on_cuda = any(p.device.type == "cuda" for block in offloaded for p in block.parameters())

    attached: list[tuple[nn.Module, LayerwiseOffloadHook]] = []
    block: nn.Module | None = None
    try:
        if share is not None:
            share.before_attach()  # other ranks wait here for the owner's packed copy
        if source is not None:
            source.load_resident(model, resolved)
        for block in offloaded:
            group.original_devices.append(next((p.device for p in block.parameters()), resolved))
            if source is not None:
                state = CheckpointOffloadState(engine, resolved, source)
            else:
                state = (ExtLayerwiseOffloadState(engine, resolved) if engine is not None
                         else LayerwiseOffloadState(stream, resolved))
            if share is not None:
                state.shared_segment = share.segment_name(len(group.states))
                state.shared_owner = share.owner
                state.shared_by = share.shared_by
            state._group = group  # type: ignore[attr-defined]
            hook = LayerwiseOffloadHook(state)
            manager = ModuleHookManager.get_from_or_default(block)
            if manager.get_forward_hook(hook.name()) is not None:
                manager.replace_forward_hook(hook.name(), hook)
            else:
                manager.append_forward_hook(hook)
            attached.append((block, hook))
            group.states.append(state)
            # Buffers are not offloaded; they must be where the block runs.
            for module in block.modules():
                for key, buffer in module.named_buffers(recurse=False):
                    if buffer is not None and buffer.device != resolved:
                        setattr(module, key, buffer.to(resolved))
        if share is not None:
            share.after_attach()  # every rank attached: the owner unlinks the names
        if source is not None:
            source.start(engine)
    except BaseException as error:
        if share is not None:
            share.abort(error)  # the other ranks learn of it instead of waiting; the owner unlinks
        # The block whose attach failed kept its parameters (attaching is all-or-nothing per block),
        # but may have been given a hook manager: take it off again.
        failed = ModuleHookManager.get_from(block) if block is not None else None
        if failed is not None and not failed.forward_hooks and all(block is not b for b, _ in attached):
            ModuleHookManager.remove_from_manager(block)
        for (block, hook), original in zip(attached, group.original_devices):
            hook.detach_device = original
            manager = ModuleHookManager.get_from(block)
            if manager is not None and manager.get_forward_hook(hook.name()) is hook:
                manager.remove_forward_hook(hook.name())
                if not manager.forward_hooks:
                    ModuleHookManager.remove_from_manager(block)
        if engine is not None:
            engine.close()
        if source is not None:
            source.roll_back()
        raise

    count = len(group.states)
    for i, state in enumerate(group.states):
        targets = []
        for step in range(1, prefetch_depth + 1):
            if not cyclic and i + step >= count:
                break
            target = group.states[(i + step) % count]
            if target not in targets:
                targets.append(target)
        state.prefetch_targets = targets
        state.next_state = targets[0] if targets else None

    for block in list(blocks)[:n_resident]:
        block.to(resolved)
    setattr(model, GROUP_ATTRIBUTE, group)
    if was_on_cuda and resolved.type == "cuda":
        torch.cuda.empty_cache()
    logger.info("Layerwise offload enabled: %r", group)
    return group


def disable_layerwise_offload(model: nn.Module, device: str | torch.device | None = None) -> None:
    """Undo ``enable_layerwise_offload``: every offloaded parameter becomes a real tensor again.

    Parameters keep their current values (including changes made inside ``mutate_params_scope``) and
    land on ``device`` (default: the offload device; pass "cpu" to get the model back in host memory).
    Host copies and device slots are freed.
    """
    group = get_offload_group(model)
    if group is None:
        raise ValueError("layerwise offload is not enabled on this model (no enable_layerwise_offload call to undo)")
    target = group.device if device is None else torch.device(device)
    for state in group.states:
        block = state.module_ref
        manager = ModuleHookManager.get_from(block)
        hook = manager.get_forward_hook(LayerwiseOffloadHook.name()) if manager is not None else None
        if hook is None:
            continue
        if isinstance(hook, LayerwiseOffloadHook):
            hook.detach_device = target
        manager.remove_forward_hook(LayerwiseOffloadHook.name())
        if not manager.forward_hooks:
            ModuleHookManager.remove_from_manager(block)
    if target != group.device:
        for block in list(group.blocks)[:group.resident_blocks]:
            block.to(target)
        for state in group.states:
            for module in state.module_ref.modules():
                for key, buffer in module.named_buffers(recurse=False):
                    if buffer is not None:
                        setattr(module, key, buffer.to(target))
    if group.engine is not None:
        group.engine.close()
    delattr(model, GROUP_ATTRIBUTE)


__all__ = [
    "LayerwiseOffloadGroup",
    "LayerwiseOffloadHook",
    "LayerwiseOffloadState",
    "disable_layerwise_offload",
    "enable_layerwise_offload",
    "get_offload_group",
]
