"""A re-plan from the last calibration's table (``group.replan()`` without a table) after a
``mutate_params_scope`` grew a block: the table's sizes are the ones measured before the scope, while the
engine's slots follow the blocks as they are now. The host as the device, both backends."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext.planning import module_packed_bytes

from ._models import make_pair, offload_hook, params_equal

BACKENDS = ["ext", "python"]
N = 6


def _held(group, reference) -> int:
    """What the applied layout holds on the device: the resident blocks and every slot (ext), as they are now."""
    stats = group.stats()
    return stats["num_slots"] * stats["slot_bytes"] + sum(module_packed_bytes(reference.blocks[i])
                                                          for i in group.resident)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replan_from_the_last_calibration_counts_a_block_a_scope_grew(backend: str) -> None:
    model, reference = make_pair(N)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    block = module_packed_bytes(model.blocks[0])
    budget = 4 * block
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=budget)
    group.calibrate(lambda: model(x), repeats=1)
    group = fo.get_offload_group(model)
    grown = group.offloaded_indices[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the scope's own warning about the budget
        with offload_hook(model.blocks[grown]).mutate_params_scope():
            torch.manual_seed(2)
            model.blocks[grown].adapter = nn.Linear(16, 64)  # not called by the block's forward
    torch.manual_seed(2)
    reference.blocks[grown].adapter = nn.Linear(16, 64)
    size = module_packed_bytes(reference.blocks[grown])  # the grown block, as its slot must hold it
    assert size > block
    # Planned from the sizes measured before the scope, the layout kept its slots of one plain block and
    # reported a device footprint within the budget while the grown block's slots took more.
    fresh = group.replan()
    assert fresh.plan.device_bytes <= budget
    assert grown in fresh.resident or fresh.plan.slot_bytes == size
    with torch.inference_mode():
        want = reference(x)
        assert all(torch.equal(model(x), want) for _ in range(2))
    if backend == "ext":
        assert _held(fresh, reference) <= budget
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
