"""Forward hooks that wrap a module's ``forward`` (FastVideo's hook surface).

PyTorch's own ``register_forward_pre_hook`` cannot replace a module's arguments *and* guarantee a
matching cleanup call when the forward raises. Offload needs exactly that guarantee: a block whose
weights were loaded into a device slot must give the slot back even if its forward fails, or the next
step computes against a slot that is never freed. So the manager replaces ``module.forward`` once with
a wrapper that runs the hooks around the original forward:

- pre-hooks run in insertion order, post-hooks in reverse;
- if the forward (or a later pre-hook) raises, every pre-hook that already ran gets
  ``post_forward(module, None)``, newest first, and the exception propagates;
- if a post-hook raises, the hooks after it in the post order still get ``post_forward(module, None)``.

There is one hook per name per module (``ForwardHook.name()`` is the key).

A module compiled on its own (``module.compile(...)``, which diffusers' ``compile_repeated_blocks()`` calls on
each block) runs its forward inside the compiled region, where the hooks would be graph breaks, and
``fullgraph=True`` refuses any. So while a manager is attached, the hooks run outside that region: the
module's compiled call is wrapped to run them around it, and inside it the forward wrapper passes straight
to the original forward, which compiles as one graph. A ``compile()`` made after the manager is attached is
caught by an instance attribute in front of ``nn.Module.compile``; removing the manager puts back the
compiled call and the method.

Fast path: a block's forward runs once per block per step, and on a host-bound model every
microsecond of Python around it adds to the step. A hook may offer ``eager_points``, two argument-free
callables with exactly the effect of its ``pre_forward`` (arguments unchanged) and ``post_forward``
(output unchanged). When a module's only hook offers them and the call is outside every compiled
region, the wrapper calls those two directly: no argument re-packing, no snapshot list, no
compiler-boundary wrappers (the hook's ``pre_forward``/``post_forward`` keep theirs, and compiled code
still goes through them).
"""
from __future__ import annotations

import functools
import logging
import types
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from fastoffload_ext.engine.messages import COPY_ERROR
from fastoffload_ext.engine.weak import WeakModule
from fastoffload_ext.errors import OffloadConfigError, OffloadStateError

logger = logging.getLogger(__name__)

# FastVideo's wording after the prefix, so that callers searching for it still find it.
HOOK_EXISTS_ERROR = ("fastoffload: Hook with name {name} is already registered; use replace_forward_hook to swap "
                     "it, or remove_forward_hook first.")
NO_HOOK_ERROR = "fastoffload: No hook with name {name} found; use append_forward_hook to add it."
DEAD_MODULE_ERROR = ("fastoffload: this forward belongs to a module that was deleted (only a reference to its "
                     "`forward` was kept); call the module itself instead of a saved `module.forward`")
GENERATOR_OUTPUT_ERROR = ("fastoffload: the forward of an offloaded block ({block}) returned a generator, which would "
                          "run after the block's weights were released and compute on empty placeholders; return its "
                          "values (a tuple or list) instead")


class ForwardHook:
    """Base class for hooks run by :class:`ModuleHookManager` around a module's forward."""

    # (enter, leave): the same effect as pre_forward / post_forward when those change nothing they are
    # given; None (the default) when the hook has no such pair. See the module docstring.
    eager_points: ClassVar[tuple[Callable[[], None], Callable[[], None]] | None] = None

    @classmethod
    def name(cls) -> str:
        """The key of this hook in a manager: one hook per name per module."""
        return cls.__name__

    def on_attach(self, module: nn.Module) -> None:
        """Called once when the hook is attached to ``module``."""

    def on_detach(self, module: nn.Module) -> None:
        """Called once when the hook is detached from ``module`` (not when the module is deleted)."""

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Called before the original forward; returns the (possibly changed) arguments."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Called after the original forward (with ``output=None`` when it raised); returns the output."""
        return output


def _run_post_hooks(module: nn.Module, ran: list[ForwardHook], output: Any) -> Any:
    """post_forward on ``ran`` newest first; after a failure the rest still run, with None."""
    error: BaseException | None = None
    for hook in reversed(ran):
        if error is None:
            try:
                output = hook.post_forward(module, output)
            except BaseException as raised:  # KeyboardInterrupt too: cleanup must still happen
                error = raised
        else:
            try:
                hook.post_forward(module, None)
            except Exception:  # the first error is the one the caller sees
                logger.exception("post_forward of %s failed while cleaning up after an error", hook.name())
    if error is not None:
        raise error
    return output


