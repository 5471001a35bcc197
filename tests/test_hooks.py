"""The ForwardHook / ModuleHookManager contract (docs/DESIGN.md, "Behaviour contract"), FastVideo's hook surface.

Every hook here is a :class:`RecordingHook` that appends what happened to it to one shared event log,
so each test asserts the exact order of calls across hooks, not only that calls happened.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fastoffload_ext.engine.hooks import ForwardHook, ModuleHookManager

Event = tuple[Any, ...]


class Affine(nn.Module):
    """forward(x, *, shift=0) = x * weight + shift; raises when asked to, to test cleanup."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([2.0, 3.0]))
        self.raise_in_forward: BaseException | None = None
        self.calls: list[tuple[torch.Tensor, Any]] = []

    def forward(self, x: torch.Tensor, *, shift: Any = 0) -> torch.Tensor:
        self.calls.append((x.clone(), shift))
        if self.raise_in_forward is not None:
            raise self.raise_in_forward
        return x * self.weight + shift


class RecordingHook(ForwardHook):
    """Logs every call as (hook name, method, details) and optionally rewrites or raises."""

    def __init__(self, log: list[Event], *, scale_args: float | None = None, add_kwarg: tuple[str, Any] | None = None,
                 post_add: float | None = None, post_mul: float | None = None,
                 raise_in_pre: BaseException | None = None, raise_in_post: BaseException | None = None,
                 raise_in_cleanup: BaseException | None = None, raise_in_attach: BaseException | None = None) -> None:
        self.log = log
        self.scale_args = scale_args
        self.add_kwarg = add_kwarg
        self.post_add = post_add
        self.post_mul = post_mul
        self.raise_in_pre = raise_in_pre
        self.raise_in_post = raise_in_post
        self.raise_in_cleanup = raise_in_cleanup
        self.raise_in_attach = raise_in_attach

    def on_attach(self, module: nn.Module) -> None:
        self.log.append((self.name(), "on_attach", module))
        if self.raise_in_attach is not None:
            raise self.raise_in_attach

    def on_detach(self, module: nn.Module) -> None:
        self.log.append((self.name(), "on_detach", module))

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.log.append((self.name(), "pre_forward", tuple(a.clone() if torch.is_tensor(a) else a for a in args),
                         dict(kwargs)))
        if self.raise_in_pre is not None:
            raise self.raise_in_pre
        if self.scale_args is not None:
            args = tuple(a * self.scale_args for a in args)
        if self.add_kwarg is not None:
            kwargs = {**kwargs, self.add_kwarg[0]: self.add_kwarg[1]}
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self.log.append((self.name(), "post_forward", None if output is None else output.clone()))
        if output is None and self.raise_in_cleanup is not None:
            raise self.raise_in_cleanup
        if output is not None and self.raise_in_post is not None:
            raise self.raise_in_post
        if output is not None and self.post_add is not None:
            output = output + self.post_add
        if output is not None and self.post_mul is not None:
            output = output * self.post_mul
        return output


def hook_class(name: str) -> type[RecordingHook]:
    """A RecordingHook subclass called ``name``: ``ForwardHook.name()`` defaults to the class name."""
    return type(name, (RecordingHook,), {})


def calls(log: list[Event], method: str | None = None) -> list[tuple[str, str]]:
    return [(event[0], event[1]) for event in log if method is None or event[1] == method]


@pytest.fixture
def log() -> list[Event]:
    return []


@pytest.fixture
def module() -> Affine:
    return Affine()


def attach(module: nn.Module, *hooks: ForwardHook) -> ModuleHookManager:
    manager = ModuleHookManager.get_from_or_default(module)
    for hook in hooks:
        manager.append_forward_hook(hook)
    return manager


X = torch.tensor([1.0, 10.0])


# Names and registration ---------------------------------------------------------------------------

def test_name_defaults_to_class_name_and_is_a_classmethod() -> None:
    hook_type = hook_class("MyHook")
    assert hook_type.name() == "MyHook"
    assert hook_type([]).name() == "MyHook"
    assert ForwardHook.name() == "ForwardHook"


def test_get_from_is_none_for_a_fresh_module(module: Affine) -> None:
    assert ModuleHookManager.get_from(module) is None
    assert not hasattr(module, "_hook_manager")
    assert "forward" not in module.__dict__


