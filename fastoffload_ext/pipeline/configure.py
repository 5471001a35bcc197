"""One call that turns an offload config into offloaded modules, and says why it did what it did.

Without this, a user has to resolve the config through the device policy, read the result, enable
layerwise offload on the transformer, wrap components for lazy loading, and remember that the policy
may have overruled them. :func:`apply_offload_config` does all of it::

    applied = apply_offload_config(
        {"engine": {"offload": {"dit_layerwise": True}}},
        transformer=dit,                                  # an nn.Module, a LazyModule, or a key of components
        components={"text_encoder": load_text_encoder,    # zero-argument loaders, not loaded modules
                    "vae": load_vae},
    )
    text_encoder = applied.components["text_encoder"]     # LazyModule or loaded module, per the config
    print(applied.explain())                              # what was done and which rule decided it

What it does, in order:

1. Checks every argument, so a mistake fails before anything is loaded or hooked: the components,
   the transformer, the names and values of ``layerwise_options`` (against ``enable_layerwise_offload``
   itself) and, when layerwise offload will run, ``device``, ``backend``, ``share_host_copy``,
   ``compress`` and ``weights``; and the config's keys: one that spells a setting otherwise (FastVideo's flat
   name such as ``dit_layerwise_offload``, or a near miss such as ``dit_layerwize`` under ``engine.offload``)
   raises, since the resolution would carry it through unread. What only the loaded model can tell (its block
   lists' names, ``resident_blocks`` against its length) is checked by the engine when it runs.
2. Resolves ``config`` through ``steps`` (default :data:`~fastoffload_ext.policy.DEVICE_POLICY_STEPS`)
   with :func:`~fastoffload_ext.policy.resolution.resolve`. The caller's config is not mutated.
3. Components: when ``engine.offload.lazy_module_load`` resolved to True, each loader is wrapped in a
   :class:`~fastoffload_ext.pipeline.lazy.LazyModule` (nothing loads now); otherwise every loader runs now and
   the loaded module is returned. Either way ``AppliedOffload.components`` maps each name to something
   usable as the module. Loaders are required, not modules: lazy loading can only save memory for a
   component that has not been loaded yet.
4. Layerwise offload: when ``engine.offload.dit_layerwise`` resolved to True, the transformer gets
   ``fastoffload_ext.engine.layerwise.enable_layerwise_offload(transformer, device=device, **layerwise_options)``.
   A lazy transformer (a ``LazyModule``, or a component name while lazy loading is on) is *not* loaded
   for this: offload is registered as its materialize transform, so it applies to the instance loaded
   now (if any) and to every instance reloaded after a release. Without a transformer, nothing is
   hooked and a warning says so; a warning also says so when the config asked for it and a resolution
   step (the device policy: unified memory, MPS) turned it off. With ``device=None`` on a machine
   without CUDA the engine declines (as FastVideo's does) and the action is ``SKIPPED``.
5. The other resolved switches (``engine.use_fsdp_inference``, ``engine.offload.dit``,
   ``text_encoder``, ``image_encoder``, ``vae``) describe FastVideo's whole-module offloads, which this
   package does not implement. The ones that resolved to True are listed in
   ``AppliedOffload.not_applied`` and logged, so the pipeline can act on them; none is silently dropped.

Calling it again for a transformer that already has layerwise offload (from an earlier call, or from
``enable_layerwise_offload``) is refused up front, before any loader runs, unless ``layerwise_options``
holds ``is_replace=True``: then the new offload replaces the old one, as ``enable_layerwise_offload``'s
``is_replace`` does. For a lazy transformer that means the offload registered for future loads is
swapped (never stacked: a second registration would offload each load twice), and the instance loaded
now, if any, has its offload replaced; one loaded without offload is offloaded. A refused replacement
leaves the old offload as it was, on the loaded instance and for future loads.

``device`` is passed to ``enable_layerwise_offload`` unchanged: None lets the engine pick the current
CUDA device; ``"cpu"`` runs the engine with the host as the device (how the CPU tests exercise it).
"""
from __future__ import annotations

import difflib
import enum
import inspect
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.pipeline.lazy import LazyModule, is_lazy_module
from fastoffload_ext.policy import DEVICE_POLICY_STEPS
from fastoffload_ext.policy.resolution import DEFAULT_SCHEMA, Resolution, ResolutionStep, resolve

