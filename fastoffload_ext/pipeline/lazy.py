"""Components that load when first used and can be dropped when no longer needed.

A diffusion pipeline usually builds every component (text encoder, image encoder, transformer, VAE)
before its first stage runs, so its peak memory is the *sum* of the components, although no two of
them are needed at the same moment. On a unified-memory device that sum is charged to the same pool
the activations come from, and a model whose parts each fit can still fail to load.

``LazyModule`` turns the sum into a *maximum*: it stands in for a component, loads it the first time
anything touches it, and drops it when told to. Whoever runs the stages decides when to release
(FastVideo's pipeline does; ``fastoffload_ext.pipeline.schedule`` does it for everyone else); this module only
owns the proxying and the load/free mechanics.

The proxy is deliberately transparent: attribute access, calls, ``isinstance`` and a container's
``len``, indexing, iteration and ``in`` all reach the real component, loading it if needed, so code
written for the real module keeps working. Three things must *not* load it: ``repr`` (logging a
pipeline must not pull gigabytes), a truth test (``if pipe.vae:``; an unloaded proxy is true, a
loaded one answers as its component) and :func:`is_lazy_module` (the way to ask "is this a proxy?"
without paying for the answer).

Python finds ``len``, indexing, iteration and ``in`` on the proxy's type, so every proxy
has them, container or not: the component answers each (a component that is no container raises its
own ``TypeError``), but ``hasattr(proxy, "__len__")`` and ``isinstance`` against ``collections.abc``'s
structural classes (``Iterable``, ``Sized``, ``Container``) answer True for any proxy. Ask the loaded
component (``materialize()``) where that distinction matters.

Loads run as they would before the pipeline: a first use inside ``torch.inference_mode()`` or
``torch.autocast`` loads the same weights as a use outside them (grad mode is kept). A loader or
materialize transform that uses the proxy it is loading is refused with an error (there is no component
yet; a transform gets it as its argument).

Threads: the first use loads once. Threads that touch the proxy while it loads wait for that load
and get the same instance, so a component is never in memory twice because two stages started
together. The loader runs with the proxy's lock held; a loader that waits for another thread which
uses the same proxy would deadlock, as it would with any lock.

Copies: ``copy.copy``, ``copy.deepcopy`` and ``pickle`` give a new, *unloaded* proxy with the same
name, loader and materialize transforms (deep-copied by ``deepcopy``; pickling needs a picklable
loader and transforms, e.g. module-level functions or ``functools.partial`` of them). A copy loads its own
instance on first use; it shares neither the loaded component nor the release callbacks, which
belong to whoever manages the original. None of them loads the component. A copy of a proxy whose
loaded component was changed since it loaded (see below) is refused: it would load the component
without the change.

Changes and release: a reload runs the loader (and the materialize transforms) again, so whatever
was done to the loaded instance afterwards (``to(dtype)``, ``half()``, ``load_state_dict``, an
in-place edit, an added adapter) would be gone after a release, and the next use would silently run
the component as the loader built it. :meth:`LazyModule.release` therefore compares an ``nn.Module``
component with what it was when it loaded (its submodules and parameters, each the same object; each
parameter's and persistent buffer's dtype, shape and version counter; each parameter's ``requires_grad``;
the forward and backward hooks registered on each submodule) and keeps a changed component loaded, with a
``RuntimeWarning`` naming the change, instead of dropping the change. A cast made through
the proxy (``proxy.half()``, ``proxy.to(dtype)``) counts even when a later call casts back
(``half().float()`` keeps the rounding, which a reload would not bring back).
``release(discard_changes=True)`` drops it anyway. Not compared, so not kept: the device (a move
keeps every value, and a pipeline moves the component again at its next use), the training flag
(``eval()``/``train()``, which pipelines also set again at each use), and what the comparison cannot
see: writes through ``.data`` (``p.data.copy_(...)``), in-place writes to inference tensors (made under
``torch.inference_mode()``, which keep no version counter), a buffer replaced by one of the same dtype
and shape, and plain attributes. Put such setup in the loader or in a materialize transform. A LoRA merge
by peft (``fuse_lora()``, ``merge_and_unload()``, a layer's ``merge()``/``unmerge()``) writes through
``.data`` too, but counts: loading a component patches peft's layers to advance the version counters
of the weights a merge wrote (``fastoffload_ext.integrations.peft``), so a LoRA fused and then unloaded
(``fuse_lora()`` then ``unload_lora_weights()``) keeps the component.

A component that something else still references after a release (a variable that holds ``materialize()``'s
result) is not freed, and the release logs a warning saying so. Its next use through the proxy gets that same
instance back, not a second copy from the loader: the two would differ as soon as either changed, and both would
take memory. Once nothing else holds it, the next use loads it again.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeGuard

import torch
from torch import nn

from fastoffload_ext.engine.messages import warn_caller
from fastoffload_ext.errors import OffloadStateError

logger = logging.getLogger(__name__)

__all__ = ["LazyModule", "is_lazy_module"]

# The proxy's own state lives in slots and is read with object.__getattribute__, because ordinary
# attribute access on the proxy belongs to the real component.
_STATE_SLOTS = ("_lazy_name", "_lazy_loader", "_lazy_transforms", "_lazy_module", "_lazy_release_callbacks",
                "_lazy_lock", "_lazy_loaded_as", "_lazy_cast_seen", "_lazy_loading", "_lazy_released")
# nn.Module's casting methods: after one is called through the proxy, a cast it made is remembered even when a
# later call casts back (half().float() keeps the rounding, which a reload would not).
_CASTING_METHODS = frozenset({"to", "half", "float", "double", "bfloat16", "type", "_apply"})

# The materialize transforms, in the order they run: (key, transform); the key is None for an unkeyed one.
Transforms = tuple[tuple[str | None, Callable[[Any], Any]], ...]

CHANGED_WARNING = ("fastoffload: deferred module {name} was not released: it changed after it loaded ({change}), and a "
                   "reload would bring it back as its loader builds it, without that change. Make the change in the "
                   "loader or in a materialize transform (set_materialize_transform), keep the component loaded "
                   "(ReleaseSchedule/run_pipeline keep=...), or call release(discard_changes=True) to drop it and "
                   "the change.")
HELD_WARNING = ("fastoffload: deferred module {name} was released, but it is still referenced elsewhere, so its memory "
                "was not freed; its next use gets that same instance back. Drop the other references (a variable that "
                "holds materialize()'s result) to free it.")
CHANGED_COPY_ERROR = ("fastoffload: cannot copy or pickle deferred module {name}: its loaded component changed after "
                      "it loaded ({change}), and a copy is an unloaded proxy that would load the component without "
                      "that change. Copy the component itself (copy.deepcopy(proxy.materialize())), or make the "
                      "change in the loader or in a materialize transform.")


def _cuda_allocated_gib() -> float | None:
    """Device memory held by tensors right now, or None where there is no CUDA to ask."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.memory_allocated() / 1024**3