# Dynamo evaluates this to True while it traces, so traced code takes the general path (and its
# compiler boundaries); in eager mode it is one cheap call.
_is_compiling = torch.compiler.is_compiling


def _no_eval_frame_callback() -> object:
    return _UNKNOWN


_UNKNOWN = object()
# Not tracing is not enough: when dynamo falls back to running a frame with a graph break eagerly, its
# frame callback stays installed and would trace into the fast path's entry points, which carry no
# compiler boundary. The callback is None only outside every compiled region; without the function
# (another torch) the fast path is never taken.
_eval_frame_callback = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None),
                               "get_eval_frame_callback", _no_eval_frame_callback)


_GENERATOR = types.GeneratorType
_OFFLOAD_HOOK_NAME = "LayerwiseOffloadHook"  # the offload hook's key in a manager (offload_hook.py)


def _forward_with_hooks(module_ref: weakref.ref, *args: Any, **kwargs: Any) -> Any:
    # The wrapper holds its module weakly (weak.py): a strong reference from the module's own attribute
    # back to the module would be a cycle.
    module: nn.Module | None = module_ref()
    if module is None:
        raise OffloadStateError(DEAD_MODULE_ERROR)
    manager: ModuleHookManager | None = getattr(module, ModuleHookManager.module_hook_attribute, None)
    if manager is None:
        # Another thread removed the manager (a disable) after this call looked up `forward`:
        # the module's own forward is back in place.
        return module.forward(*args, **kwargs)
    if getattr(manager, "hooks_ran_outside", False):  # a manager of another class has no such attribute
        # Called from the module's compiled region, whose wrapper has run the hooks: this traces as plain code.
        forward = manager.instance_forward
        return forward(*args, **kwargs) if forward is not None else manager.class_forward(module, *args, **kwargs)
    hooks = manager.forward_hooks
    if len(hooks) == 1 and not _is_compiling() and _eval_frame_callback() is None:
        for only in hooks.values():
            # A hook of another ForwardHook class (FastVideo's own, under an installed integration) has no
            # such attribute: it takes the general path.
            points = getattr(only, "eager_points", None)
            if points is not None:
                # Inline rather than a helper: one Python frame less on every block of every step.
                points[0]()
                try:
                    forward = manager.instance_forward
                    output = forward(*args, **kwargs) if forward is not None else \
                        manager.class_forward(module, *args, **kwargs)
                except BaseException:
                    try:
                        points[1]()
                    except Exception:
                        logger.exception("post_forward of %s failed while cleaning up after an error", only.name())
                    raise
                points[1]()
                if type(output) is _GENERATOR:
                    raise OffloadStateError(GENERATOR_OUTPUT_ERROR.format(block=type(module).__name__))
                return output
    return _run_hooks_around(module, manager, None, args, kwargs)


def _run_hooks_around(module: nn.Module, manager: ModuleHookManager, call: Callable[..., Any] | None,
                      args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Every hook's ``pre_forward`` in order, ``call`` (None: the module's own forward) with the arguments they
    give, every ``post_forward`` in reverse; when anything raises, the pre-hooks that ran get
    ``post_forward(module, None)``, newest first."""
    ran: list[ForwardHook] = []
    try:
        # A snapshot: another thread may remove a hook while this forward runs.
        for hook in tuple(manager.forward_hooks.values()):
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
            ran.append(hook)
        if call is None:
            forward = manager.instance_forward
            output = forward(*args, **kwargs) if forward is not None else manager.class_forward(module, *args, **kwargs)
        else:
            output = call(*args, **kwargs)
        if type(output) is _GENERATOR and _OFFLOAD_HOOK_NAME in manager.forward_hooks:
            # Its body would run once the offload hook has released the block: on empty placeholders.
            raise OffloadStateError(GENERATOR_OUTPUT_ERROR.format(block=type(module).__name__))
    except BaseException:
        for hook in reversed(ran):
            try:
                hook.post_forward(module, None)
            except Exception:
                logger.exception("post_forward of %s failed while cleaning up after an error", hook.name())
        raise
    return _run_post_hooks(module, ran, output)


def _compiled_with_hooks(module_ref: weakref.ref, compiled: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A compiled module's call while a manager is attached: the hooks run here, outside the compiled region, and
    the forward wrapper inside it passes straight to the original forward."""
    module: nn.Module | None = module_ref()
    if module is None:
        raise OffloadStateError(DEAD_MODULE_ERROR)
    manager: ModuleHookManager | None = getattr(module, ModuleHookManager.module_hook_attribute, None)
    if manager is None or manager.hooks_ran_outside:
        return compiled(*args, **kwargs)

    def inside(*args: Any, **kwargs: Any) -> Any:
        manager.hooks_ran_outside = True
        try:
            return compiled(*args, **kwargs)
        finally:
            manager.hooks_ran_outside = False

    return _run_hooks_around(module, manager, inside, args, kwargs)