def test_get_from_or_default_creates_once_and_wraps_forward_once(module: Affine, log: list[Event]) -> None:
    manager = ModuleHookManager.get_from_or_default(module)
    wrapped = module.forward
    assert ModuleHookManager.get_from(module) is manager
    assert module._hook_manager is manager
    assert ModuleHookManager.module_hook_attribute == "_hook_manager"
    assert "forward" in module.__dict__

    assert ModuleHookManager.get_from_or_default(module) is manager
    assert module.forward is wrapped
    manager.append_forward_hook(hook_class("A")(log))
    torch.testing.assert_close(module(X), X * module.weight.detach())
    # Wrapped once: one call of the module runs the hook once and the original forward once.
    assert calls(log, "pre_forward") == [("A", "pre_forward")]
    assert calls(log, "post_forward") == [("A", "post_forward")]
    assert len(module.calls) == 1


def test_append_runs_on_attach_once_with_the_module(module: Affine, log: list[Event]) -> None:
    hook = hook_class("A")(log)
    manager = attach(module, hook)
    assert log == [("A", "on_attach", module)]
    assert manager.forward_hooks == {"A": hook}
    assert manager.get_forward_hook("A") is hook


def test_duplicate_name_raises_and_attaches_nothing_more(module: Affine, log: list[Event]) -> None:
    first = hook_class("A")(log)
    manager = attach(module, first)
    duplicate = type(first)(log)
    with pytest.raises(ValueError, match="Hook with name A is already registered"):
        manager.append_forward_hook(duplicate)
    assert calls(log, "on_attach") == [("A", "on_attach")]
    assert manager.forward_hooks == {"A": first}
    assert manager.get_forward_hook("A") is first


def test_on_attach_failure_leaves_no_hook_behind(module: Affine, log: list[Event]) -> None:
    manager = attach(module)
    with pytest.raises(RuntimeError, match="attach failed"):
        manager.append_forward_hook(hook_class("A")(log, raise_in_attach=RuntimeError("attach failed")))
    assert manager.forward_hooks == {}
    manager.append_forward_hook(hook_class("A")(log))
    assert list(manager.forward_hooks) == ["A"]


@pytest.mark.parametrize("name", ["B", "Other"])
def test_a_failed_on_attach_in_a_replace_leaves_neither_hook(module: Affine, log: list[Event], name: str) -> None:
    """The old hook is detached first; the new one whose on_attach raised is not left registered, where each
    forward would call a hook that never attached."""
    a, b, c = hook_class("A")(log), hook_class("B")(log), hook_class("C")(log)
    manager = attach(module, a, b, c)
    log.clear()
    with pytest.raises(RuntimeError, match="attach failed"):
        manager.replace_forward_hook("B", hook_class(name)(log, raise_in_attach=RuntimeError("attach failed")))
    assert log == [("B", "on_detach", module), (name, "on_attach", module)]
    assert list(manager.forward_hooks.items()) == [("A", a), ("C", c)]
    log.clear()
    assert torch.equal(module(X), X * module.weight.detach())
    assert calls(log) == [("A", "pre_forward"), ("C", "pre_forward"), ("C", "post_forward"), ("A", "post_forward")]


def test_get_forward_hook_and_forward_hooks_dict(module: Affine, log: list[Event]) -> None:
    a, b = hook_class("A")(log), hook_class("B")(log)
    manager = attach(module, a, b)
    assert isinstance(manager.forward_hooks, dict)
    assert list(manager.forward_hooks.items()) == [("A", a), ("B", b)]
    assert manager.get_forward_hook("B") is b
    assert manager.get_forward_hook("missing") is None


# Order and rewriting --------------------------------------------------------------------------------

def test_pre_hooks_in_insertion_order_post_hooks_in_reverse(module: Affine, log: list[Event]) -> None:
    attach(module, hook_class("A")(log), hook_class("B")(log), hook_class("C")(log))
    log.clear()
    module(X)
    assert calls(log) == [("A", "pre_forward"), ("B", "pre_forward"), ("C", "pre_forward"),
                          ("C", "post_forward"), ("B", "post_forward"), ("A", "post_forward")]


