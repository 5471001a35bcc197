"""Offload state of a block whose weights come from a checkpoint file (ext backend).

It behaves like ``ExtLayerwiseOffloadState`` once attached; what differs is where the bytes come
from: ``on_init`` hands the engine the block's file ranges instead of tensors, so the host copy is read
straight from disk into pinned memory (host tier), or not kept at all (disk tier: read every step).

A model built on the meta device cannot have its parameters rebound to real memory in place (a meta
tensor's storage is of another kind), so each meta parameter is first replaced by an empty real one of
the same dtype and ``requires_grad``; on failure, and on a detach back to the meta device, the original
parameters are put back.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch import nn

from fastoffload_ext.engine.offload_state import ExtLayerwiseOffloadState
from fastoffload_ext.engine.state import parameter_names
from fastoffload_ext.errors import OffloadStateError
from fastoffload_ext.storage.source import BlockSource, CheckpointSource

logger = logging.getLogger(__name__)

__all__ = ["CheckpointOffloadState", "DISK_LOAD_ERROR", "DISK_MUTATION_ERROR"]

DISK_MUTATION_ERROR = ("fastoffload: this block is in the disk tier: its weights are read from the checkpoint every "
                       "step and it has no host copy that mutate_params_scope could rebuild. Raise host_budget so "
                       "that it fits in host memory, or apply the change to the checkpoint")
DISK_LOAD_ERROR = ("fastoffload: this block is in the disk tier: its weights are read from the checkpoint every step, "
                   "and it has no host copy to load new values into. Nothing was loaded. Raise host_budget so that it "
                   "fits in host memory, or save the new values as a checkpoint and enable again with weights= it")


class CheckpointOffloadState(ExtLayerwiseOffloadState):
    """A block packed from (host tier) or streamed from (disk tier) a checkpoint."""

    restores_to_meta = True  # restore() takes a block to the meta device itself, without a read

    def __init__(self, engine: Any, device: torch.device, source: CheckpointSource) -> None:
        super().__init__(engine, device)
        self.source = source
        self.block: BlockSource = source.next_block(engine)
        # (the submodule, held weakly as the block is (engine/weak.py), the key, its meta parameter)
        self._originals: list[tuple[weakref.ref, str, nn.Parameter]] = []
        self.mutated = False  # a mutation (mutate_params_scope, a load) began: the names may not be the file's

    @property
    def on_disk(self) -> bool:
        return self.block.on_disk

    @staticmethod
    def _aliases(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
        """Every (owner, attribute) of each parameter of ``module``, by the parameter's id: a parameter tied
        inside the block (``b.weight = a.weight``) is listed once by ``named_parameters()`` but is held
        under each of its names, and a replacement must reach all of them or the tie breaks."""
        def place(name: str) -> tuple[nn.Module, str]:
            owner, _, leaf = name.rpartition(".")
            return module.get_submodule(owner), leaf

        return {key: [place(name) for name in names] for key, names in parameter_names(module).items()}

    def _replace_meta_parameters(self, module: nn.Module) -> list[torch.Tensor]:
        params = []
        places = self._aliases(module)
        for name in self.block.names:
            prefix, _, leaf = name.rpartition(".")
            owner = module.get_submodule(prefix)
            param = owner._parameters[leaf]
            if param.is_meta:
                with torch.inference_mode(False):  # an ordinary tensor, also when enable runs in inference mode
                    empty = nn.Parameter(torch.empty(0, dtype=param.dtype), requires_grad=param.requires_grad)
                for place, key in places.get(id(param), [(owner, leaf)]):
                    self._originals.append((weakref.ref(place), key, param))
                    place._parameters[key] = empty
                param = empty
            params.append(param)
        return params

    def _put_back_originals(self) -> None:
        for owner_ref, leaf, param in reversed(self._originals):
            owner = owner_ref()
            if owner is not None:
                current = owner._parameters.get(leaf)
                if current is not None and current is not param:
                    # A freeze or unfreeze made while the block was offloaded holds for its meta original too.
                    param.requires_grad_(current.requires_grad)
                owner._parameters[leaf] = param
        self._originals.clear()

    @torch.compiler.disable
    def on_init(self, module: nn.Module) -> None:
        self.module_ref = module
        self.param_names = list(self.block.names)
        self.params = params = self._replace_meta_parameters(module)
        add = self.engine.add_block_on_disk if self.block.on_disk else self.engine.add_block_from_file
        try:
            # The engine names tensors by their checkpoint keys, which is what its read errors must say.
            keys = [entry.name for entry in self.block.entries]
            with self.source.timed("attach"):
                self.handle = add(keys, params, self.block.shapes(), self.source.spans(self.block))
        except BaseException:
            self._put_back_originals()
            raise

    def load_refusal(self) -> OffloadStateError | None:
        """What a load_state_dict into this block raises before anything changes (state_dict.ModelStateDictHooks)."""
        return OffloadStateError(DISK_LOAD_ERROR) if self.block.on_disk else None

    def mutation_refusal(self) -> Exception | None:
        return OffloadStateError(DISK_MUTATION_ERROR) if self.block.on_disk else super().mutation_refusal()

    def begin_mutation(self) -> None:
        if self.block.on_disk:
            raise OffloadStateError(DISK_MUTATION_ERROR)
        super().begin_mutation()
        self.mutated = True

    def restore(self, module: nn.Module, device: torch.device) -> None:
        if torch.device(device).type != "meta":
            super().restore(module, device)
            return
        if self.mutated:
            self._restore_mutated_to_meta(module)
            return
        # Rolled back before the model ever had values, or disabled to the meta device: the engine's copy
        # is dropped without a read (the file may be what failed, or may have changed since enable), the
        # meta parameters go back, and a parameter that was real before enable becomes a meta one.
        if self._attached():
            self.engine.drop(self.handle)
        ExtLayerwiseOffloadState._detaches += 1  # as super().restore counts it
        self._put_back_originals()
        # By object: a submodule wrapped since enable renamed the parameters, which the checkpoint names no more.
        places = self._aliases(module)
        for entry, param in zip(self.block.entries, self.params):
            spots = places.get(id(param))
            if param.is_meta or not spots:
                continue  # its meta original is back in its place, or the caller replaced it
            meta = nn.Parameter(torch.empty(entry.shape, dtype=param.dtype, device="meta"),
                                requires_grad=param.requires_grad)
            for place, key in spots:  # a tie stays a tie
                place._parameters[key] = meta

    def _restore_mutated_to_meta(self, module: nn.Module) -> None:
        """To the meta device after a mutation: the scope may have added parameters, replaced submodules or
        changed shapes, so the checkpoint's names and shapes no longer describe the block. Its host copy is
        complete (a host-tier block: a disk-tier one is never mutated), so it comes back onto the host,
        where every parameter has its shape again, and each goes to meta from there."""
        if self._attached():
            self.engine.restore(self.handle, torch.device("cpu"))
        ExtLayerwiseOffloadState._detaches += 1
        self._originals.clear()  # the block's parameters are now the ones the mutation left
        for places in self._aliases(module).values():
            owner, leaf = places[0]
            param = owner._parameters[leaf]
            if param is not None and not param.is_meta:
                meta = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                    requires_grad=param.requires_grad)
                for place, key in places:  # a tie stays a tie
                    place._parameters[key] = meta

    def check_files(self) -> None:
        """Raises the reader's error when a file this disk-tier block is read from changed since enable
        (a detach to a real device reads it): before a disable detaches any block."""
        if self.block.on_disk and self._attached():
            for file in sorted({file for file, _, _ in self.source.spans(self.block)}):
                self.source.reader.check_unchanged(file)

    def host_bytes(self) -> int:
        return 0 if self.block.on_disk else super().host_bytes()

    # weight_bytes() is the base class's: the engine block's layout while attached (a disk-tier block's too),
    # 0 once its weights came back. A disable cut short between two blocks, and disable's detach of a block
    # whose hook was taken off, tell a detached block by that 0.
