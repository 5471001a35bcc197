"""Layerwise offload for the transformer of a diffusers pipeline, and what the pipeline may do with it.

``offload_transformer(pipe)`` enables this engine on ``pipe.transformer`` (and ``pipe.transformer_2``
where the pipeline has a second denoiser), puts the modules outside the block list on the offload
device, and defines the pipeline's device operations on the offloaded model:

- ``model.to(device)``, ``.cuda()``, ``.cpu()``, and so ``pipe.to(device)``: a move to the offload
  device works (the modules outside the block list go there; the blocks stay offloaded). A move to
  any other device raises :class:`~fastoffload_ext.errors.OffloadStateError` before anything moves:
  the blocks are streamed to one device, and the rest of the model cannot run elsewhere. Undo the
  offload first (``disable_layerwise_offload(model, device=...)``).
- ``model.to(dtype)``, ``.half()``, ``.float()``, ``.bfloat16()``, ``.double()``, ``.type(...)``, and so
  ``pipe.to(dtype)``: a cast that leaves every offloaded parameter's dtype as it is works (the modules
  outside the block list are cast). A cast that would change an offloaded parameter raises
  :class:`~fastoffload_ext.errors.OffloadStateError` before anything is cast, the pipeline's other
  components included: a cast does not reach the blocks' host copy, so the model would be left with
  its resident parts in the new dtype and its blocks in the old one (the engine refuses such a model
  at its next forward). Cast before ``offload_transformer``, or disable the offload, cast, and offload
  again.
- ``pipe.enable_model_cpu_offload()``: works for the other components and keeps the layerwise
  offload: the offloaded transformer is kept out of accelerate's whole-model hooks (which would move
  it to the CPU after every call) and stays on its offload device. It still takes its place in the
  pipeline's offload sequence: when it runs, the component before it (the text encoder) goes back to
  the CPU, as accelerate's next hook would have sent it, instead of staying on the device through the
  denoising loop until the VAE runs.
- ``pipe.enable_sequential_cpu_offload()`` would put accelerate's per-parameter hooks on the
  offloaded blocks; it raises :class:`OffloadStateError` instead.
- ``pipe.enable_group_offload()`` and ``model.enable_group_offload()`` would put diffusers' group offload
  hooks on the offloaded blocks, which move and copy (to disk, too) their placeholders; they raise
  :class:`OffloadStateError` before any component is hooked. A pipeline call whose ``exclude_modules`` names
  every offloaded model works for its other components.
- ``model.fuse_qkv_projections()`` and ``model.enable_layerwise_casting()`` rewrite weights that offloaded
  blocks hold as placeholders; they raise :class:`OffloadStateError` before anything changes. Layerwise
  casting enabled before the offload works, bit-exact to the resident model with the same casting, and its
  blocks then move in the storage dtype. diffusers' caches (``enable_cache`` with first-block cache,
  TaylorSeer, ...) work in either order.

The four pipeline methods are defined once on diffusers' ``DiffusionPipeline`` class, for every
pipeline that holds an offloaded model in any component slot: ``DiffusionPipeline.from_pipe`` builds a
new pipeline around the same components and casts it (to ``torch.float32`` unless given a dtype), and
that cast must be refused before it reaches the shared text encoder. A pipeline without an offloaded
component goes straight to diffusers' own methods. Any other object with a denoiser attribute gets them
on itself alone.

``bound(pipe, name, component)`` puts a component into a pipeline slot for one stage only, so that a
pipeline built with that slot empty can hand its stages :class:`~fastoffload_ext.pipeline.lazy.LazyModule`
components: diffusers asks every component it holds for its device on each call, which would load a
lazy one that the release schedule has dropped.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from fastoffload_ext.engine.graph_forward import graph_forward
from fastoffload_ext.engine.guards import is_guard, mark
from fastoffload_ext.engine.hooks import DEAD_MODULE_ERROR
from fastoffload_ext.engine.layerwise import (LayerwiseOffloadGroup, disable_layerwise_offload, enable_layerwise_offload,
                                              get_offload_group)
from fastoffload_ext.errors import OffloadStateError
from fastoffload_ext.pipeline.lazy import is_lazy_module

logger = logging.getLogger(__name__)

__all__ = ["DENOISER_NAMES", "bound", "guard_device_moves", "guard_fusions", "offload_transformer"]

DENOISER_NAMES = ("transformer", "transformer_2")
_GUARDED_METHODS = ("to", "cuda", "cpu", "half", "float", "bfloat16", "double", "type")
# The dtype each of nn.Module's casting methods gives a floating-point parameter (the others stay as they are).
_FLOAT_CASTS = {"half": torch.float16, "float": torch.float32, "bfloat16": torch.bfloat16, "double": torch.float64}
_NAMES_ATTRIBUTE = "_fastoffload_denoisers"  # on the pipeline: every attribute offload_transformer offloaded
_WRAPPED = "_fastoffload_wrapped"  # on a pipeline method this module defined
_HANDOVER_ATTRIBUTE = "_fastoffload_handovers"  # on the pipeline: hooks from hand_over_in_sequence

MOVE_ERROR = ("fastoffload: {what} would move the layerwise-offloaded {model} to {target}, but its blocks are "
              "offloaded to {device} and the rest of the model must run there too. Move it to {device} (or leave "
              "it), or undo the offload first: fastoffload_ext.disable_layerwise_offload(model, device={target!r})")
CAST_ERROR = ("fastoffload: {what} would cast the layerwise-offloaded {model} to {dtype}, but the weights of its "
              "offloaded blocks live in the offload engine's host copy, which a cast does not reach ({name} would go "
              "from {was} to {dtype}); nothing was cast. Cast the model before offloading it, or undo the offload "
              "first: fastoffload_ext.disable_layerwise_offload(model, device=...), cast, and offload it again")
FROM_PIPE_HINT = (". A pipeline that DiffusionPipeline.from_pipe builds is cast to its dtype= (torch_dtype=) "
                  "argument, torch.float32 when none is given: pass the offloaded model's dtype there")
FUSE_ERROR = ("fastoffload: {what} on the layerwise-offloaded {model} would build fused projections from the "
              "offloaded blocks' placeholders (their weights live in the offload engine's host copy, which it does "
              "not read); nothing was fused. Fuse before offloading the model, or undo the offload first: "
              "fastoffload_ext.disable_layerwise_offload(model, device=...), fuse, and offload it again")
GROUP_OFFLOAD_ERROR = ("fastoffload: {what} would put diffusers' group offload hooks on the layerwise-offloaded "
                       "{model}, whose blocks this engine already streams (group offload would move and copy their "
                       "placeholders, not their weights); nothing was hooked. Leave the offloaded model to this engine "
                       "(a pipeline's enable_group_offload(..., exclude_modules=[...its name...]) hooks the other "
                       "components), or undo the offload first: fastoffload_ext.disable_layerwise_offload(model, "
                       "device=...)")
# diffusers' projection fusion: the model's method runs each attention module's; both refuse while offloaded.
_FUSING_METHODS = ("fuse_qkv_projections", "fuse_projections")
LAYERWISE_CASTING_ERROR = (
    "fastoffload: {what} on the layerwise-offloaded {model} would cast the offloaded blocks' placeholders to the "
    "storage dtype (their weights live in the offload engine's host copy, which a cast does not reach), and the next "
    "forward would refuse them; nothing was cast. Enable layerwise casting before offloading the model (its blocks are "
    "then stored and moved in the storage dtype), or undo the offload first: "
    "fastoffload_ext.disable_layerwise_offload(model, device=...), enable the casting, and offload it again")
SEQUENTIAL_ERROR = ("fastoffload: enable_sequential_cpu_offload would put accelerate's per-parameter hooks on "
                    "the layerwise-offloaded {names}, whose blocks this engine already streams. Use "
                    "enable_model_cpu_offload() (it keeps the layerwise offload) or undo the offload first with "
                    "fastoffload_ext.disable_layerwise_offload")


def _same_device(target: torch.device, device: torch.device) -> bool:
    if target.type != device.type:
        return False
    if target.index is None or device.index is None:
        # "cuda" means the current device, which is where enable put the blocks when it chose one.
        return target.type != "cuda" or (device.index or 0) == torch.cuda.current_device()
    return target.index == device.index


def _target_of(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    if method == "cpu":
        return torch.device("cpu")
    if method == "cuda":
        index = args[0] if args else kwargs.get("device")
        if index is None:
            return torch.device("cuda")
        return torch.device("cuda", index) if isinstance(index, int) else torch.device(index)
    if method != "to":
        return None  # the casts (half, float, ..., type) move nothing: type()'s device is in _cast_of
    device, _, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    return device


def _module_to_cast(dtype: torch.dtype | None) -> Callable[[torch.Tensor], torch.Tensor | torch.dtype] | None:
    """What ``nn.Module.to(dtype=dtype)`` gives each parameter: ``dtype`` for floating-point and complex ones."""
    if dtype is None or not (dtype.is_floating_point or dtype.is_complex):
        return None  # no cast, or one nn.Module.to refuses itself before changing anything
    return lambda t: dtype if t.is_floating_point() or t.is_complex() else t.dtype


def _cast_of(method: str, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor | torch.dtype] | None:
    """For a guarded call, the dtype (or, for ``type``, the tensor) it gives one parameter; None: it casts nothing."""
    if method in _FLOAT_CASTS:
        dtype = _FLOAT_CASTS[method]
        return lambda t: dtype if t.is_floating_point() else t.dtype
    if method == "type":
        if not args and "dst_type" not in kwargs:
            return None  # type() with no target answers the type name and changes nothing
        target = args[0] if args else kwargs["dst_type"]
        # Tensor.type of the (empty) placeholder: the dtype and device the parameter would get, for any form of
        # dst_type (a dtype, "torch.HalfTensor", "torch.cuda.HalfTensor"); it copies nothing.
        return lambda t: t.type(target)
    if method == "to":
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        return _module_to_cast(dtype)
    return None


def _offloaded_parameters(group: LayerwiseOffloadGroup) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
    for state in group.states:
        for name, param in state.module_ref.named_parameters():
            yield state.module_ref, name, param


def _check_cast(model: nn.Module, group: LayerwiseOffloadGroup, what: str, model_name: str,
                cast: Callable[[torch.Tensor], torch.Tensor | torch.dtype], hint: str = "") -> None:
    """Raise CAST_ERROR (with ``hint`` after it) when ``cast`` would change the dtype (or device) of an
    offloaded parameter."""
    for block, name, param in _offloaded_parameters(group):
        result = cast(param)
        dtype = result if isinstance(result, torch.dtype) else result.dtype
        if isinstance(result, torch.Tensor) and result.device != param.device:
            raise OffloadStateError(MOVE_ERROR.format(what=what, model=model_name, target=str(result.device),
                                                      device=str(group.device)))
        if dtype != param.dtype:
            block_name = next((n for n, m in model.named_modules() if m is block), "?")
            raise OffloadStateError(CAST_ERROR.format(what=what, model=model_name, dtype=dtype,
                                                      name=f"{block_name}.{name}", was=param.dtype) + hint)


def _pipeline_target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.device | None, torch.dtype | None]:
    """The device and dtype of a ``DiffusionPipeline.to`` call: its arguments are a device, a dtype, or both. A None
    argument names neither: diffusers reads ``to("cuda", None)`` as a move of every component to ``"cuda"``."""
    device, dtype = None, None
    for arg in args:
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif arg is not None:
            device = arg
    device, dtype = kwargs.get("device") or device, kwargs.get("dtype") or dtype
    return (None if device is None else torch.device(device)), dtype


def _guarded(model: nn.Module, method: str, original: Callable[..., Any]) -> Callable[..., Any]:
    # The guard sits on the model and holds it weakly, and the class's method rather than the bound one: a
    # strong reference back would keep a dropped model, and its host copy, until the cycle collector ran.
    model_ref = weakref.ref(model)
    own = model.__dict__.get(method)  # another wrapper's, set on the instance: kept as it is
    unbound = getattr(type(model), method)

    @functools.wraps(original)
    def move(*args: Any, **kwargs: Any) -> Any:
        model = model_ref()
        if model is None:
            raise OffloadStateError(DEAD_MODULE_ERROR)
        group = get_offload_group(model)
        # Arguments that diffusers' own ``to`` accepts but torch's parser does not.
        parse_kwargs = {k: v for k, v in kwargs.items() if k not in ("silence_dtype_warnings",)}
        if group is not None:
            what, name = f"{type(model).__name__}.{method}()", type(model).__name__
            target = _target_of(method, args, parse_kwargs)
            if target is not None and not _same_device(target, group.device):
                raise OffloadStateError(MOVE_ERROR.format(what=what, model=name, target=str(target),
                                                          device=str(group.device)))
            cast = _cast_of(method, args, parse_kwargs)
            if cast is not None:
                _check_cast(model, group, what, name, cast)
        result = own(*args, **kwargs) if own is not None else unbound(model, *args, **kwargs)
        return model if result is model else result

    if own is None:
        del move.__wrapped__  # functools.wraps kept the bound method there, a reference back to the model
    return mark(move, own)  # taken off at disable


def guard_device_moves(model: nn.Module) -> None:
    """Make ``model.to``/``cuda``/``cpu`` refuse moves away from its offload device, and its casts
    (``to(dtype)``, ``half``, ``float``, ``bfloat16``, ``double``, ``type``) refuse a dtype change of an
    offloaded parameter, before anything changes (see the module doc).

    The guard is per instance and checks the offload at call time; ``disable_layerwise_offload`` takes it off
    (engine/guards.py), so a disabled model moves, copies and pickles as before.
    """
    if is_guard(model.__dict__.get("to")):
        return
    for method in _GUARDED_METHODS:
        # The guard wraps whatever ``to`` the model's class defines.
        object.__setattr__(model, method, _guarded(model, method, getattr(model, method)))


def _refusing(model: nn.Module, owner: nn.Module, method: str, message: str) -> Callable[..., Any]:
    # Weak references, as in _guarded: the function sits on ``owner``, inside ``model``.
    model_ref, owner_ref = weakref.ref(model), weakref.ref(owner)
    unbound = getattr(type(owner), method)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        model, owner = model_ref(), owner_ref()
        if model is None or owner is None:
            raise OffloadStateError(DEAD_MODULE_ERROR)
        if get_offload_group(model) is not None:
            raise OffloadStateError(message.format(what=f"{type(owner).__name__}.{method}()",
                                                   model=type(model).__name__))
        return unbound(owner, *args, **kwargs)

    return mark(refuse)  # taken off at disable


def guard_fusions(model: nn.Module, group: LayerwiseOffloadGroup) -> None:
    """Make diffusers' weight rewrites refuse while ``model`` is offloaded, before anything changes:

    - projection fusion (``fuse_qkv_projections`` on the model, ``fuse_projections`` on each attention module
      of the offloaded block lists) concatenates ``to_q``/``to_k``/``to_v`` weights through ``.data``, which for
      an offloaded block are empty placeholders, and the next forward would fail on the empty fused layer;
    - ``enable_layerwise_casting`` casts every layer's weights to the storage dtype, which for an offloaded
      block casts its placeholders and not its host copy, and the next forward would refuse the cast. Enabled
      before the offload it works: the blocks are stored and moved in the storage dtype;
    - ``enable_group_offload`` puts diffusers' group offload hooks on the blocks, which move and copy their
      placeholders (offloaded to disk, an onload then binds the saved placeholders, and the next forward refuses
      the block).
    """
    owners = [model, *(module for name in group.list_names for module in getattr(model, name).modules())]
    for owner in owners:
        for method in _FUSING_METHODS:
            if callable(getattr(type(owner), method, None)) and method not in owner.__dict__:
                object.__setattr__(owner, method, _refusing(model, owner, method, FUSE_ERROR))
    for method, message in (("enable_layerwise_casting", LAYERWISE_CASTING_ERROR),
                            ("enable_group_offload", GROUP_OFFLOAD_ERROR)):
        if callable(getattr(type(model), method, None)) and method not in model.__dict__:
            object.__setattr__(model, method, _refusing(model, model, method, message))


def _place_rest(model: nn.Module, group: LayerwiseOffloadGroup) -> None:
    """Everything outside the offloaded block list goes to the offload device (the blocks' buffers already did)."""
    for name, child in model.named_children():
        if name not in group.list_names:
            child.to(group.device)
    for key, param in model.named_parameters(recurse=False):
        param.data = param.data.to(group.device)
    for key, buffer in model.named_buffers(recurse=False):
        setattr(model, key, buffer.to(group.device))


def _devices_before(group: LayerwiseOffloadGroup) -> torch.device:
    """Where the offloaded blocks were before enable (the offload device when every block stayed resident)."""
    return group.original_devices[0] if group.original_devices else group.device


def _component_names(pipe: Any) -> tuple[str, ...]:
    """The component slots a diffusers pipeline registered; () for other objects. A component is an
    attribute of the pipeline named in its config; the config's other keys (``expand_timesteps``) are
    not attributes, and reading them through the pipeline warns."""
    if _diffusion_pipeline_class(pipe) is None:
        return ()
    slots = vars(pipe)
    return tuple(key for key in pipe.config.keys() if not key.startswith("_") and key in slots)


def loaded_component(pipe: Any, name: str) -> Any:
    """``pipe.<name>``, with a lazy component's module when it is loaded and None when it is not (asking must
    not load it)."""
    component = getattr(pipe, name, None)
    if is_lazy_module(component):
        return component.materialize() if component.is_materialized else None
    return component


@contextlib.contextmanager
def hidden_components(pipe: Any, names: Iterable[str]) -> Iterator[None]:
    """The pipeline's slots ``names`` hold None for the ``with`` body, so that a pipeline method that walks its
    components passes them by; each holds what it held before afterwards, also when the body raised."""
    hidden = {name: getattr(pipe, name) for name in names}
    for name in hidden:
        object.__setattr__(pipe, name, None)
    try:
        yield
    finally:
        for name, component in hidden.items():
            object.__setattr__(pipe, name, component)


def _offloaded_model(pipe: Any, name: str) -> nn.Module | None:
    """``pipe.<name>`` when it is an offloaded model; a lazy component counts only while loaded."""
    component = loaded_component(pipe, name)
    if isinstance(component, nn.Module) and get_offload_group(component) is not None:
        return component
    return None


def _offloaded_models(pipe: Any) -> dict[str, nn.Module]:
    """Slot name -> offloaded model: the usual denoisers, any other attribute offload_transformer(names=...)
    offloaded (a "unet"), and any component holding an offloaded model (a pipeline that from_pipe built
    around one)."""
    names = dict.fromkeys((*DENOISER_NAMES, *getattr(pipe, _NAMES_ATTRIBUTE, ()), *_component_names(pipe)))
    found = {name: _offloaded_model(pipe, name) for name in names}
    return {name: model for name, model in found.items() if model is not None}


def _offloaded_names(pipe: Any) -> list[str]:
    return list(_offloaded_models(pipe))


def _check_pipeline_to(pipe: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuses a ``pipe.to(...)`` that would move an offloaded component off its offload device or cast
    an offloaded parameter, before the pipeline moves or casts anything: diffusers moves the components one
    by one, and a refusal half-way would leave the pipeline (and the components it shares) split."""
    target, dtype = _pipeline_target(args, kwargs)
    cast = _module_to_cast(dtype)  # diffusers casts each component with module.to(device, dtype)
    for name, model in _offloaded_models(pipe).items():
        group = get_offload_group(model)
        if target is not None and not _same_device(target, group.device):
            raise OffloadStateError(MOVE_ERROR.format(what=f"pipe.to({str(target)!r})", model=f"pipe.{name}",
                                                      target=str(target), device=str(group.device)))
        if cast is not None:
            _check_cast(model, group, f"pipe.to({dtype})", f"pipe.{name}", cast, hint=FROM_PIPE_HINT)


def hand_over_in_sequence(pipe: Any, names: Iterable[str]) -> None:
    """After ``enable_model_cpu_offload()``, which left the offloaded models ``names`` out of accelerate's chain:
    each of them, as it starts a forward, sends the hooked component before it in ``model_cpu_offload_seq``
    back to the CPU, which is what the chain's hook for it would have done. Without this the text encoder
    would stay on the device through the whole denoising loop, until the VAE's hook sends it back.

    The pipeline's earlier hand-overs are removed first (``maybe_free_model_hooks`` enables the offload again
    at the end of every call), and one does nothing once the hook it serves is no longer the pipeline's
    (``remove_all_hooks()``). A hand-over runs before the model's other forward pre-hooks, however often it was
    registered again since they were."""
    for handle in vars(pipe).pop(_HANDOVER_ATTRIBUTE, ()):
        handle.remove()
    hooks = {id(hook.model): hook for hook in getattr(pipe, "_all_hooks", ()) if hasattr(hook, "model")}
    sequence = [name for name in getattr(pipe, "model_cpu_offload_seq", "").split("->") if name]
    handles = []
    for position, name in enumerate(sequence):
        if name not in names:
            continue
        before = (getattr(pipe, earlier, None) for earlier in reversed(sequence[:position]))
        hook = next((hooks[id(component)] for component in before if id(component) in hooks), None)
        if hook is not None:
            handles.append(getattr(pipe, name).register_forward_pre_hook(_handing_over(pipe, hook), prepend=True))
    if handles:
        object.__setattr__(pipe, _HANDOVER_ATTRIBUTE, handles)


def on_execution_device(hook: Any) -> bool:
    """Whether the component of accelerate's offload ``hook`` is on the device it runs on (not sent back yet)."""
    param = next(hook.model.parameters(), None)
    return param is not None and param.device.type != "cpu"


def _handing_over(pipe: Any, hook: Any) -> Callable[..., None]:
    pipe_ref = weakref.ref(pipe)  # the model holds this hook; the pipeline holds the model

    def hand_over(module: nn.Module, args: Any) -> None:
        owner = pipe_ref()
        if owner is None or not any(kept is hook for kept in getattr(owner, "_all_hooks", ())):
            return
        if on_execution_device(hook):
            hook.offload()

    return hand_over


def _pipeline_methods() -> dict[str, Callable[..., Callable[..., Any]]]:
    """For each pipeline method defined on offloaded models: a function of the original (called as
    ``original(pipe, *args, **kwargs)``) giving its replacement (same signature)."""

    def to(original: Callable[..., Any]) -> Callable[..., Any]:
        def checked_to(pipe: Any, *args: Any, **kwargs: Any) -> Any:
            _check_pipeline_to(pipe, args, kwargs)
            return original(pipe, *args, **kwargs)
        return checked_to

    def enable_model_cpu_offload(original: Callable[..., Any]) -> Callable[..., Any]:
        def keeping_layerwise(pipe: Any, *args: Any, **kwargs: Any) -> Any:
            # Hidden from the pipeline's components for the call: diffusers first moves every component
            # to the CPU, then hooks each one in its offload sequence.
            names = _offloaded_names(pipe)
            with hidden_components(pipe, names):
                result = original(pipe, *args, **kwargs)
            hand_over_in_sequence(pipe, names)
            return result
        return keeping_layerwise

    def enable_sequential_cpu_offload(original: Callable[..., Any]) -> Callable[..., Any]:
        def refused(pipe: Any, *args: Any, **kwargs: Any) -> Any:
            names = _offloaded_names(pipe)
            if names:
                raise OffloadStateError(SEQUENTIAL_ERROR.format(names=" and ".join(f"pipe.{n}" for n in names)))
            return original(pipe, *args, **kwargs)
        return refused

    def enable_group_offload(original: Callable[..., Any]) -> Callable[..., Any]:
        def refused(pipe: Any, *args: Any, **kwargs: Any) -> Any:
            # diffusers hooks the components one by one: refused before the first, unless every offloaded model
            # is excluded (diffusers then moves each excluded one to the onload device, which its guard checks).
            try:
                arguments = inspect.signature(original).bind(pipe, *args, **kwargs).arguments
                excluded = arguments.get("exclude_modules", kwargs.get("exclude_modules"))
            except TypeError:
                return original(pipe, *args, **kwargs)  # diffusers' own error, before it hooks anything
            excluded = [excluded] if isinstance(excluded, str) else list(excluded or ())
            names = [name for name in _offloaded_names(pipe) if name not in excluded]
            if names:
                raise OffloadStateError(GROUP_OFFLOAD_ERROR.format(
                    what="enable_group_offload", model=" and ".join(f"pipe.{n}" for n in names)))
            return original(pipe, *args, **kwargs)
        return refused

    return {"to": to, "enable_model_cpu_offload": enable_model_cpu_offload,
            "enable_sequential_cpu_offload": enable_sequential_cpu_offload,
            "enable_group_offload": enable_group_offload}


def _diffusion_pipeline_class(pipe: Any) -> type | None:
    """diffusers' ``DiffusionPipeline`` when ``pipe`` is one (diffusers is never imported here: a pipeline
    of it means it already is)."""
    diffusers = sys.modules.get("diffusers")
    base = getattr(diffusers, "DiffusionPipeline", None) if diffusers is not None else None
    return base if isinstance(base, type) and isinstance(pipe, base) else None


def _wrap_pipeline_offloads(pipe: Any) -> None:
    """Defines ``to``, ``enable_model_cpu_offload``, ``enable_sequential_cpu_offload`` and ``enable_group_offload``
    on offloaded components. For a diffusers pipeline, once on ``DiffusionPipeline`` itself, so that every pipeline that
    holds an offloaded model has them, also one built later around a shared component
    (``from_pipe``); a pipeline without one passes straight through. For any other object, on it alone."""
    base = _diffusion_pipeline_class(pipe)
    for method, wrap in _pipeline_methods().items():
        if base is not None:
            original = base.__dict__.get(method)
            if original is not None and not getattr(original, _WRAPPED, False):
                replacement = functools.wraps(original)(wrap(original))
                setattr(replacement, _WRAPPED, True)
                setattr(base, method, replacement)
        elif hasattr(pipe, method):
            _wrap_on_instance(pipe, method, wrap)


def _wrap_on_instance(pipe: Any, method: str, wrap: Callable[..., Callable[..., Any]]) -> None:
    bound_method = getattr(pipe, method)
    if getattr(bound_method, _WRAPPED, False):
        return
    replacement = wrap(lambda _pipe, *args, **kwargs: bound_method(*args, **kwargs))

    def call(*args: Any, **kwargs: Any) -> Any:
        return replacement(pipe, *args, **kwargs)

    functools.update_wrapper(call, bound_method)
    setattr(call, _WRAPPED, True)
    object.__setattr__(pipe, method, call)


def _check_names(pipe: Any, names: Any) -> tuple[str, ...]:
    """``names`` as a tuple, every one an attribute of ``pipe`` holding a module; checked before anything is
    offloaded, so a bad name cannot leave one denoiser offloaded without the pipeline's wrappers."""
    if isinstance(names, str):
        raise TypeError(f"fastoffload: offload_transformer() names must be a sequence of attribute names, got the "
                        f"string {names!r}; write names=({names!r},)")
    chosen = tuple(names)
    for name in chosen:
        if not isinstance(name, str):
            raise TypeError(f"fastoffload: offload_transformer() names must be attribute names (strings), got "
                            f"{name!r} ({type(name).__name__})")
        model = getattr(pipe, name, None)
        if not isinstance(model, nn.Module):
            held = "nothing" if not hasattr(pipe, name) else repr(model) if model is None else type(model).__name__
            raise ValueError(f"fastoffload: offload_transformer() cannot offload pipe.{name}: it holds {held}, not an "
                             f"nn.Module; name only the denoisers this {type(pipe).__name__} has, or leave names=None "
                             f"to offload those of {', '.join(DENOISER_NAMES)} that hold a module")
    return chosen


def offload_transformer(pipe: Any, names: tuple[str, ...] | None = None, *, cuda_graph: bool = False,
                        **options: Any) -> dict[str, LayerwiseOffloadGroup]:
    """Enable layerwise offload on the pipeline's denoiser(s) and define the pipeline's moves on them.

    Args:
        pipe: a diffusers ``DiffusionPipeline`` (anything with the denoiser as an attribute works).
        names: the attributes to offload; default: those of :data:`DENOISER_NAMES` that hold a module.
        cuda_graph: replay each denoiser's forward from CUDA graphs (``graph_forward``: one per input
            signature, captured at its first call; ext backend on CUDA). The pipeline's calls stay as they are.
        **options: keyword arguments of ``enable_layerwise_offload`` (``device``, ``backend``,
            ``prefetch_depth``, ...), the same for every denoiser.

    Returns:
        Attribute name -> the offload group. A denoiser the engine declined (no CUDA and no device
        given) is left out and stays as it was.

    Raises:
        TypeError: ``names`` is a string, or holds something other than strings.
        ValueError: a name in ``names`` holds no module on ``pipe``; nothing is offloaded.
        Whatever ``enable_layerwise_offload`` (or ``graph_forward``, with ``cuda_graph``) raises for a denoiser:
            the ones this call had offloaded are undone first (their blocks go back where they were), so nothing
            stays offloaded.
    """
    present = tuple(n for n in DENOISER_NAMES if isinstance(getattr(pipe, n, None), nn.Module))
    chosen = _check_names(pipe, names) if names is not None else present
    groups: dict[str, LayerwiseOffloadGroup] = {}
    try:
        for name in chosen:
            group = enable_layerwise_offload(getattr(pipe, name), **options)
            if group is not None:
                groups[name] = group
                if cuda_graph:
                    graph_forward(getattr(pipe, name))
    except BaseException:
        # A later denoiser refused: the ones offloaded by this call go back, so that the pipeline is as it
        # was (a retry would otherwise find them offloaded, and they would have no pipeline wrappers).
        for name, group in groups.items():
            disable_layerwise_offload(getattr(pipe, name), device=_devices_before(group))
        raise
    for name, group in groups.items():
        model = getattr(pipe, name)
        _place_rest(model, group)
        guard_device_moves(model)
        guard_fusions(model, group)
    if groups:
        setattr(pipe, _NAMES_ATTRIBUTE, (*getattr(pipe, _NAMES_ATTRIBUTE, ()), *groups))
    if groups:
        _wrap_pipeline_offloads(pipe)
    logger.info("Offloaded %s of %s layer by layer", ", ".join(groups) or "nothing", type(pipe).__name__)
    return groups


@contextlib.contextmanager
def bound(pipe: Any, name: str, component: Any) -> Iterator[Any]:
    """``pipe.<name>`` holds ``component`` inside the block and what it held before afterwards.

    Setting the slot through the pipeline's own ``__setattr__`` records the component in the
    pipeline's config, which inspects (and so would load) a lazy component; the slot is set directly.
    """
    previous = getattr(pipe, name)
    object.__setattr__(pipe, name, component)
    try:
        yield component
    finally:
        object.__setattr__(pipe, name, previous)