def test_pre_hooks_rewrite_args_and_kwargs_in_a_chain(module: Affine, log: list[Event]) -> None:
    attach(module, hook_class("A")(log, scale_args=10.0), hook_class("B")(log, add_kwarg=("shift", 5.0)),
           hook_class("C")(log, scale_args=0.5))
    log.clear()
    output = module(X, shift=1.0)
    pre = [event for event in log if event[1] == "pre_forward"]
    # Each pre-hook sees what the previous one returned.
    assert torch.equal(pre[0][2][0], X) and pre[0][3] == {"shift": 1.0}
    assert torch.equal(pre[1][2][0], X * 10.0) and pre[1][3] == {"shift": 1.0}
    assert torch.equal(pre[2][2][0], X * 10.0) and pre[2][3] == {"shift": 5.0}
    # And the original forward gets the last one's.
    forward_x, forward_shift = module.calls[-1]
    assert torch.equal(forward_x, X * 5.0) and forward_shift == 5.0
    assert torch.equal(output, X * 5.0 * module.weight.detach() + 5.0)


def test_post_hooks_rewrite_the_output_in_reverse_chain(module: Affine, log: list[Event]) -> None:
    attach(module, hook_class("A")(log, post_mul=2.0), hook_class("B")(log, post_add=1.0))
    log.clear()
    raw = X * module.weight.detach()
    output = module(X)
    # B runs first (reverse order) and sees the raw output; A sees B's result.
    post = [event for event in log if event[1] == "post_forward"]
    assert [event[0] for event in post] == ["B", "A"]
    assert torch.equal(post[0][2], raw)
    assert torch.equal(post[1][2], raw + 1.0)
    assert torch.equal(output, (raw + 1.0) * 2.0)


# replace / remove -----------------------------------------------------------------------------------

def test_replace_detaches_old_before_attaching_new_and_keeps_position(module: Affine, log: list[Event]) -> None:
    a, b, c = hook_class("A")(log), hook_class("B")(log), hook_class("C")(log)
    manager = attach(module, a, b, c)
    log.clear()
    new_b = hook_class("B")(log, post_add=100.0)
    manager.replace_forward_hook("B", new_b)
    assert log == [("B", "on_detach", module), ("B", "on_attach", module)]
    assert manager.forward_hooks == {"A": a, "B": new_b, "C": c}
    assert list(manager.forward_hooks) == ["A", "B", "C"]
    log.clear()
    output = module(X)
    assert calls(log) == [("A", "pre_forward"), ("B", "pre_forward"), ("C", "pre_forward"),
                          ("C", "post_forward"), ("B", "post_forward"), ("A", "post_forward")]
    assert torch.equal(output, X * module.weight.detach() + 100.0)


def test_replace_under_a_new_name_keeps_position(module: Affine, log: list[Event]) -> None:
    a, b, c = hook_class("A")(log), hook_class("B")(log), hook_class("C")(log)
    manager = attach(module, a, b, c)
    other = hook_class("Other")(log)
    manager.replace_forward_hook("B", other)
    assert list(manager.forward_hooks.items()) == [("A", a), ("Other", other), ("C", c)]
    assert manager.get_forward_hook("B") is None


def test_replace_onto_a_name_already_taken_raises_before_detaching(module: Affine, log: list[Event]) -> None:
    a, b = hook_class("A")(log), hook_class("B")(log)
    manager = attach(module, a, b)
    log.clear()
    with pytest.raises(ValueError, match="Hook with name A is already registered"):
        manager.replace_forward_hook("B", hook_class("A")(log))
    assert log == []
    assert manager.forward_hooks == {"A": a, "B": b}


def test_replace_without_on_attach(module: Affine, log: list[Event]) -> None:
    manager = attach(module, hook_class("A")(log))
    log.clear()
    new_a = hook_class("A")(log)
    manager.replace_forward_hook("A", new_a, run_on_attach=False)
    assert log == [("A", "on_detach", module)]
    assert manager.get_forward_hook("A") is new_a


def test_replace_unknown_name_raises(module: Affine, log: list[Event]) -> None:
    manager = attach(module, hook_class("A")(log))
    log.clear()
    with pytest.raises(ValueError, match="No hook with name Missing found"):
        manager.replace_forward_hook("Missing", hook_class("Missing")(log))
    assert log == []
    assert list(manager.forward_hooks) == ["A"]


@pytest.mark.parametrize("run_detach", [True, False])
def test_remove_forward_hook(module: Affine, log: list[Event], run_detach: bool) -> None:
    a, b = hook_class("A")(log), hook_class("B")(log)
    manager = attach(module, a, b)
    log.clear()
    manager.remove_forward_hook("A", run_detach=run_detach)
    assert log == ([("A", "on_detach", module)] if run_detach else [])
    assert manager.forward_hooks == {"B": b}
    assert manager.get_forward_hook("A") is None
    log.clear()
    module(X)
    assert calls(log) == [("B", "pre_forward"), ("B", "post_forward")]