logger = logging.getLogger(__name__)

__all__ = ["AppliedOffload", "LayerwiseAction", "apply_offload_config"]

_LAYERWISE_PATH = "engine.offload.dit_layerwise"
_LAZY_PATH = "engine.offload.lazy_module_load"
# Resolved switches that describe offloads this package does not perform itself.
_NOT_IMPLEMENTED_PATHS = (
    "engine.use_fsdp_inference",
    "engine.offload.dit",
    "engine.offload.text_encoder",
    "engine.offload.image_encoder",
    "engine.offload.vae",
)
# FastVideo's flat argument names (FastVideoArgs) for the settings the config holds nested.
_FLAT_NAMES = {
    "dit_layerwise_offload": "engine.offload.dit_layerwise",
    "dit_cpu_offload": "engine.offload.dit",
    "text_encoder_cpu_offload": "engine.offload.text_encoder",
    "image_encoder_cpu_offload": "engine.offload.image_encoder",
    "vae_cpu_offload": "engine.offload.vae",
    "use_fsdp_inference": "engine.use_fsdp_inference",
}
# Keys of FastVideo's offload config that the schema does not name, carried through as they are.
_OTHER_OFFLOAD_KEYS = ("pin_cpu_memory",)
UNREAD_SETTING_ERROR = (
    "fastoffload: the config key {where} is not a setting this config reads, so it would be carried through unread "
    "while {meant} kept its default (the offload it asks for would silently not happen); write it as "
    "{example}")
# Arguments of enable_layerwise_offload that apply_offload_config supplies itself.
_RESERVED_LAYERWISE_OPTIONS = ("model", "device")
# The key of the layerwise offload among a lazy transformer's materialize transforms: registered again, it
# replaces the one there instead of offloading each load twice.
LAYERWISE_TRANSFORM_KEY = "fastoffload_ext.layerwise_offload"
ALREADY_OFFLOADED_ERROR = (
    "fastoffload: {what} already has layerwise offload{how}; applying it again would offload it twice. To "
    "replace that offload with this call's options, pass layerwise_options={{..., 'is_replace': True}}; to keep "
    "it, do not apply the config to this transformer again (or pass a config with "
    "engine.offload.dit_layerwise=False)")


class LayerwiseAction(enum.StrEnum):
    """What :func:`apply_offload_config` did about layerwise offload."""

    APPLIED = "applied"
    """``enable_layerwise_offload`` ran on the (loaded) transformer."""
    ON_LOAD = "on_load"
    """The transformer is lazy: offload is applied to every instance it loads (and to the loaded one now)."""
    SKIPPED = "skipped"
    """No CUDA and no ``device`` given: ``enable_layerwise_offload`` declined (it logged why), or, for a lazy
    transformer, would decline every load, so no transform was registered (a warning says so)."""
    DISABLED = "disabled"
    """``engine.offload.dit_layerwise`` resolved to False; see the resolution for which rule decided it."""
    NO_TRANSFORMER = "no_transformer"
    """The config asked for layerwise offload but no transformer was passed."""


@dataclass(frozen=True)
class AppliedOffload:
    """What :func:`apply_offload_config` did, and the resolution that made it do so.

    Attributes:
        resolution: the resolved config with its provenance (``resolution.explain()``).
        layerwise: what happened about layerwise offload.
        layerwise_result: what ``enable_layerwise_offload`` returned (its ``LayerwiseOffloadGroup`` when
            ``APPLIED``; None otherwise).
        components: each component name → a ``LazyModule`` (lazy loading on) or the loaded module.
        lazy_components: the names wrapped in ``LazyModule``, in the order given.
        not_applied: settings that resolved to True but that this package does not act on.
    """

    resolution: Resolution
    layerwise: LayerwiseAction
    layerwise_result: Any
    components: Mapping[str, Any]
    lazy_components: tuple[str, ...]
    not_applied: tuple[str, ...]

    @property
    def config(self) -> dict[str, Any]:
        """The resolved config (nested dicts)."""
        return self.resolution.config

    def explain(self) -> str:
        """The actions taken, each with the rule that decided it, followed by the full resolution."""
        resolution = self.resolution

        def why(path: str) -> str:
            origin = resolution.origins.get(path, "default")
            source = origin if origin in ("input", "default") else f"set by {origin}"
            return f"{path} = {resolution.get(path)} ({source})"

        lines = [f"Layerwise offload: {self.layerwise.value} [{why(_LAYERWISE_PATH)}]"]
        lazy = ", ".join(self.lazy_components) if self.lazy_components else "none"
        lines.append(f"Lazy components: {lazy} [{why(_LAZY_PATH)}]")
        if self.not_applied:
            lines.append("Resolved on but not performed by fastoffload_ext (your pipeline must act on them): "
                         + ", ".join(self.not_applied))
        lines.append(resolution.explain())
        return "\n".join(lines)


