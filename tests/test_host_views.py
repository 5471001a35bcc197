"""Writes into ``cpu_named_parameters``, the seed's host copy of each offloaded parameter, against the resident model
bit for bit.

In the seed a write into those tensors is how a weight changes: the next copy to the device reads it. Here a block
may already sit on the device when the write lands (prefetched for the next step, or cached in its slot), so the
write must drop that copy; and where the tensors handed out are copies (a host copy stored compressed), the write
cannot reach the model and the block's next forward must say so instead of running with the old values.
"""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext.errors import OffloadStateError
from tests._models import OFFLOAD_DEVICES, make_pair, offload_hook, params_equal, place_outside_blocks

D = 128  # bf16 weights of a few hundred KiB: the codec compresses them

# (backend, prefetch_depth, compress): depth 2 keeps all three blocks cached in their slots between steps; "auto"
# keeps a raw and a compressed copy until it picks one, then drops the other.
CASES = [("ext", depth, compress) for depth in (1, 2) for compress in (False, "auto")] + \
        [("python", depth, False) for depth in (1, 2)]


def _offloaded(device: str, **options: object) -> tuple[nn.Module, nn.Module, torch.Tensor, fo.LayerwiseOffloadGroup]:
    model, reference = make_pair(3, torch.bfloat16, d=D)
    place_outside_blocks(model, device)
    reference.to(device)
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(device)
    group = fo.enable_layerwise_offload(model, device=device, **options)
    assert group is not None
    return model, reference, x, group


def _write(group: fo.LayerwiseOffloadGroup, reference: nn.Module, index: int, name: str) -> None:
    """Doubles parameter ``name`` of block ``index`` through cpu_named_parameters, and the reference's the same way."""
    with torch.no_grad():
        group.states[index].cpu_named_parameters[name].mul_(2)
        reference.blocks[index].get_parameter(name).mul_(2)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize(("backend", "depth", "compress"), CASES)
def test_a_write_into_the_host_copy_reaches_every_later_forward(device: str, backend: str, depth: int,
                                                                compress: object) -> None:
    model, reference, x, group = _offloaded(device, backend=backend, prefetch_depth=depth, compress=compress)
    if compress == "auto":
        group.engine.set_auto_threshold(0.0)  # picks compressed travel after its measured steps
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))  # every block has been on the device, block 0 is prefetched again
    _write(group, reference, 0, "up.weight")
    with torch.inference_mode():
        _write(group, reference, 1, "qkv.weight")  # a write made inside inference_mode() counts as well
    _write(group, reference, 2, "norms.1.bias")
    with torch.inference_mode():
        for _ in range(4):
            assert torch.equal(model(x), reference(x))
    if compress == "auto":
        modes = {group.engine.codec_info(state.handle)["mode"] for state in group.states}
        assert "measuring" not in modes, modes  # the written values went through the choice of travel
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
def test_a_write_into_a_compressed_blocks_copy_is_refused_and_changes_nothing(device: str) -> None:
    model, reference, x, group = _offloaded(device, compress=True)
    assert group.engine.codec_info(group.states[1].handle)["mode"] == "compressed"
    with torch.inference_mode():
        want = reference(x)
        assert torch.equal(model(x), want)
    host = group.states[1].cpu_named_parameters  # decoded copies: the host copy is stored compressed
    with torch.no_grad():
        host["up.weight"].mul_(2)
    with torch.inference_mode():
        for _ in range(2):  # refused while the edited copy is alive
            with pytest.raises(OffloadStateError, match=r"cpu_named_parameters entry 'up\.weight'.*was a copy"):
                model(x)
    del host  # already said: dropped, it is forgotten
    gc.collect()
    with torch.inference_mode():
        assert torch.equal(model(x), want)  # the old values, every one
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
def test_a_view_taken_before_compressed_travel_was_chosen_is_a_copy_after_it(device: str) -> None:
    model, reference, x, group = _offloaded(device, compress="auto")
    state = group.states[1]
    host = state.cpu_named_parameters  # views of the raw copy, which "auto" keeps while it measures
    with torch.inference_mode():
        want = reference(x)
        assert torch.equal(model(x), want)
    group.engine.choose_travel(state.handle, True)  # the raw copy is dropped: the views hold the old bytes alone
    with torch.no_grad():
        host["up.weight"].mul_(2)
    del host  # edited and dropped before anything said so: said once, by the next forward
    gc.collect()
    with torch.inference_mode():
        with pytest.raises(OffloadStateError, match=r"cpu_named_parameters entry 'up\.weight'.*then dropped"):
            model(x)
        assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_views_read_and_dropped_are_forgotten_by_the_next_forward() -> None:
    model, reference, x, group = _offloaded("cpu")
    for _ in range(3):
        assert torch.equal(group.states[1].cpu_named_parameters["up.weight"], reference.blocks[1].up.weight)
    records = offload_hook(model.blocks[1]).state_dict_hooks.copies
    assert len(records) == 3 * len(list(reference.blocks[1].parameters()))
    gc.collect()
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))
    assert records == []  # dropped and never written: nothing is left for the next forwards to check
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.cuda
@pytest.mark.parametrize("depth", [1, 3])
def test_graph_forward_replays_a_write_into_the_host_copy(depth: int) -> None:
    """Replays copy what the host copy holds at each replay; with every block cached in its own slot (depth 3, four
    blocks) the write drops the cached copy, and the next call captures or copies again, never replaying old bytes."""
    from fastoffload_ext.engine.graph_forward import graph_forward

    model, reference = make_pair(4, torch.bfloat16, d=256)
    reference.cuda()
    place_outside_blocks(model, "cuda")
    group = fo.enable_layerwise_offload(model, backend="ext", prefetch_depth=depth)
    graph_forward(model)
    x = torch.randn(2, 64, 256, device="cuda").bfloat16()
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        assert torch.equal(model(x), reference(x))  # replayed
        _write(group, reference, 2, "o.weight")
        assert torch.equal(model(x), reference(x))
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("depth", [1, 3])
def test_a_captured_graph_does_not_replay_over_a_write_into_the_host_copy(depth: int) -> None:
    """A replay runs no hook, so it applies a write into cpu_named_parameters itself, before it decides whether it
    can replay: with every block in a slot of its own (depth 3, four blocks) the graph copies nothing, and would read
    the old bytes from the slot. It refuses instead, saying to capture again (graph_forward does so by itself)."""
    from fastoffload_ext.engine.graphs import cyclic_slot_assignment

    from tests.test_graphs import _stand_in_graph

    model, reference, x, group = _offloaded("cpu", prefetch_depth=depth)
    group.engine.set_slot_assignment(*cyclic_slot_assignment(3, depth))
    with torch.no_grad():
        model(x)
    graph, replays = _stand_in_graph(model, group)
    with torch.no_grad():
        model(x)
    assert graph.replay() == "output" and replays == [1]
    _write(group, reference, 2, "o.weight")
    with pytest.raises(OffloadStateError, match="a write into cpu_named_parameters.*call recapture"):
        graph.replay()
    assert replays == [1]  # nothing replayed over the old bytes
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))  # eager, the written values
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
