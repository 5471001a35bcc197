"""The thirty-eight diffusers DiTs of tests/_dits.py built from a checkpoint: each written by ``save_pretrained``,
built again with empty weights (accelerate's ``init_empty_weights``, as diffusers' own loader does), and enabled
with ``weights=`` the saved folder and every block list in the ring, half the blocks' bytes on disk. Outputs
bit-equal to the model that was saved, over three steps; after disable every parameter holds the saved values."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload
from fastoffload_ext.planning.tiers import STAGING_SLACK
from fastoffload_ext.storage import DiskOptions
from tests._dits import SPECS, DiT, build, inputs, run
from tests._models import OFFLOAD_DEVICES
from tests.test_dit_architectures import RUN_OUT_OF_RING_ORDER

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (scripts/setup_env.sh installs it)")
accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (scripts/setup_env.sh installs it)")


def _block_bytes(model: nn.Module) -> list[int]:
    lists = [child for child in model.children() if isinstance(child, nn.ModuleList)]
    return [sum(p.numel() * p.element_size() for p in block.parameters()) for one in lists for block in one]


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("spec", SPECS, ids=[spec.name for spec in SPECS])
def test_a_diffusers_dit_from_its_saved_folder_with_every_list_half_on_disk(spec: DiT, device: str,
                                                                            tmp_path: Path) -> None:
    reference = build(spec)
    reference.save_pretrained(tmp_path / "transformer")
    with accelerate.init_empty_weights():
        model = getattr(diffusers, spec.cls_name)(**spec.config).eval()
    sizes = sorted(size for size in _block_bytes(reference) if size)
    # About half the blocks beside one staging buffer; always less than every block (two blocks: both on disk).
    budget = min(sum(sizes[:len(sizes) // 2]) + sizes[-1] + STAGING_SLACK, sum(sizes) - 1)
    kwargs = inputs(spec, device)
    reference = reference.to(device)
    with torch.inference_mode():
        expected = run(reference, spec, kwargs)
        if device != "cpu" and not torch.equal(run(reference, spec, kwargs), expected):
            pytest.skip(f"{spec.name}: two forwards of the resident model differ on {device}")
    group = enable_layerwise_offload(model, device=device, weights=tmp_path / "transformer", block_lists="all",
                                     host_budget=budget, disk_options=DiskOptions(staging_buffers=1))
    assert group.engine is not None and any(state.on_disk for state in group.states)
    with torch.inference_mode():
        for step in range(3):
            assert torch.equal(run(model, spec, kwargs), expected), f"step {step}"
    # The prefetches and the disk tier's reads follow the order the forward ran the blocks in.
    assert group.stats()["run_order"] == ("rewired" if spec.name in RUN_OUT_OF_RING_ORDER else "ring")
    disable_layerwise_offload(model, device="cpu")
    saved = dict(reference.cpu().named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param.detach().cpu(), saved[name]), name