def _check_components(components: Mapping[str, Callable[[], Any]] | None) -> dict[str, Callable[[], Any]]:
    if components is None:
        return {}
    if not isinstance(components, Mapping):
        raise TypeError("fastoffload: components must be a mapping of name -> loader, got "
                        f"{type(components).__name__}")
    loaders: dict[str, Callable[[], Any]] = {}
    for name, loader in components.items():
        # is_lazy_module before isinstance: isinstance() on a LazyModule would load it.
        if is_lazy_module(loader):
            raise TypeError(f"fastoffload: components[{name!r}] is already a LazyModule; pass its loader (a "
                            "zero-argument callable) and apply_offload_config will wrap it when lazy loading is on")
        if isinstance(loader, nn.Module):
            raise TypeError(f"fastoffload: components[{name!r}] is a loaded {type(loader).__name__}; pass a loader "
                            f"instead, e.g. components={{{name!r}: build_{name}}} where build_{name}() returns the "
                            "module: lazy loading can only save memory for a component that is not loaded yet")
        if not callable(loader):
            raise TypeError(f"fastoffload: components[{name!r}] is {type(loader).__name__}, not a loader; pass a "
                            "zero-argument callable that returns the module")
        loaders[name] = loader
    return loaders


def _nested_example(path: str, value: Any) -> str:
    parts = path.split(".")
    text = f"{{{parts[-1]!r}: {value!r}}}"
    for part in reversed(parts[:-1]):
        text = f"{{{part!r}: {text}}}"
    return text


def _check_unread_settings(config: Any) -> None:
    """Refuses a key that spells one of the schema's settings otherwise (FastVideo's flat argument name such as
    ``dit_layerwise_offload``, or a near miss such as ``dit_layerwize``) where the config's settings live: the
    resolution carries unknown keys through unread, so the setting would take its default without a word. Keys
    that are no near miss (a larger config's own settings) are left alone."""
    containers = {"": sorted({path.split(".")[0] for path in DEFAULT_SCHEMA})}
    for path in DEFAULT_SCHEMA:
        parent, _, leaf = path.rpartition(".")
        containers.setdefault(parent, []).append(leaf)
    for parent, known in containers.items():
        node: Any = config
        for part in parent.split(".") if parent else ():
            node = node.get(part) if isinstance(node, Mapping) else None
        if not isinstance(node, Mapping):
            continue
        for key, value in node.items():
            if not isinstance(key, str) or key in known or key in _OTHER_OFFLOAD_KEYS:
                continue
            meant = _FLAT_NAMES.get(key)
            if meant is None and parent:  # not at the top, where a larger config's "model" is no "mode"
                close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
                meant = f"{parent}.{close[0]}" if close else None
            if meant is not None and meant in DEFAULT_SCHEMA:
                where = f"{parent}.{key}".lstrip(".")
                raise OffloadConfigError(UNREAD_SETTING_ERROR.format(where=repr(where), meant=meant,
                                                                     example=_nested_example(meant, value)))


def _check_transformer(transformer: nn.Module | LazyModule | str | None, loaders: Mapping[str, Any]) -> None:
    if transformer is None or is_lazy_module(transformer):
        return
    if isinstance(transformer, str):
        if transformer not in loaders:
            raise ValueError(f"fastoffload: transformer={transformer!r} names no component; components has "
                             f"{', '.join(map(repr, loaders)) or 'nothing'}. Pass the transformer module, or the key "
                             "of its loader in components")
        return
    if not isinstance(transformer, nn.Module):
        raise TypeError("fastoffload: transformer must be an nn.Module, a LazyModule or the name of a component, got "
                        f"{type(transformer).__name__}")