def _compile_outside_hooks(module_ref: weakref.ref, *args: Any, **kwargs: Any) -> None:
    """``module.compile(...)`` while a manager is attached: nn.Module's own, then its compiled call wrapped."""
    module: nn.Module | None = module_ref()
    if module is None:
        raise OffloadStateError(DEAD_MODULE_ERROR)
    manager = ModuleHookManager.get_from(module)
    if manager is not None:
        manager.unwrap_compiled()
    type(module).compile(module, *args, **kwargs)
    if manager is not None and ModuleHookManager.get_from(module) is manager:
        manager.wrap_compiled()


_COMPILED_CALL = "_compiled_call_impl"  # where nn.Module.compile() keeps the compiled call


class ModuleHookManager:
    """The hooks of one module, stored on it as ``module._hook_manager``."""

    module_hook_attribute = "_hook_manager"
    module = WeakModule()  # held weakly: the module holds the manager

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.forward_hooks: dict[str, ForwardHook] = {}
        # The forward the hooks run around. One set on the instance (another wrapper's) is kept as it is;
        # the class's is called with the module each time, so that the manager holds no bound method, whose
        # strong reference back to the module would be a cycle.
        self.instance_forward: Callable[..., Any] | None = module.__dict__.get("forward")
        self.class_forward: Callable[..., Any] = type(module).forward
        # True while a compiled call's wrapper runs the compiled region, having run the hooks itself.
        self.hooks_ran_outside = False
        self.compiled_call: Callable[..., Any] | None = None  # the module's own compiled call, while wrapped

    @property
    def original_forward(self) -> Callable[..., Any]:
        """The module's own forward, as a callable without the module argument."""
        if self.instance_forward is not None:
            return self.instance_forward
        module = self.module
        if module is None:
            raise OffloadStateError(DEAD_MODULE_ERROR)
        return types.MethodType(self.class_forward, module)

    @original_forward.setter
    def original_forward(self, forward: Callable[..., Any]) -> None:
        self.instance_forward = forward

    def __reduce_ex__(self, protocol: object) -> Any:
        # Reached first when a model with offloaded blocks is deep-copied or pickled: a clear refusal
        # instead of pickle's complaint about whatever unpicklable object it meets deeper down.
        raise OffloadStateError(COPY_ERROR)

    @classmethod
    def get_from(cls, module: nn.Module) -> ModuleHookManager | None:
        """The module's manager, or None when it has none."""
        return getattr(module, cls.module_hook_attribute, None)

    @classmethod
    def get_from_or_default(cls, module: nn.Module) -> ModuleHookManager:
        """The module's manager, created (and ``module.forward`` wrapped, once) if it has none."""
        manager = cls.get_from(module)
        if manager is None:
            manager = cls(module)
            setattr(module, cls.module_hook_attribute, manager)
            module.forward = functools.partial(_forward_with_hooks, weakref.ref(module))
            if "compile" not in module.__dict__:  # another wrapper set on the instance is left as it is
                module.compile = functools.partial(_compile_outside_hooks, weakref.ref(module))
            manager.wrap_compiled()
        return manager

    def wrap_compiled(self) -> None:
        """Puts the hooks around the module's compiled call, if it has one (see the module docstring)."""
        module = self.module
        compiled = getattr(module, _COMPILED_CALL, None) if module is not None else None
        if compiled is None or self.compiled_call is not None:
            return
        self.compiled_call = compiled
        setattr(module, _COMPILED_CALL, functools.partial(_compiled_with_hooks, weakref.ref(module), compiled))

    def unwrap_compiled(self) -> None:
        """Gives the module its own compiled call back, if :meth:`wrap_compiled` wrapped one."""
        module = self.module
        if self.compiled_call is None or module is None:
            return
        current = getattr(module, _COMPILED_CALL, None)
        if isinstance(current, functools.partial) and current.func is _compiled_with_hooks:
            setattr(module, _COMPILED_CALL, self.compiled_call)
        self.compiled_call = None

    @staticmethod
    def remove_from_manager(module: nn.Module) -> None:
        """Drops the manager and restores the original forward. Hooks are not detached."""
        manager = ModuleHookManager.get_from(module)
        if manager is None:
            return
        if manager.instance_forward is not None:
            module.forward = manager.instance_forward
        else:
            module.__dict__.pop("forward", None)  # the class's forward again
        manager.unwrap_compiled()
        compile_method = module.__dict__.get("compile")
        if isinstance(compile_method, functools.partial) and compile_method.func is _compile_outside_hooks:
            del module.__dict__["compile"]  # nn.Module's own again
        delattr(module, ModuleHookManager.module_hook_attribute)

    def _check_manager_attached(self) -> None:
        attached = self.get_from(self.module)
        if attached is None:
            raise OffloadConfigError("fastoffload: ModuleHookManager is not attached to the module; use "
                                     "ModuleHookManager.get_from_or_default(module).")
        if attached is not self:
            # FastVideo's text after the prefix, as for the other refusals here.
            raise OffloadConfigError("fastoffload: ModuleHookManager attached to the module is different (another "
                                     "manager replaced this one); use ModuleHookManager.get_from(module).")

    def append_forward_hook(self, hook: ForwardHook) -> None:
        """Adds ``hook`` last (its pre-hook runs last, its post-hook first), then calls ``on_attach``."""
        self._check_manager_attached()
        name = hook.name()
        if name in self.forward_hooks:
            raise OffloadConfigError(HOOK_EXISTS_ERROR.format(name=name))
        self.forward_hooks[name] = hook
        try:
            hook.on_attach(self.module)
        except BaseException:
            del self.forward_hooks[name]
            raise

    # Here and below the name is FastVideo's parameter, ``hook_name``: its callers may pass it by keyword.
    def replace_forward_hook(self, hook_name: str, new_hook: ForwardHook, run_on_attach: bool = True) -> None:
        """Swaps the hook called ``hook_name`` for ``new_hook`` in the same position: the old hook's
        ``on_detach`` runs first, then (if ``run_on_attach``) the new hook's ``on_attach``. A failed ``on_attach``
        leaves neither hook (the old one is detached already), as a failed append adds none."""
        self._check_manager_attached()
        if hook_name not in self.forward_hooks:
            raise OffloadConfigError(NO_HOOK_ERROR.format(name=hook_name))
        new_name = new_hook.name()
        if new_name != hook_name and new_name in self.forward_hooks:
            raise OffloadConfigError(HOOK_EXISTS_ERROR.format(name=new_name))
        old_hook = self.forward_hooks[hook_name]
        old_hook.on_detach(self.module)
        self.forward_hooks = {(new_name if key == hook_name else key): (new_hook if key == hook_name else hook)
                              for key, hook in self.forward_hooks.items()}
        if run_on_attach:
            try:
                new_hook.on_attach(self.module)
            except BaseException:
                del self.forward_hooks[new_name]
                raise

    def remove_forward_hook(self, hook_name: str, run_detach: bool = True) -> None:
        """Removes the hook called ``hook_name``, calling its ``on_detach`` first when ``run_detach``."""
        self._check_manager_attached()
        if hook_name not in self.forward_hooks:
            raise OffloadConfigError(NO_HOOK_ERROR.format(name=hook_name))
        if run_detach:
            self.forward_hooks[hook_name].on_detach(self.module)
        del self.forward_hooks[hook_name]

    def get_forward_hook(self, hook_name: str) -> ForwardHook | None:
        """The hook called ``hook_name``, or None."""
        return self.forward_hooks.get(hook_name)


__all__ = ["ForwardHook", "ModuleHookManager"]
