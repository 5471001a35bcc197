"""Edges of training through offloaded blocks, against the resident model, bit for bit: a block entry that fails
after its acquire, and what runs after it.

Every failure here is an exception; what is checked is that nothing stays behind it: a block whose entry raised holds
no device copy, no gate and no saved-tensor hooks, so the next step, in this thread or another, runs as on the
resident model.
"""
from __future__ import annotations

import threading

import pytest
import torch

import fastoffload_ext as fo

from ._models import params_equal
from .test_autograd import _frozen_pair, _grads

BACKENDS = ["ext", "python"]


def _in_thread(call):
    result: list = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as error:  # handed to the test's thread
            result.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_block_whose_saved_tensor_hooks_are_refused_is_released(backend: str) -> None:
    # Under disable_saved_tensors_hooks the guard's hooks are refused after the block was acquired: the block must be
    # released again, or it holds its device copy and the model's gate for good, and every forward from another
    # thread is refused from then on.
    model, reference = _frozen_pair(3, "cpu")
    fo.enable_layerwise_offload(model, device="cpu", backend=backend, prefetch_depth=1)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(11))
    with torch.autograd.graph.disable_saved_tensors_hooks("saved-tensor hooks are off here"):
        with pytest.raises(RuntimeError, match="saved-tensor hooks are off here"):
            model(x.clone().requires_grad_(True))
    assert all(p.numel() == 0 for p in model.blocks[0].parameters())
    want = _grads(reference, x)
    for got in (_in_thread(lambda: _grads(model, x)), _grads(model, x)):
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


def _func_grad(model: torch.nn.Module, x: torch.Tensor):
    return torch.func.grad(lambda t: model(t).square().sum())(x)


def _func_vjp(model: torch.nn.Module, x: torch.Tensor):
    out, pullback = torch.func.vjp(model, x)
    return pullback(torch.ones_like(out))


def _func_jvp(model: torch.nn.Module, x: torch.Tensor):
    return torch.func.jvp(model, (x,), (torch.ones_like(x),))


def _func_jvp_no_grad(model: torch.nn.Module, x: torch.Tensor):
    with torch.no_grad():  # forward mode runs without grad mode: the refusal must not depend on it
        return _func_jvp(model, x)


def _func_vmap_of_grad(model: torch.nn.Module, x: torch.Tensor):
    return torch.vmap(torch.func.grad(lambda t: model(t).square().sum()))(x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transform", [_func_grad, _func_vjp, _func_jvp, _func_jvp_no_grad, _func_vmap_of_grad],
                         ids=["grad", "vjp", "jvp", "jvp-no-grad", "vmap-of-grad"])
def test_torch_func_differentiation_through_offloaded_blocks_is_refused_clearly(backend: str, transform) -> None:
    # torch.func's grad and jvp levels wrap what a block's acquire binds to its parameters: the python backend left
    # each parameter holding a tensor of a transform level that had ended (the process crashed at its next use), the
    # compiled core raised "Cannot access storage of TensorWrapper". Refused before anything is bound, with what to
    # use instead; the parameters keep their values and the next step is the resident model's.
    model, reference = _frozen_pair(3, "cpu")
    fo.enable_layerwise_offload(model, device="cpu", backend=backend, prefetch_depth=1)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(12))
    transform(reference, x.clone())  # the resident model runs it
    with pytest.raises(fo.OffloadStateError, match=r"^fastoffload: torch\.func's .* torch\.autograd\.grad"):
        transform(model, x.clone())
    assert all(p.numel() == 0 for block in model.blocks for p in block.parameters())
    want = _grads(reference, x)
    for got in (_grads(model, x), _in_thread(lambda: _grads(model, x))):
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_through_offloaded_blocks_is_exact(backend: str) -> None:
    model, reference = _frozen_pair(3, "cpu")
    fo.enable_layerwise_offload(model, device="cpu", backend=backend, prefetch_depth=1)
    x = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(13))
    for _ in range(2):
        assert torch.equal(torch.vmap(model)(x), torch.vmap(reference)(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
