"""LoRA adapters (peft) on a layerwise-offloaded model: merges run on the real weights, one block at a time.

A peft LoRA layer merges by writing into its base weight (``base_layer.weight.data += delta``). In an
offloaded block that weight is an empty placeholder between forwards, and so are the adapter's own
weights when the adapter was added before the offload. Left alone, a merge there adds an empty delta
to an empty tensor, marks the adapter merged, and every later forward silently runs without it (or,
with the adapter added after the offload, fails on the shapes).

``guard_adapters(model, group)``, which ``enable_layerwise_offload`` calls, makes both work:

- ``merge()``/``unmerge()`` of each peft layer inside an offloaded block run inside that block's
  ``mutate_params_scope()``: the block's weights are real device tensors for the call, and its host
  copy is rebuilt from them afterwards (with the adapter's weights too, when they were added after
  the offload). peft's ``merge_and_unload()`` and ``merge_adapter()`` go through these.
- diffusers' ``fuse_lora()``/``unfuse_lora()`` on the model run with one block materialized at a time:
  each block's layers are merged inside one scope, so the host copy of a block is rebuilt once.
- ``add_adapter()``/``load_lora_adapter()`` guard the layers they add.

The results are bit for bit the resident model's. A block whose host copy cannot be rebuilt (shared
between ranks, or read from disk) refuses the merge with the engine's message, before anything
changes. The guards check the offload at call time: after ``disable_layerwise_offload`` every call goes
straight to peft.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from fastoffload_ext.engine.group import LayerwiseOffloadGroup, get_offload_group
from fastoffload_ext.engine.hooks import DEAD_MODULE_ERROR, ModuleHookManager
from fastoffload_ext.engine.offload_hook import LayerwiseOffloadHook
from fastoffload_ext.engine.state import BlockOffloadState
from fastoffload_ext.errors import OffloadStateError

__all__ = ["guard_adapters"]

_LAYER_METHODS = ("merge", "unmerge")
_BLOCKWISE_METHODS = ("fuse_lora", "unfuse_lora")
_ADDING_METHODS = ("add_adapter", "load_lora_adapter")
_GUARDED = "_fastoffload_adapter_guard"  # on a model or a peft layer: its methods are guarded
_session = threading.local()  # .blockwise: the _Blockwise of a fuse_lora() running in this thread

MERGE_REFUSED = ("fastoffload: {what} would merge adapter weights into the offloaded block {block}, which refuses: "
                 "{reason}. Nothing was merged")


def _tuner_layers(module: nn.Module) -> list[nn.Module]:
    """peft's LoRA (and other tuner) layers inside ``module``; none while peft was never imported."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    base = getattr(tuners, "BaseTunerLayer", None)
    return [] if base is None else [m for m in module.modules() if isinstance(m, base)]


def _hook(state: BlockOffloadState) -> LayerwiseOffloadHook:
    manager = ModuleHookManager.get_from(state.module_ref)
    hook = manager.get_forward_hook(LayerwiseOffloadHook.name()) if manager is not None else None
    if not isinstance(hook, LayerwiseOffloadHook):
        raise OffloadStateError("fastoffload: an offloaded block lost its offload hook; disable the offload "
                                "(disable_layerwise_offload) and enable it again before merging an adapter")
    return hook


def _owners(group: LayerwiseOffloadGroup) -> dict[int, BlockOffloadState]:
    """id of each module inside an offloaded block -> that block's state."""
    return {id(module): state for state in group.states for module in state.module_ref.modules()}


def _check_mergeable(model: nn.Module, states: list[BlockOffloadState], what: str) -> None:
    """Raise MERGE_REFUSED, before anything changes, when a block of ``states`` could not be materialized and
    rebuilt (a host copy shared between ranks, a disk-tier block, an edit made while offloaded)."""
    for state in states:
        refusal = getattr(state, "mutation_refusal", None)
        refused = refusal() if callable(refusal) else None
        if refused is not None:
            block = next((name for name, module in model.named_modules() if module is state.module_ref), "?")
            raise OffloadStateError(MERGE_REFUSED.format(what=what, block=block, reason=refused)) from refused


class _Blockwise:
    """One block's mutation scope open at a time, for the layers of a whole-model merge: the model's
    ``apply()`` reaches the layers of one block one after another, so each block is materialized once."""

    def __init__(self, group: LayerwiseOffloadGroup, owners: dict[int, BlockOffloadState]) -> None:
        self.group = group
        self.owners = owners
        self.open: BlockOffloadState | None = None
        self.scope = contextlib.ExitStack()

    def enter(self, state: BlockOffloadState) -> None:
        if state is self.open:
            return
        self.close()
        self.scope.enter_context(_hook(state).mutate_params_scope())
        self.open = state

    def close(self) -> None:
        self.open = None
        self.scope.close()  # the host copy of the block is rebuilt, also after an exception


