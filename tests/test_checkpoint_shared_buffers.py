"""A checkpoint build (`weights=`) against the resident model: a buffer that several modules hold stays one tensor."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model
from torch import nn

from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload


class _ScaledBlock(nn.Module):
    def __init__(self, d: int, scale: torch.Tensor) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.scale


class _SharedBuffer(nn.Module):
    """One persistent buffer held by the model, its input projection and every block, updated in place by
    each forward (a running statistic): the modules see one tensor, so each step sees the last update."""

    def __init__(self, d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((d,), 1.5))
        self.proj_in = nn.Linear(d, d)
        self.proj_in.register_buffer("scale", self.scale)
        self.blocks = nn.ModuleList(_ScaledBlock(d, self.scale) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x) * self.proj_in.scale
        for block in self.blocks:
            x = block(x)
        self.scale.mul_(1.25)
        return x


@pytest.mark.parametrize("resident", [None, [0, 1, 2, 3]])
def test_a_buffer_held_under_several_names_stays_one_tensor(tmp_path: Path, resident: list[int] | None) -> None:
    torch.manual_seed(0)
    reference = _SharedBuffer()
    path = tmp_path / "model.safetensors"
    save_model(reference, str(path))  # keeps one name of the shared buffer, as save_pretrained does
    with torch.device("meta"):
        model = _SharedBuffer()
    enable_layerwise_offload(model, device="cpu", weights=path, resident_blocks=resident)
    assert model.proj_in.scale is model.scale
    assert all(block.scale is model.scale for block in model.blocks)
    x = torch.randn(2, 64)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
    disable_layerwise_offload(model)
    assert torch.equal(model.scale, reference.scale)
