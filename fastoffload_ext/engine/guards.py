"""Functions that integrations set on the instances of an offloaded model, and their removal at disable.

An integration that must refuse or steer a method of one model (diffusers' ``model.to`` of an offloaded
transformer, its projection fusion) sets a wrapper on that instance with :func:`mark`. Such a function
refers back to its model, weakly: left on the instance after ``disable_layerwise_offload`` it would
follow a ``copy.deepcopy`` of the model and act on the original, and make ``torch.save(model)`` fail. The
disable calls :func:`remove_guards`, which puts back what each wrapper replaced.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["is_guard", "mark", "remove_guard", "remove_guards"]

_GUARD = "_fastoffload_guard"  # on a wrapper: set by mark()
_REPLACED = "_fastoffload_replaced"  # on a wrapper: the instance attribute it replaced (None: there was none)


def mark(wrapper: Callable[..., Any], replaced: Any = None) -> Callable[..., Any]:
    """``wrapper``, marked as an instance guard that replaced ``replaced`` (None: the class's method)."""
    setattr(wrapper, _GUARD, True)
    setattr(wrapper, _REPLACED, replaced)
    return wrapper


def is_guard(value: Any) -> bool:
    """Whether ``value`` is a wrapper that :func:`mark` marked."""
    return bool(getattr(value, _GUARD, False))


def remove_guard(module: nn.Module, key: str) -> bool:
    """Takes the marked wrapper at ``module.<key>`` off the instance, putting back what it replaced; whether
    there was one."""
    value = module.__dict__.get(key)
    if not is_guard(value):
        return False
    replaced = getattr(value, _REPLACED, None)
    if replaced is None:
        del module.__dict__[key]
    else:
        module.__dict__[key] = replaced
    return True


def remove_guards(model: nn.Module) -> None:
    """Takes every marked wrapper off the instances of ``model``'s modules, putting back what each replaced."""
    for module in model.modules():
        for key in [key for key, value in vars(module).items() if is_guard(value)]:
            remove_guard(module, key)
