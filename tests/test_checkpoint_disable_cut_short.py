"""Offload built from a checkpoint (``weights=``), host and disk tiers: a disable cut short between two blocks.

A checkpoint-backed block whose weights came back (its engine block detached) holds no offloaded bytes any
more, as an ordinary offloaded block does: the forward that meets it says to finish the disable (rather
than to re-enable, which the group still on the model would refuse), ``stats()`` counts the blocks still
offloaded, and the second disable restores every parameter exactly.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext.engine.offload_hook import LayerwiseOffloadHook
from fastoffload_ext.errors import OffloadStateError
from fastoffload_ext.planning.tiers import STAGING_SLACK
from tests._checkpoints import block_bytes, inputs, meta_stack, reference_stack, write_single
from tests._models import params_equal

N = 4
AGAIN = (r"^fastoffload: a disable_layerwise_offload\(model\) was cut short .* "
         r"call disable_layerwise_offload\(model\) again to finish it")


def _interrupt_after_second_detach(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A KeyboardInterrupt right after the second block's ``on_detach`` restored its weights, before its hook
    came off."""
    original = LayerwiseOffloadHook.on_detach
    calls: list[int] = []

    def interrupted(self: Any, module: nn.Module) -> None:
        calls.append(1)
        original(self, module)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(LayerwiseOffloadHook, "on_detach", interrupted)
    return calls


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_disable_cut_short_on_a_checkpoint_model_says_to_finish_it_and_the_second_one_is_exact(
        tmp_path: Path, tier: str, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = reference_stack(N)
    path = write_single(reference, tmp_path / "model.safetensors")
    budget = None if tier == "host" else 2 * block_bytes(reference) + 8192 + 2 * STAGING_SLACK
    model = meta_stack(N)
    group = fo.enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget)
    assert any(state.on_disk for state in group.states) == (tier == "disk")
    x = inputs()
    with torch.no_grad():
        expected = reference(x)
        assert torch.equal(model(x), expected)
    each = block_bytes(reference)
    assert group.stats()["weight_bytes"] == N * each

    calls = _interrupt_after_second_detach(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        fo.disable_layerwise_offload(model)
    monkeypatch.undo()
    assert len(calls) == 2
    assert fo.get_offload_group(model) is group  # cut short: the group is still there
    # Two blocks' weights are back: only the other two are still offloaded.
    assert group.stats()["weight_bytes"] == (N - 2) * each
    # The second block's weights are back but its hook is still on: its forward says what to do.
    with torch.no_grad(), pytest.raises(OffloadStateError, match=AGAIN):
        model(x)

    fo.disable_layerwise_offload(model)
    assert fo.get_offload_group(model) is None
    assert params_equal(model, reference)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