def _model_of(model_ref: weakref.ref[nn.Module]) -> nn.Module:
    model = model_ref()
    if model is None:
        raise OffloadStateError(DEAD_MODULE_ERROR)
    return model


def _guard_layer(model: nn.Module, layer: nn.Module) -> None:
    if layer.__dict__.get(_GUARDED):
        return
    # Weak references, and the class's functions rather than bound methods: a function on the layer that held the
    # layer or the model strongly would keep a dropped model, and its host copy, until the cycle collector ran.
    model_ref, layer_ref = weakref.ref(model), weakref.ref(layer)
    for method in _LAYER_METHODS:
        unbound = getattr(type(layer), method, None)
        if callable(unbound) and method not in layer.__dict__:
            wrapper = _in_block_scope(model_ref, layer_ref, unbound)
            wrapper.__signature__ = inspect.signature(getattr(layer, method))  # type: ignore[attr-defined]
            object.__setattr__(layer, method, wrapper)
    object.__setattr__(layer, _GUARDED, True)


def _in_block_scope(model_ref: weakref.ref[nn.Module], layer_ref: weakref.ref[nn.Module],
                    unbound: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(unbound)
    def call(*args: Any, **kwargs: Any) -> Any:
        model, layer = _model_of(model_ref), layer_ref()
        if layer is None:
            raise OffloadStateError(DEAD_MODULE_ERROR)
        group = get_offload_group(model)
        blockwise: _Blockwise | None = getattr(_session, "blockwise", None)
        if group is None:
            return unbound(layer, *args, **kwargs)
        if blockwise is not None and blockwise.group is group:
            state = blockwise.owners.get(id(layer))
            if state is not None:
                blockwise.enter(state)
            return unbound(layer, *args, **kwargs)
        state = _owners(group).get(id(layer))
        if state is None:  # in a resident block, or outside the block lists: real weights already
            return unbound(layer, *args, **kwargs)
        _check_mergeable(model, [state], f"{type(layer).__name__}.{unbound.__name__}()")
        with _hook(state).mutate_params_scope():
            return unbound(layer, *args, **kwargs)

    del call.__wrapped__  # functools.wraps kept the function there; the signature is set by the caller
    return call


@contextlib.contextmanager
def _blockwise(group: LayerwiseOffloadGroup, owners: dict[int, BlockOffloadState]) -> Iterator[None]:
    if getattr(_session, "blockwise", None) is not None:  # a fuse_lora inside another: the outer one's blocks
        yield
        return
    session = _session.blockwise = _Blockwise(group, owners)
    try:
        yield
    finally:
        _session.blockwise = None
        session.close()


def _guard_model_method(model: nn.Module, method: str) -> None:
    unbound = getattr(type(model), method, None)
    if not callable(unbound) or method in model.__dict__:
        return
    model_ref = weakref.ref(model)

    @functools.wraps(unbound)
    def call(*args: Any, **kwargs: Any) -> Any:
        model = _model_of(model_ref)
        group = get_offload_group(model)
        if group is None:
            return unbound(model, *args, **kwargs)
        if method in _ADDING_METHODS:
            try:
                return unbound(model, *args, **kwargs)
            finally:
                _guard_layers(model, group)
        _guard_layers(model, group)  # layers added since enable, by a call that was not guarded
        owners = _owners(group)
        merged = (owners.get(id(layer)) for layer in _layers_in_lists(model, group))
        _check_mergeable(model, list({id(s): s for s in merged if s is not None}.values()),
                         f"{type(model).__name__}.{method}()")
        with _blockwise(group, owners):
            return unbound(model, *args, **kwargs)

    del call.__wrapped__  # the class's function, whose signature names self
    call.__signature__ = inspect.signature(getattr(model, method))  # type: ignore[attr-defined]
    object.__setattr__(model, method, call)


def _layers_in_lists(model: nn.Module, group: LayerwiseOffloadGroup) -> list[nn.Module]:
    return [layer for name in group.list_names for layer in _tuner_layers(getattr(model, name))]


def _guard_layers(model: nn.Module, group: LayerwiseOffloadGroup) -> None:
    for layer in _layers_in_lists(model, group):
        _guard_layer(model, layer)


def guard_adapters(model: nn.Module, group: LayerwiseOffloadGroup) -> None:
    """Make LoRA merges on ``model`` run on its blocks' real weights while it is offloaded (see the module doc)."""
    if not model.__dict__.get(_GUARDED):
        for method in (*_BLOCKWISE_METHODS, *_ADDING_METHODS):
            _guard_model_method(model, method)
        object.__setattr__(model, _GUARDED, True)
    _guard_layers(model, group)
