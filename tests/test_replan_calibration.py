"""Calibration as it re-plans a live model: what it leaves applied, and the step it times on that layout.
The host as the device, both backends."""
from __future__ import annotations

import pytest
import torch

import fastoffload_ext as fo
from fastoffload_ext.planning import module_packed_bytes

from ._models import make_pair, params_equal

BACKENDS = ["ext", "python"]
N = 6


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_calibration_outside_no_grad_times_the_applied_layout_as_it_measured(backend: str) -> None:
    """The measurement runs the step under inference_mode; the step timed on the layout the re-plan applied
    ran in the caller's grad mode, where a model whose blocks require grad (nn.Module's default) raised
    after the new layout was applied, leaving the plan without its reference step."""
    model, reference = make_pair(N)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    block = module_packed_bytes(model.blocks[0])
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=4 * block)
    costs = group.calibrate(lambda: model(x), repeats=1)
    now = fo.get_offload_group(model)
    assert now.costs == costs and now.plan.calibrated and now.plan.measured_step_ms > 0
    assert now.stats()["plan"]["measured_step_ms"] == now.plan.measured_step_ms
    assert all(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        want = reference(x)
        assert all(torch.equal(model(x), want) for _ in range(2))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