def test_hook_names_pass_by_fastvideos_keyword(module: Affine, log: list[Event]) -> None:
    manager = attach(module, hook_class("A")(log))
    new = hook_class("A")(log)
    manager.replace_forward_hook(hook_name="A", new_hook=new, run_on_attach=True)
    assert manager.get_forward_hook(hook_name="A") is new
    manager.remove_forward_hook(hook_name="A", run_detach=True)
    assert manager.forward_hooks == {}
    assert calls(log) == [("A", "on_attach"), ("A", "on_detach"), ("A", "on_attach"), ("A", "on_detach")]


def test_remove_forward_hook_detaches_by_default(module: Affine, log: list[Event]) -> None:
    manager = attach(module, hook_class("A")(log))
    log.clear()
    manager.remove_forward_hook("A")
    assert log == [("A", "on_detach", module)]


def test_remove_unknown_hook_raises(module: Affine, log: list[Event]) -> None:
    manager = attach(module, hook_class("A")(log))
    with pytest.raises(ValueError, match="No hook with name Missing found"):
        manager.remove_forward_hook("Missing")
    assert list(manager.forward_hooks) == ["A"]


def test_remove_from_manager_restores_the_original_forward(module: Affine, log: list[Event]) -> None:
    before = module(X, shift=0.25)
    attach(module, hook_class("A")(log, post_add=7.0))
    assert not torch.equal(module(X, shift=0.25), before)
    ModuleHookManager.remove_from_manager(module)
    assert torch.equal(module(X, shift=0.25), before)
    assert not hasattr(module, "_hook_manager")
    assert ModuleHookManager.get_from(module) is None
    assert "forward" not in module.__dict__, "the class's forward must be visible again, not a saved bound method"
    assert module.forward.__func__ is Affine.forward
    # A fresh manager wraps again and works.
    log.clear()
    attach(module, hook_class("B")(log))
    module(X)
    assert calls(log) == [("B", "on_attach"), ("B", "pre_forward"), ("B", "post_forward")]


def test_remove_from_manager_keeps_an_instance_forward_the_user_set(module: Affine, log: list[Event]) -> None:
    def custom_forward(x: torch.Tensor) -> torch.Tensor:
        return x - 1.0

    module.forward = custom_forward
    attach(module, hook_class("A")(log, post_add=7.0))
    assert torch.equal(module(X), X + 6.0)
    ModuleHookManager.remove_from_manager(module)
    assert module.__dict__["forward"] is custom_forward
    assert torch.equal(module(X), X - 1.0)


def test_remove_from_manager_on_a_module_without_one_is_a_no_op(module: Affine) -> None:
    ModuleHookManager.remove_from_manager(module)
    assert ModuleHookManager.get_from(module) is None
    assert "forward" not in module.__dict__


# Cleanup when something raises ----------------------------------------------------------------------

def test_exception_in_forward_cleans_up_newest_first_and_propagates(module: Affine, log: list[Event]) -> None:
    attach(module, hook_class("A")(log), hook_class("B")(log), hook_class("C")(log))
    log.clear()
    module.raise_in_forward = ValueError("forward exploded")
    with pytest.raises(ValueError, match="forward exploded"):
        module(X)
    assert calls(log) == [("A", "pre_forward"), ("B", "pre_forward"), ("C", "pre_forward"),
                          ("C", "post_forward"), ("B", "post_forward"), ("A", "post_forward")]
    assert all(event[2] is None for event in log if event[1] == "post_forward")


def test_exception_in_second_pre_hook_cleans_up_only_the_first(module: Affine, log: list[Event]) -> None:
    attach(module, hook_class("A")(log), hook_class("B")(log, raise_in_pre=RuntimeError("pre B failed")),
           hook_class("C")(log))
    log.clear()
    with pytest.raises(RuntimeError, match="pre B failed"):
        module(X)
    assert calls(log) == [("A", "pre_forward"), ("B", "pre_forward"), ("A", "post_forward")]
    assert log[-1][2] is None
    assert module.calls == [], "the original forward must not run after a pre-hook failed"


