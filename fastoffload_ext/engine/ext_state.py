"""The ``"ext"`` backend: one block is one handle into the compiled core's ``OffloadEngine``.

Acquire, prefetch and release are one engine call each; the engine packs the block into one pinned
region, copies it with one transfer into a static device slot and rebinds the parameters in C++.

Differences from the python backend, each tested:
- A grad-recording forward through an offloaded block whose parameters require grad is refused by
  the engine. With frozen parameters and grad mode on, acquire binds a private device copy of the
  slot, so what autograd saved survives the slot's reuse by later blocks.
- The threading contract (one forward at a time, see threads.py) and the in-place/cast checks are
  enforced in C++ (csrc/thread_gate.h, OffloadEngine::acquire), with the python backend's texts.
- Under ``share_host_copy`` (see sharing.py) ``mutate_params_scope`` is refused with
  ``messages.SHARED_MUTATION_ERROR``: the host copy belongs to every rank of the host.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from fastoffload_ext.engine.messages import LOST_EDIT_WARNING, SHARED_MUTATION_ERROR
from fastoffload_ext.engine.state import BlockOffloadState, SeedEntryPoints
from fastoffload_ext.engine.threads import CONCURRENT_FORWARD_ERROR
from fastoffload_ext.engine.weak import WeakModule
from fastoffload_ext.errors import OffloadStateError

__all__ = ["ExtLayerwiseOffloadState"]


class ExtLayerwiseOffloadState(SeedEntryPoints):
    """Offload state of one block over the compiled core (backend ``"ext"``)."""

    backend = "ext"
    module_ref = WeakModule()  # the block, held weakly: it holds this state through its hook
    # An acquire waits for its own slot's copy alone, so a block's release can start the next copy into the
    # slot it frees (layerwise._wire_prefetch_targets) without delaying any block that runs before that one.
    prefetches_on_release = True
    # Detaches of any ext block so far: a change makes try_acquire_and_prefetch resolve its targets again.
    _detaches = 0

    def __init__(self, engine: Any, device: torch.device, next_state: BlockOffloadState | None = None) -> None:
        self.engine = engine
        self.device: torch.device = torch.device(device)
        self.next_state = next_state
        self.prefetch_targets: list[BlockOffloadState] = [] if next_state is None else [next_state]
        self.handle: int | None = None
        # The block's offloaded parameters, by their names when offloaded: a submodule wrapped since (a LoRA
        # layer around a Linear) renames them, and everything that maps a host copy to a parameter goes by object.
        self.param_names: list[str] = []
        self.params: list[nn.Parameter] = []
        # Set by enable_layerwise_offload when the ranks of this host share one host copy (sharing.py):
        # the segment of this block, whether this process owns (packs) it, how many ranks map it.
        self.shared_segment: str | None = None
        self.shared_owner = False
        self.shared_by = 0
        # Another rank's block whose segment the owner filled compressed: (compressed bytes, checksum).
        self.shared_encoded: tuple[int, int] = (0, 0)
        # try_acquire_and_prefetch's handles of prefetch_targets, and the list they were read from.
        self._target_handles: tuple[int, ...] | None = None
        self._targets_seen: list[BlockOffloadState] | None = None
        self._targets_len = -1
        self._detaches_seen = -1
        # Where cpu_named_parameters records the tensors it hands out (the block's state-dict hooks, held weakly:
        # they hold this state): a write into a view of the host copy is applied before the block runs next, and
        # one into a copy is refused there.
        self.hand_out_host: weakref.WeakMethod | None = None

    def _attached(self) -> bool:
        return self.handle is not None and not self.engine.is_removed(self.handle)

    @torch.compiler.disable
    def on_init(self, module: nn.Module) -> None:
        self.module_ref = module
        named = list(module.named_parameters())
        self.param_names = [name for name, _ in named]
        self.params = params = [p for _, p in named]
        if self.shared_segment is not None:
            packed_bytes, checksum = (0, 0) if self.shared_owner else self.shared_encoded
            self.handle = self.engine.add_block_shared(self.param_names, params, self.shared_segment, self.shared_owner,
                                                       packed_bytes, checksum)
        else:
            self.handle = self.engine.add_block(self.param_names, params)

    def offloaded_parameters(self) -> dict[str, nn.Parameter]:
        """Each offloaded parameter object by its name when offloaded (empty once restored)."""
        return dict(zip(self.param_names, self.params)) if self._attached() else {}

    # The seed exposes these dicts; here they are computed on demand (never on the hot path). They are views of
    # the block's raw host copy, so a write into one changes the model as in the seed (the block's device copies
    # made before it, a cached slot or a prefetch, are dropped before it runs next); copies where there is no such
    # copy: a compressed, disk-tier or shared block (a shared block's pages are other ranks' weights too, and
    # read-only on a non-owner), and a write into one of those is refused at the block's next forward.
    @property
    def cpu_named_parameters(self) -> dict[str, torch.Tensor]:
        values = self.host_values()
        record = self.hand_out_host() if self.hand_out_host is not None else None
        if values and record is not None:
            record(values, int(self.engine.host_copy_address(self.handle)))
        return values

    def host_values(self) -> dict[str, torch.Tensor]:
        """``cpu_named_parameters`` without recording it: the engine's own reads, which hand nothing out."""
        if not self._attached():
            return {}
        # Ordinary tensors, whose version counters tell a write, even when asked for inside inference_mode().
        with torch.inference_mode(False):
            # One decode for the whole block when its host copy is compressed.
            return dict(zip(self.param_names, self.engine.host_views(self.handle)))

    def host_written(self, address: int) -> bool | None:
        """A write into views of the block's raw host copy at ``address`` was made: True once the block's next run
        copies it, False when that host copy is no longer there (the write reached a copy only), None while the
        block runs (applied at its next entry)."""
        if not self._attached():
            return False
        if self.is_running():
            return None
        try:
            return bool(self.engine.host_written(self.handle, address))
        except RuntimeError:
            return False  # materialized: the scope's own values go back into the host copy over the write

    @property
    def gpu_named_parameters(self) -> dict[str, torch.Tensor]:
        # The tensors the parameters are bound to while the block runs or is inside mutate_params_scope(). A
        # block only prefetched, or still cached in its slot after it ran, has placeholders bound: no values.
        if not self._attached():
            return {}
        slot = self.engine.slot_of(self.handle)
        if not self.mutating and (slot < 0 or self.engine.slot_state(slot) != "in_use"):
            return {}
        return {name: param.data for name, param in zip(self.param_names, self.params)}

    def is_live(self) -> bool:
        """Whether the parameters hold the block's current values now: running, inside mutate_params_scope(), or
        kept materialized by a rebuild that failed."""
        if not self._attached():
            return False
        slot = self.engine.slot_of(self.handle)
        return bool(self.engine.is_materialized(self.handle)) or (slot >= 0 and self.engine.slot_state(slot) == "in_use")

    def is_running(self) -> bool:
        """Whether a forward holds the block's slot now: its parameters are views of the slot, which the release
        drops (not a scope's or a kept materialization's own tensors)."""
        if not self._attached() or self.engine.is_materialized(self.handle):
            return False
        slot = self.engine.slot_of(self.handle)
        return slot >= 0 and self.engine.slot_state(slot) == "in_use"

    def acquire(self) -> None:
        self.engine.acquire(self.handle)

    def try_acquire_and_prefetch(self) -> bool:
        """``acquire``, then ``prefetch`` of every target, in one engine call when the targets are all this
        engine's blocks (the hook's per-step entry; on a host-bound model each call across the boundary
        counts). Returns False, having done nothing, otherwise: the caller takes the general path."""
        targets = self.prefetch_targets
        if targets is not self._targets_seen or len(targets) != self._targets_len or \
                self._detaches_seen != ExtLayerwiseOffloadState._detaches:
            self._resolve_targets(targets)
        handles = self._target_handles
        if handles is None:
            return False
        self.engine.acquire_and_prefetch(self.handle, handles)
        return True

    def unlink(self) -> None:
        super().unlink()
        self._targets_seen, self._target_handles = None, None

    def _resolve_targets(self, targets: list[BlockOffloadState]) -> None:
        # Keyed on the list object and its length: the list is replaced when prefetching is rewired. An
        # edit in place that keeps the length can only leave a prefetch stale, never a block wrong (acquire
        # loads whatever was not prefetched).
        handles: list[int] = []
        self._detaches_seen = ExtLayerwiseOffloadState._detaches
        for target in targets:
            if not isinstance(target, ExtLayerwiseOffloadState) or target.engine is not self.engine or \
                    target.handle is None or type(target).prefetch is not ExtLayerwiseOffloadState.prefetch:
                self._target_handles = None
                return  # the general path, tried again next time: a target may be attached later
            if target._attached():  # a block detached on its own (its hook removed) is not prefetched
                handles.append(target.handle)
        same = type(self).acquire is ExtLayerwiseOffloadState.acquire and \
            type(self).release is ExtLayerwiseOffloadState.release and self.handle is not None
        self._target_handles = tuple(handles) if same else None
        self._targets_seen, self._targets_len = targets, len(targets)

    def prefetch(self) -> None:
        if self._attached():  # a detached block runs as an ordinary module now: nothing to copy ahead
            self.engine.prefetch(self.handle)

    def release(self) -> None:
        if self.handle is not None:
            self.engine.release(self.handle)

    def release_if_running(self) -> None:
        """Releases the block when the engine holds it as running: after an entry that raised, which may
        have acquired it (an exception raised just after the acquire returned) or not (the acquire failed)."""
        if not self._attached():
            return
        slot = self.engine.slot_of(self.handle)
        if slot >= 0 and self.engine.slot_state(slot) == "in_use":
            try:
                self.engine.release(self.handle)
            except RuntimeError as error:
                # The entry was refused because another thread's forward runs this block: it is that
                # thread's to release, and this entry acquired nothing.
                if str(error) != CONCURRENT_FORWARD_ERROR:
                    raise

    def mutation_refusal(self) -> Exception | None:
        """What ``begin_mutation`` would raise now (None: the block can be materialized and rebuilt); checks
        without changing anything."""
        if self.shared_segment is not None:
            # One rank's LoRA merge would change every rank's weights under them (or, repacked
            # privately, silently diverge from them): refused, see sharing.py.
            return OffloadStateError(SHARED_MUTATION_ERROR.format(n=self.shared_by))
        return self.binding_refusal()

    def begin_mutation(self) -> None:
        if self.shared_segment is not None:
            raise OffloadStateError(SHARED_MUTATION_ERROR.format(n=self.shared_by))
        self.engine.materialize(self.handle)

    def end_mutation(self) -> None:
        if not self._attached():
            return  # disabled inside the scope: the parameters hold the scope's values as ordinary tensors
        named = list(self.module_ref.named_parameters())
        names, params = [name for name, _ in named], [p for _, p in named]
        # A repack that raises (a sparse or meta parameter added in the scope) changes nothing: the block stays
        # materialized, and its names and objects must still match the host copy it keeps.
        self.engine.repack(self.handle, names, params)
        kept = {id(param) for param in params}
        for param in self.params:
            if id(param) not in kept:
                # Moved out of the block since enable (``model.extra = block.up``): no longer this block's to offload,
                # it keeps its value as an ordinary device tensor, copied out of the buffer that materialize bound
                # the whole block to, so that buffer is freed.
                param.data = param.data.clone()
        self.param_names, self.params = names, params

    def lost_edit(self, template: str = LOST_EDIT_WARNING) -> str | None:
        """What a restore now would lose: an in-place write to an offloaded parameter, or a cast and a cast back
        (``template``: LOST_EDIT_WARNING, or STALE_SAVE_WARNING for a state_dict())."""
        name = self.engine.edited_in_place(self.handle) if self._attached() else None
        return None if name is None else template.format(name=name, index=self.handle)

    def binding_refusal(self) -> Exception | None:
        """What materializing the block now would raise for an edit, cast or rebind made while it was offloaded
        (None: nothing, or the block is live); checks without changing anything."""
        if not self._attached():
            return None
        try:
            self.engine.check_offloaded_bindings(self.handle)
        except RuntimeError as error:
            return error
        return None

    def restore(self, module: nn.Module, device: torch.device) -> None:
        if self._attached():
            self.engine.restore(self.handle, device)
        self.params = []
        ExtLayerwiseOffloadState._detaches += 1  # the blocks that prefetch this one resolve their targets again

    def host_bytes(self) -> int:
        # The raw and/or the compressed copy (both while compress="auto" measures).
        return int(self.engine.codec_info(self.handle)["host_bytes"]) if self._attached() else 0

    def weight_bytes(self) -> int:
        # From the block's layout: no decode of a compressed copy.
        return int(self.engine.weight_bytes(self.handle)) if self._attached() else 0
