"""The hook manager's single-hook fast path (fastoffload_ext/engine/hooks.py): the offload hook's enter and
leave called straight from the wrapper in eager mode, the general path everywhere else, bit-exact in both."""
from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext.engine.hooks import ForwardHook, ModuleHookManager
from fastoffload_ext.engine.offload_hook import LayerwiseOffloadHook
from tests._models import make_pair, params_equal

BACKENDS = ["ext", "python"]
HOOK = "LayerwiseOffloadHook"


def _offload_hooks(model: nn.Module) -> list[LayerwiseOffloadHook]:
    return [ModuleHookManager.get_from(block).get_forward_hook(HOOK) for block in model.blocks]


class Counted:
    """Wraps a callable and counts its calls."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)


def _count_entry_points(monkeypatch: pytest.MonkeyPatch) -> tuple[Counted, Counted]:
    pre, post = Counted(LayerwiseOffloadHook.pre_forward), Counted(LayerwiseOffloadHook.post_forward)

    def pre_forward(self: LayerwiseOffloadHook, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return pre(self, module, *args, **kwargs)

    def post_forward(self: LayerwiseOffloadHook, module: nn.Module, output: Any) -> Any:
        return post(self, module, output)

    monkeypatch.setattr(LayerwiseOffloadHook, "pre_forward", pre_forward)
    monkeypatch.setattr(LayerwiseOffloadHook, "post_forward", post_forward)
    return pre, post


@pytest.mark.parametrize("backend", BACKENDS)
def test_eager_forward_takes_the_fast_path_bit_exact(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference = make_pair(4)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    hooks = _offload_hooks(model)
    counted = [(Counted(hook.eager_points[0]), Counted(hook.eager_points[1])) for hook in hooks]
    for hook, pair in zip(hooks, counted):
        hook.eager_points = pair
    pre, post = _count_entry_points(monkeypatch)  # patched after enable: the pairs above stay in place
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), reference(x))
    assert [(enter.calls, leave.calls) for enter, leave in counted] == [(2, 2)] * 4
    assert (pre.calls, post.calls) == (0, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_hook_on_a_block_takes_the_general_path_in_order(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference = make_pair(3)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    events: list[str] = []

    class Marker(ForwardHook):
        def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
            events.append("marker pre")
            return args, kwargs

        def post_forward(self, module: nn.Module, output: Any) -> Any:
            events.append("marker post")
            return output

    ModuleHookManager.get_from(model.blocks[1]).append_forward_hook(Marker())
    pre, post = _count_entry_points(monkeypatch)
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert events == ["marker pre", "marker post"]
    assert (pre.calls, post.calls) == (1, 1)  # block 1 only; blocks 0 and 2 keep the fast path


def test_a_subclass_that_changes_an_entry_point_has_no_fast_path() -> None:
    class Shifted(LayerwiseOffloadHook):
        def post_forward(self, module: nn.Module, output: Any) -> Any:
            return super().post_forward(module, output) + 1

    model, _ = make_pair(2)
    fo.enable_layerwise_offload(model, device="cpu")
    state = _offload_hooks(model)[0].state
    assert _offload_hooks(model)[0].eager_points is not None
    assert Shifted(state).eager_points is None
    assert ForwardHook.eager_points is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forward_that_raises_on_the_fast_path_releases_and_keeps_every_value(backend: str) -> None:
    model, reference = make_pair(3)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    block = model.blocks[1]
    original = ModuleHookManager.get_from(block).original_forward

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom in the block")

    ModuleHookManager.get_from(block).original_forward = failing
    x = torch.randn(2, 3, 16)
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom in the block"):
        model(x)
    ModuleHookManager.get_from(block).original_forward = original
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))  # the slot came back: the next step runs and is exact
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_a_failing_leave_after_a_failed_forward_is_logged_and_the_forward_error_wins(
        caplog: pytest.LogCaptureFixture) -> None:
    model, _ = make_pair(2)
    fo.enable_layerwise_offload(model, device="cpu")
    hook = _offload_hooks(model)[0]
    enter, leave = hook.eager_points

    def bad_leave() -> None:
        leave()
        raise ValueError("leave failed too")

    hook.eager_points = (enter, bad_leave)
    manager = ModuleHookManager.get_from(model.blocks[0])
    manager.original_forward = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("forward failed"))
    with caplog.at_level(logging.ERROR, logger="fastoffload_ext.engine.hooks"), torch.no_grad(), \
            pytest.raises(RuntimeError, match="forward failed"):
        model(torch.randn(2, 3, 16))
    assert any("post_forward of LayerwiseOffloadHook failed while cleaning up after an error" in record.getMessage()
               for record in caplog.records)


def test_grad_mode_on_the_fast_path_still_guards_saved_tensors() -> None:
    model, reference = make_pair(3)
    model.blocks.requires_grad_(False)
    reference.blocks.requires_grad_(False)
    fo.enable_layerwise_offload(model, device="cpu")
    x = torch.randn(2, 3, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, want = model(x), reference(x_ref)
    assert torch.equal(out, want)
    out.sum().backward()
    want.sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
