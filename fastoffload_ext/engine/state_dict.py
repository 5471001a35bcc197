"""``state_dict()`` and ``load_state_dict()`` of an offloaded block: the real values, in and out.

While offloaded, a block's parameters are empty placeholders, so the module's own state dict would
hold ``(0, 0)`` tensors (and ``torch.save`` would write a garbage checkpoint), and loading would fail
with a size mismatch. Module state-dict hooks put the host copy in:

- ``state_dict()`` gets a copy of each offloaded parameter's host values (on the CPU, in the
  parameter's current dtype). Copies rather than views: a write into the returned tensor must not
  change an offloaded weight behind the engine's back (device slots would keep the old bytes). A
  block inside ``mutate_params_scope`` already holds real values and saves the parameters' own tensors,
  as a resident model does; a running block's values are views of a device slot, and are saved as copies.
- A copy is where a resident model's entry is not: its entries share the parameters' storage (and
  ``keep_vars=True`` gives the parameters), so an in-place edit of one (an EMA update,
  ``sd[k].copy_(new)``) changes the model. Here it would change only the copy, so the hooks record each
  copy they hand out (``StateDictHooks.copies``): the tensor, weakly, with its version counter then and
  its key and parameter. A copy changed in place and still alive makes the block's next forward raise
  ``messages.EDITED_COPY_ERROR`` before anything of the block runs, and again at each forward (and at a
  ``mutate_params_scope()`` entry, whose rebuild would drop the edit) until it is loaded
  (``model.load_state_dict(state_dict)``, which records the loaded copies at their versions then) or
  dropped; a ``state_dict()`` of the block meanwhile warns (``EDITED_COPY_SAVE_WARNING``), and a disable
  warns (``EDITED_COPY_WARNING``) and forgets the records. A dropped dict frees its memory, and its
  records go at the next check; one edited and dropped before any of this said so (a temporary dict in
  an EMA loop) is said once, by the next check (``DROPPED_COPY_ERROR`` for a forward), for every block
  at once. The version counter is read through an empty alias sharing it, so a dropped copy is still
  told apart. An edit through ``.data``, which counts no version, is not seen. A block with no copy
  recorded pays one test of an empty list per forward.
- The seed's ``cpu_named_parameters`` is recorded the same way (``hand_out_host``). Its tensors are views of the
  block's raw host copy where there is one, and a write into them is the model's, as in the seed: the check at
  the block's next entry finds it and drops the device copies made from the old bytes (``host_written``), so the
  next run copies the written values. Where the tensors are copies (a block stored compressed, in the disk tier
  or shared, or a view whose host copy was dropped or rebuilt since), a write is refused as an edited
  ``state_dict()`` copy is.
- ``load_state_dict()`` makes the block's parameters ordinary device tensors for the load (as
  ``mutate_params_scope`` does), lets the module load into them, and rebuilds the host copy from
  them; a block whose host copy is shared with other ranks refuses (``messages.SHARED_LOAD_ERROR``).

Both work on the block list alone and through any parent (``model.state_dict()``), since torch runs
every submodule's hooks; and on a submodule of a block alone (``block.attn.state_dict()``), which runs
only the hooks of that submodule and below, so each submodule carries them too. Through the block, the
submodules' hooks leave the work to the block's (one read of a compressed host copy, one rebuild).

A parameter moved out of its block since enable (``model.extra = block.up``) is still offloaded, by object,
until its block is next rebuilt (a ``mutate_params_scope()``, a load into the block), which leaves it an
ordinary tensor on the device with its value. Until then its saved value is its host copy (the moved
submodule keeps these hooks; ``ModelStateDictHooks`` on the model and on every module outside the blocks
cover a parameter rebound into any other module), and a load that names it rebuilds its block first.

A load is all or nothing for the offloaded model: torch loads a parent before its children, so a
pre-hook on the model and on the block list (``ModelStateDictHooks``) refuses, before any module has loaded, a
state dict that names a parameter of a block that would refuse it (disk tier, shared host copy, a block
running a forward: a load from a hook inside it).
Otherwise the blocks before that one would already hold the new values when the error is raised.
"""
from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fastoffload_ext.engine.messages import (
    COPY_ENTRY,
    COPY_ERROR,
    COPY_WHY,
    DROPPED_COPY_ERROR,
    EDITED_COPY_ERROR,
    EDITED_COPY_SAVE_WARNING,
    SHARED_LOAD_ERROR,
    STALE_SAVE_WARNING,
    UNPACKABLE_LOAD_ERROR,
    warn_caller,
)
from fastoffload_ext.engine.state import (
    BlockOffloadState,
    enter_mutation,
    host_values_of,
    leave_mutation,
    parameter_names,
)
from fastoffload_ext.engine.weak import WeakModule
from fastoffload_ext.errors import OffloadStateError