def _check_layerwise_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The options' names against ``enable_layerwise_offload`` and the values that need no device."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"fastoffload: layerwise_options must be a mapping of enable_layerwise_offload keyword "
                        f"arguments, got {type(options).__name__}")
    reserved = [key for key in _RESERVED_LAYERWISE_OPTIONS if key in options]
    if reserved:
        raise ValueError(f"fastoffload: layerwise_options may not contain {', '.join(map(repr, reserved))}: pass the "
                         "transformer as transformer= and the device as device= to apply_offload_config")
    # Imported here: the engine module is heavier and this module must stay importable without it.
    from fastoffload_ext.engine import layerwise
    from fastoffload_ext.engine.model_checks import check_block_lists_form
    from fastoffload_ext.engine.options import check_flags, check_knobs
    from fastoffload_ext.planning.budgets import parse_size
    from fastoffload_ext.planning.layout import check_reserve_has_budget
    from fastoffload_ext.planning.plan import OffloadPlan

    try:
        inspect.signature(layerwise.enable_layerwise_offload).bind(None, **options)
    except TypeError as error:
        raise TypeError(f"fastoffload: layerwise_options does not fit enable_layerwise_offload ({error}); pass only "
                        "its keyword arguments, e.g. prefetch_depth=, resident_blocks=, backend=") from None
    check_knobs(options.get("prefetch_depth", 1), options.get("cyclic", True), options.get("pinned_limit_bytes"),
                options.get("pin_backing"))
    check_flags(options.get("is_replace", False), options.get("allow_pageable_fallback", False))
    _check_resident_blocks(options.get("resident_blocks"))
    # The engine checks these only once it has the model: for a lazy transformer that is at every load,
    # after apply_offload_config reported ON_LOAD, and every load would then fail.
    parse_size(options.get("device_budget"), "device_budget")
    parse_size(options.get("host_budget", "auto"), "host_budget")
    parse_size(options.get("activation_reserve"), "activation_reserve", allow_auto=False)
    check_reserve_has_budget(options.get("activation_reserve"), options.get("device_budget"),
                             options.get("resident_blocks"), options.get("prefetch_depth"), options.get("plan"))
    plan = options.get("plan")
    if plan is not None and not isinstance(plan, OffloadPlan):
        raise OffloadConfigError(f"fastoffload: plan must be an OffloadPlan from plan_offload(), got "
                                 f"{type(plan).__name__}")
    check_block_lists_form(options.get("block_lists"))
    return dict(options)


def _check_resident_blocks(resident: Any) -> None:
    """The forms ``enable_layerwise_offload`` takes (None, N, a collection of indices, ``"auto"``), without the
    block count, which only the loaded model has: the engine checks the upper bound when it runs."""
    if resident is None or (isinstance(resident, str) and resident == "auto"):
        return
    if isinstance(resident, int) and not isinstance(resident, bool):
        if resident >= 0:
            return
    elif isinstance(resident, Collection) and not isinstance(resident, (str, bytes, bool)):
        if all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in resident):
            return
        raise OffloadConfigError(f"fastoffload: resident_blocks indices must be integers >= 0 (blocks of the "
                                 f"transformer's block list), got {resident!r}")
    raise OffloadConfigError(f"fastoffload: resident_blocks must be None or an integer >= 0, got {resident!r}; or "
                             "pass a collection of block indices, or 'auto'")


def _check_layerwise_target(device: torch.device | str | None, options: Mapping[str, Any]) -> None:
    """What enable will check against the device: done before any loader runs, not after."""
    from fastoffload_ext import codec
    from fastoffload_ext.engine import sharing
    from fastoffload_ext.engine.options import choose_backend, resolve_device
    from fastoffload_ext.storage.options import check_storage_arguments

    resolved = resolve_device(device)
    if resolved is None:
        return  # the engine declines (no CUDA, no device) and checks nothing more
    chosen = choose_backend(options.get("backend", "auto"), resolved)
    share_host_copy = check_storage_arguments(options.get("weights"), options.get("disk_options"), chosen,
                                              options.get("share_host_copy", "auto"))
    sharing.resolve(share_host_copy, chosen, options.get("process_group"))
    codec.resolve_compress(options.get("compress", False), chosen)


