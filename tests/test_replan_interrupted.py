"""A re-plan cut short (a Ctrl-C, an error) while it takes the old layout off: the model must be left
offloaded as it was, with its current values, and run bit for bit as the resident model. The host as the
device, both backends."""
from __future__ import annotations

import pytest
import torch

import fastoffload_ext as fo
from fastoffload_ext.engine.offload_hook import LayerwiseOffloadHook
from fastoffload_ext.planning import BlockCosts, module_packed_bytes

from ._models import make_pair, params_equal

BACKENDS = ["ext", "python"]
N = 6


def _edited_pair():
    """An offloaded model and its resident twin, both given new values through load_state_dict after enable."""
    model, reference = make_pair(N)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    return model, reference


def _interrupt_on_detach(monkeypatch: pytest.MonkeyPatch, call: int, after: bool) -> None:
    """The ``call``-th ``on_detach`` raises KeyboardInterrupt, before or after it restored its block."""
    original = LayerwiseOffloadHook.on_detach
    calls = [0]

    def on_detach(self, module):
        calls[0] += 1
        if calls[0] == call and not after:
            raise KeyboardInterrupt
        original(self, module)
        if calls[0] == call:
            raise KeyboardInterrupt

    monkeypatch.setattr(LayerwiseOffloadHook, "on_detach", on_detach)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("call, after", [(1, False), (2, False), (2, True), (4, True)])
def test_a_replan_interrupted_while_it_disables_keeps_the_old_layout_exactly(
        monkeypatch: pytest.MonkeyPatch, backend: str, call: int, after: bool) -> None:
    model, reference = _edited_pair()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    block = module_packed_bytes(model.blocks[0])
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=4 * block)
    state = {key: value * 1.5 for key, value in reference.state_dict().items()}
    model.load_state_dict(state)
    reference.load_state_dict(state)
    old = (group.resident, group.prefetch_depth)
    table = BlockCosts([1.0, 0.1] * 3, [block] * N, 1e-3)  # a new layout: the re-plan offloads again
    _interrupt_on_detach(monkeypatch, call, after)
    with pytest.raises(KeyboardInterrupt):
        group.replan(table)
    monkeypatch.undo()
    now = fo.get_offload_group(model)
    assert now is not None and (now.resident, now.prefetch_depth) == old
    assert now.stats()["plan"]["resident"] == list(old[0])
    with torch.inference_mode():
        want = reference(x)
        assert all(torch.equal(model(x), want) for _ in range(2))
    # The group on the model re-plans as any other.
    fresh = now.replan(table)
    assert fresh.resident != old[0]
    with torch.inference_mode():
        assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
