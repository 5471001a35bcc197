"""``state_dict()`` and ``load_state_dict()`` of an offloaded block: the real values, in and out.

While offloaded, a block's parameters are empty placeholders, so the module's own state dict would
hold ``(0, 0)`` tensors (and ``torch.save`` would write a garbage checkpoint), and loading would fail
with a size mismatch. Module state-dict hooks put the host copy in:

- ``state_dict()`` gets a copy of each offloaded parameter's host values (on the CPU, in the
  parameter's current dtype). Copies rather than views: a write into the returned tensor must not
  change an offloaded weight behind the engine's back (device slots would keep the old bytes). A
  block that is running or inside ``mutate_params_scope`` already holds real values and is left as is.
- ``load_state_dict()`` makes the block's parameters ordinary device tensors for the load (as
  ``mutate_params_scope`` does), lets the module load into them, and rebuilds the host copy from
  them; a block whose host copy is shared with other ranks refuses (``messages.SHARED_LOAD_ERROR``).

Both work on the block list alone and through any parent (``model.state_dict()``), since torch runs
every submodule's hooks; and on a submodule of a block alone (``block.attn.state_dict()``), which runs
only the hooks of that submodule and below, so each submodule carries them too. Through the block, the
submodules' hooks leave the work to the block's (one read of a compressed host copy, one rebuild).

A load is all or nothing for the offloaded model: torch loads a parent before its children, so a
pre-hook on the model and on the block list (``LoadGuard``) refuses, before any module has loaded, a
state dict that names a parameter of a block that would refuse it (disk tier, shared host copy).
Otherwise the blocks before that one would already hold the new values when the error is raised.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fastoffload_ext.engine.messages import COPY_ERROR, SHARED_LOAD_ERROR, STALE_SAVE_WARNING, warn_caller
from fastoffload_ext.engine.state import BlockOffloadState, enter_mutation, leave_mutation, parameter_names
from fastoffload_ext.engine.weak import WeakModule
from fastoffload_ext.errors import OffloadStateError

logger = logging.getLogger(__name__)

__all__ = ["LoadGuard", "StateDictHooks"]


class StateDictHooks:
    """The state-dict hooks of one offloaded block, on the block and on each of its submodules."""

    _block = WeakModule()  # held weakly: the block holds these hooks

    def __init__(self, state: BlockOffloadState) -> None:
        self.state = state
        self._handles: list[RemovableHandle] = []
        self._loading = False
        # Where the state_dict() or load now under way entered the block: (prefix, the submodule's name in
        # the block with a trailing dot, '' for the block). The submodules it reaches leave their part to it.
        self._saving_at: tuple[str, str] | None = None
        self._loading_at: tuple[str, str] | None = None
        self._saving_keeps_vars = False  # the state_dict() under way was asked for keep_vars

    def __reduce_ex__(self, protocol: object) -> Any:
        raise OffloadStateError(COPY_ERROR)  # the module's hooks are what a deepcopy or pickle meets first

    def attach(self, module: nn.Module) -> None:
        """Hooks ``module`` (the block) and every submodule it has now (again after a mutation, which may
        have replaced some)."""
        self.detach()
        self._block = module
        # torch marks a state-dict hook with an attribute, which a bound method cannot carry.
        hooks = (StateDictHooks._saving_starts, StateDictHooks._real_values, StateDictHooks._before_load,
                 StateDictHooks._after_load)
        for sub in module.modules():
            saving, real, before, after = (functools.partial(hook, self) for hook in hooks)
            self._handles += [sub.register_state_dict_pre_hook(saving), sub.register_state_dict_post_hook(real),
                              sub.register_load_state_dict_pre_hook(before),
                              sub.register_load_state_dict_post_hook(after)]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def attached(self) -> bool:
        """Whether the hooks are on the block (not yet taken off by a disable)."""
        return bool(self._handles)

    def _within(self, module: nn.Module) -> str | None:
        """``module``'s name in the block now, with a trailing dot ('' for the block; None: no longer in it)."""
        if module is self._block:
            return ""
        for name, sub in self._block.named_modules() if self._block is not None else ():
            if sub is module:
                return name + "."
        return None

    @staticmethod
    def _reached(at: tuple[str, str] | None, prefix: str, within: str) -> bool:
        """Whether a submodule at ``within`` with ``prefix`` lies below where the call under way entered (``at``)."""
        return at is not None and within != at[1] and within.startswith(at[1]) and prefix == at[0] + within[len(at[1]):]

    def _saving_starts(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        within = self._within(module)
        if within is not None and not self._reached(self._saving_at, prefix, within):
            self._saving_at = (prefix, within)
            self._saving_keeps_vars = keep_vars

    def _real_values(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        within = self._within(module)
        if within is None or self._saving_at != (prefix, within):
            return  # not in the block any more, or reached by a call on a module above it, whose hook fills in
        self._saving_at = None
        host_values = self.state.cpu_named_parameters
        if not host_values:
            return
        # Each host copy goes to every name its parameter object has in the block now: a parameter tied inside
        # the block (``b.weight = a.weight``) is offloaded under its first name but saved under every one, and a
        # submodule wrapped since enable (a LoRA layer around a Linear) renamed it. One the caller replaced has
        # no name left: its entry is the caller's value.
        names_now = parameter_names(self._block)
        objects = self.state.offloaded_parameters()
        running = not getattr(self.state, "mutating", False)
        checked = False
        for name, host in host_values.items():
            value = None
            param = objects.get(name)
            for alias in names_now.get(id(param), []) if param is not None else [name]:
                if not alias.startswith(within):
                    continue  # outside the submodule saved
                key = prefix + alias[len(within):]
                entry = state_dict.get(key)
                if entry is None:
                    continue  # not saved
                if tuple(entry.shape) == tuple(host.shape):
                    # A live value. Inside mutate_params_scope it is the parameter's own tensor, saved as a resident
                    # model saves it. In a running block (a state_dict() from a hook inside the forward) it is a
                    # view of a device slot that the next block's copy overwrites: saved as a copy.
                    if running and not self._saving_keeps_vars:
                        state_dict[key] = entry.clone()
                    continue
                if not checked:
                    checked = True  # what the host copy lacks, said once per state_dict() of the block
                    lost_edit = getattr(self.state, "lost_edit", None)
                    lost = lost_edit(STALE_SAVE_WARNING) if callable(lost_edit) else None
                    if lost is not None:
                        warn_caller(lost)
                if value is None:
                    value = host.detach().clone()
                    value = value if value.dtype == entry.dtype else value.to(entry.dtype)
                state_dict[key] = value

    def refusal(self) -> Exception | None:
        """The error a load into this block raises before it changes anything (None: it loads)."""
        if getattr(self.state, "shared_segment", None) is not None:
            index = getattr(self.state, "handle", None)
            return OffloadStateError(SHARED_LOAD_ERROR.format(index=index, n=getattr(self.state, "shared_by", 0)))
        own = getattr(self.state, "load_refusal", None)  # a state's own (a disk-tier block has no host copy)
        refused = own() if callable(own) else None
        if refused is None:
            # An edit, cast or rebind made while the block was offloaded, which the load's materialize refuses.
            binding = getattr(self.state, "binding_refusal", None)
            refused = binding() if callable(binding) else None
        return refused

    def finish_interrupted_load(self) -> None:
        """Ends a load into this block that raised (Ctrl-C, a failing hook of a module loaded after this
        block's pre-hook) before its post-hook ran: the host copy is rebuilt from what the block holds now,
        as the resident model holds what that load had copied. Left open, the block stayed materialized,
        counted as inside mutate_params_scope() (a re-plan refused it for good) and a later scope's exit
        was taken for an inner one, which does not rebuild."""
        if self._loading:
            self._loading = False
            self._loading_at = None
            with torch.no_grad():
                leave_mutation(self.state)

    def _before_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        within = self._within(module)
        if within is None or (self._loading and self._reached(self._loading_at, prefix, within)):
            return  # not in the block any more, or a submodule the load under way has made real already
        self.finish_interrupted_load()
        if not any(key.startswith(prefix) for key in state_dict):
            return  # nothing for this block (a partial load): its host copy stays as it is
        refused = self.refusal()
        if refused is not None:
            raise refused
        enter_mutation(self.state)  # inside mutate_params_scope() the load goes into the scope's live values
        self._loading = True
        self._loading_at = (prefix, within)

    def _after_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        if not self._loading or self._loading_at is None or self._within(module) != self._loading_at[1]:
            return  # no load of ours, or a submodule inside the load that entered the block above it
        self._loading = False
        self._loading_at = None
        with torch.no_grad():
            leave_mutation(self.state)


class LoadGuard:
    """The load_state_dict pre-hook of the model and of every module between it and its offloaded blocks
    (the block list): refuses a load that one of those blocks would refuse, before any module has
    loaded anything, whichever of them the load is called on."""

    def __init__(self, blocks: list[tuple[str, StateDictHooks]]) -> None:
        self.blocks = blocks  # (the block's name in the model, with a trailing dot; its hooks)
        self._handles: list[RemovableHandle] = []

    def attach(self, model: nn.Module) -> LoadGuard:
        modules = dict(model.named_modules())
        below: dict[str, list[tuple[str, StateDictHooks]]] = {}
        for name, hooks in self.blocks:
            parts = name.rstrip(".").split(".")
            for depth in range(len(parts)):  # every module above the block: the model, the block list
                above = ".".join(parts[:depth])
                below.setdefault(above, []).append((".".join(parts[depth:]) + ".", hooks))
        for above, blocks in below.items():
            if above in modules:
                check = functools.partial(LoadGuard._check, blocks)
                self._handles.append(modules[above].register_load_state_dict_pre_hook(check))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @staticmethod
    def _check(blocks: list[tuple[str, StateDictHooks]], module: nn.Module, state_dict: dict[str, Any], prefix: str,
               *args: Any) -> None:
        for name, hooks in blocks:
            refused = hooks.refusal()
            if refused is not None and any(key.startswith(prefix + name) for key in state_dict):
                raise refused
