"""Enable and disable cut short by a Ctrl-C inside one block's attach or detach: no value is lost.

enable_layerwise_offload: an interrupt in a block's ``on_attach`` after its state took the weights
(``state.on_init``) leaves every block with its exact values, the model running as before, and enable
works again. disable_layerwise_offload: an interrupt between two blocks' detach leaves some blocks
restored and others still offloaded; the forward then says to call disable again, and that second
disable restores every parameter exactly. Both backends, the host as the device.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext.engine import layerwise
from fastoffload_ext.engine.offload_hook import LayerwiseOffloadHook
from fastoffload_ext.engine.state_dict import StateDictHooks
from fastoffload_ext.errors import OffloadStateError

from ._models import make_pair, params_equal
from ._trees import has_hooks

BACKENDS = ["ext", "python"]
N = 4
AGAIN = (r"^fastoffload: a disable_layerwise_offload\(model\) was cut short .* "
         r"call disable_layerwise_offload\(model\) again to finish it")


def _pair() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    model, reference = make_pair(N, seed=5)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(6))
    return model, reference, x


def _same_values(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    now = dict(model.named_parameters())
    assert now.keys() == before.keys()
    for name, value in before.items():
        assert now[name].device == value.device, name
        assert torch.equal(now[name].detach(), value), name


def _runs_exactly(model: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), reference(x))


def _interrupting(original: Callable[[Any, nn.Module], None], calls: list[int],
                  when: str) -> Callable[[Any, nn.Module], None]:
    """``original`` (a hook method taking the block), with a KeyboardInterrupt at its second call: before
    ``original`` runs for that block ("before") or after it ran ("after")."""

    def interrupted(self: Any, module: nn.Module) -> None:
        if when == "after":
            original(self, module)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        if when == "before":
            original(self, module)

    return interrupted


def _rolled_back_and_usable(model: nn.Module, reference: nn.Module, x: torch.Tensor, before: dict[str, torch.Tensor],
                            backend: str) -> None:
    """After an enable that failed part-way: no offload left, every value exact, and the model offloads again."""
    assert fo.get_offload_group(model) is None
    assert not any(has_hooks(block) for block in model.blocks)
    _same_values(model, before)
    assert params_equal(model, reference)
    _runs_exactly(model, reference, x)
    assert fo.enable_layerwise_offload(model, device="cpu", backend=backend) is not None
    _runs_exactly(model, reference, x)
    fo.disable_layerwise_offload(model)
    _same_values(model, before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("when", ["before", "after"])
def test_an_interrupt_in_a_blocks_on_attach_after_its_state_took_the_weights_loses_nothing(
        backend: str, when: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference, x = _pair()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    calls: list[int] = []
    # The second block's state has taken its weights (on_init ran); its state-dict hooks are not on yet
    # ("before") or are on ("after").
    monkeypatch.setattr(StateDictHooks, "attach", _interrupting(StateDictHooks.attach, calls, when))
    with pytest.raises(KeyboardInterrupt):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    monkeypatch.undo()
    assert len(calls) == 2
    _rolled_back_and_usable(model, reference, x, before, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_interrupt_after_a_blocks_hook_is_on_but_before_its_attach_finished_loses_nothing(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block's hook is on and has taken its weights; the interrupt lands before its attach returned (while
    its buffers move, say): that block is rolled back with the others."""
    model, reference, x = _pair()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    attach_one = layerwise._attach_one
    seen: list[int] = []

    def attach_then_interrupt(*args: Any) -> Any:
        result = attach_one(*args)
        seen.append(1)
        if len(seen) == 2:
            raise KeyboardInterrupt  # as if it landed in the buffer moves, after the hook went on
        return result

    monkeypatch.setattr(layerwise, "_attach_one", attach_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    monkeypatch.undo()
    assert len(seen) == 2
    _rolled_back_and_usable(model, reference, x, before, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_second_disable_after_an_interrupted_one_restores_every_parameter_exactly(
        backend: str, when: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference, x = _pair()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    _runs_exactly(model, reference, x)
    calls: list[int] = []
    # The second block: before its state restores its weights, or after it did.
    monkeypatch.setattr(LayerwiseOffloadHook, "on_detach", _interrupting(LayerwiseOffloadHook.on_detach, calls, when))
    with pytest.raises(KeyboardInterrupt):
        fo.disable_layerwise_offload(model)
    monkeypatch.undo()
    assert len(calls) == 2
    assert fo.get_offload_group(model) is not None  # cut short: the group is still there
    if when == "after":
        # The second block's weights are back but its hook is still on: its forward says what to do.
        with torch.no_grad(), pytest.raises(OffloadStateError, match=AGAIN):
            model(x)
    else:
        _runs_exactly(model, reference, x)  # the second block is still offloaded, with its values

    fo.disable_layerwise_offload(model)
    assert fo.get_offload_group(model) is None
    assert not any(has_hooks(block) for block in model.blocks)
    _same_values(model, before)
    assert params_equal(model, reference)
    _runs_exactly(model, reference, x)
    assert fo.enable_layerwise_offload(model, device="cpu", backend=backend) is not None
    _runs_exactly(model, reference, x)
    fo.disable_layerwise_offload(model)
    _same_values(model, before)