def _load_now(name: str, loader: Callable[[], Any]) -> Any:
    component = loader()
    if component is None:
        raise ValueError(f"fastoffload: loader for component {name} returned None; the loader must return the built "
                         "component (check for a missing return statement)")
    return component


def _check_offloaded_again(transformer: Any, options: Mapping[str, Any]) -> None:
    """Refuses, before anything loads, a transformer that has layerwise offload already (an earlier call's,
    or ``enable_layerwise_offload``'s), unless ``is_replace`` asks to replace it. Loads nothing."""
    from fastoffload_ext.engine.group import get_offload_group

    if options.get("is_replace") is True or transformer is None:
        return
    if is_lazy_module(transformer):  # first: isinstance() on a proxy would load it
        name = transformer.lazy_name
        if transformer.has_materialize_transform(LAYERWISE_TRANSFORM_KEY):
            raise OffloadConfigError(ALREADY_OFFLOADED_ERROR.format(
                what=f"the lazy transformer {name!r}",
                how=" registered by an earlier apply_offload_config call (it offloads every instance it loads)"))
        if transformer.is_materialized and get_offload_group(transformer.materialize()) is not None:
            raise OffloadConfigError(ALREADY_OFFLOADED_ERROR.format(
                what=f"the instance the lazy transformer {name!r} has loaded", how=""))
        return
    if isinstance(transformer, nn.Module) and get_offload_group(transformer) is not None:
        raise OffloadConfigError(ALREADY_OFFLOADED_ERROR.format(what=f"the transformer ({type(transformer).__name__})",
                                                                how=""))


def _apply_layerwise(resolution: Resolution, target: Any, device: torch.device | str | None,
                     options: dict[str, Any]) -> tuple[LayerwiseAction, Any]:
    """Layerwise offload of ``target`` as resolved: now, on load (a lazy target), or not; and its result."""
    if not resolution.get(_LAYERWISE_PATH):
        decided_by = resolution.decided_by(_LAYERWISE_PATH)
        if resolution.input_values.get(_LAYERWISE_PATH) is True and decided_by is not None:
            # Asked for and overruled by the device policy (unified memory, MPS): the policy's own line is INFO on
            # unified memory, so at the default log level a run would otherwise drop the offload without a word;
            # this line names the setting, the step and where to read why, on every platform.
            logger.warning("engine.offload.dit_layerwise was requested but %s turned it off, so the transformer is not "
                           "offloaded; AppliedOffload.explain() says why", decided_by)
        return LayerwiseAction.DISABLED, None
    if target is None:
        logger.warning("engine.offload.dit_layerwise is on but no transformer was given, so nothing is offloaded; "
                       "pass transformer= to apply_offload_config")
        return LayerwiseAction.NO_TRANSFORMER, None
    # Imported here: the engine module is heavier and this module must stay importable without it.
    from fastoffload_ext.engine.group import get_offload_group
    from fastoffload_ext.engine.layerwise import enable_layerwise_offload

    # is_replace replaces the offload on a transformer that has one, and offloads one that has none (an
    # instance a lazy transformer loads is always new).
    replacing = options.pop("is_replace", False) is True

    def offload(module: Any) -> Any:
        if replacing and get_offload_group(module) is not None:
            return enable_layerwise_offload(module, is_replace=True, device=device, **options)
        return enable_layerwise_offload(module, device=device, **options)

    if is_lazy_module(target):
        from fastoffload_ext.engine.options import resolve_device

        if resolve_device(device) is None:
            # The engine would decline every load (and say so each time); registering would report ON_LOAD
            # for an offload that never happens.
            logger.warning("engine.offload.dit_layerwise is on but no device was given and CUDA is not available, "
                           "so the lazy transformer is not offloaded when it loads; pass device= to "
                           "apply_offload_config")
            return LayerwiseAction.SKIPPED, None

        def offload_on_load(module: Any) -> Any:
            offload(module)
            return module

        # Keyed: a later call with is_replace swaps it (the refusal above keeps any other call from stacking it).
        target.set_materialize_transform(offload_on_load, key=LAYERWISE_TRANSFORM_KEY)
        return LayerwiseAction.ON_LOAD, None
    layerwise_result = offload(target)
    return (LayerwiseAction.SKIPPED if layerwise_result is None else LayerwiseAction.APPLIED), layerwise_result


