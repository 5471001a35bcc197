"""A re-plan whose new plan would read blocks from disk, on an offload that streams none: a re-plan applies its
layout from host memory, where those blocks do not fit, so it is refused (or, from a calibration, the layout is
kept) before the model is taken apart, and the group the caller holds stays the model's."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import fastoffload_ext as fo
from fastoffload_ext.errors import OffloadStateError
from fastoffload_ext.planning import BlockCosts, module_packed_bytes
from fastoffload_ext.planning import replan as replanning

from ._models import Block, make_pair, params_equal

N = 6
BLOCK_BYTES = module_packed_bytes(Block(16, 2))


def _reading_from_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's next plan puts other blocks resident and reads one offloaded block from disk."""
    plan = replanning.plan_offload

    def planned(*args: object, **kwargs: object) -> object:
        real = plan(*args, **kwargs)
        return dataclasses.replace(real, resident=(1, 3, 5), disk_blocks=1)

    monkeypatch.setattr(replanning, "plan_offload", planned)


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_a_replan_to_a_plan_that_reads_from_disk_is_refused_before_anything_changes(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference = make_pair(N)
    model.requires_grad_(False)
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=5 * BLOCK_BYTES)
    assert group.resident == (0, 1, 2) and group.disk_blocks() == 0
    _reading_from_disk(monkeypatch)
    with pytest.raises(OffloadStateError, match="reads 1 blocks from disk every step"):
        group.replan(BlockCosts([0.1] * N, [BLOCK_BYTES] * N, 1e-3))
    assert fo.get_offload_group(model) is group and group.resident == (0, 1, 2)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_a_calibration_whose_plan_reads_from_disk_keeps_the_layout(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    model, reference = make_pair(N)
    model.requires_grad_(False)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", device_budget=5 * BLOCK_BYTES)
    _reading_from_disk(monkeypatch)
    x = torch.randn(2, 5, 16)

    def step() -> None:
        with torch.no_grad():
            model(x)

    with caplog.at_level(logging.WARNING, logger="fastoffload_ext.planning.replan"):
        kept = group.calibrate(step, repeats=1)
    assert "keeping the layout enable applied" in caplog.text
    assert fo.get_offload_group(model) is group and kept is not None and group.resident == (0, 1, 2)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
