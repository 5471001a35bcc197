"""Thirty-eight diffusers DiT architectures at toy sizes (tests/_dits.py), offloaded with FastVideo's first list and
with every list, on both backends: outputs bit-equal to the same model resident over three steps, the
prefetches following the order the forward ran the blocks in, and every parameter back with its exact
values after disable. Under diffusers' gradient checkpointing, the inputs' gradients bit-equal too."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload
from tests._dits import SPECS, DiT, build, inputs, run
from tests._models import OFFLOAD_DEVICES, count_calls, params_equal

pytest.importorskip("diffusers", reason="diffusers is not installed (scripts/setup_env.sh installs it)")

BACKENDS = ["ext", "python"]
# Run their lists in an order that is not a rotation of the registered one: Lumina2 its context refiner before its
# noise refiner; Wan Animate and Latte interleave two lists (a face adapter after some blocks; temporal blocks).
RUN_OUT_OF_RING_ORDER = {"lumina2", "wan_animate", "latte"}


def _lists(model: nn.Module) -> dict[str, nn.ModuleList]:
    return {name: child for name, child in model.named_children() if isinstance(child, nn.ModuleList) and len(child)}


def _run_order(model: nn.Module, spec: DiT, kwargs: dict[str, Any], names: list[str]) -> list[str]:
    """The blocks of the lists ``names`` in the order one forward of ``model`` runs them (``list.i``)."""
    order: list[str] = []
    handles = [block.register_forward_pre_hook(lambda *_, key=f"{name}.{i}": order.append(key))
               for name in names for i, block in enumerate(getattr(model, name))]
    try:
        with torch.inference_mode():
            run(model, spec, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return order


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_lists", [None, "all"], ids=["first list", "all lists"])
@pytest.mark.parametrize("spec", SPECS, ids=[spec.name for spec in SPECS])
def test_a_diffusers_dit_offloaded_is_bit_exact_prefetches_in_run_order_and_comes_back(
        spec: DiT, block_lists: str | None, backend: str, device: str) -> None:
    model, reference = build(spec), build(spec).to(device)
    model.to(device)  # on a GPU the blocks start there too, as a pipeline's .to("cuda") leaves them
    original = {name: param.detach().clone() for name, param in model.named_parameters()}
    kwargs = inputs(spec, device)
    with torch.inference_mode():
        expected = run(reference, spec, kwargs)
        if device != "cpu" and not torch.equal(run(reference, spec, kwargs), expected):
            # HiDream's mixture of experts sums with scatter_reduce, whose CUDA kernel adds in any order: no offloader
            # can be bit-exact to a model that is not bit-exact to itself (its CPU cases above still are).
            pytest.skip(f"{spec.name}: two forwards of the resident model differ on {device}")
    registered = list(_lists(model))
    ringed = registered if block_lists == "all" else registered[:1]
    ran = _run_order(reference, spec, kwargs, ringed)
    # The spec says in which order the forward runs its block lists (HiDream's caption_projection, a list of
    # projections that "all" rings too, is not among them).
    ran_lists = list(dict.fromkeys(key.rpartition(".")[0] for key in ran))
    assert [name for name in ran_lists if name in spec.lists] == [name for name in spec.lists if name in ringed]

    group = enable_layerwise_offload(model, device=device, backend=backend, block_lists=block_lists)
    assert group.list_names == ringed
    ring = [f"{name}.{i}" for name in ringed for i in range(len(getattr(model, name)))]
    assert sorted(ran) == sorted(ring)  # every block of the ring runs once a step
    misses = []
    with torch.inference_mode():
        for step in range(3):
            assert torch.equal(run(model, spec, kwargs), expected), f"step {step}"
            if group.engine is not None:
                misses.append(group.stats()["sync_loads"])

    stats = group.stats()
    # Wan VACE and HiDream run the list registered last first: a rotation of the ring, which prefetches the same.
    rotation = any(ran == ring[k:] + ring[:k] for k in range(len(ring)))
    assert stats["run_order"] == ("ring" if rotation else "rewired")
    assert (spec.name in RUN_OUT_OF_RING_ORDER and block_lists == "all") == (stats["run_order"] == "rewired")
    # Each block prefetches the one that ran after it (the last one the first: the next step's).
    state_of = {ring[position]: state for position, state in zip(group.offloaded_indices, group.states)}
    for i, key in enumerate(ran):
        assert state_of[key].prefetch_targets == [state_of[ran[(i + 1) % len(ran)]]], key
    if misses:
        assert misses[2] == misses[1], "a step after the first loaded a block its predecessor had not prefetched"
        # No forward here keeps a view of a weight past its block: the slots keep their buffers (and addresses).
        assert stats["slots_replaced"] == 0

    disable_layerwise_offload(model)
    for name, param in model.named_parameters():
        assert param.device.type == torch.device(device).type and torch.equal(param, original[name].to(device)), name
    with torch.inference_mode():
        assert torch.equal(run(model, spec, kwargs), expected)


def _latents(kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``kwargs`` with each floating input of two or more dimensions (the latents, the text states; Z-Image's come
    in lists) made a leaf that requires grad, what guidance or a training step differentiates; and those leaves."""
    leaves: list[torch.Tensor] = []

    def leaf(value: Any) -> Any:
        if isinstance(value, list):
            return [leaf(item) for item in value]
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2:
            leaves.append(value.detach().clone().requires_grad_(True))
            return leaves[-1]
        return value

    return {key: leaf(value) for key, value in kwargs.items()}, leaves


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", SPECS, ids=[spec.name for spec in SPECS])
def test_a_diffusers_dit_under_gradient_checkpointing_gives_the_resident_models_gradients(
        spec: DiT, backend: str, device: str) -> None:
    # Every list offloaded, every weight frozen, diffusers' enable_gradient_checkpointing on both models: the
    # blocks run again in backward as often as on the resident model, and the inputs' gradients are bit-equal.
    model, reference = build(spec).to(device), build(spec).to(device)
    if not getattr(model, "_supports_gradient_checkpointing", False):
        pytest.skip(f"{spec.name}: diffusers does not checkpoint this model")
    for m in (model, reference):
        m.requires_grad_(False)
        m.enable_gradient_checkpointing()
    kwargs = inputs(spec, device)
    names = list(_lists(model))
    calls, reference_calls = (count_calls(block for name in names for block in getattr(m, name))
                              for m in (model, reference))
    enable_layerwise_offload(model, device=device, backend=backend, block_lists="all")
    for step in range(2):
        grads = []
        for m in (reference, model):
            call, leaves = _latents(kwargs)
            try:
                run(m, spec, call).float().square().mean().backward()
            except TypeError as error:
                if m is not reference:
                    raise
                # HunyuanImage 2.1 passes keyword arguments to diffusers' own checkpoint function, which takes none.
                pytest.skip(f"{spec.name}: diffusers' gradient checkpointing fails on the resident model: {error}")
            grads.append([leaf.grad for leaf in leaves])
        assert any(grad is not None for grad in grads[0]), f"step {step}: no input got a gradient"
        for i, (got, want) in enumerate(zip(grads[1], grads[0])):
            same = (got is None) == (want is None) and (want is None or torch.equal(got, want))
            assert same, f"step {step}: input {i}"
        assert calls == reference_calls, f"step {step}"
    assert max(calls) > 2, "the checkpoint ran no block again in backward"
    disable_layerwise_offload(model)
    assert params_equal(model, reference)
