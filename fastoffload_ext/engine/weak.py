"""Back-references from the offload's objects to the modules they serve, held weakly.

A module holds its hook manager, the manager its hooks, a hook its block's state; the model holds its
offload group. Strong references back (a state to its block, the group to its model, a wrapped
``forward`` to its module) would close each of those into a reference cycle, and a cycle is freed only
when Python's cycle collector next runs: a dropped offloaded model would keep its pinned host copy and
its device slots until then, which in a process with many long-lived objects can be a long time. Held
weakly, an offloaded model is freed as soon as its last reference goes, like any other module.
"""
from __future__ import annotations

import weakref
from typing import Any

__all__ = ["WeakModule"]


class WeakModule:
    """A class attribute that stores a module (or None) as a weak reference: reading it gives the module,
    or None once the module is gone."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._key = "_weak_" + name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        ref = instance.__dict__.get(self._key)
        return None if ref is None else ref()

    def __set__(self, instance: Any, value: Any) -> None:
        instance.__dict__[self._key] = None if value is None else weakref.ref(value)
