"""A ``load_state_dict()`` made while an offloaded block runs (from a hook inside its forward), on both backends.

The running block's parameters are views of its device copy, which its release drops: a load into them cannot
reach the host copy before the forward goes on. The load is refused before any module has loaded anything, the
same way on both backends, and the model keeps its values.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fastoffload_ext as fo

from ._models import make_pair, params_equal

BACKENDS = ["ext", "python"]


def _x() -> torch.Tensor:
    return torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["model", "block", "submodule"])
def test_a_load_into_a_running_block_is_refused_and_changes_nothing(backend: str, where: str) -> None:
    model, reference = make_pair(3)
    other, _ = make_pair(3, seed=9)
    for m in (model, reference, other):
        m.requires_grad_(False)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    target = {"model": model, "block": model.blocks[1], "submodule": model.blocks[1].o}[where]
    values = {"model": other, "block": other.blocks[1], "submodule": other.blocks[1].o}[where].state_dict()
    errors: list[BaseException] = []

    def load(module: nn.Module, args: object, output: object) -> None:
        if not errors:
            try:
                target.load_state_dict(values)
            except RuntimeError as error:
                errors.append(error)
                raise

    handle = model.blocks[1].qkv.register_forward_hook(load)
    with torch.no_grad(), pytest.raises(RuntimeError, match="load_state_dict.. is refused on block 1: it is running"):
        model(_x())
    handle.remove()
    assert len(errors) == 1
    # Nothing was loaded: not the modules ahead of block 1 (the input projection, block 0), not block 1.
    got, want = model.state_dict(), reference.state_dict()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(_x()), reference(_x()))
    # Between forwards the same load works.
    target.load_state_dict(values)
    {"model": reference, "block": reference.blocks[1], "submodule": reference.blocks[1].o}[where].load_state_dict(values)
    with torch.no_grad():
        assert torch.equal(model(_x()), reference(_x()))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