def test_exception_in_post_hook_still_cleans_up_the_rest(module: Affine, log: list[Event]) -> None:
    attach(module, hook_class("A")(log), hook_class("B")(log, raise_in_post=RuntimeError("post B failed")),
           hook_class("C")(log, post_add=1.0))
    log.clear()
    with pytest.raises(RuntimeError, match="post B failed"):
        module(X)
    post = [event for event in log if event[1] == "post_forward"]
    assert [event[0] for event in post] == ["C", "B", "A"]
    assert torch.equal(post[0][2], X * module.weight.detach())  # C ran normally
    assert torch.equal(post[1][2], X * module.weight.detach() + 1.0)  # B got C's output, then raised
    assert post[2][2] is None  # A only cleans up


def test_exception_in_newest_post_hook_cleans_up_all_older(module: Affine, log: list[Event]) -> None:
    attach(module, hook_class("A")(log), hook_class("B")(log),
           hook_class("C")(log, raise_in_post=RuntimeError("post C failed")))
    log.clear()
    with pytest.raises(RuntimeError, match="post C failed"):
        module(X)
    post = [event for event in log if event[1] == "post_forward"]
    assert [(event[0], event[2] is None) for event in post] == [("C", False), ("B", True), ("A", True)]


def test_failing_cleanup_does_not_mask_the_forward_error(module: Affine, log: list[Event]) -> None:
    attach(module, hook_class("A")(log), hook_class("B")(log, raise_in_cleanup=RuntimeError("cleanup B failed")),
           hook_class("C")(log))
    log.clear()
    module.raise_in_forward = ValueError("forward exploded")
    with pytest.raises(ValueError, match="forward exploded"):
        module(X)
    assert calls(log, "post_forward") == [("C", "post_forward"), ("B", "post_forward"), ("A", "post_forward")]


def test_keyboard_interrupt_in_forward_runs_cleanup_and_propagates(module: Affine, log: list[Event]) -> None:
    attach(module, hook_class("A")(log), hook_class("B")(log))
    log.clear()
    module.raise_in_forward = KeyboardInterrupt("stop")
    with pytest.raises(KeyboardInterrupt):
        module(X)
    assert calls(log) == [("A", "pre_forward"), ("B", "pre_forward"), ("B", "post_forward"), ("A", "post_forward")]
    assert all(event[2] is None for event in log if event[1] == "post_forward")


def test_keyboard_interrupt_in_post_hook_runs_cleanup_and_propagates(module: Affine, log: list[Event]) -> None:
    attach(module, hook_class("A")(log), hook_class("B")(log, raise_in_post=KeyboardInterrupt("stop")))
    log.clear()
    with pytest.raises(KeyboardInterrupt):
        module(X)
    post = [event for event in log if event[1] == "post_forward"]
    assert [(event[0], event[2] is None) for event in post] == [("B", False), ("A", True)]


def test_hooks_run_again_normally_after_a_failed_call(module: Affine, log: list[Event]) -> None:
    attach(module, hook_class("A")(log, post_add=1.0))
    module.raise_in_forward = ValueError("once")
    with pytest.raises(ValueError, match="once"):
        module(X)
    module.raise_in_forward = None
    log.clear()
    assert torch.equal(module(X), X * module.weight.detach() + 1.0)
    assert calls(log) == [("A", "pre_forward"), ("A", "post_forward")]


# A stale manager ------------------------------------------------------------------------------------

def test_manager_replaced_on_the_module_refuses_to_act(module: Affine, log: list[Event]) -> None:
    stale = attach(module, hook_class("A")(log))
    newer = ModuleHookManager(module)
    setattr(module, ModuleHookManager.module_hook_attribute, newer)
    # FastVideo's text, right after the prefix.
    message = r"^fastoffload: ModuleHookManager attached to the module is different"
    with pytest.raises(ValueError, match=message):
        stale.append_forward_hook(hook_class("B")(log))
    with pytest.raises(ValueError, match=message):
        stale.replace_forward_hook("A", hook_class("A")(log))
    with pytest.raises(ValueError, match=message):
        stale.remove_forward_hook("A")
    assert calls(log) == [("A", "on_attach")]


def test_manager_removed_from_the_module_refuses_to_act(module: Affine, log: list[Event]) -> None:
    stale = attach(module, hook_class("A")(log))
    ModuleHookManager.remove_from_manager(module)
    with pytest.raises(ValueError, match="ModuleHookManager is not attached to the module"):
        stale.append_forward_hook(hook_class("B")(log))
    assert calls(log) == [("A", "on_attach")]
