"""The compiled core's per-step entry ``OffloadEngine.acquire_and_prefetch`` and the ext state's use of it:
the same effect as ``acquire`` then each ``prefetch``, bit-exact against the resident model, with every check
of ``acquire`` still made (a write to a placeholder or a slot, a parameter rebound behind the engine's back)
and the block given back when a prefetch fails."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext import _backend

from ._models import OFFLOAD_DEVICES, make_pair, params_equal, place_outside_blocks

_C = _backend.require_ext()

IN_PLACE = ("fastoffload: parameter '0.weight' of block 1 was changed in place while it was offloaded (its "
            "placeholder or device slot holds no lasting copy), so the change would be silently lost. Change a "
            "block's parameters inside mutate_params_scope(), which rebuilds the host copy, or disable offload first.")
REPLACED = ("fastoffload: parameter '0.weight' of block 1 was replaced while it was offloaded, so its new value would "
            "be silently overwritten. Change a block's parameters inside mutate_params_scope(), which rebuilds the "
            "host copy, or disable offload first.")


def _blocks(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).requires_grad_(False) for _ in range(n)]


def _engine_with(blocks: list[nn.Module], device: str = "cpu", num_slots: int = 2) -> tuple[_C.OffloadEngine, list[int]]:
    dev = torch.device(device) if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    engine = _C.OffloadEngine(dev, num_slots, _C.PinnedPool(-1 if dev.type == "cpu" else dev.index))
    handles = [engine.add_block([n for n, _ in b.named_parameters()], list(b.parameters())) for b in blocks]
    return engine, handles


def _run(blocks: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
def test_it_is_acquire_then_prefetch_bit_exact(device: str) -> None:
    blocks, reference = _blocks(3), _blocks(3)
    for block in reference:
        block.to(device)
    engine, handles = _engine_with(blocks, device)
    x = torch.randn(2, 8, device=device)
    with torch.no_grad():
        want = _run(reference, x)
        for _ in range(2):
            out = x
            for i, (block, handle) in enumerate(zip(blocks, handles)):
                engine.acquire_and_prefetch(handle, (handles[(i + 1) % 3],))
                out = block(out)
                engine.release(handle)
            assert torch.equal(out, want)
    stats = engine.stats()
    assert (stats["acquires"], stats["prefetches"]) == (6, 6)
    assert stats["prefetch_hits"] == 5 and stats["sync_loads"] == 1  # only the very first block loads itself
    for block, handle in zip(blocks, handles):
        engine.restore(handle, torch.device("cpu"))
    assert all(torch.equal(p, q.cpu()) for b, r in zip(blocks, reference) for p, q in zip(b.parameters(), r.parameters()))


@pytest.mark.parametrize("handle, targets", [(-1, ()), (3, ()), (0, (3,)), (0, (1, -2))])
def test_every_handle_is_bounds_checked(handle: int, targets: tuple[int, ...]) -> None:
    blocks = _blocks(3)
    engine, handles = _engine_with(blocks)
    bad = handle if not 0 <= handle < 3 else next(t for t in targets if not 0 <= t < 3)
    with pytest.raises(RuntimeError, match=rf"^fastoffload: block handle {bad} is out of range \(the engine holds 3 "
                                           r"blocks\); use a handle returned by add_block"):
        engine.acquire_and_prefetch(handle, targets)
    assert all(engine.slot_of(h) < 0 for h in handles)  # nothing was acquired or prefetched


def test_a_write_to_a_placeholder_is_still_detected_and_nothing_is_bound() -> None:
    blocks = _blocks(3)
    engine, handles = _engine_with(blocks)
    with torch.no_grad():
        blocks[1][0].weight.mul_(2)  # on the placeholder: no lasting copy
        with pytest.raises(RuntimeError) as raised:
            engine.acquire_and_prefetch(handles[1], (handles[2],))
    assert str(raised.value).split("\n")[0] == IN_PLACE
    assert blocks[1][0].weight.numel() == 0 and engine.slot_of(handles[1]) < 0 and engine.slot_of(handles[2]) < 0


def test_a_write_to_the_slot_during_the_run_is_detected_at_the_next_entry() -> None:
    blocks = _blocks(3)
    engine, handles = _engine_with(blocks)
    with torch.no_grad():
        engine.acquire_and_prefetch(handles[1], (handles[2],))
        blocks[1][0].weight.add_(1)  # on the slot: lost when the slot is reused
        engine.release(handles[1])
        with pytest.raises(RuntimeError) as raised:
            engine.acquire_and_prefetch(handles[1], ())
    assert str(raised.value).split("\n")[0] == IN_PLACE


def test_a_foreign_rebind_is_still_detected() -> None:
    blocks = _blocks(3)
    engine, handles = _engine_with(blocks)
    blocks[1][0].weight.data = torch.ones(8, 8)
    with pytest.raises(RuntimeError) as raised:
        engine.acquire_and_prefetch(handles[1], (handles[2],))
    assert str(raised.value).split("\n")[0] == REPLACED
    assert torch.equal(blocks[1][0].weight, torch.ones(8, 8))  # left as the caller set it
    assert engine.slot_of(handles[2]) < 0


def test_a_failing_prefetch_gives_the_block_back() -> None:
    blocks = _blocks(3)
    original = [p.clone() for p in blocks[0].parameters()]
    engine, handles = _engine_with(blocks)
    engine.restore(handles[2], torch.device("cpu"))
    with torch.no_grad(), pytest.raises(RuntimeError, match="^fastoffload: block 2 was detached from the offload engine"):
        engine.acquire_and_prefetch(handles[0], (handles[1], handles[2]))
    assert blocks[0][0].weight.numel() == 0 and engine.slot_state(engine.slot_of(handles[0])) != "in_use"
    with torch.no_grad():
        engine.acquire_and_prefetch(handles[0], ())  # released: it can run again
        assert all(torch.equal(p, q) for p, q in zip(blocks[0].parameters(), original))
        engine.release(handles[0])


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_ext_state_passes_its_prefetch_targets(depth: int) -> None:
    model, reference = make_pair(4)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", prefetch_depth=depth)
    assert group is not None
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    states = group.states
    handles = [state.handle for state in states]
    assert [state._target_handles for state in states] == [
        tuple(handles[(i + k) % 4] for k in range(1, depth + 1)) for i in range(4)]
    states[0].prefetch_targets = []  # rewired: read again at the next step
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert states[0]._target_handles == ()
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_targets_of_another_engine_take_the_general_path() -> None:
    model, reference = make_pair(2)
    other, other_reference = make_pair(2, seed=1)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    other_group = fo.enable_layerwise_offload(other, device="cpu", backend="ext")
    assert group is not None and other_group is not None
    group.states[1].prefetch_targets = [other_group.states[0]]
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        assert group.states[1]._target_handles is None
        assert other_group.engine.stats()["prefetches"] == 1  # block 1 prefetched the other model's block 0
        assert torch.equal(other(x), other_reference(x))
    fo.disable_layerwise_offload(model)
    fo.disable_layerwise_offload(other)
    assert params_equal(model, reference) and params_equal(other, other_reference)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["ext", "python"])
def test_on_the_device_parameters_stay_ordinary_and_an_inference_mode_write_is_caught(backend: str) -> None:
    model, reference = make_pair(3)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    place_outside_blocks(model, "cuda")
    reference.cuda()
    fo.enable_layerwise_offload(model, device="cuda", backend=backend)
    seen: list[bool] = []
    model.blocks[1].o.register_forward_pre_hook(lambda module, args: seen.append(module.weight.is_inference()))
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(2)).cuda()
    with torch.inference_mode():
        for _ in range(2):
            assert torch.equal(model(x), reference(x))
        assert seen == [False, False]
        model.blocks[1].o.weight.mul_(2)  # between steps, on the placeholder
        with pytest.raises(RuntimeError, match=r"^fastoffload: parameter 'o\.weight' of block 1 was changed in place "
                                               r"while it was offloaded"):
            model(x)
    with pytest.warns(RuntimeWarning, match=r"parameter 'o\.weight' of block 1 was changed while it was offloaded "
                                            r".* disabled with its value from before that change"):
        fo.disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference.cpu())