def _state(proxy: LazyModule, slot: str) -> Any:
    return object.__getattribute__(proxy, slot)


def _set_state(proxy: LazyModule, slot: str, value: Any) -> None:
    object.__setattr__(proxy, slot, value)


# The device types whose autocast a load turns off (torch.autocast takes each of them, built for it or not).
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "privateuseone")


@contextlib.contextmanager
def _as_at_startup() -> Iterator[None]:
    """A load that a use inside ``torch.inference_mode()`` or ``torch.autocast`` starts builds the component as a
    load outside them does.

    Without this, the component's weights would be inference tensors when its first use happens to be inside
    inference mode: layerwise offload refuses those (it cannot watch them for in-place writes), they cannot be
    written outside inference mode, and release() could not see an in-place change to them. Grad mode is kept.
    Under autocast, whatever the loader or a transform computes (a LoRA merged into a weight, a fused
    projection) would be computed in the autocast dtype and rounded, so the component would hold other
    weights than one loaded before the pipeline ran, and another load (after a release) could differ again.
    """
    with contextlib.ExitStack() as stack:
        if torch.is_inference_mode_enabled():
            grad = torch.is_grad_enabled()
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.set_grad_enabled(grad))
        for device_type in _AUTOCAST_DEVICE_TYPES:
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def _apply_transform(transform: Callable[[Any], Any], component: Any, name: str) -> Any:
    """``transform(component)``, refusing None (a transform that forgot to return its module)."""
    transformed = transform(component)
    if transformed is None:
        raise ValueError(f"fastoffload: Materialize transform for module {name} returned None; a transform must return "
                         "the module it was given, or a wrapper of it")
    return transformed


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:
        return None  # an inference tensor keeps no version counter


