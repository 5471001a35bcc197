"""Layerwise offload of a transformer's block list: the hook, and enable/disable.

``enable_layerwise_offload(model)`` takes the first direct-child ``nn.ModuleList`` of ``model`` (Wan:
``blocks``, Flux/Cosmos/SD3: ``transformer_blocks``, HunyuanVideo: ``double_blocks``), keeps its
blocks' weights in host memory and puts a :class:`LayerwiseOffloadHook` on every block: before block
*i* runs its weights are made resident and the next ``prefetch_depth`` blocks start copying on a side
stream; after it runs its weights are dropped again. The last block prefetches the first (``cyclic``),
so the next denoising step starts warm. It is a drop-in for FastVideo's
``fastvideo.hooks.layerwise_offload``: same names, same hook name, same callers.

Models with several block lists (Flux: ``transformer_blocks`` then ``single_transformer_blocks``;
HunyuanVideo: ``double_blocks`` then ``single_blocks``) opt in with ``block_lists="all"`` or a list of
attribute names: the blocks of every listed list form one ring in execution order, so prefetch
crosses from the last block of one list to the first of the next. The default stays FastVideo's
first list.

Two backends do the moving, with bit-identical results:
- ``"ext"``: the compiled core. One packed pinned region per block, one copy per block into static
  device slots, event-ordered reuse, parameter rebinding in C++.
- ``"python"``: FastVideo's algorithm, per-parameter pinning and copies. It is the fallback when the
  compiled core is unavailable and the baseline of every benchmark.
``"auto"`` picks ``"ext"`` when it can.

What stays where: only parameters are offloaded; buffers of the offloaded blocks (rotary tables, norm
statistics) are moved to the offload device and stay there, and modules outside the block list are the
caller's business, as with FastVideo.

Autograd: gradients flow through offloaded blocks whose own parameters are frozen, exactly as on the
resident model (to the input, and to trainable parameters outside the block list). What autograd saved
from the offloaded weights is kept alive until backward (see ``autograd.py``; on the ext backend, grad
mode makes each acquire bind a private device copy of the block), so a grad-recording forward costs
device memory for every block whose weights backward needs, as on the resident model. A
grad-recording forward through a block whose parameters require grad raises (``messages.GRAD_ERROR``).
Inference belongs under ``torch.no_grad()`` or ``inference_mode()``, where none of this runs.

Threads: one offloaded model runs one forward at a time. The thread whose forward acquired a block
owns the model until its blocks are released; a forward from another thread meanwhile raises
(``threads.CONCURRENT_FORWARD_ERROR``, the same text from both backends), and a
``mutate_params_scope`` from another thread waits for the running block. A call that changes the
layout from another thread (``disable_layerwise_offload``, ``group.replan``/``calibrate``,
``is_replace=True``) waits for the whole running forward, also while it is between blocks or in a
resident block, and forwards that start meanwhile wait for it (``threads.ModelForwards``): the running
forward finishes on the layout it started with, exactly. Forwards from several threads one after
another are fine.

What users do to an offloaded model: ``state_dict()`` returns the real values and
``load_state_dict()`` updates the host copy (``state_dict.py``); an in-place write to an offloaded
parameter or a cast (``model.half()``) after enable raises at the next forward instead of being lost,
and disable follows a cast; conjugate and negative views are resolved when the block is packed.

Several ranks of one host (torchrun): with ``share_host_copy`` (default "auto": when torch.distributed
is initialized, the backend is "ext" and the group has several ranks on this host) the ranks of a host
share one host copy in shared memory instead of one each; ``enable_layerwise_offload`` is then a
collective that every rank must call with the same model, and ``mutate_params_scope`` is refused (merge
LoRA before enabling). See ``sharing.py``.

Tied weights: a parameter (or its storage) shared between two offloaded blocks, or between an offloaded
block and any other part of the model, is refused at enable with an error naming both places
(offloading one side would silently turn the other into a placeholder, or untie the two).
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

from fastoffload_ext import _backend
from fastoffload_ext import codec
from fastoffload_ext.engine import sharing
from fastoffload_ext.engine.ext_state import ExtLayerwiseOffloadState
from fastoffload_ext.engine.guards import remove_guards
from fastoffload_ext.engine.group import GROUP_ATTRIBUTE, LayerwiseOffloadGroup, get_offload_group
from fastoffload_ext.engine.hooks import ModuleHookManager
from fastoffload_ext.engine.model_checks import (check_devices, check_repeated_blocks, check_tied_parameters,
                                                 check_weight_hooks, lists_left_out)
from fastoffload_ext.engine.offload_hook import LayerwiseOffloadHook, offload_hook_of
from fastoffload_ext.engine.options import (BACKENDS, DEFAULT_PIN_BACKING, PIN_BACKINGS, CheckedArguments,
                                            OffloadOptions, check_arguments, resolve_device, validate_arguments)
from fastoffload_ext.engine.python_state import LayerwiseOffloadState
from fastoffload_ext.engine.run_order import RunOrderWatch
from fastoffload_ext.engine.state import BackwardRuns, BlockOffloadState
from fastoffload_ext.engine.state_dict import ModelStateDictHooks
from fastoffload_ext.engine.threads import ModelForwards, layout_change
from fastoffload_ext.errors import OffloadConfigError, OffloadStateError
from fastoffload_ext.integrations.peft import guard_adapters
from fastoffload_ext.storage.options import DiskOptions
from fastoffload_ext.storage.source import CheckpointSource
from fastoffload_ext.storage.state import CheckpointOffloadState
from fastoffload_ext.planning.budgets import format_bytes
from fastoffload_ext.planning.plan import OffloadPlan
from fastoffload_ext.planning.schedule import acquire_targets, backward_targets, release_target

logger = logging.getLogger(__name__)


def enable_layerwise_offload(model: nn.Module, is_replace: bool = False, *,
                             resident_blocks: int | Collection[int] | str | None = None,
                             cyclic: bool = True, prefetch_depth: int | str | None = None, backend: str = "auto",
                             device: str | torch.device | int | None = None, pin_backing: str | None = None,
                             allow_pageable_fallback: bool = False,
                             pinned_limit_bytes: int | None = None, share_host_copy: bool | str = "auto",
                             process_group: Any = None, compress: bool | str = False,
                             device_budget: int | str | None = None, host_budget: int | str | None = "auto",
                             activation_reserve: int | str | None = None,
                             plan: OffloadPlan | None = None, weights: Any = None,
                             disk_options: DiskOptions | None = None,
                             block_lists: str | Sequence[str] | None = None) -> LayerwiseOffloadGroup | None:
    """Offload the blocks of ``model``'s first direct-child ``nn.ModuleList`` layer by layer.

    Returns the :class:`LayerwiseOffloadGroup` (``.stats()`` tells sizes and counters), or None when offload
    was skipped because CUDA is not available and no device was given.

    Args:
        model: the transformer. Its block list may be on the CPU or already on ``device``.
        is_replace: swap the offload hook already on every block (FastVideo's flag); raises when none is.
            A refused replacement leaves the offload that ran in place (see ``_replace``).
        resident_blocks: blocks kept on the device, never copied: N (the first N), a collection of block
            indices, or "auto" (the planner chooses). None: none without a budget, "auto" with one.
        cyclic: the last block prefetches the first, so the next step starts warm (False: text encoders).
        prefetch_depth: offloaded blocks copied ahead while a block runs (device slots: depth + 1), or
            "auto". None: 1 without a budget, "auto" with one. Clamped to the number of offloaded blocks.
        backend: "auto", "ext" (compiled core) or "python" (FastVideo's algorithm).
        device: "cuda", "cuda:N", or "cpu" (the engine with the host as its device, for tests). None: the
            current CUDA device, or — without CUDA — a warning and no offload, as FastVideo does.
        pin_backing, allow_pageable_fallback, pinned_limit_bytes: ext only: how host copies are pinned
            ("host_alloc", "register" or "pageable"; default DEFAULT_PIN_BACKING), whether a failed pin
            warns and falls back to pageable memory instead of raising, and a cap on pinned bytes.
        share_host_copy, process_group: the ranks of one host (of the group, default: the default group)
            share one host copy: "auto", True or False. Unless False (or backend="python") the call is a
            collective: every rank makes it with the same model, and an error on one rank is raised on
            all (docs/DESIGN.md, "Sharing the host copy between ranks").
        compress: ext only: lossless compressed host copies, decoded on the GPU: True, "auto" (only
            when the step is transfer-bound) or False; a shared copy is encoded once by its owner, and with
            weights= the disk tier reads coded blocks from a spill file (docs/DESIGN.md, "Compressed host copies").
        device_budget, host_budget, activation_reserve: device bytes this offload may hold, pinned host
            bytes its blocks may take, device bytes for activations ("20GiB", bytes or "auto"); the planner
            fills what resident_blocks/prefetch_depth leave open (docs/DESIGN.md, "Residency planner and budgets").
        plan: an :class:`OffloadPlan` from ``plan_offload``, applied as it is (within ``device_budget``).
        weights, disk_options: ext only: a safetensors checkpoint (file, ``*.index.json`` or folder) read
            straight into pinned memory (the model may be on the meta device), and the reader's knobs;
            blocks beyond ``host_budget`` (also "auto") stay on disk (docs/DESIGN.md, "Disk tier").
        block_lists: the direct-child ``nn.ModuleList``s that form the ring: None (the first one,
            FastVideo's rule), "all", or attribute names in the order the forward runs them.
    """
    # Made before any check: when this call is a collective, a failure on this rank is sent to the
    # others in the negotiation they wait in, and every rank raises together (sharing.py).
    rendezvous = sharing.Rendezvous(share_host_copy, backend, process_group)
    given = dict(is_replace=is_replace, resident_blocks=resident_blocks, cyclic=cyclic, prefetch_depth=prefetch_depth,
                 backend=backend, pin_backing=pin_backing, allow_pageable_fallback=allow_pageable_fallback,
                 pinned_limit_bytes=pinned_limit_bytes, share_host_copy=share_host_copy, process_group=process_group,
                 compress=compress, device_budget=device_budget, host_budget=host_budget,
                 activation_reserve=activation_reserve, plan=plan, weights=weights, disk_options=disk_options,
                 block_lists=block_lists)
    try:
        resolved = resolve_device(device)
        if resolved is None:
            return _skip_without_cuda(rendezvous)
        # Before anything changes: with is_replace, a bad argument leaves the offload already there running.
        checked = check_arguments(model, resolved, **given)
    except BaseException as error:
        rendezvous.fail(error)
        raise
    # What a later re-plan passes to enable again (planning/replan.py).
    arguments = dict(backend=backend, device=device, cyclic=cyclic, pin_backing=pin_backing,
                     allow_pageable_fallback=allow_pageable_fallback, pinned_limit_bytes=pinned_limit_bytes,
                     share_host_copy=share_host_copy, process_group=process_group, compress=compress,
                     host_budget=host_budget, activation_reserve=activation_reserve, block_lists=block_lists)
    enable = _Enable(model, resolved, given, checked, arguments, rendezvous)
    if is_replace is True and get_offload_group(model) is not None:
        # A forward running in another thread finishes first, on the layout it started with (threads.py).
        with layout_change(model):
            return _replace(enable)
    return enable.run(replaced=False)


@dataclasses.dataclass
class _Enable:
    """One enable call's arguments, checked, and what runs it once the model is ready for it."""

    model: nn.Module
    device: torch.device
    given: dict[str, Any]  # validate_arguments' keyword arguments
    checked: CheckedArguments
    arguments: dict[str, Any]
    rendezvous: sharing.Rendezvous

    def run(self, replaced: bool) -> LayerwiseOffloadGroup:
        """``replaced``: is_replace found this library's offload on the model, and it has been undone."""
        model = self.model
        group: LayerwiseOffloadGroup | None = None
        try:
            options = validate_arguments(model, self.device, **self.given, checked=self.checked)
            _check_model(model, options, replaced)
            was_on_cuda = any(p.device.type == "cuda" for block in options.offloaded for p in block.parameters())
            group = _build_group(model, options, self.arguments)
            _negotiate_sharing(group, options, self.rendezvous)
        except BaseException as error:
            self.rendezvous.fail(error)  # a no-op once the negotiation ran
            if group is not None and group.engine is not None:
                # No block is attached yet: the engine's files, threads and spill file go now, not when the
                # traceback that holds the group does.
                try:
                    group.engine.close()
                except Exception:  # the original error is the one to raise
                    logger.exception("fastoffload: closing the engine of an enable that failed failed")
            raise
        _attach_blocks(group, options)
        try:
            _wire_prefetch_targets(group.states, options.prefetch_depth, options.cyclic, options.offloaded_indices)
            group.run_order = _watch_run_order(group, options)
            group.model_hooks = _model_hooks(model, group)
        except BaseException as error:  # a Ctrl-C too: the blocks are attached, and the group is not on the model
            _undo_attach(group, error)
            raise
        return _finish(model, group, options, was_on_cuda)


REPLACE_ROLLBACK_NOTE = ("fastoffload: the offload that was on the model before this is_replace=True call was undone "
                         "to apply the new one, and could not be applied again ({reason}); the model is in host memory "
                         "without offload. Enable offload again (with the arguments that worked before)")


DISK_REPLACE_ERROR = ("fastoffload: is_replace=True would undo an offload that streams {disk} blocks from disk (built "
                      "with weights=) by bringing every block into host memory first, which a model larger than the "
                      "host's RAM cannot survive; nothing was changed. To swap it: disable_layerwise_offload(model, "
                      "'meta'), then enable_layerwise_offload(model, weights=..., ...) with the new arguments")


def _replace(enable: _Enable) -> LayerwiseOffloadGroup:
    """is_replace on a model this library offloads: the offload there is undone, then the new one is enabled.

    Undone first because it holds its blocks' weights as empty placeholders: the new layout would be
    planned, and held to the budgets, as if they were free. Its blocks come back to host memory, where it
    kept them: on the device, all of them at once may not fit (offload is there because they do not).
    Every refusal that the arguments alone can tell was raised before this (``check_arguments``); if the
    new offload still fails (a budget, the model's devices, memory), the offload that ran before is
    applied again, with the model's current values, before the error is raised, as a failed re-plan does.
    An offload that streams blocks from disk is refused instead (``DISK_REPLACE_ERROR``), as its re-plan is.
    """
    model = enable.model
    old = get_offload_group(model)
    if old is None:  # another thread's disable got here first: nothing to undo
        return enable.run(replaced=False)
    try:
        if old.disk_blocks():
            # Undoing it to host memory would read every block from disk into RAM at once.
            raise OffloadStateError(DISK_REPLACE_ERROR.format(disk=old.disk_blocks()))
        disable_layerwise_offload(model, device="cpu")
    except BaseException as error:
        enable.rendezvous.fail(error)  # the other ranks of a collective learn of it instead of waiting
        raise
    try:
        return enable.run(replaced=True)
    except BaseException as error:
        from fastoffload_ext.planning import replan as replanning

        reason = replanning.reapply_refusal(old)
        if reason is None:
            try:
                replanning.reapply(old)
            except BaseException as second:
                reason = f"{type(second).__name__}: {second}"
        if reason is not None:
            note = REPLACE_ROLLBACK_NOTE.format(reason=reason)
            logger.error(note)
            if hasattr(error, "add_note"):
                error.add_note(note)
        raise


def _skip_without_cuda(rendezvous: sharing.Rendezvous) -> None:
    """FastVideo's answer to no device given and no CUDA: a warning, and no offload (on every rank)."""
    logger.warning("CUDA is not available. Layerwise offloading is disabled.")
    rendezvous.skip("CUDA is not available")


def _build_group(model: nn.Module, options: OffloadOptions, arguments: dict[str, Any]) -> LayerwiseOffloadGroup:
    """The checkpoint read (with ``weights``), the engine built, and the group that records it all."""
    checkpoint = _prepare_checkpoint(model, options)
    engine = _build_engine(options)
    group = LayerwiseOffloadGroup(model, options.list_name, options.blocks, options.device, options.backend,
                                  options.prefetch_depth, options.resident, options.cyclic, engine)
    group.compress_mode = options.compress if engine is not None else "off"
    group.plan = options.plan
    if checkpoint is not None and engine is not None:
        checkpoint.open_files(engine)
        checkpoint.open_spill(engine, options.compress)
        group.checkpoint = checkpoint
    elif checkpoint is not None:
        # Every block stays resident (a plan that fits them all): nothing to stream, everything is read
        # onto the device now, and the model holds its values as if it had been loaded.
        try:
            checkpoint.load_resident(model, options.device)
        except BaseException:
            checkpoint.roll_back()  # every tensor it replaced goes back
            raise
    group.enable_kwargs = {**(options.settings or {}), "arguments": arguments}
    group.list_names = [name for name, _ in options.lists] or [options.list_name]
    return group


def _negotiate_sharing(group: LayerwiseOffloadGroup, options: OffloadOptions,
                       rendezvous: sharing.Rendezvous) -> None:
    """The ranks agree on sharing the host copy (a no-op for one process); the verdict goes on the group."""
    # The index only names blocks in a mismatch message; with a scattered resident set, the first offloaded.
    first = options.offloaded_indices[0] if options.offloaded_indices else 0
    group.share = rendezvous.negotiate(options.share_host_copy, options.backend, options.offloaded,
                                       options.list_name, first, group.engine, options.compress)


def _check_model(model: nn.Module, options: OffloadOptions, replaced: bool = False) -> None:
    """Refusals that depend on the model: an offload already there (or none to replace), devices, ties.
    ``replaced``: is_replace found this library's offload on the model, and it has been undone."""
    blocks, offloaded = options.blocks, options.offloaded_indices
    names = options.block_names
    _check_hook_managers(options, names)
    check_repeated_blocks(blocks, names, offloaded)
    check_weight_hooks(blocks, names, offloaded)
    existing = get_offload_group(model)
    if options.is_replace:
        first = blocks[offloaded[0]] if offloaded else None
        manager = ModuleHookManager.get_from(first) if first is not None else None
        if not replaced and (manager is None or manager.get_forward_hook(LayerwiseOffloadHook.name()) is None):
            # FastVideo's exception type, and its text after the prefix: its callers catch and search for them.
            raise AssertionError(f"fastoffload: Expect hook exists in {options.list_name} for replacement. Call "
                                 "enable_layerwise_offload without is_replace=True when no offload is there yet")
    elif existing is not None:
        raise OffloadConfigError(f"fastoffload: layerwise offload is already enabled on this model ({existing!r}); "
                                 "call disable_layerwise_offload(model) first, or pass is_replace=True")
    else:
        _check_no_offload_hook(options, names)
    # Resident blocks are moved to the device at the end: check them too, before anything changes.
    check_devices(list(blocks), 0, options.device, from_file=options.weights is not None)
    offset = 0
    # Per list, with the ring's offloaded set split across them: a weight tied to a block of another
    # list is outside this list's offloaded set, so ties across lists are refused too.
    for list_name, one_list in options.lists or ((options.list_name, blocks),):
        in_list = {i - offset for i in offloaded if offset <= i < offset + len(one_list)}
        check_tied_parameters(model, list_name, one_list, in_list)
        offset += len(one_list)


def _check_no_offload_hook(options: OffloadOptions, names: list[str]) -> None:
    """Without is_replace, refuses a block that already carries an offload hook (one attached by hand, with
    no group on the model), as FastVideo's append does: attaching would silently swap it for a new one."""
    name = LayerwiseOffloadHook.name()
    for index in options.offloaded_indices:
        manager = ModuleHookManager.get_from(options.blocks[index])
        if manager is not None and manager.get_forward_hook(name) is not None:
            # FastVideo's text after the prefix: its callers catch ValueError and search for it.
            raise OffloadConfigError(f"fastoffload: Hook with name {name} is already registered on {names[index]}; "
                                     "pass is_replace=True to swap it, or remove it first "
                                     f"(ModuleHookManager.get_from(block).remove_forward_hook({name!r}))")


def _check_hook_managers(options: OffloadOptions, names: list[str]) -> None:
    """Refuses an offloaded block whose forward another class's hook manager wraps (FastVideo's own, attached
    before this engine was installed): its wrapper runs no post_forward when the forward raises, so one
    failing forward would leave the block holding its device slot, and every later forward would fail."""
    for index in options.offloaded_indices:
        manager = ModuleHookManager.get_from(options.blocks[index])
        if manager is not None and not isinstance(manager, ModuleHookManager):
            kind = f"{type(manager).__module__}.{type(manager).__qualname__}"
            raise OffloadConfigError(f"fastoffload: {names[index]} carries hooks under another hook manager ({kind}), "
                                     "whose forward does not release a block when it raises, so one failing forward "
                                     "would keep the block's device slot for good. Remove those hooks "
                                     "(ModuleHookManager.remove_from_manager) and attach them after enabling offload; "
                                     "with FastVideo, call fastoffload_ext.integrations.fastvideo.install() before "
                                     "FastVideo attaches any hook")


def _build_engine(options: OffloadOptions) -> Any:
    """The compiled core's engine and pinned pool (ext backend with blocks to offload), else None."""
    if options.backend != "ext" or not options.offloaded:
        return None
    core = _backend.require_ext()
    index = -1 if options.device.type == "cpu" else options.device.index
    pool = core.PinnedPool(index, options.pin_backing, options.pinned_limit_bytes, options.allow_pageable_fallback, 0)
    engine = core.OffloadEngine(options.device, options.prefetch_depth + 1, pool)
    if options.compress != "off":
        codec.configure_engine(engine, options.compress)
    return engine


def _prepare_checkpoint(model: nn.Module, options: OffloadOptions) -> CheckpointSource | None:
    """With ``weights``: the checkpoint read and checked against the model (nothing changes yet), also
    when every block stays resident (then it is all read onto the device)."""
    if options.weights is None:
        return None
    return CheckpointSource.prepare(model, options.block_names, options.blocks, list(options.offloaded_indices),
                                    options.weights, options.host_budget_bytes, options.disk_options, options.device)


def _new_state(group: LayerwiseOffloadGroup, stream: torch.cuda.Stream | None) -> BlockOffloadState:
    if group.engine is not None and group.checkpoint is not None:
        return CheckpointOffloadState(group.engine, group.device, group.checkpoint)
    if group.engine is None:
        state = LayerwiseOffloadState(stream, group.device)
        # One forward at a time per model (threads.py): every block of the model shares one gate.
        if group.states:
            state.gate = group.states[0].gate  # type: ignore[attr-defined]
        state.block_index = len(group.states)
        return state
    state = ExtLayerwiseOffloadState(group.engine, group.device)
    share = group.share
    if share is not None:
        state.shared_segment = share.segment_name(len(group.states))
        state.shared_owner = share.owner
        state.shared_by = share.shared_by
        state.shared_encoded = share.encoded_form(len(group.states))
    return state


def _budget_check(group: LayerwiseOffloadGroup, block: nn.Module) -> Callable[[], None]:
    """What runs as a mutate_params_scope on ``block`` ends: the plan's budget checked against the block's
    new size (``replan.warn_if_grown``). Holds the group weakly (the hook outlives it when a re-plan
    replaces the group), and the block too (the block holds the hook: weak.py)."""
    group_ref, block_ref = weakref.ref(group), weakref.ref(block)

    def check() -> None:
        from fastoffload_ext.planning import replan as replanning

        current, block = group_ref(), block_ref()
        if current is None or block is None or get_offload_group(current.model_ref) is not current:
            return
        index = next((i for i, candidate in enumerate(current.blocks) if candidate is block), None)
        if index is not None:
            replanning.warn_if_grown(current, index)
    return check


def _attach_one(group: LayerwiseOffloadGroup, block: nn.Module, stream: torch.cuda.Stream | None,
                attached: list[tuple[nn.Module, LayerwiseOffloadHook]]) -> None:
    """Hooks ``block`` (its state takes the weights) and moves its buffers to the device. The hook goes into
    ``attached`` before it goes on the block: however early an interrupt lands, a hook that holds the block's
    weights is one that ``_roll_back`` finds (it skips one that never went on)."""
    group.original_devices.append(next((p.device for p in block.parameters()), group.device))
    state = _new_state(group, stream)
    hook = LayerwiseOffloadHook(state)
    hook.after_mutation = _budget_check(group, block)
    manager = ModuleHookManager.get_from_or_default(block)
    attached.append((block, hook))
    if manager.get_forward_hook(hook.name()) is not None:
        manager.replace_forward_hook(hook.name(), hook)
    else:
        manager.append_forward_hook(hook)
    group.states.append(state)
    # Buffers are not offloaded; they must be where the block runs.
    for module in block.modules():
        for key, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.device != group.device:
                setattr(module, key, buffer.to(group.device))


def _attach_blocks(group: LayerwiseOffloadGroup, options: OffloadOptions) -> None:
    """Attaches every offloaded block; on any error (Ctrl-C too) every block is as it was before."""
    share = group.share
    stream = torch.cuda.Stream(group.device) if (group.engine is None and group.device.type == "cuda") else None
    attached: list[tuple[nn.Module, LayerwiseOffloadHook]] = []
    block: nn.Module | None = None
    try:
        if share is not None:
            share.before_attach(options.offloaded)  # other ranks wait here for the owner's packed copy
        if group.checkpoint is not None:
            group.checkpoint.load_block_buffers(group.model_ref, group.device)  # attaching moves them
        for block in options.offloaded:
            _attach_one(group, block, stream, attached)
        if share is not None and not share.after_attach(group.states):  # the owner unlinks the names
            group.share = None  # the ranks fell back to one copy each
        if group.checkpoint is not None:
            # Everything outside the blocks is read while the blocks' reads, queued above, run.
            group.checkpoint.load_resident(group.model_ref, group.device)
            group.checkpoint.start(group.engine)
    except BaseException as error:
        if share is not None:
            share.abort(error)  # the other ranks learn of it instead of waiting; the owner unlinks
        _roll_back(group, attached, block)
        if group.checkpoint is not None:
            group.checkpoint.roll_back()
            _note_values_dropped(group, len(attached), error)
        raise


WEIGHTS_ROLLBACK_NOTE = ("fastoffload: enable from weights= failed after it had replaced the values of {n} offloaded "
                         "block(s) that held real weights before; those blocks are on the meta device now, since their "
                         "old values were freed as the checkpoint was read. Fix the cause and enable again with "
                         "weights=, or load the model again")


def _note_values_dropped(group: LayerwiseOffloadGroup, attached: int, error: BaseException) -> None:
    """After a failed enable from a checkpoint: says on ``error`` which real blocks went to meta."""
    real = sum(1 for device in group.original_devices[:attached] if device.type != "meta")
    if real == 0:
        return  # a meta model is exactly as it was
    note = WEIGHTS_ROLLBACK_NOTE.format(n=real)
    logger.warning(note)
    if hasattr(error, "add_note"):
        error.add_note(note)


def _roll_back(group: LayerwiseOffloadGroup, attached: list[tuple[nn.Module, LayerwiseOffloadHook]],
               failed_block: nn.Module | None) -> None:
    # Built from a checkpoint, an attached block's old values went as its host copy was read, and that
    # copy may be incomplete (the read that failed): the block goes back to the meta device, never to
    # a mix of old, new and unread bytes (_note_values_dropped says so on the error).
    dropped = group.checkpoint is not None
    for (block, hook), original in zip(attached, group.original_devices):
        hook.detach_device = torch.device("meta") if dropped else original
        manager = ModuleHookManager.get_from(block)
        if manager is not None and manager.get_forward_hook(hook.name()) is hook:
            manager.remove_forward_hook(hook.name())
            if not manager.forward_hooks:
                ModuleHookManager.remove_from_manager(block)
    # A block whose hook never went on kept its parameters (a failed on_attach puts back what its state took),
    # but may have been given a hook manager: take it off again.
    failed = ModuleHookManager.get_from(failed_block) if failed_block is not None else None
    if failed is not None and not failed.forward_hooks:
        ModuleHookManager.remove_from_manager(failed_block)
    if group.engine is not None:
        group.engine.close()


def _model_hooks(model: nn.Module, group: LayerwiseOffloadGroup) -> ModelStateDictHooks:
    """The model's state-dict hooks: a refused load changes nothing, a moved parameter is saved and loaded (state_dict.py)."""
    names = {id(module): name for name, module in model.named_modules()}
    blocks = []
    for state in group.states:
        hook = offload_hook_of(state.module_ref)
        if hook is not None and id(state.module_ref) in names:
            blocks.append((names[id(state.module_ref)] + ".", hook.state_dict_hooks))
    return ModelStateDictHooks(blocks).attach(model)


def _wire_prefetch_targets(states: list[BlockOffloadState], prefetch_depth: int, cyclic: bool,
                           positions: Sequence[int]) -> None:
    """Each state prefetches the next ``prefetch_depth`` states as it starts (wrapping around when ``cyclic``)
    and, where the backend allows it, one more as it releases when other compute follows it; run again by a
    backward pass (activation checkpointing), the ``prefetch_depth`` states before it; and in a training forward
    (once a backward pass has run the blocks again), nothing that wraps into the next step, whose first blocks
    the backward pass would evict (``planning/schedule.py``). ``positions`` are the states' indices in the block
    list."""
    count = len(states)
    runs = BackwardRuns()
    for i, state in enumerate(states):
        targets = acquire_targets(i, count, prefetch_depth, cyclic)
        unwrapped = acquire_targets(i, count, prefetch_depth, cyclic=False)
        state.prefetch_targets = [states[t] for t in targets]
        state.training_targets = None if unwrapped == targets else [states[t] for t in unwrapped]
        state.backward_targets = [states[t] for t in backward_targets(i, prefetch_depth)]
        state.backward_runs, state.backward_count_seen, state.last_forward_grad = runs, 0, False
        state.next_state = state.prefetch_targets[0] if state.prefetch_targets else None
        if getattr(state, "prefetches_on_release", False):
            target = release_target(i, positions, prefetch_depth, cyclic)
            state.release_targets = [] if target is None else [states[target]]
            state.release_wraps = target is not None and target <= i



def _watch_run_order(group: LayerwiseOffloadGroup, options: OffloadOptions) -> RunOrderWatch | None:
    """Learns the order the first forward runs the offloaded blocks in, and sets the prefetches to it when it
    differs from the ring's (run_order.py). None with fewer than two offloaded blocks (nothing to order)."""
    hooks = [offload_hook_of(state.module_ref) for state in group.states]
    if len(hooks) < 2 or None in hooks:
        return None
    names = options.block_names
    depth, cyclic = options.prefetch_depth, options.cyclic
    # The engine, not the group: the watch is kept on the group, and a closure holding the group would be a cycle.
    disk_engine = group.engine if any(getattr(state, "on_disk", False) for state in group.states) else None

    def rewire(states: list[BlockOffloadState], positions: list[int], disk: bool) -> None:
        _wire_prefetch_targets(states, depth, cyclic, positions)
        if disk and disk_engine is not None:
            # The disk tier reads ahead in the same order, from the block that starts now (the pass's last). Only
            # its speed depends on it: a failure leaves the ring's order (blocks read out of turn on demand).
            try:
                disk_engine.set_disk_order([state.handle for state in states[-1:] + states[:-1]])  # type: ignore[attr-defined]
            except RuntimeError:
                logger.warning("fastoffload: the disk tier keeps reading ahead in the ring's order", exc_info=True)

    watch = RunOrderWatch(group.states, options.offloaded_indices, [names[i] for i in options.offloaded_indices],
                          rewire, group.device, cyclic)
    watch.watch(hooks)
    return watch


def _resident_to_device(group: LayerwiseOffloadGroup, options: OffloadOptions) -> None:
    """Moves the resident blocks to the device. If that fails (out of memory, Ctrl-C), enable is undone
    like a failed attach: the moved blocks go back where they were, the offloaded ones are detached (with
    their values; built from ``weights=``, to the meta device, see ``_roll_back``), and the checkpoint's
    tensors are put back."""
    # Parameters keep their objects through .to() (their .data changes); buffers are replaced, so they
    # are found again by module and name.
    params: dict[int, tuple[nn.Parameter, torch.device]] = {}
    buffers: list[tuple[nn.Module, str, torch.device]] = []
    try:
        for index in options.resident:
            block = options.blocks[index]
            params.update({id(p): (p, p.device) for p in block.parameters()})
            buffers += [(m, key, b.device) for m in block.modules() for key, b in m._buffers.items() if b is not None]
            block.to(options.device)
    except BaseException as error:
        for param, device in params.values():
            if param.device != device and device.type != "meta":
                param.data = param.data.to(device)
        for module, key, device in buffers:
            buffer = module._buffers.get(key)
            if buffer is not None and buffer.device != device and device.type != "meta":
                module._buffers[key] = buffer.to(device)
        _undo_attach(group, error)
        raise


def _undo_attach(group: LayerwiseOffloadGroup, error: BaseException) -> None:
    """After the blocks were attached and before the group is on the model: every block detached with its values
    (built from ``weights=``, to the meta device, see ``_roll_back``), and the checkpoint's tensors put back."""
    if group.model_hooks is not None:
        group.model_hooks.detach()
    hooks = [(s.module_ref, ModuleHookManager.get_from(s.module_ref).get_forward_hook(LayerwiseOffloadHook.name()))
             for s in group.states if ModuleHookManager.get_from(s.module_ref) is not None]
    attached = [(b, h) for b, h in hooks if h is not None]
    _roll_back(group, attached, None)
    if group.checkpoint is not None:
        group.checkpoint.roll_back()
        _note_values_dropped(group, len(attached), error)


def _finish(model: nn.Module, group: LayerwiseOffloadGroup, options: OffloadOptions,
            was_on_cuda: bool) -> LayerwiseOffloadGroup:
    """Resident blocks to the device, the group onto the model; returns the group now on the model."""
    _resident_to_device(group, options)
    if group.checkpoint is not None:
        group.checkpoint.commit()  # nothing is rolled back from here on; its record would keep the model alive
    setattr(model, GROUP_ATTRIBUTE, group)
    guard_adapters(model)  # a LoRA merge runs on the blocks' real weights
    group.free_with(model)  # a model dropped without a disable frees its host copy and slots at once
    ModelForwards.attach(model)  # what a later layout change waits for (threads.py)
    if was_on_cuda and options.device.type == "cuda":
        torch.cuda.empty_cache()
    left_out = lists_left_out(model, group.list_names)
    if left_out:
        logger.info("Layerwise offload enabled: %r; not offloaded: %s (block_lists='all' offloads every list)", group,
                    ", ".join(f"{name} ({count} blocks, {format_bytes(size)})" for name, count, size in left_out))
    else:
        logger.info("Layerwise offload enabled: %r", group)
    if group.plan is None:
        return group
    from fastoffload_ext.planning import replan as replanning

    replanning.with_disk_tier(group)  # a checkpoint's disk tier: the plan predicts its reads too
    if group.compress_mode == "on":
        # The plan counted estimated compressed sizes; the engine has encoded now and knows the real ones.
        return replanning.recheck(group)
    return group


def disable_layerwise_offload(model: nn.Module, device: str | torch.device | None = None) -> None:
    """Undo ``enable_layerwise_offload``: every offloaded parameter becomes a real tensor again.

    Parameters keep their current values (including changes made inside ``mutate_params_scope``) and
    land on ``device`` (default: the offload device; pass "cpu" to get the model back in host memory).
    Host copies and device slots are freed.
    """
    # A forward running in another thread finishes first, on the weights it started with, and the forwards
    # that start meanwhile wait for the disable to finish (threads.ModelForwards).
    with layout_change(model):
        _disable(model, device)


def _disable(model: nn.Module, device: str | torch.device | None) -> None:
    group = get_offload_group(model)
    if group is None:
        raise OffloadConfigError("fastoffload: layerwise offload is not enabled on this model (no "
                                 "enable_layerwise_offload call to undo); call disable only after enable")
    target = _disable_target(group, device)
    if target.type != "meta":
        # A disk-tier block is read back from its file: a file changed since enable is refused before
        # any block is detached (disabling to "meta" reads nothing, and is the way out the error names).
        for state in group.states:
            check = getattr(state, "check_files", None)
            if check is not None:
                check()
    # The parameters it makes are ordinary tensors even when called inside inference_mode() (a pipeline
    # that tears down in its own call): inference tensors as parameters would refuse every later
    # in-place update or load_state_dict outside it, and autograd for good.
    with torch.inference_mode(False):
        _detach_all(model, group, target)


DISABLE_DEVICE_ERROR = ("fastoffload: disable_layerwise_offload's device must be None (the offload device), 'cpu', "
                        "'cuda', 'cuda:N' or 'meta', got {device!r}{why}; nothing was changed")
DISABLE_CUDA_ERROR = ("fastoffload: disable_layerwise_offload(device={device!r}) asks for a CUDA device{why}; pass "
                      "device='cpu', or None for the offload device ({offload}); nothing was changed")


def _disable_target(group: LayerwiseOffloadGroup, device: str | torch.device | int | None) -> torch.device:
    """Where disable puts the parameters, checked before any block is detached: a device torch cannot
    make (CUDA on a machine without it) failed at the first block's restore, with torch's own text."""
    if device is None:
        return group.device
    try:
        target = torch.device("cuda", device) if isinstance(device, int) and not isinstance(device, bool) \
            else torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise OffloadConfigError(DISABLE_DEVICE_ERROR.format(device=device, why="")) from error
    if target.type == "cpu":
        return torch.device("cpu")
    if target.type == "meta":
        return target
    if target.type != "cuda":
        raise OffloadConfigError(DISABLE_DEVICE_ERROR.format(device=device, why=""))
    if not torch.cuda.is_available():
        raise OffloadStateError(DISABLE_CUDA_ERROR.format(device=device, why=", but CUDA is not available",
                                                          offload=group.device))
    index = target.index if target.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise OffloadConfigError(DISABLE_CUDA_ERROR.format(
            device=device, why=f" that does not exist ({torch.cuda.device_count()} visible)", offload=group.device))
    return torch.device("cuda", index)


def _detach_all(model: nn.Module, group: LayerwiseOffloadGroup, target: torch.device) -> None:
    for state in group.states:
        block = state.module_ref
        manager = ModuleHookManager.get_from(block)
        hook = manager.get_forward_hook(LayerwiseOffloadHook.name()) if manager is not None else None
        if hook is None:
            _detach_unhooked(group, state, target)
            if manager is not None and not manager.forward_hooks:
                ModuleHookManager.remove_from_manager(block)
            continue
        if isinstance(hook, LayerwiseOffloadHook):
            hook.detach_device = target
            hook.detaching = True  # if this disable is cut short, the block's next forward says to call it again
        manager.remove_forward_hook(LayerwiseOffloadHook.name())
        if not manager.forward_hooks:
            ModuleHookManager.remove_from_manager(block)
    if target != group.device:
        for index in group.resident:
            group.blocks[index].to(target)
        for state in group.states:
            for module in state.module_ref.modules():
                for key, buffer in module.named_buffers(recurse=False):
                    if buffer is not None:
                        setattr(module, key, buffer.to(target))
    if group.model_hooks is not None:
        group.model_hooks.detach()
    if group.finalizer is not None:
        group.finalizer()  # cuts the states' prefetch ring now, once: the states go with this group
    if group.engine is not None:
        group.engine.close()
    delattr(model, GROUP_ATTRIBUTE)
    remove_guards(model)  # the integrations' wrappers on its instances (engine/guards.py)
    forwards = ModelForwards.of(model)
    if forwards is not None:
        forwards.detach(model)


def _detach_unhooked(group: LayerwiseOffloadGroup, state: BlockOffloadState, target: torch.device) -> None:
    """Detaches a block whose offload hook was taken off without its ``on_detach``
    (``remove_forward_hook(name, run_detach=False)``, ``ModuleHookManager.remove_from_manager``).

    Its parameters are still placeholders and its values live only in the host copy, which closing the
    engine frees: skipped, the block came back empty, its values lost. It is restored as the hook's
    ``on_detach`` would have, and that hook's state-dict hooks come off with it (left on, a later
    ``load_state_dict()`` would try to materialize a block no engine holds). A hook whose ``on_detach``
    ran (``replace_forward_hook``, ``remove_forward_hook``) left nothing offloaded.
    """
    if state.weight_bytes() == 0:
        return
    stand_in = LayerwiseOffloadHook(state)
    stand_in.detach_device = target
    stand_in.on_detach(state.module_ref)
    for _, hooks in group.model_hooks.blocks if group.model_hooks is not None else ():
        if hooks.state is state:
            hooks.detach()


__all__ = [
    "BACKENDS",
    "DEFAULT_PIN_BACKING",
    "GROUP_ATTRIBUTE",
    "PIN_BACKINGS",
    "LayerwiseOffloadGroup",
    "LayerwiseOffloadHook",
    "LayerwiseOffloadState",
    "disable_layerwise_offload",
    "enable_layerwise_offload",
    "get_offload_group",
]
