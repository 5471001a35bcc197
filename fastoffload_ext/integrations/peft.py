"""LoRA adapters (peft) on a layerwise-offloaded model: merges run on the real weights, one block at a time.

A peft LoRA layer merges by writing into its base weight (``base_layer.weight.data += delta``). In an
offloaded block that weight is an empty placeholder between forwards, and so are the adapter's own
weights once the block's host copy holds them (the adapter was added before the offload, or loaded
since). Left alone, a merge there adds an empty delta to an empty tensor, marks the adapter merged,
and every later forward silently runs without it.

``patch_peft()`` (run by ``enable_layerwise_offload`` and whenever a block's host copy is rebuilt, so
a peft imported after the enable is covered by then) wraps ``merge()`` and ``unmerge()`` of peft's
layer classes: a layer that holds an offload placeholder merges inside its block's
``mutate_params_scope()``, where the block's weights are real device tensors, and the block's host
copy is rebuilt from them afterwards. peft's ``merge_and_unload()`` and ``merge_adapter()`` go through
these. A merge or unmerge inside a forward that is running the block (peft unmerges a fused layer in its
forward when the adapters are disabled) writes the running step's weights: the block's release then
rebuilds the host copy from them (``LayerwiseOffloadHook.keep_running_changes``), or, where the block cannot
be rebuilt, the call refuses before peft changes anything. An adapter added after the enable is an ordinary
tensor of its block until a rebuild takes it into the host copy, and trains as one. Removing adapters
(diffusers' ``delete_adapters()`` and ``unload_lora()``, peft's ``delete_adapter()``, ``unload()`` and
``merge_and_unload()``) rebuilds the blocks whose host copy held the removed weights (``settle_removed``),
so they are neither kept in host memory nor copied every step. A pipeline's ``set_lora_device()`` leaves the
adapter weights that an offloaded block's host copy holds where they are: they already wait in host memory and
reach the device with their block, and moving their placeholders would make the next forward refuse them.
``guard_adapters(model)`` (run by the enable) wraps diffusers' adapter methods on the model's class:

- ``fuse_lora()``/``unfuse_lora()`` keep one block's scope open at a time, so each block is materialized
  and rebuilt once, however many layers it holds.
- ``add_adapter()`` and ``load_lora_adapter()`` refuse what would read or copy the offloaded base weights
  (DoRA, initializations computed from the base weight such as PiSSA or OLoRA, ``modules_to_save``
  inside the block list, a hotswap into offloaded adapter weights) before anything changes. A load asked
  for with ``low_cpu_mem_usage=True`` (diffusers' pipelines ask by default) runs the ordinary way: its
  weights would be made on the meta device inside the offloaded blocks, and the values are the same.

peft's own entry points get the same refusals, on its classes and functions (``patch_peft()``): the
injection behind ``get_peft_model``, ``inject_adapter_in_model`` and ``PeftModel.add_adapter`` checks
the adapter's configuration as ``add_adapter()`` does; ``add_weighted_adapter()`` (which reads the
adapters' weights) and the hotswap functions (``prepare_model_for_compiled_hotswap``,
``hotswap_adapter_from_state_dict``, which rebuild or swap them in place) refuse on an offloaded model.

The results are bit for bit the resident model's. A block whose host copy cannot be rebuilt (shared
between ranks, read from disk, edited while offloaded) refuses a merge before any layer changes. The
wrappers sit on the classes, never on a model or layer, and pass every call on a model that is not
offloaded straight through: a disabled model copies and pickles as before.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from fastoffload_ext.engine.group import LayerwiseOffloadGroup, get_offload_group
from fastoffload_ext.engine.offload_hook import LayerwiseOffloadHook, offload_hook_of
from fastoffload_ext.engine.state import BlockOffloadState
from fastoffload_ext.errors import OffloadStateError

__all__ = ["ADD_REFUSED", "MERGE_REFUSED", "guard_adapters", "patch_peft", "settle_removed"]

logger = logging.getLogger(__name__)

_LAYER_METHODS = ("merge", "unmerge")
_MERGING_METHODS = ("fuse_lora", "unfuse_lora")
_ADDING_METHODS = ("add_adapter", "load_lora_adapter")
_REMOVING_METHODS = ("delete_adapters", "unload_lora")  # diffusers' model methods
_COMBINING_METHODS = ("add_weighted_adapter",)  # on peft's tuner classes
# On peft's tuner classes: behind PeftModel.delete_adapter(), unload() and merge_and_unload().
_TUNER_REMOVING_METHODS = ("delete_adapter", "_unload_and_optionally_merge")
_HOTSWAP_FUNCTIONS = ("prepare_model_for_compiled_hotswap", "hotswap_adapter_from_state_dict")  # peft.utils.hotswap
_PLACING = ("diffusers.loaders.lora_base", "LoraBaseMixin", "set_lora_device")  # diffusers' pipeline method
_ADAPTER_PARTS = ("lora_A", "lora_B", "lora_magnitude_vector")  # what set_lora_device moves of each adapter
_PATCHED = "_fastoffload_patched"  # on a function this module put on a class
_SAFE_INITS = (True, False, "gaussian")  # LoRA initializations that never read the base weight
_models: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # every model guard_adapters saw
_session = threading.local()  # .blockwise: the _Blockwise of a fuse_lora() running in this thread

MERGE_REFUSED = ("fastoffload: {what} would merge adapter weights into the offloaded block {block}, which refuses: "
                 "{reason}. Nothing was merged")
ADD_REFUSED = ("fastoffload: {what} on the layerwise-offloaded {model} would {why}; an offloaded block's weights are "
               "empty placeholders between forwards. Nothing was added. Add the adapter before enable_layerwise_offload, "
               "or disable the offload (disable_layerwise_offload), add it, and enable again")


def _peft_base_layer() -> type | None:
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    return getattr(tuners, "BaseTunerLayer", None)


def _subclasses(cls: type) -> list[type]:
    found, todo = [], [cls]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(current.__subclasses__())
    return found


def patch_peft() -> None:
    """Wraps ``merge``/``unmerge`` of every peft layer class defined so far, the injection and weighted
    combination of every tuner class, and peft's hotswap functions (each once); a no-op until peft is imported.
    Also diffusers' pipeline ``set_lora_device()``, once diffusers' LoRA loaders are imported."""
    _patch_placing()
    base = _peft_base_layer()
    if base is None:
        return
    for cls in _subclasses(base):
        for method in _LAYER_METHODS:
            function = cls.__dict__.get(method)
            if callable(function) and not getattr(function, _PATCHED, False):
                setattr(cls, method, _in_block_scope(function))
    tuner = getattr(sys.modules.get("peft.tuners.tuners_utils"), "BaseTuner", None)
    wrappers = {"inject_adapter": _injecting, **dict.fromkeys(_COMBINING_METHODS, _combining),
                **dict.fromkeys(_TUNER_REMOVING_METHODS, _tuner_removing)}
    for cls in _subclasses(tuner) if tuner is not None else ():
        for method, wrap in wrappers.items():
            function = cls.__dict__.get(method)
            if callable(function) and not getattr(function, _PATCHED, False):
                setattr(cls, method, wrap(function))
    try:  # imported here so that a later ``from peft.utils.hotswap import ...`` gets the wrapped functions
        hotswap = importlib.import_module("peft.utils.hotswap")
    except ImportError:
        return
    for name in _HOTSWAP_FUNCTIONS:
        function = getattr(hotswap, name, None)
        if callable(function) and not getattr(function, _PATCHED, False):
            setattr(hotswap, name, _hotswapping(function))


def _holds_placeholder(layer: nn.Module) -> bool:
    # An offloaded block's parameters are empty between forwards; a real model has no empty parameter.
    return any(param.numel() == 0 for param in layer.parameters())


def _owners(group: LayerwiseOffloadGroup) -> dict[int, BlockOffloadState]:
    """id of each module inside an offloaded block -> that block's state."""
    return {id(module): state for state in group.states for module in state.module_ref.modules()}