def _tensor_entry(kind: str, name: str, tensor: torch.Tensor) -> tuple[Any, ...]:
    return (kind, name, weakref.ref(tensor), tensor.dtype, tuple(tensor.shape), _version(tensor), tensor.requires_grad)


# The hooks a module runs around its forward and backward: one registered on the loaded component changes what it
# computes, and a reload would come back without it.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _hook_keys(module: nn.Module) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(getattr(module, hooks, {})) for hooks in _HOOK_DICTS)


def _loaded_as(component: Any) -> list[tuple[Any, ...]] | None:
    """What release() compares against: each submodule, parameter and persistent buffer of an ``nn.Module``
    component (weakly referenced), with what a change of its values would alter; None for a component of
    another kind.

    The device is left out on purpose: a move keeps every value, and pipelines move a component to the device
    each time they use it (FastVideo's stages do), so a reload followed by that move is the same component."""
    if not isinstance(component, nn.Module):
        return None
    entries: list[tuple[Any, ...]] = []
    for prefix, module in component.named_modules(remove_duplicate=False):
        entries.append(("submodule", prefix, weakref.ref(module), _hook_keys(module)))
        dot = prefix + "." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None:
                entries.append(_tensor_entry("parameter", dot + name, param))
        for name, buffer in module._buffers.items():
            # A non-persistent buffer is a cache (a rotary table) that a module may recompute: not state.
            if buffer is not None and name not in module._non_persistent_buffers_set:
                entries.append(_tensor_entry("buffer", dot + name, buffer))
    return entries


def _weak_record(component: Any, loaded_as: Any, cast_seen: str | None) -> tuple[Any, ...] | None:
    """What a release keeps of the component it drops: a weak reference and what it loaded as (None for a
    component that takes no weak reference)."""
    try:
        return (weakref.ref(component), loaded_as, cast_seen)
    except TypeError:
        return None


def _first_cast(before: list[tuple[Any, ...]], now: list[tuple[Any, ...]]) -> str | None:
    """A parameter or buffer of ``before`` whose dtype is another now, in words; None when there is none."""
    for old, new in zip(before, now):
        if old[0] != "submodule" and (old[0], old[1]) == (new[0], new[1]) and old[3] != new[3]:
            return f"its {old[0]} {old[1]!r} was cast from {old[3]} to {new[3]}"
    return None


def _change(before: list[tuple[Any, ...]], now: list[tuple[Any, ...]]) -> str | None:
    """The first difference between two ``_loaded_as`` results, in words; None when there is none."""
    for old, new in zip(before, now):
        kind, name = old[0], old[1] or "the component"
        if (old[0], old[1]) != (new[0], new[1]):
            return f"its {new[0]} {new[1]!r} is new, or its {kind} {old[1]!r} was removed"
        same_object = old[2]() is new[2]()
        if kind == "submodule":
            if not same_object:
                return f"its submodule {name!r} was replaced"
            if old[3] != new[3]:
                where = f"its submodule {old[1]!r}" if old[1] else "the component"
                return f"a forward or backward hook was registered on, or removed from, {where}"
            continue
        # nn.Module.to/cuda/half rebind a parameter in place (same object, version kept) but give a buffer a
        # new tensor: only a parameter's object is compared, and a buffer's version only while it is the same.
        if kind == "parameter" and not same_object:
            return f"its parameter {name!r} was replaced"
        if old[3] != new[3]:
            return f"its {kind} {name!r} was cast from {old[3]} to {new[3]}"
        if old[4] != new[4]:
            return f"its {kind} {name!r} changed shape from {list(old[4])} to {list(new[4])}"
        if same_object and old[5] != new[5]:
            return f"its {kind} {name!r} was written in place, by load_state_dict or an in-place update"
        if kind == "parameter" and old[6] != new[6]:
            return f"its {kind} {name!r} was {'unfrozen' if new[6] else 'frozen'} (requires_grad_({new[6]}))"
    if len(before) != len(now):
        added = len(now) > len(before)
        extra = now[len(before)] if added else before[len(now)]
        return f"its {extra[0]} {extra[1]!r} was {'added' if added else 'removed'}"
    return None