def apply_offload_config(
    config: Mapping[str, Any],
    *,
    transformer: nn.Module | LazyModule | str | None = None,
    components: Mapping[str, Callable[[], Any]] | None = None,
    device: torch.device | str | None = None,
    layerwise_options: Mapping[str, Any] | None = None,
    steps: Sequence[ResolutionStep] = DEVICE_POLICY_STEPS,
) -> AppliedOffload:
    """Resolve ``config`` through the device policy and apply the result (see the module docstring).

    Called again for a transformer that already has layerwise offload (a lazy one whose offload an earlier
    call registered, loaded or not, or a module offloaded before), it raises before anything is loaded or
    changed, unless ``layerwise_options`` holds ``is_replace=True``: then this call's offload replaces the
    one there (for a lazy transformer, on the instance loaded now and for every later load).

    Args:
        config: the offload config as nested mappings (schema:
            :data:`~fastoffload_ext.policy.resolution.DEFAULT_SCHEMA`); not mutated.
        transformer: the DiT to offload layerwise: an ``nn.Module``, a ``LazyModule``, or the name of
            its loader in ``components``. May be None.
        components: name → zero-argument loader returning the module.
        device: the device the layerwise engine computes on (None: the engine's default).
        layerwise_options: extra keyword arguments for ``enable_layerwise_offload`` (e.g.
            ``resident_blocks``, ``prefetch_depth``, ``cyclic``, ``backend``).
        steps: the resolution steps; defaults to the device policy.

    Returns:
        :class:`AppliedOffload`: the components to use, what was done, and why.

    Raises:
        TypeError: a component is not a loader, ``transformer`` is of the wrong kind, or
            ``layerwise_options`` names an argument ``enable_layerwise_offload`` does not take.
        OffloadConfigError: layerwise offload is on and ``transformer`` has layerwise offload already (an
            earlier call registered it, or it was enabled by hand), and ``layerwise_options`` lacks
            ``is_replace=True``; nothing was loaded or changed (see "Calling it again" in the module docstring).
        ValueError: ``transformer`` names no component, ``layerwise_options`` holds ``model`` or
            ``device`` or a bad value (``OffloadConfigError``), ``device`` is not a device, or a loader
            returned None; resolution errors
            (:class:`~fastoffload_ext.policy.resolution.ResolutionError`) and errors of
            ``enable_layerwise_offload`` propagate.
    """
    _check_unread_settings(config)
    loaders = _check_components(components)
    _check_transformer(transformer, loaders)
    options = _check_layerwise_options(layerwise_options)

    resolution = resolve(config, steps)
    if resolution.get(_LAYERWISE_PATH) and transformer is not None:
        _check_layerwise_target(device, options)
        _check_offloaded_again(transformer, options)

    lazy = bool(resolution.get(_LAZY_PATH))
    built: dict[str, Any] = {}
    for name, loader in loaders.items():
        built[name] = LazyModule(name, loader) if lazy else _load_now(name, loader)
    lazy_components = tuple(loaders) if lazy else ()

    # is_lazy_module first: isinstance(proxy, str) would load a lazy transformer just to answer.
    target = transformer
    if not is_lazy_module(transformer) and isinstance(transformer, str):
        target = built[transformer]
    action, layerwise_result = _apply_layerwise(resolution, target, device, options)

    not_applied = tuple(path for path in _NOT_IMPLEMENTED_PATHS if resolution.get(path))
    if not_applied:
        logger.info("Resolved on but not performed by fastoffload_ext, act on them in your pipeline: %s",
                    ", ".join(not_applied))
    logger.info("Offload applied: layerwise %s, lazy components: %s", action.value,
                ", ".join(lazy_components) or "none")

    return AppliedOffload(resolution=resolution, layerwise=action, layerwise_result=layerwise_result,
                          components=MappingProxyType(built), lazy_components=lazy_components,
                          not_applied=not_applied)
