"""Thirty-eight diffusers DiT architectures at toy sizes (tests/_dits.py), offloaded with FastVideo's first list and
with every list, on both backends: outputs bit-equal to the same model resident over three steps, the
prefetches following the order the forward ran the blocks in, and every parameter back with its exact
values after disable."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload
from tests._dits import SPECS, DiT, build, inputs, run
from tests._models import OFFLOAD_DEVICES

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

    disable_layerwise_offload(model)
    for name, param in model.named_parameters():
        assert param.device.type == torch.device(device).type and torch.equal(param, original[name].to(device)), name
    with torch.inference_mode():
        assert torch.equal(run(model, spec, kwargs), expected)