class LazyModule:
    """Stands in for a pipeline component and loads it on first use.

    Every attribute access, call, ``isinstance`` check and container operation (``len``, indexing,
    iteration, ``in``) is forwarded to the real component, which is loaded first if needed; a truth
    test loads nothing.
    :meth:`release` drops the reference and empties the allocator cache; any later use runs the loader
    again and the transforms of :meth:`set_materialize_transform` (unless something else still holds the
    released instance: that instance comes back, see the module docstring). What was done to the loaded
    instance afterwards (``eval()``, ``to(dtype)``, ``load_state_dict``) is not replayed: put such
    setup in the loader or in a materialize transform, and releasing early then costs time, never
    correctness. A component changed that way is not released (see the module docstring).

    Args:
        name: the component's name, used in log messages and errors.
        loader: a zero-argument callable that builds and returns the component. It runs once per
            materialization: on first use, and again after each :meth:`release`.
    """

    __slots__ = _STATE_SLOTS

    def __init__(self, name: str, loader: Callable[[], Any]) -> None:
        _set_state(self, "_lazy_name", name)
        _set_state(self, "_lazy_loader", loader)
        _set_state(self, "_lazy_transforms", ())
        _set_state(self, "_lazy_module", None)
        _set_state(self, "_lazy_release_callbacks", [])
        _set_state(self, "_lazy_loaded_as", None)
        _set_state(self, "_lazy_cast_seen", None)  # a cast seen through the proxy since the load (then undone)
        # Reentrant: a loader or transform may read the proxy's own state (lazy_name, is_materialized).
        _set_state(self, "_lazy_lock", threading.RLock())
        _set_state(self, "_lazy_loading", False)  # a load is running (in the thread that holds the lock)
        # The last released component, weakly, with what it loaded as: (ref, loaded_as, cast_seen) or None.
        _set_state(self, "_lazy_released", None)

    @property
    def lazy_name(self) -> str:
        """The name given at construction; reading it does not load the component."""
        return _state(self, "_lazy_name")

    @property
    def is_materialized(self) -> bool:
        """Whether the real component is loaded now; asking does not load it."""
        return _state(self, "_lazy_module") is not None

    def materialize(self) -> Any:
        """The real component, loaded (and transformed) now if this is its first use since a release.

        Raises:
            ValueError: the loader, or a materialize transform, returned None; a missing return
                statement would otherwise surface much later as a confusing ``NoneType`` error.
            OffloadStateError: the loader, or a materialize transform, used this proxy's component while
                it loaded (there is none yet); it would otherwise recurse until Python's limit.
        """
        loaded = _state(self, "_lazy_module")
        if loaded is not None:
            return loaded
        with _state(self, "_lazy_lock"):
            # Another thread may have loaded it while this one waited for the lock.
            loaded = _state(self, "_lazy_module")
            if loaded is not None:
                return loaded
            revived = self._revive()
            if revived is not None:
                return revived
            if _state(self, "_lazy_loading"):
                # The lock is reentrant, so this is the thread that runs the load: its loader or a transform.
                name = _state(self, "_lazy_name")
                raise OffloadStateError(f"fastoffload: deferred module {name} was used by its own loader or "
                                        "materialize transform while it loaded, before there is a component to use; "
                                        "build it from something other than the proxy (a transform gets the "
                                        "component as its argument: use that)")
            _set_state(self, "_lazy_loading", True)
            try:
                return self._load()
            finally:
                _set_state(self, "_lazy_loading", False)

    def _load(self) -> Any:
        """Runs the loader and the transform; called with the lock held."""
        name = _state(self, "_lazy_name")
        logger.info("Loading deferred module %s", name)
        with _as_at_startup():
            try:
                component = _state(self, "_lazy_loader")()
            except Exception as error:
                # Same exception, same type; the note says whose load failed (a pipeline has several).
                if hasattr(error, "add_note"):
                    error.add_note(f"while loading deferred module {name}")
                raise
            if component is None:
                raise ValueError(f"fastoffload: Deferred loader for module {name} returned None; the loader must "
                                 "return the built component (check for a missing return statement)")

            for _, transform in _state(self, "_lazy_transforms"):
                component = _apply_transform(transform, component, name)
        # peft merges write through .data, which no version counter sees: patched, a merge (fuse_lora) counts as
        # the in-place write it is. Imported here: the integration imports the engine.
        from fastoffload_ext.integrations.peft import patch_peft

        patch_peft()
        _set_state(self, "_lazy_loaded_as", _loaded_as(component))
        _set_state(self, "_lazy_cast_seen", None)
        _set_state(self, "_lazy_released", None)
        _set_state(self, "_lazy_module", component)

        allocated = _cuda_allocated_gib()
        if allocated is not None:
            logger.info("Loaded deferred module %s, cuda allocated now %.2f GiB", name, allocated)
        return component

    def set_materialize_transform(self, transform: Callable[[Any], Any], *, key: str | None = None) -> None:
        """Apply ``transform`` to the component now (if loaded) and to every instance loaded later.

        Registering a transform never loads the component. Transforms compose: a second call wraps
        the first (``new(old(module))``) for future loads, while an instance that is already loaded,
        having been through ``old`` already, receives only ``new``, so current and future instances
        end up set up the same way. A transform may return a wrapper (``torch.compile`` does).

        ``key`` names the transform, so that registering it again replaces it instead of stacking a
        second copy: a transform registered under the same ``key`` before is swapped for ``transform``
        in its place in the chain, so future loads run the new one where the old one ran; a loaded
        instance, which has been through the old one, receives the new one, which must therefore take
        an instance that the old one set up (offload that replaces the offload already there, say).

        Raises:
            ValueError: the component is loaded and ``transform`` returned None for it; the proxy is
                left exactly as it was (previous transforms, previous instance). Whatever ``transform``
                raises on the loaded instance propagates, and leaves the proxy as it was too.
        """
        with _state(self, "_lazy_lock"):
            self._add_transform(transform, key)

    def has_materialize_transform(self, key: str) -> bool:
        """Whether a transform is registered under ``key`` (:meth:`set_materialize_transform`); asking does
        not load the component."""
        return any(existing == key for existing, _ in _state(self, "_lazy_transforms"))

    def _add_transform(self, transform: Callable[[Any], Any], key: str | None) -> None:
        transforms = _state(self, "_lazy_transforms")
        keys = [existing for existing, _ in transforms]
        if key is not None and key in keys:
            at = keys.index(key)
            chain = (*transforms[:at], (key, transform), *transforms[at + 1:])
        else:
            chain = (*transforms, (key, transform))
        loaded = _state(self, "_lazy_module")
        if loaded is None:
            loaded = self._revive()
        if loaded is not None:
            unchanged = self._change() is None
            transformed = _apply_transform(transform, loaded, self.lazy_name)
            _set_state(self, "_lazy_module", transformed)
            if unchanged:
                # What the transform did is replayed on every reload: it is part of what the component loads as.
                # A change made before it is not, and stays visible to release().
                _set_state(self, "_lazy_loaded_as", _loaded_as(transformed))
        _set_state(self, "_lazy_transforms", chain)

    def _change(self) -> str | None:
        """How the loaded component differs from what it loaded as, in words; None when it does not (or is not
        loaded, or is no ``nn.Module``)."""
        component = _state(self, "_lazy_module")
        loaded_as, seen = _state(self, "_lazy_loaded_as"), _state(self, "_lazy_cast_seen")
        released = _state(self, "_lazy_released")
        if component is None and released is not None:
            # Released, but still referenced elsewhere: the next use gets it back (see _revive).
            component, loaded_as, seen = released[0](), released[1], released[2]
        if loaded_as is None or component is None:
            return None
        now = _loaded_as(component)
        change = _change(loaded_as, now) if now is not None else "it is no longer an nn.Module"
        return change if change is not None or seen is None else f"{seen} and back, which kept the rounding"

    def _revive(self) -> Any:
        """The component a release dropped, made the loaded one again while something else still holds it
        (called with the lock held); None when there is none. A reload would build a second, different copy: the
        caller that holds the released instance would see changes the proxy's copy lacks, and both would take
        memory. What it loaded as comes back with it, so a change made since its load still counts."""
        released = _state(self, "_lazy_released")
        if released is None:
            return None
        _set_state(self, "_lazy_released", None)
        component = released[0]()
        if component is None:
            return None
        logger.info("Deferred module %s is still referenced elsewhere since its release: using that instance again",
                    _state(self, "_lazy_name"))
        _set_state(self, "_lazy_loaded_as", released[1])
        _set_state(self, "_lazy_cast_seen", released[2])
        _set_state(self, "_lazy_module", component)
        return component

    def _note_cast(self) -> None:
        """After a casting method ran through the proxy: remembers the first cast it made since the load."""
        loaded_as = _state(self, "_lazy_loaded_as")
        component = _state(self, "_lazy_module")
        if _state(self, "_lazy_cast_seen") is not None or loaded_as is None or component is None:
            return
        now = _loaded_as(component)
        if now is not None:
            _set_state(self, "_lazy_cast_seen", _first_cast(loaded_as, now))

    def add_release_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` every time the real component is dropped (after the drop, in order)."""
        _state(self, "_lazy_release_callbacks").append(callback)

    def release(self, *, discard_changes: bool = False) -> bool:
        """Drop the real component and free what it held.

        Release callbacks run after the proxy lets go of the component, then the garbage collector
        runs and, where CUDA is available, the caching allocator hands its free blocks back; memory
        only comes back if nothing else still references the component.

        A component that changed after it loaded (cast, written in place, frozen or unfrozen, a hook
        registered, a parameter or submodule added or replaced: see the module docstring) is kept
        loaded, with a ``RuntimeWarning`` naming the change: a reload would silently run it without the
        change. ``discard_changes=True`` drops it anyway.

        Returns:
            True if a loaded component was dropped, False if there was nothing to release or the
            component was kept because it changed.
        """
        with _state(self, "_lazy_lock"):
            # Under the lock: a release never drops an instance that a load is still setting up.
            component = _state(self, "_lazy_module")
            if component is None:
                return False
            change = None if discard_changes else self._change()
            if change is not None:
                warn_caller(CHANGED_WARNING.format(name=_state(self, "_lazy_name"), change=change))
                return False
            before = _cuda_allocated_gib()
            _set_state(self, "_lazy_released", _weak_record(component, _state(self, "_lazy_loaded_as"),
                                                            _state(self, "_lazy_cast_seen")))
            _set_state(self, "_lazy_module", None)
            _set_state(self, "_lazy_loaded_as", None)
            _set_state(self, "_lazy_cast_seen", None)
            del component

        name = _state(self, "_lazy_name")
        for callback in list(_state(self, "_lazy_release_callbacks")):
            callback()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        released = _state(self, "_lazy_released")
        if released is not None and released[0]() is not None:
            logger.warning(HELD_WARNING.format(name=name))

        after = _cuda_allocated_gib()
        if before is not None and after is not None:
            logger.info("Released deferred module %s, cuda allocated %.2f -> %.2f GiB, freed %.2f GiB", name, before,
                        after, before - after)
        else:
            logger.info("Released deferred module %s", name)
        return True

    # ---- copies (see the module docstring) ----------------------------------------------------

    def _check_copyable(self) -> None:
        with _state(self, "_lazy_lock"):
            change = self._change()
        if change is not None:
            raise OffloadStateError(CHANGED_COPY_ERROR.format(name=_state(self, "_lazy_name"), change=change))

    def __copy__(self) -> LazyModule:
        self._check_copyable()
        clone = LazyModule(_state(self, "_lazy_name"), _state(self, "_lazy_loader"))
        _set_state(clone, "_lazy_transforms", _state(self, "_lazy_transforms"))
        return clone

    def __deepcopy__(self, memo: dict[int, Any]) -> LazyModule:
        self._check_copyable()
        clone = LazyModule(copy.deepcopy(_state(self, "_lazy_name"), memo),
                           copy.deepcopy(_state(self, "_lazy_loader"), memo))
        memo[id(self)] = clone
        _set_state(clone, "_lazy_transforms", copy.deepcopy(_state(self, "_lazy_transforms"), memo))
        return clone

    def __reduce_ex__(self, protocol: object) -> tuple[Any, ...]:
        # Only the recipe travels: a lock and a loaded component cannot (and should not) be pickled.
        self._check_copyable()
        return (_rebuild, (_state(self, "_lazy_name"), _state(self, "_lazy_loader"), _state(self, "_lazy_transforms")))

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__reduce_ex__(2)

    # ---- proxying -----------------------------------------------------------------------------

    def __getattr__(self, item: str) -> Any:
        # Only reached when normal lookup failed, i.e. the attribute is not the proxy's own. The
        # proxy's slots are excluded so an uninitialised proxy (e.g. one built by copy/pickle
        # machinery) fails with AttributeError instead of recursing through materialize().
        if item in _STATE_SLOTS:
            raise AttributeError(item)
        value = getattr(self.materialize(), item)
        # A plain function too: a wrapper set on the instance (offload_transformer's guarded ``to``) returns
        # the component as the method it wraps does.
        if inspect.ismethod(value) or inspect.isbuiltin(value) or inspect.isfunction(value):
            return self._keep_proxy_identity(value, casts=item in _CASTING_METHODS)
        return value

    def _keep_proxy_identity(self, method: Callable[..., Any], casts: bool = False) -> Callable[..., Any]:
        """Wrap ``method`` so that when it returns the component itself, the proxy is returned.

        ``nn.Module.to``, ``.cuda``, ``.eval``, ``.half``, ``.requires_grad_`` return ``self``, and
        pipelines write ``self.vae = self.vae.to(device)``. Returning the real component there would
        silently replace the proxy with a strong reference that nobody can release: the run would
        look normal and free nothing.
        """

        @functools.wraps(method)
        def forwarding(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            if casts:
                with _state(self, "_lazy_lock"):
                    self._note_cast()
            if result is _state(self, "_lazy_module"):
                return self
            return result

        return forwarding

    def __setattr__(self, item: str, value: Any) -> None:
        setattr(self.materialize(), item, value)

    def __delattr__(self, item: str) -> None:
        delattr(self.materialize(), item)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.materialize()(*args, **kwargs)

    # Python looks the container operations up on the type, never through __getattr__: without these a
    # proxy for an nn.ModuleList, nn.Sequential or nn.ModuleDict has no len(), indexing, iteration or
    # ``in``, and is truthy when the container is empty. Each loads, as any other use does, and a
    # component that is no container raises the TypeError it raises itself.

    def __len__(self) -> int:
        return len(self.materialize())

    def __getitem__(self, key: Any) -> Any:
        return self.materialize()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.materialize()[key] = value

    def __delitem__(self, key: Any) -> None:
        del self.materialize()[key]

    def __iter__(self) -> Any:
        return iter(self.materialize())

    def __reversed__(self) -> Any:
        return reversed(self.materialize())

    def __contains__(self, item: Any) -> bool:
        return item in self.materialize()

    def __bool__(self) -> bool:
        # Without it bool() would call __len__ above, which loads, and raises for a component that is no
        # container. A truth test (``if pipe.vae:``) must not pull a component in: an unloaded proxy is
        # true, as any module is; a loaded one answers as its component (False for an empty container).
        module = _state(self, "_lazy_module")
        return True if module is None else bool(module)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # type: ignore[override]
        # isinstance() falls back to __class__ when the exact type does not match, so forwarding it
        # keeps checks such as isinstance(module, FSDPModule) truthful. The price is that such a
        # check loads the component; a wrong answer would be worse, since callers branch on it
        # without saying so. is_lazy_module() is the check that does not load.
        return type(self.materialize())

    def __repr__(self) -> str:
        state = "materialized" if _state(self, "_lazy_module") is not None else "deferred"
        return f"<LazyModule {_state(self, '_lazy_name')} ({state})>"


def _rebuild(name: str, loader: Callable[[], Any], transforms: Transforms | Callable[[Any], Any] | None) -> LazyModule:
    """An unloaded proxy from its recipe (what pickle stores). A pickle from before transforms had keys
    holds one composed transform, or None."""
    proxy = LazyModule(name, loader)
    if callable(transforms):
        transforms = ((None, transforms),)
    _set_state(proxy, "_lazy_transforms", tuple(transforms or ()))
    return proxy


def is_lazy_module(obj: Any) -> TypeGuard[LazyModule]:
    """Whether ``obj`` is a :class:`LazyModule` proxy, without loading it (``isinstance`` would)."""
    # type() reads the real type slot; it does not consult the forwarded __class__.
    return type(obj) is LazyModule
