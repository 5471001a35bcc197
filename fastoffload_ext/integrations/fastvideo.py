"""Swap this engine into an installed FastVideo, without editing any FastVideo file.

FastVideo enables layerwise offload from its transformer loader when ``dit_layerwise_offload`` is set:
``fastvideo.models.loader.component_loader`` calls ``enable_layerwise_offload(model)``, a name it
imported from ``fastvideo.hooks.layerwise_offload`` when it was first imported. Rebinding the name in
the source module alone would miss that copy, so :func:`install` walks every loaded module under
``fastvideo`` and rebinds each module-level name that still holds one of FastVideo's originals; modules
imported afterwards pick the new names up from the source module. Every rebinding is recorded, and
:func:`uninstall` puts back exactly those (skipping any name someone else rebound in between), and
also the names a FastVideo module imported while installed, which still hold a replacement.

What is replaced, and why:

- ``enable_layerwise_offload``: the entry point; it runs this engine, with the keyword options given to
  :func:`install` (``device``, ``backend``, ``prefetch_depth``, ...) filled in on every call.
- ``LayerwiseOffloadHook`` and ``LayerwiseOffloadState``: FastVideo's LoRA pipeline looks the hook up by
  name and enters its ``mutate_params_scope``; with the classes rebound, ``isinstance`` checks against
  the names FastVideo exposes see the hooks this engine attaches.
- ``ModuleHookManager`` (``fastvideo.hooks.hooks``): the same attribute and methods as FastVideo's,
  plus cleanup when a forward raises, which a block that holds a device slot needs. Hooks FastVideo
  defines (activation tracing) run under it unchanged.

Models offloaded while installed keep this engine's hooks after :func:`uninstall`; undo them with
``fastoffload_ext.disable_layerwise_offload(model)``.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from torch import nn

from fastoffload_ext.engine import hooks as our_hooks
from fastoffload_ext.engine import layerwise as our_layerwise
from fastoffload_ext.engine import offload_state as our_state
from fastoffload_ext.errors import OffloadConfigError

logger = logging.getLogger(__name__)

__all__ = ["install", "installed_options", "is_installed", "replaced_names", "uninstall"]

PACKAGE = "fastvideo"
# FastVideo's module -> the names in it this integration replaces.
SOURCES: dict[str, tuple[str, ...]] = {
    "fastvideo.hooks.layerwise_offload": ("enable_layerwise_offload", "LayerwiseOffloadHook", "LayerwiseOffloadState"),
    "fastvideo.hooks.hooks": ("ModuleHookManager",),
}
# Options FastVideo passes itself, which install() must not preset.
_CALLER_ARGUMENTS = ("model", "is_replace")


@dataclass
class _Installation:
    options: dict[str, Any]
    # (module, attribute, FastVideo's original, what install() put there), in rebinding order.
    rebound: list[tuple[ModuleType, str, Any, Any]] = field(default_factory=list)


_current: _Installation | None = None


def _import_sources() -> dict[str, ModuleType]:
    modules: dict[str, ModuleType] = {}
    for name in SOURCES:
        try:
            modules[name] = importlib.import_module(name)
        except ImportError as error:
            raise ImportError(f"fastoffload: the FastVideo integration needs an importable fastvideo, but importing "
                              f"{name} failed ({error}); install it (pip install fastvideo) or use "
                              "fastoffload_ext.enable_layerwise_offload directly") from error
    return modules


def _check_options(options: dict[str, Any]) -> None:
    preset = sorted(set(options) & set(_CALLER_ARGUMENTS))
    if preset:
        raise OffloadConfigError(f"fastoffload: install() cannot preset {', '.join(preset)}: FastVideo passes those "
                                 "itself on every call; give only engine options such as device or prefetch_depth")
    accepted = inspect.signature(our_layerwise.enable_layerwise_offload).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        known = ", ".join(name for name in accepted if name not in _CALLER_ARGUMENTS)
        raise OffloadConfigError(f"fastoffload: install() got unknown option(s) {', '.join(unknown)}; "
                                 f"enable_layerwise_offload accepts {known}")


def _entry_point(options: dict[str, Any]) -> Callable[..., Any]:
    @functools.wraps(our_layerwise.enable_layerwise_offload)
    def enable_layerwise_offload(model: nn.Module, is_replace: bool = False, **overrides: Any) -> Any:
        return our_layerwise.enable_layerwise_offload(model, is_replace, **{**options, **overrides})

    return enable_layerwise_offload


def _replacements(options: dict[str, Any]) -> dict[str, Any]:
    return {
        "enable_layerwise_offload": _entry_point(options),
        "LayerwiseOffloadHook": our_layerwise.LayerwiseOffloadHook,
        "LayerwiseOffloadState": our_state.LayerwiseOffloadState,
        "ModuleHookManager": our_hooks.ModuleHookManager,
    }


def _fastvideo_modules() -> list[ModuleType]:
    # A snapshot: rebinding must not race with imports that rebinding itself could trigger.
    return [module for name, module in list(sys.modules.items())
            if isinstance(module, ModuleType) and (name == PACKAGE or name.startswith(PACKAGE + "."))]


def install(**options: Any) -> None:
    """Make the installed FastVideo run this engine wherever it enables layerwise offload.

    Args:
        **options: keyword arguments of ``fastoffload_ext.enable_layerwise_offload`` applied to every
            call FastVideo makes (for example ``prefetch_depth=2``, or ``device="cpu"`` to run the
            engine with the host as its device). FastVideo's own arguments (``model``, ``is_replace``)
            cannot be preset.

    Calling it again replaces the options (the previous installation is undone first).

    Raises:
        ImportError: fastvideo is not importable (the message says which module failed).
        OffloadConfigError: an option is unknown or is one FastVideo passes itself; nothing changed.
        Whatever rebinding a name raises: the names rebound before it are put back, and nothing is installed.
    """
    global _current
    _check_options(options)
    sources = _import_sources()
    if _current is not None:
        uninstall()  # first: the originals are read from the source modules below
    originals: dict[int, tuple[str, Any]] = {}
    for module_name, names in SOURCES.items():
        for name in names:
            original = getattr(sources[module_name], name)
            originals[id(original)] = (name, original)
    replacements = _replacements(dict(options))
    installation = _Installation(options=dict(options))
    try:
        for module in _fastvideo_modules():
            for attribute, value in list(vars(module).items()):
                found = originals.get(id(value))
                if found is None or found[1] is not value:
                    continue
                replacement = replacements[found[0]]
                setattr(module, attribute, replacement)
                installation.rebound.append((module, attribute, value, replacement))
    except BaseException:
        # A name that cannot be rebound (a module that refuses the assignment, Ctrl-C): without this the names
        # rebound so far would stay, with is_installed() False and nothing uninstall() could put back.
        for module, attribute, original, _ in reversed(installation.rebound):
            setattr(module, attribute, original)
        raise
    _current = installation
    logger.info("FastVideo now uses fastoffload_ext for layerwise offload (%d names rebound, options %s)",
                len(installation.rebound), options or "default")


def _restore_later_imports(installation: _Installation) -> None:
    """FastVideo modules imported while installed took a replacement from a source module: give them the original.

    Only a name that still holds this installation's own replacement object is touched, so a name someone
    else rebound is left as it is. Without this, such a module would keep running this engine after
    uninstall(), and after a second install() it would keep the first installation's options.
    """
    originals = {id(replacement): (replacement, original)
                 for _, _, original, replacement in installation.rebound}
    recorded = {(id(module), attribute) for module, attribute, _, _ in installation.rebound}
    for module in _fastvideo_modules():
        for attribute, value in list(vars(module).items()):
            found = originals.get(id(value))
            if found is None or found[0] is not value or (id(module), attribute) in recorded:
                continue
            setattr(module, attribute, found[1])


def uninstall() -> bool:
    """Put back every FastVideo name :func:`install` replaced. Returns False when nothing was installed.

    A name that was rebound again after :func:`install` (by another patch) is left as it is, with a
    warning: restoring it would undo someone else's change.
    """
    global _current
    installation = _current
    if installation is None:
        return False
    for module, attribute, original, replacement in reversed(installation.rebound):
        if getattr(module, attribute, None) is replacement:
            setattr(module, attribute, original)
        else:
            logger.warning("fastoffload: %s.%s changed after install(); left as it is", module.__name__, attribute)
    _restore_later_imports(installation)
    _current = None
    logger.info("FastVideo uses its own layerwise offload again")
    return True


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _current is not None


def installed_options() -> dict[str, Any]:
    """The options given to :func:`install` (empty when not installed)."""
    return dict(_current.options) if _current is not None else {}


def replaced_names() -> list[str]:
    """``module.attribute`` for every name the current installation rebound, in order."""
    if _current is None:
        return []
    return [f"{module.__name__}.{attribute}" for module, attribute, _, _ in _current.rebound]