logger = logging.getLogger(__name__)

RUNNING_LOAD_ERROR = ("fastoffload: load_state_dict() is refused on block {index}: it is running a forward (the load "
                      "was made from a hook inside it), and its parameters are views of the device copy that its "
                      "release drops. Load between forwards, for instance after the model's forward returns")
# A load into a parameter that a conversion under torch.__future__.set_overwrite_module_params_on_conversion(True)
# replaced by a new, empty Parameter made from its placeholder (StateDictHooks.rewrapped).
REWRAPPED_LOAD_ERROR = ("fastoffload: load_state_dict() is refused on block {index}: its parameter '{name}' was "
                        "replaced by a new, empty Parameter made from its offload placeholder (a .to(), .float() or "
                        ".half() with torch.__future__.set_overwrite_module_params_on_conversion(True)), which has no "
                        "values to load into and which the block's forward does not bind. Call "
                        "disable_layerwise_offload(model), which gives that Parameter its values, then load and enable "
                        "offload again; convert the model before enable_layerwise_offload, or with that setting off")

__all__ = ["HandedOutCopy", "ModelStateDictHooks", "StateDictHooks"]


class HandedOutCopy:
    """One tensor of an offloaded block's host values handed out, held weakly: a copy a ``state_dict()`` made
    (``source`` "state_dict"), or a tensor of ``cpu_named_parameters`` ("host"), which is a view of the block's raw
    host copy at ``address`` (an edit of it reaches the model) or, with ``address`` 0, a copy.

    ``counter`` is an empty alias of the copy that shares its version counter but not its storage: it tells an
    in-place edit made before the copy was dropped, and keeps none of the copy's memory. A view keeps its storage
    (``storage``): the address it was taken at then names that host copy alone, never memory used again since."""

    __slots__ = ("ref", "counter", "version", "key", "name", "param_id", "reported", "source", "address", "storage")

    def __init__(self, value: torch.Tensor, key: str, name: str, param_id: int | None, source: str = "state_dict",
                 address: int = 0) -> None:
        self.source, self.address = source, address
        self.storage = value.untyped_storage() if address else None
        self.ref = weakref.ref(value)
        counter: torch.Tensor | None = None
        try:
            with torch.no_grad(), torch.inference_mode(False):
                counter = value.detach()
                counter.set_(torch.empty(0, dtype=value.dtype, device=value.device))  # counts a version: read after
        except (RuntimeError, NotImplementedError):
            counter = None  # a layout without set_ (sparse): its edit is told while the copy is alive only
        self.counter = counter
        self.version = self.version_now()
        self.key, self.name, self.param_id = key, name, param_id
        self.reported = False  # an edit of it was raised or warned about: once dropped it is forgotten

    def version_now(self) -> int | None:
        tensor = self.counter if self.counter is not None else self.ref()
        return None if tensor is None else tensor._version

    def edited(self) -> bool:
        now = self.version_now()
        return now is not None and now != self.version


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
        # Every block's hooks of the same offload, held weakly (set by ModelStateDictHooks.attach): a parameter
        # moved from one block into another, or into a module outside the blocks, is found by its owner.
        self._peers: list[weakref.ref[StateDictHooks]] = []
        # Each copy of this block's host values handed out while it was offloaded (see the module's docstring). The
        # hook's forward entry holds this same list and tests it for emptiness alone: it is changed in place only.
        self.copies: list[HandedOutCopy] = []
        self._prune_at = 64  # a record past this many prunes the dropped copies first
        self._loading_params: set[int] = set()  # the parameters the load under way names
        if hasattr(state, "hand_out_host"):
            state.hand_out_host = weakref.WeakMethod(self.hand_out_host)  # cpu_named_parameters records here

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

    def peers(self) -> list[StateDictHooks]:
        """The hooks of every block of this offload, this block's first."""
        found = [peer() for peer in self._peers]
        return [self] + [peer for peer in found if peer is not None and peer is not self]

    def _owners(self) -> dict[int, tuple[StateDictHooks, str]]:
        """Each parameter object a block of this offload still offloads: (its block's hooks, its name there)."""
        owners: dict[int, tuple[StateDictHooks, str]] = {}
        for peer in self.peers():
            for name, param in peer.state.offloaded_parameters().items():
                owners.setdefault(id(param), (peer, name))
        return owners

    def hand_out(self, value: torch.Tensor, key: str, name: str, param: nn.Parameter | None) -> torch.Tensor:
        """Records ``value``, a copy of the host value of this block's parameter ``name`` saved under ``key``."""
        if not value.is_inference():  # made outside inference mode: an inference tensor counts no versions
            self._record(HandedOutCopy(value, key, name, None if param is None else id(param)))
        return value

    def _record(self, copy: HandedOutCopy) -> None:
        if len(self.copies) >= self._prune_at:
            self._edited()
            self._prune_at = max(64, 2 * len(self.copies))
        self.copies.append(copy)

    def hand_out_host(self, values: dict[str, torch.Tensor], address: int) -> dict[str, torch.Tensor]:
        """Records ``values``, the tensors ``cpu_named_parameters`` hands out: views of the block's raw host copy at
        ``address``, or copies (``address`` 0)."""
        objects = self.state.offloaded_parameters()
        for name, value in values.items():
            if not value.is_inference() and value.numel():
                param = objects.get(name)
                self._record(HandedOutCopy(value, name, name, None if param is None else id(param), "host", address))
        return values

    def _write_reached(self, copy: HandedOutCopy) -> bool:
        """Whether an edit of ``copy``, a view of the raw host copy, is in the model's values: then the block's device
        copies made before it are dropped now (or, while the block runs, before its next run), and ``copy`` counts
        as unchanged from here. False when the view stopped being one (the edit reached a copy only)."""
        written = getattr(self.state, "host_written", None)
        reached = written(copy.address) if callable(written) else False
        if reached is None:
            return True  # the block is running: applied at its next entry, which checks again
        if reached:
            copy.version, copy.reported = copy.version_now(), False
        return bool(reached)

    def _edited(self) -> list[HandedOutCopy]:
        """The records of copies changed in place: alive, or dropped since without being reported. Forgets the others
        that were dropped: a dropped dict costs nothing from the next check on. An edit of a view of the raw host copy
        is the model's and is applied, not counted."""
        kept, edited = [], []
        for copy in self.copies:
            changed = copy.edited()
            if changed and copy.address and self._write_reached(copy):
                changed = False
            if copy.ref() is not None or (changed and not copy.reported):
                kept.append(copy)
                if changed:
                    edited.append(copy)
        self.copies[:] = kept
        return edited

    def edited_copy(self, template: str | None = None) -> str | None:
        """The message for a copy of this block's host values changed in place (None: none): ``template`` (by default
        ``EDITED_COPY_ERROR``, or ``DROPPED_COPY_ERROR`` where every such copy was dropped since). Each of them counts
        as reported from then on: a dropped one is forgotten, one alive is reported again at each check."""
        edited = self._edited()
        if not edited:
            return None
        alive = [copy for copy in edited if copy.ref() is not None]
        first = (alive or edited)[0]
        reported, touched = list(edited), [self]
        if not alive:
            # Dropped: the dropped edits of every block of this offload are said in this one message, so that the
            # blocks after this one do not refuse again, one by one, for the same dict.
            for peer in self.peers()[1:]:
                dropped = [copy for copy in peer._edited() if copy.ref() is None]
                reported += dropped
                touched += [peer] if dropped else []
        for copy in reported:
            copy.reported = True
        for hooks in touched:
            hooks._edited()  # forgets the dropped ones now reported
        if template is None:
            template = EDITED_COPY_ERROR if alive else DROPPED_COPY_ERROR
        more = f", and {len(reported) - 1} more entries" if len(reported) > 1 else ""
        what = "was changed in place" if alive else "was changed in place and then dropped"
        return template.format(entry=COPY_ENTRY[first.source].format(key=first.key), why=COPY_WHY[first.source],
                               name=first.name, index=self._index(), more=more, what=what)

    def refuse_edited_copies(self) -> None:
        """Raises ``EDITED_COPY_ERROR`` for a copy of this block's host values changed in place and still alive (on
        each call until it is loaded or dropped), ``DROPPED_COPY_ERROR`` once for one dropped since."""
        for copy in self.copies:  # the common case first, at a forward's cost: every copy alive and unchanged
            counter = copy.counter
            if counter is None or counter._version != copy.version or copy.ref() is None:
                break
        else:
            return
        message = self.edited_copy()
        if message is not None:
            raise OffloadStateError(message)

    def forget_copies(self) -> None:
        self.copies.clear()

    def loaded(self, params: set[int]) -> None:
        """A load gave each parameter of ``params`` (by id) the value the caller chose: an edit of a copy of its
        value made so far is no longer lost. A copy still alive is recorded at its version now, so a later edit of
        it still is."""
        if not params:
            return
        for peer in self.peers():
            for copy in peer.copies:
                if copy.param_id in params:
                    copy.version, copy.reported = copy.version_now(), False
            peer._edited()

    def fill_placeholders(self, state_dict: dict[str, Any], entries: list[tuple[str, nn.Parameter]]) -> None:
        """For each (key, parameter) of ``entries`` whose saved value is the empty placeholder of a parameter that a
        block of this offload still offloads, saves that block's host copy instead: a parameter moved out of its
        block since enable (``model.extra = block.up``) is offloaded still, until that block's next rebuild.
        The parameter's own block is found by object, whichever block or module it sits in now."""
        pending = [(key, param) for key, param in entries
                   if isinstance(state_dict.get(key), torch.Tensor) and state_dict[key].numel() == 0]
        if not pending:
            return
        owners = self._owners()
        host_values: dict[int, dict[str, torch.Tensor]] = {}
        for key, param in pending:
            owner = owners.get(id(param))
            if owner is None:
                continue
            peer, name = owner
            if id(peer) not in host_values:
                host_values[id(peer)] = host_values_of(peer.state)  # one decode of a compressed host copy
            host = host_values[id(peer)].get(name)
            if host is not None and host.numel() != 0:
                state_dict[key] = peer.hand_out(_copy(host, state_dict[key].dtype), key, name, param)

    def _live(self) -> bool:
        """Whether the block holds its values now (running, inside a scope, or kept materialized by a failed
        rebuild): then every parameter it holds is its current value, whatever its shape."""
        live = getattr(self.state, "is_live", None)
        return bool(live()) if callable(live) else bool(getattr(self.state, "mutating", False))

    def settle(self) -> None:
        """Rebuilds the block, so that a parameter moved out of it since enable becomes an ordinary tensor."""
        refused = self.state.mutation_refusal()
        if refused is not None:
            raise refused
        with torch.no_grad():
            enter_mutation(self.state)
            leave_mutation(self.state)

    def settle_foreign(self) -> None:
        """Before this block is rebuilt: a parameter it holds that another block still offloads (moved here from
        there since enable) becomes an ordinary tensor first. Taken as it is, its empty placeholder would be
        packed as its value."""
        block = self._block
        if block is None or not self._peers:
            return
        own = {id(param) for param in self.state.offloaded_parameters().values()}
        foreign = [param for param in block.parameters() if id(param) not in own]
        if not foreign:
            return
        owners = self._owners()
        settled: set[int] = set()
        for param in foreign:
            owner = owners.get(id(param))
            if owner is not None and owner[0] is not self and id(owner[0]) not in settled:
                settled.add(id(owner[0]))
                owner[0].settle()

    def _real_values(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        within = self._within(module)
        if within is None:
            # A submodule moved out of the block: its own parameters (each submodule of it has these hooks too).
            self.fill_placeholders(state_dict, [(prefix + name, param) for name, param in module._parameters.items()
                                                if param is not None])
            return
        if self._saving_at != (prefix, within):
            return  # reached by a call on a module above it, whose hook fills in
        self._saving_at = None
        host_values = host_values_of(self.state)
        # Each host copy goes to every name its parameter object has in the block now: a parameter tied inside
        # the block (``b.weight = a.weight``) is offloaded under its first name but saved under every one, and a
        # submodule wrapped since enable (a LoRA layer around a Linear) renamed it. One the caller replaced has
        # no name left: its entry is the caller's value.
        names_now = parameter_names(self._block)
        objects = self.state.offloaded_parameters()
        running = not getattr(self.state, "mutating", False)
        live = self._live()
        checked = False
        edited = self.edited_copy(EDITED_COPY_SAVE_WARNING) if self.copies else None
        if edited is not None:
            warn_caller(edited)  # the values saved are the model's, not those of the copy changed in place
        rewrapped: dict[str, tuple[nn.Parameter, torch.Tensor]] | None = None
        for name, host in host_values.items():
            value = None
            param = objects.get(name)
            aliases = names_now.get(id(param), []) if param is not None else [name]
            if not aliases and param is not None:
                # Not held by the block any more: replaced by the caller, moved out, or converted into a new object
                # made from its placeholder, which saves the host copy's value.
                if rewrapped is None:
                    rewrapped = self.rewrapped()
                if name in rewrapped:
                    aliases = names_now.get(id(rewrapped[name][1]), [])
            for alias in aliases:
                if not alias.startswith(within):
                    continue  # outside the submodule saved
                key = prefix + alias[len(within):]
                entry = state_dict.get(key)
                if entry is None:
                    continue  # not saved
                if live or tuple(entry.shape) == tuple(host.shape):
                    # A live value. Inside mutate_params_scope it is the parameter's own tensor, saved as a resident
                    # model saves it. In a running block (a state_dict() from a hook inside the forward) it is a
                    # view of a device slot that the next block's copy overwrites: saved as a copy.
                    if running and not self._saving_keeps_vars:
                        state_dict[key] = self.hand_out(_copy(entry, entry.dtype), key, name, param)
                    continue
                if not checked:
                    checked = True  # what the host copy lacks, said once per state_dict() of the block
                    lost_edit = getattr(self.state, "lost_edit", None)
                    lost = lost_edit(STALE_SAVE_WARNING) if callable(lost_edit) else None
                    if lost is not None:
                        warn_caller(lost)
                if value is None:  # one copy for every name of a tied parameter, recorded once
                    value = self.hand_out(_copy(host, entry.dtype), key, name, param)
                state_dict[key] = value
        # A parameter moved into this block from another one, still offloaded there.
        self.fill_placeholders(state_dict, [(prefix + alias[len(within):], param) for alias, param in
                                            self._block.named_parameters(remove_duplicate=False) if alias.startswith(within)])

    def rewrapped(self) -> dict[str, tuple[nn.Parameter, torch.Tensor]]:
        """The offloaded parameters whose place in the block holds a new, empty tensor made from their placeholder,
        by the name they were offloaded under: (the offloaded parameter, what stands in its place now).

        With ``torch.__future__.set_overwrite_module_params_on_conversion(True)``, every ``.to()``, ``.float()``,
        ``.half()`` on the model puts a new Parameter made from the one it finds in each place: for an offloaded
        block, from its empty placeholder. That object is the offloaded parameter converted (a resident model's is
        the parameter's value converted), so it is saved and restored with the host copy's value in its dtype;
        taken as a parameter the caller replaced (``block.up.weight = nn.Parameter(new)``), whose value is its
        own, its empty tensor was saved and kept by a disable, and every value of the block was lost.
        """
        block = self._block
        objects = self.state.offloaded_parameters()
        if block is None or not objects:
            return {}
        held = {id(param) for param in block.parameters()}
        missing = {name: param for name, param in objects.items() if id(param) not in held}
        if not missing:
            return {}
        offloaded = self._owners()  # a placeholder of another block's parameter, moved here, is that parameter
        found: dict[str, tuple[nn.Parameter, torch.Tensor]] = {}
        for name, param in missing.items():
            try:
                now = block.get_parameter(name)
            except AttributeError:
                continue  # the place is gone (a submodule replaced): the parameter was moved out or replaced
            if now is not param and now.numel() == 0 and id(now) not in offloaded:
                found[name] = (param, now)
        return found

    def moved_out(self) -> list[nn.Parameter]:
        """The parameters this block offloaded that it no longer holds: moved elsewhere since enable, or replaced."""
        objects = self.state.offloaded_parameters()
        if self._block is None or not objects:
            return []
        held = {id(param) for param in self._block.parameters()}
        return [param for param in objects.values() if id(param) not in held]

    def _index(self) -> object:
        index = getattr(self.state, "handle", None)
        return getattr(self.state, "block_index", "?") if index is None else index

    def refusal(self) -> Exception | None:
        """The error a load into this block raises before it changes anything (None: it loads)."""
        running = getattr(self.state, "is_running", None)
        if callable(running) and running():
            # Loaded from a hook inside the block's forward: its parameters are views of the device copy that its
            # release drops, and the rebuild would leave the rest of its forward placeholders.
            return OffloadStateError(RUNNING_LOAD_ERROR.format(index=self._index()))
        if getattr(self.state, "shared_segment", None) is not None:
            index = getattr(self.state, "handle", None)
            return OffloadStateError(SHARED_LOAD_ERROR.format(index=index, n=getattr(self.state, "shared_by", 0)))
        own = getattr(self.state, "load_refusal", None)  # a state's own (a disk-tier block has no host copy)
        refused = own() if callable(own) else None
        if refused is None:
            # An edit, cast or rebind made while the block was offloaded, which the load's materialize refuses.
            binding = getattr(self.state, "binding_refusal", None)
            refused = binding() if callable(binding) else None
        if refused is None:
            # A parameter converted into a new, empty object made from its placeholder (see rewrapped): torch would
            # load into that empty tensor and refuse its shape, after the modules before it had loaded.
            rewrapped = next(iter(self.rewrapped()), None)
            if rewrapped is not None:
                return OffloadStateError(REWRAPPED_LOAD_ERROR.format(index=self._index(), name=rewrapped))
        if refused is None and self._block is not None:
            # A parameter the load's closing rebuild could not pack (added by a scope whose rebuild failed): refused
            # now, or the load would stop at this block's end with the modules after it not loaded.
            for name, param in self._block.named_parameters():
                if param.is_meta or param.layout != torch.strided:
                    what = "is on the meta device" if param.is_meta else f"has layout {param.layout}"
                    return OffloadStateError(UNPACKABLE_LOAD_ERROR.format(index=self._index(), name=name, what=what))
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
        if within is None:
            # A submodule moved out of the block: a load that names one of its parameters this block still offloads
            # rebuilds the block first, which leaves that parameter an ordinary tensor for the load to fill.
            moved = {id(param) for param in self.moved_out()}
            if any(id(param) in moved and prefix + name in state_dict for name, param in module._parameters.items()):
                self.settle()
            self.loaded({id(param) for name, param in module._parameters.items()
                         if param is not None and prefix + name in state_dict})
            return
        if self._loading and self._reached(self._loading_at, prefix, within):
            return  # a submodule the load under way has made real already
        self.finish_interrupted_load()
        if not any(key.startswith(prefix) for key in state_dict):
            return  # nothing for this block (a partial load): its host copy stays as it is
        refused = self.refusal()
        if refused is not None:
            raise refused
        self.settle_foreign()
        enter_mutation(self.state)  # inside mutate_params_scope() the load goes into the scope's live values
        self._loading = True
        self._loading_at = (prefix, within)
        self._loading_params = {id(param) for alias, param in self._block.named_parameters(remove_duplicate=False)
                                if alias.startswith(within) and prefix + alias[len(within):] in state_dict}

    def _after_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        if not self._loading or self._loading_at is None or self._within(module) != self._loading_at[1]:
            return  # no load of ours, or a submodule inside the load that entered the block above it
        self._loading = False
        self._loading_at = None
        loaded, self._loading_params = self._loading_params, set()
        self.loaded(loaded)  # the block holds the loaded values now, whether or not the rebuild below succeeds
        with torch.no_grad():
            leave_mutation(self.state)


def _copy(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of ``value`` in ``dtype`` that shares memory with nothing; an ordinary tensor inside inference mode too,
    as a resident model's entries are, so that an in-place edit of it counts a version."""
    with torch.inference_mode(False):
        copy = value.detach().clone()
        return copy if copy.dtype == dtype else copy.to(dtype)


class ModelStateDictHooks:
    """The state-dict hooks of the model and of every module outside its offloaded blocks, whichever of them the
    call is made on:

    - before a load, on the model and the modules above the blocks (the block list), a refusal of what one of the
      blocks would refuse, before any module has loaded anything; and on each of them, a parameter moved out of its
      block since enable, which the state dict names, becomes an ordinary tensor first (its block is rebuilt
      without it), so the load reaches it wherever it now sits;
    - after a ``state_dict()``, the host copy for a parameter moved out of its block into a module that no block's
      hooks reach (``model.proj_out.weight = block.o.weight``).
    """

    def __init__(self, blocks: list[tuple[str, StateDictHooks]]) -> None:
        self.blocks = blocks  # (the block's name in the model, with a trailing dot; its hooks)
        self._handles: list[RemovableHandle] = []

    def attach(self, model: nn.Module) -> ModelStateDictHooks:
        below: dict[str, list[tuple[str, StateDictHooks]]] = {}
        for name, hooks in self.blocks:
            parts = name.rstrip(".").split(".")
            for depth in range(len(parts)):  # every module above the block: the model, the block list
                above = ".".join(parts[:depth])
                below.setdefault(above, []).append((".".join(parts[depth:]) + ".", hooks))
        every = [hooks for _, hooks in self.blocks]
        for hooks in every:
            hooks._peers = [weakref.ref(peer) for peer in every]
        if not every:
            return self
        # On the model and on every module outside the blocks, whichever of them the call is made on: a parameter
        # moved into one of them is saved from its host copy, and settled before a load that names it. The blocks'
        # hooks are held weakly: a module outside the blocks may be held by a state (a checkpoint's reader).
        first = weakref.ref(every[0])
        inside = {id(sub) for hooks in every if hooks._block is not None for sub in hooks._block.modules()}
        for name, module in model.named_modules():
            if id(module) in inside:
                continue
            # The model and the modules above the blocks look through their whole subtree (a module added since
            # enable has no hooks of its own); the others at their own parameters.
            check = functools.partial(ModelStateDictHooks._check, below.get(name, []), first, name in below)
            self._handles.append(module.register_load_state_dict_pre_hook(check))
            moved = functools.partial(ModelStateDictHooks._moved, first, name == "")
            self._handles.append(module.register_state_dict_post_hook(moved))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @staticmethod
    def _check(blocks: list[tuple[str, StateDictHooks]], first: weakref.ref[StateDictHooks], recurse: bool,
               module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name, hooks in blocks:
            refused = hooks.refusal()
            if refused is not None and any(key.startswith(prefix + name) for key in state_dict):
                raise refused
        named = module.named_parameters(remove_duplicate=False) if recurse else module._parameters.items()
        # Only an empty tensor can be a placeholder: a module without one is done at once.
        empty = {id(param) for key, param in named
                 if param is not None and param.numel() == 0 and prefix + key in state_dict}
        owner = first() if empty else None
        for hooks in owner.peers() if owner is not None else ():
            if any(id(param) in empty for param in hooks.moved_out()):
                hooks.settle()  # the rebuild leaves the moved parameters as ordinary tensors
        if owner is not None:
            owner.loaded(empty)  # a copy of a moved parameter's value that the load now replaces

    @staticmethod
    def _moved(first: weakref.ref[StateDictHooks], recurse: bool, module: nn.Module, state_dict: dict[str, Any],
               prefix: str, local_metadata: Any) -> None:
        hooks = first()
        if hooks is None:
            return
        named = module.named_parameters(remove_duplicate=False) if recurse else module._parameters.items()
        hooks.fill_placeholders(state_dict, [(prefix + key, param) for key, param in named if param is not None])

