"""Gradients through offloaded blocks whose own weights are frozen, against the resident model, bit for bit.

Training adapters outside the block list (here ``proj_in``) and guidance that differentiates with
respect to the latents both backpropagate through offloaded blocks. Autograd keeps the weights it saved
in the forward until backward; offload must keep those bytes alive although the parameters themselves
went back to placeholders and later blocks reused the device slots. Under the caller's own saved-tensor
hooks (activation checkpointing, ``save_on_cpu``) those hooks get what they get from the resident model:
the checkpointed blocks run again in backward, and nothing else is kept.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fastoffload_ext as fo

from ._models import OFFLOAD_DEVICES, count_calls, make_pair, params_equal, place_outside_blocks

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


class _Checkpointed(torch.nn.Module):
    """The model with each block under ``torch.utils.checkpoint`` (diffusers' ``enable_gradient_checkpointing``)."""

    def __init__(self, inner: torch.nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.proj_in, self.blocks, self.proj_out = inner.proj_in, inner.blocks, inner.proj_out
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.proj_out(x)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_checkpointed_blocks_run_again_in_backward_with_exact_gradients(device: str, backend: str, reentrant: bool,
                                                                        depth: int) -> None:
    # Had the offload's own saved-tensor hooks taken the blocks' tensors from the checkpoint's, the checkpoint
    # would keep every activation (and, on the ext backend, every block's private weight copy) and never
    # recompute: the call count is what says the checkpoint got them.
    inner, inner_reference = _frozen_pair(4, device)
    model, reference = _Checkpointed(inner, reentrant), _Checkpointed(inner_reference, reentrant)
    fo.enable_layerwise_offload(model, device=device, backend=backend, prefetch_depth=depth)
    calls, reference_calls = count_calls(model.blocks), count_calls(reference.blocks)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(6)).to(_device(device))
    for step in range(1, 3):
        want = _grads(reference, x)
        got = _grads(model, x)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        assert calls == reference_calls == [2 * step] * 4  # a forward and a recompute per step
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


class _Recorder:
    """Saved-tensor hooks of the caller's own: each saved tensor's shape and dtype, in the order saved."""

    def __init__(self) -> None:
        self.packed: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.unpacked = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            self.packed.append((tuple(tensor.shape), tensor.dtype))
            return tensor.clone()  # what the resident model would lose if the hooks were bypassed

        def unpack(tensor: torch.Tensor) -> torch.Tensor:
            self.unpacked += 1
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("outer", ["recorder", "save_on_cpu"])
def test_the_callers_saved_tensor_hooks_see_what_they_see_on_the_resident_model(device: str, backend: str,
                                                                                 outer: str) -> None:
    model, reference = _frozen_pair(3, device)
    fo.enable_layerwise_offload(model, device=device, backend=backend, prefetch_depth=1)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(7)).to(_device(device))
    for _ in range(2):
        recorders = [_Recorder(), _Recorder()]
        results = []
        for m, recorder in zip((reference, model), recorders):
            hooks = recorder.hooks() if outer == "recorder" else \
                torch.autograd.graph.save_on_cpu(pin_memory=device == "cuda")
            with hooks:
                results.append(_grads(m, x))
        for g, w in zip(results[1], results[0]):
            assert torch.equal(g, w)
        if outer == "recorder":
            assert recorders[1].packed == recorders[0].packed and len(recorders[0].packed) > 0
            assert recorders[1].unpacked == recorders[0].unpacked > 0
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpointed_forward_holds_no_more_device_memory_than_the_resident_one(backend: str) -> None:
    # Until backward the checkpoint keeps only each block's input; the offload must not keep weight copies or
    # activations beside them.
    inner, inner_reference = _frozen_pair(6, "cuda")
    model, reference = _Checkpointed(inner, False), _Checkpointed(inner_reference, False)
    fo.enable_layerwise_offload(model, device="cuda", backend=backend, prefetch_depth=1)
    x = torch.randn(64, 32, 16, generator=torch.Generator().manual_seed(9)).cuda()

    def held_after_forward(m: torch.nn.Module) -> int:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = m(x.detach().clone().requires_grad_(True))
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        out.square().sum().backward()
        return held

    for m in (model, reference):
        held_after_forward(m)  # the first step allocates the slots
    assert held_after_forward(model) <= held_after_forward(reference)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("depth", [1, 2])
def test_a_training_step_copies_each_block_once_a_direction_and_loads_none_on_demand(depth: int,
                                                                                     reentrant: bool) -> None:
    # Backward runs the checkpointed blocks again, last first: each copies the one before it ahead. Once a backward
    # pass has run, a training forward copies nothing for the next step: the blocks it leaves in the slots are the
    # ones backward runs first, and those backward leaves are the next forward's first. So a step copies 2 x
    # (blocks - slots). Prefetching in the forward's order there loaded every block on demand in backward and
    # copied some twice. A reentrant checkpoint runs the forward under no_grad; it is a training step's because a
    # backward pass ran the blocks since they last ran forward, also under no_grad. Inference forwards afterwards
    # wrap around: after reentrant training from the second on, after grad-mode forwards from the first.
    inner, inner_reference = _frozen_pair(6, "cpu")
    model, reference = _Checkpointed(inner, reentrant), _Checkpointed(inner_reference, reentrant)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", prefetch_depth=depth)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(10))
    slots = depth + 1
    for step in range(4):
        latents = x.clone().requires_grad_(True)
        before = group.stats()
        out = model(latents)
        middle = group.stats()
        out.square().sum().backward()
        after = group.stats()
        if step == 0:  # the first forward wrapped around: backward loads the block that evicted on demand
            assert after["copies"] - middle["copies"] == 6 and after["sync_loads"] - middle["sync_loads"] <= 1
        else:
            assert after["copies"] - before["copies"] == 2 * (6 - slots)
            assert after["sync_loads"] - before["sync_loads"] == 0
        want = x.clone().requires_grad_(True)
        reference(want).square().sum().backward()
        assert torch.equal(latents.grad, want.grad)
    with torch.no_grad():
        loads = []
        for _ in range(3):
            before = group.stats()
            assert torch.equal(model(x), reference(x))
            loads.append(group.stats()["sync_loads"] - before["sync_loads"])
        # After reentrant training the first, taken for a training step's, left the last blocks in the slots.
        assert loads == ([0, 1, 0] if reentrant else [0, 0, 0])
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