def _find(layer: nn.Module) -> tuple[nn.Module, BlockOffloadState] | None:
    """The offloaded model and block state that ``layer`` belongs to (None: no offloaded model holds it)."""
    for model in list(_models):
        group = get_offload_group(model)
        state = _owners(group).get(id(layer)) if group is not None else None
        if state is not None:
            return model, state
    return None


def _hook(state: BlockOffloadState) -> LayerwiseOffloadHook:
    hook = offload_hook_of(state.module_ref)
    if hook is None:
        raise OffloadStateError("fastoffload: an offloaded block lost its offload hook; disable the offload "
                                "(disable_layerwise_offload) and enable it again before merging an adapter")
    return hook


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

    def __init__(self, owners: dict[int, BlockOffloadState]) -> None:
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


@contextlib.contextmanager
def _blockwise(owners: dict[int, BlockOffloadState]) -> Iterator[None]:
    if getattr(_session, "blockwise", None) is not None:  # a fuse_lora inside another: the outer one's blocks
        yield
        return
    session = _session.blockwise = _Blockwise(owners)
    try:
        yield
    finally:
        _session.blockwise = None
        session.close()


def _merged(layer: nn.Module) -> list[Any]:
    return list(getattr(layer, "merged_adapters", ()))


def _counted(function: Callable[..., Any], layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``function(layer, ...)``; when it merged or unmerged an adapter, the version counter of each weight of the
    layer's base layer is advanced, also after an error part-way.

    peft writes a merge through ``.data`` (``base_layer.weight.data += delta``), which leaves the counter as it
    was: whatever compares counters to see a change would miss the merge. ``LazyModule.release()`` does, and
    would drop a component that a LoRA was fused into (``fuse_lora()`` then ``unload_lora_weights()``), so that
    its next use reloads it without the LoRA."""
    before = _merged(layer)
    try:
        return function(layer, *args, **kwargs)
    finally:
        if _merged(layer) != before:
            base = layer.get_base_layer() if callable(getattr(layer, "get_base_layer", None)) else layer
            for param in base.parameters():
                if param.numel() > 0:  # an offloaded placeholder holds no value to count
                    torch.autograd.graph.increment_version(param)


def _in_block_scope(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
        session: _Blockwise | None = getattr(_session, "blockwise", None)
        state = session.owners.get(id(layer)) if session is not None else None
        if not _holds_placeholder(layer):
            # Real weights: not offloaded, a resident block, inside a scope, or a forward running the block, where
            # peft itself unmerges (a forward with the adapters disabled on a fused layer). There the weights are
            # the running step's, dropped at its release: the release rebuilds the host copy from them (in a
            # mutate_params_scope(), whose writes count as changes).
            found = None if state is not None and state is session.open else _find(layer)
            if found is not None and getattr(found[1], "is_running", lambda: False)():
                _check_mergeable(found[0], [found[1]], f"{type(layer).__name__}.{function.__name__}()")
                _hook(found[1]).keep_running_changes()
                return function(layer, *args, **kwargs)
            return _counted(function, layer, *args, **kwargs)
        if session is not None and state is not None:
            session.enter(state)
            return _counted(function, layer, *args, **kwargs)
        found = _find(layer)
        if found is None:  # empty parameters of its own, in no offloaded model
            return function(layer, *args, **kwargs)
        model, state = found
        _check_mergeable(model, [state], f"{type(layer).__name__}.{function.__name__}()")
        with _hook(state).mutate_params_scope():
            return _counted(function, layer, *args, **kwargs)

    setattr(call, _PATCHED, True)
    return call


def _merging(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        group = get_offload_group(model)
        if group is None:
            return function(model, *args, **kwargs)
        patch_peft()
        owners = _owners(group)
        base = _peft_base_layer()
        layers = [m for m in model.modules() if isinstance(m, base)] if base is not None else []
        merged = (owners.get(id(layer)) for layer in layers)
        _check_mergeable(model, list({id(s): s for s in merged if s is not None}.values()),
                         f"{type(model).__name__}.{function.__name__}()")
        with _blockwise(owners):
            return function(model, *args, **kwargs)

    setattr(call, _PATCHED, True)
    return call


def _in_lists(model: nn.Module, group: LayerwiseOffloadGroup, targets: Any) -> str | None:
    """The first module of the offloaded lists that ``targets`` (peft's ``modules_to_save``) names, if any."""
    names = [targets] if isinstance(targets, str) else list(targets or ())
    for list_name in group.list_names:
        for name, _ in getattr(model, list_name).named_modules(prefix=list_name):
            if any(name == target or name.endswith("." + target) for target in names):
                return name
    return None


def _config_refusal(model: nn.Module, group: LayerwiseOffloadGroup, config: Any) -> str | None:
    """Why adding an adapter of ``config`` would read or copy offloaded base weights (None: it does not)."""
    if getattr(config, "use_dora", False):
        return "add a DoRA adapter (use_dora=True), whose magnitude is computed from the base weights"
    init = getattr(config, "init_lora_weights", True)
    if init not in _SAFE_INITS:
        return f"initialize the adapter from the base weights (init_lora_weights={init!r})"
    saved = _in_lists(model, group, getattr(config, "modules_to_save", None))
    if saved is not None:
        return f"copy the offloaded module {saved} (modules_to_save)"
    return None


def _adding_refusal(model: nn.Module, group: LayerwiseOffloadGroup, method: str, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> str | None:
    """Why ``method`` would read or copy offloaded base weights (None: it does not)."""
    if method == "add_adapter":
        return _config_refusal(model, group, args[0] if args else kwargs.get("adapter_config"))
    if kwargs.get("hotswap"):
        return "swap new values into the adapter's weights in place (hotswap=True); load it under a new adapter_name"
    if getattr(model, "_prepare_lora_hotswap_kwargs", None) is not None:
        return ("rebuild the adapter's weights padded for a compiled hotswap (enable_lora_hotswap()); enable the "
                "hotswap before enable_layerwise_offload")
    weights = args[0] if args else kwargs.get("pretrained_model_name_or_path_or_dict")
    if isinstance(weights, dict) and any("lora_magnitude_vector" in key for key in weights):
        return "load a DoRA adapter, whose magnitude is computed from the base weights"
    return None


def _adding(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        group = get_offload_group(model)
        if group is not None:
            why = _adding_refusal(model, group, function.__name__, args, kwargs)
            if why is not None:
                raise OffloadStateError(ADD_REFUSED.format(what=f"{type(model).__name__}.{function.__name__}()",
                                                           model=type(model).__name__, why=why))
            if kwargs.get("low_cpu_mem_usage"):
                # diffusers' pipelines ask for it by default (load_lora_weights): the adapter's weights made on the
                # meta device inside the offloaded blocks, then assigned from the state dict. Loaded the ordinary way
                # they hold the same values, and an adapter is small.
                kwargs = {**kwargs, "low_cpu_mem_usage": False}
                logger.debug("fastoffload: %s.%s() on an offloaded model loads with low_cpu_mem_usage=False",
                             type(model).__name__, function.__name__)
        try:
            return function(model, *args, **kwargs)
        finally:
            if group is not None:
                patch_peft()  # the call may have imported peft's layer classes

    setattr(call, _PATCHED, True)
    return call


def settle_removed(model: nn.Module) -> None:
    """Rebuild each offloaded block of ``model`` whose host copy still holds a parameter the block no longer has
    (the weights of a deleted or unloaded adapter): without it they would stay in host memory, be copied to the
    device every step, and, left trainable, make every grad-mode forward refuse with no way to freeze them. A block
    that cannot be rebuilt (shared between ranks, read from disk) keeps them, as it keeps a parameter moved out."""
    group = get_offload_group(model)
    for state in group.states if group is not None else ():
        held = {id(param) for param in state.module_ref.parameters()}
        if all(id(param) in held for param in state.offloaded_parameters().values()):
            continue
        refusal = getattr(state, "mutation_refusal", None)
        if callable(refusal) and refusal() is not None:
            continue
        with _hook(state).mutate_params_scope():
            pass  # the rebuild takes what the block holds now


def _then_settle(model: Any, run: Callable[[], Any]) -> Any:
    """``run()``, then :func:`settle_removed` on the offloaded model that ``model`` is or holds, also after ``run``
    raised part-way (some weights may be gone by then); a failure to settle then does not hide ``run``'s error."""
    found = _offloaded_in(model)
    if found is None:
        return run()
    try:
        result = run()
    except BaseException:
        try:
            settle_removed(found[0])
        except Exception:
            logger.exception("fastoffload: rebuilding the blocks after a failed adapter removal failed")
        raise
    settle_removed(found[0])
    return result


def _removing(function: Callable[..., Any]) -> Callable[..., Any]:
    """diffusers' ``delete_adapters()`` and ``unload_lora()``: the offloaded blocks then drop the removed weights."""
    @functools.wraps(function)
    def call(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _then_settle(model, lambda: function(model, *args, **kwargs))

    setattr(call, _PATCHED, True)
    return call


def _tuner_removing(function: Callable[..., Any]) -> Callable[..., Any]:
    """peft's tuner ``delete_adapter()`` and ``_unload_and_optionally_merge()`` (``unload()``, ``merge_and_unload()``):
    the offloaded blocks then drop the removed weights."""
    @functools.wraps(function)
    def call(tuner: Any, *args: Any, **kwargs: Any) -> Any:
        return _then_settle(getattr(tuner, "model", None), lambda: function(tuner, *args, **kwargs))

    setattr(call, _PATCHED, True)
    return call


def _offloaded_in(model: Any) -> tuple[nn.Module, LayerwiseOffloadGroup] | None:
    """The offloaded model that ``model`` is or holds (a PeftModel around it), with its group; None: none."""
    for module in model.modules() if isinstance(model, nn.Module) else ():
        group = get_offload_group(module)
        if group is not None:
            return module, group
    return None


def _injecting(function: Callable[..., Any]) -> Callable[..., Any]:
    """peft's ``inject_adapter`` (behind ``get_peft_model``, ``inject_adapter_in_model``, ``PeftModel.add_adapter``):
    the adapter's configuration is checked as diffusers' ``add_adapter()`` is, before any layer is replaced."""
    @functools.wraps(function)
    def call(tuner: Any, model: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> Any:
        found = _offloaded_in(model)
        if found is not None:
            config = getattr(tuner, "peft_config", {}).get(adapter_name)
            why = _config_refusal(found[0], found[1], config)
            if why is not None:
                # The tuner entered the configuration before injecting (into the model's own dict, on a diffusers
                # model): it goes again, as peft's add_adapter() drops it after a failed injection.
                getattr(tuner, "peft_config", {}).pop(adapter_name, None)
                raise OffloadStateError(ADD_REFUSED.format(
                    what=f"peft's {type(tuner).__name__}.inject_adapter() (get_peft_model, inject_adapter_in_model, "
                         "add_adapter)", model=type(found[0]).__name__, why=why))
        try:
            return function(tuner, model, adapter_name, *args, **kwargs)
        finally:
            if found is not None:
                patch_peft()  # the injection may have imported more of peft's layer classes

    setattr(call, _PATCHED, True)
    return call


def _combining(function: Callable[..., Any]) -> Callable[..., Any]:
    """``add_weighted_adapter()`` reads every combined adapter's weights: refused on an offloaded model."""
    @functools.wraps(function)
    def call(tuner: Any, *args: Any, **kwargs: Any) -> Any:
        found = _offloaded_in(getattr(tuner, "model", None))
        if found is not None:
            raise OffloadStateError(ADD_REFUSED.format(
                what=f"peft's {type(tuner).__name__}.{function.__name__}()", model=type(found[0]).__name__,
                why="combine adapters from their weights, which the offloaded blocks hold as placeholders"))
        return function(tuner, *args, **kwargs)

    setattr(call, _PATCHED, True)
    return call


def _hotswapping(function: Callable[..., Any]) -> Callable[..., Any]:
    """peft's hotswap functions rebuild or overwrite an adapter's weights in place: refused on an offloaded model."""
    @functools.wraps(function)
    def call(model: Any, *args: Any, **kwargs: Any) -> Any:
        found = _offloaded_in(model)
        if found is not None:
            raise OffloadStateError(ADD_REFUSED.format(
                what=f"peft's {function.__name__}()", model=type(found[0]).__name__,
                why="rebuild or overwrite the adapter's weights in place, which the offloaded blocks hold as "
                    "placeholders; load the new weights under a new adapter name"))
        return function(model, *args, **kwargs)

    setattr(call, _PATCHED, True)
    return call


def _place_adapters(model: nn.Module, group: LayerwiseOffloadGroup, adapter_names: Any, device: Any) -> None:
    """What diffusers' ``set_lora_device`` does to one model, except to the adapter weights an offloaded block's
    host copy holds: those stay offloaded (their block takes them to the device each step)."""
    base = _peft_base_layer()
    offloaded = {id(param) for state in group.states for param in state.offloaded_parameters().values()}
    for layer in model.modules():
        if base is None or not isinstance(layer, base):
            continue
        for adapter in adapter_names:
            for part in _ADAPTER_PARTS:
                held = getattr(layer, part, None)
                if not isinstance(held, nn.ModuleDict | nn.ParameterDict) or adapter not in held:
                    continue
                value = held[adapter]
                weights = value.parameters() if isinstance(value, nn.Module) else (value,)
                if not any(id(param) in offloaded for param in weights):
                    held[adapter] = value.to(device)


def _placing(function: Callable[..., Any]) -> Callable[..., Any]:
    """diffusers' pipeline ``set_lora_device()``: its components that are offloaded models are hidden from it for the
    call, and their adapters placed by :func:`_place_adapters`."""
    @functools.wraps(function)
    def call(pipe: Any, adapter_names: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
        # Imported here: the diffusers integration imports the engine, which imports this module.
        from fastoffload_ext.integrations.diffusers import hidden_components, loaded_component

        found = {}
        for name in getattr(pipe, "_lora_loadable_modules", ()):
            model = loaded_component(pipe, name)
            offloaded = _offloaded_in(model)
            if offloaded is not None:
                found[name] = (model, offloaded[1])
        if not found:
            return function(pipe, adapter_names, device, *args, **kwargs)
        with hidden_components(pipe, found):
            result = function(pipe, adapter_names, device, *args, **kwargs)
        for model, group in found.values():
            _place_adapters(model, group, adapter_names, device)
        return result

    setattr(call, _PATCHED, True)
    return call


def _patch_placing() -> None:
    module_name, class_name, method = _PLACING
    owner = getattr(sys.modules.get(module_name), class_name, None)
    function = owner.__dict__.get(method) if isinstance(owner, type) else None
    if callable(function) and not getattr(function, _PATCHED, False):
        setattr(owner, method, _placing(function))


def guard_adapters(model: nn.Module) -> None:
    """Make LoRA merges on ``model`` run on its blocks' real weights while it is offloaded (see the module doc)."""
    _models.add(model)
    patch_peft()
    wrappers = {**dict.fromkeys(_MERGING_METHODS, _merging), **dict.fromkeys(_ADDING_METHODS, _adding),
                **dict.fromkeys(_REMOVING_METHODS, _removing)}
    for method, wrap in wrappers.items():
        owner = next((cls for cls in type(model).__mro__ if method in cls.__dict__), None)
        function = owner.__dict__[method] if owner is not None else None
        if callable(function) and not getattr(function, _PATCHED, False):
            setattr(owner, method, wrap(function))
