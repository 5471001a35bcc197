"""Gradients through offloaded blocks whose own weights are frozen, against the resident model, bit for bit.

Training adapters outside the block list (here ``proj_in``) and guidance that differentiates with
respect to the latents both backpropagate through offloaded blocks. Autograd keeps the weights it saved
in the forward until backward; offload must keep those bytes alive although the parameters themselves
went back to placeholders and later blocks reused the device slots.
"""
from __future__ import annotations

import pytest
import torch

import fastoffload_ext as fo

from ._models import OFFLOAD_DEVICES, make_pair, params_equal, place_outside_blocks

BACKENDS = ["ext", "python"]


def _device(name: str) -> torch.device:
    return torch.device("cpu") if name == "cpu" else torch.device("cuda", torch.cuda.current_device())


def _frozen_pair(n_blocks: int, device: str):
    model, reference = make_pair(n_blocks)
    for m in (model, reference):
        m.blocks.requires_grad_(False)
    reference.to(_device(device))
    place_outside_blocks(model, device)
    return model, reference


def _grads(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    model.proj_in.weight.grad = None
    out = model(x)
    out.square().sum().backward()
    return out.detach(), x.grad, model.proj_in.weight.grad


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("n_blocks", [1, 2, 3, 5])
def test_input_and_adapter_gradients_are_exact(device: str, backend: str, depth: int, n_blocks: int) -> None:
    model, reference = _frozen_pair(n_blocks, device)
    fo.enable_layerwise_offload(model, device=device, backend=backend, prefetch_depth=depth)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3)).to(_device(device))
    want = _grads(reference, x)
    for _ in range(2):  # the second step starts from slots the first one left behind
        got = _grads(model, x)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_forwards_then_one_backward_is_exact(backend: str) -> None:
    # Classifier-free guidance shape: both forwards' saved tensors are alive when backward runs.
    model, reference = _frozen_pair(3, "cpu")
    fo.enable_layerwise_offload(model, device="cpu", backend=backend, prefetch_depth=1)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(4))

    def guided(m: torch.nn.Module) -> torch.Tensor:
        latents = x.clone().requires_grad_(True)
        (m(latents) - 0.5 * m(latents * 2)).sum().backward()
        return latents.grad

    assert torch.equal(guided(model), guided(reference))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_offloaded_parameters_that_require_grad_are_still_refused(backend: str) -> None:
    model, reference = make_pair(2)
    model.blocks[1].requires_grad_(False)  # block 0 still trains
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    x = torch.randn(2, 4, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"^fastoffload: .*its parameter '\S+' requires grad, and grad mode is on"):
        model(x)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
