"""The compiled core directly: packing, slot rotation, rebinding, errors.

On the CPU the engine runs with the host as its "device" (copies are memcpy, events no-ops), so these
tests exercise the real packing, slot assignment and rebinding code that runs on a GPU.
"""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from fastoffload_ext import _backend

from ._models import OFFLOAD_DEVICES

_C = _backend.require_ext()



def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t``'s elements in logical order (bit-exact comparison for any dtype)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and torch.equal(bits(a), bits(b)))


def _engine(device: str, num_slots: int, **pool_kwargs) -> _C.OffloadEngine:
    dev = torch.device(device) if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    index = -1 if dev.type == "cpu" else dev.index
    return _C.OffloadEngine(dev, num_slots, _C.PinnedPool(index, **pool_kwargs))


def _dtype_cases() -> list[torch.dtype]:
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int32,
              torch.int64, torch.bool, torch.complex64]
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            dtypes.append(getattr(torch, name))
    return dtypes


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod().item()) * torch.empty(0, dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def _layouts(dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One tensor per stride pattern the store must preserve."""
    base = _random((6, 10), dtype, gen)
    conv = _random((2, 3, 4, 5), dtype, gen).contiguous(memory_format=torch.channels_last)
    return {
        "contiguous": _random((5, 7), dtype, gen),
        "transposed": base.t(),
        "channels_last": conv,
        "gapped": base[:, ::3],
        "offset_view": base[2:4],
        "expanded": _random((1, 4), dtype, gen).expand(3, 4),
        "zero_size": _random((0, 3), dtype, gen),
        "scalar": _random((), dtype, gen),
        "vector": _random((33,), dtype, gen),
    }


class _Holder(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("dtype", _dtype_cases(), ids=str)
def test_round_trip_every_dtype_and_layout(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    originals = {name: t.clone() if t.is_contiguous() else t for name, t in _layouts(dtype, gen).items()}
    expected = {name: (t.dtype, tuple(t.shape), t.stride(), bits(t).clone()) for name, t in originals.items()}
    module = _Holder(originals)
    engine = _engine(device, 2)
    names, params = zip(*module.named_parameters())
    handle = engine.add_block(list(names), list(params))
    target = torch.device(device) if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    for name, param in module.named_parameters():
        # Placeholders: empty, same rank and dtype, on the offload device.
        assert param.numel() == 0 and param.dim() == max(len(expected[name][1]), 1)
        assert param.dtype == dtype and param.device == target
    for _ in range(2):
        engine.acquire(handle)
        for name, param in module.named_parameters():
            dt, shape, stride, raw = expected[name]
            assert param.device == target and param.dtype == dt and tuple(param.shape) == shape
            assert param.stride() == stride, name
            assert torch.equal(bits(param), raw), name
        assert module.channels_last.is_contiguous(memory_format=torch.channels_last)
        engine.release(handle)
    engine.restore(handle, torch.device("cpu"))
    for name, param in module.named_parameters():
        dt, shape, stride, raw = expected[name]
        assert param.device.type == "cpu" and tuple(param.shape) == shape and param.stride() == stride
        assert torch.equal(bits(param), raw), name
    assert engine.pool.stats()["in_use_bytes"] == 0


def _distinct_blocks(n: int, width: int = 40) -> list[nn.Module]:
    blocks = []
    for i in range(n):
        block = nn.Sequential(nn.Linear(width, width + i), nn.LayerNorm(width + i))
        with torch.no_grad():
            for p in block.parameters():
                p.fill_(float(i + 1))
                p.add_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * 1e-3)
        block.requires_grad_(False)
        blocks.append(block)
    return blocks


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("n_blocks", [1, 2, 3, 5, 7])
def test_slot_rotation_with_wraparound(device: str, n_blocks: int, depth: int) -> None:
    blocks = _distinct_blocks(n_blocks)
    expected = [[p.detach().clone() for p in b.parameters()] for b in blocks]
    engine = _engine(device, depth + 1)
    handles = [engine.add_block([n for n, _ in b.named_parameters()], list(b.parameters())) for b in blocks]
    steps = 4
    addresses = None
    for _ in range(steps):
        for i, handle in enumerate(handles):
            engine.acquire(handle)
            if addresses is None:  # slots are allocated on first use
                addresses = {engine.slot_address(s) for s in range(engine.num_slots)}
            for step in range(1, depth + 1):
                engine.prefetch(handles[(i + step) % n_blocks])
            # Never another block's weights, whatever the block count and depth.
            for p, want in zip(blocks[i].parameters(), expected[i]):
                assert torch.equal(p.cpu(), want)
            in_use = [s for s in range(engine.num_slots) if engine.slot_state(s) == "in_use"]
            assert [engine.slot_block(s) for s in in_use] == [handle]
            engine.release(handle)
            assert all(p.numel() == 0 for p in blocks[i].parameters())
    if device == "cuda":
        torch.cuda.synchronize()
    stats = engine.stats()
    assert stats["sync_loads"] == 1  # only the very first block of the very first step
    if n_blocks <= depth + 1:
        # Everything fits in the slots: each block is copied once and then stays.
        assert stats["copies"] == n_blocks
    else:
        # One copy per block per step, plus the wrap-around prefetches left in flight after the last.
        assert stats["copies"] == steps * n_blocks + depth
        assert stats["prefetch_hits"] == steps * n_blocks - 1
    # Slots are static: the same device addresses for the engine's whole life.
    assert {engine.slot_address(s) for s in range(engine.num_slots)} == addresses


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
def test_skipped_and_repeated_blocks(device: str) -> None:
    blocks = _distinct_blocks(4)
    expected = [[p.detach().clone() for p in b.parameters()] for b in blocks]
    engine = _engine(device, 2)
    handles = [engine.add_block([n for n, _ in b.named_parameters()], list(b.parameters())) for b in blocks]

    def run(i: int, prefetch: int | None) -> None:
        engine.acquire(handles[i])
        if prefetch is not None:
            engine.prefetch(handles[prefetch])
        for p, want in zip(blocks[i].parameters(), expected[i]):
            assert torch.equal(p.cpu(), want)
        engine.release(handles[i])

    run(0, 1)
    run(2, 3)  # block 1 was prefetched and is skipped
    run(2, 3)  # block 2 runs twice in a row
    run(3, 0)
    run(1, 2)  # the skipped block, late
    run(1, None)
    for s in range(engine.num_slots):
        assert engine.slot_state(s) != "in_use"


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
def test_nested_acquire_is_refcounted(device: str) -> None:
    (block,) = _distinct_blocks(1)
    engine = _engine(device, 2)
    handle = engine.add_block([n for n, _ in block.named_parameters()], list(block.parameters()))
    engine.acquire(handle)
    engine.acquire(handle)
    assert engine.release(handle) and block[0].weight.numel() > 0
    assert engine.release(handle) and block[0].weight.numel() == 0
    assert engine.release(handle) is False  # releasing a block that is not loaded is a no-op


def test_error_messages() -> None:
    blocks = _distinct_blocks(3)
    engine = _engine("cpu", 1)
    handles = [engine.add_block([n for n, _ in b.named_parameters()], list(b.parameters())) for b in blocks]
    with pytest.raises(RuntimeError, match=r"block handle 9 is out of range \(the engine holds 3 blocks\)"):
        engine.acquire(9)
    engine.acquire(handles[0])
    with pytest.raises(RuntimeError, match=r"cannot load block 1: all 1 slots hold running blocks \( 0 \)"):
        engine.acquire(handles[1])
    assert engine.prefetch(handles[1]) is False and engine.stats()["skipped_prefetches"] == 1
    with pytest.raises(RuntimeError, match="enter mutate_params_scope\\(\\) between forwards"):
        engine.materialize(handles[0])
    engine.release(handles[0])
    # A parameter rebound behind the engine's back would be silently overwritten: refused.
    blocks[1][0].weight.data = torch.ones(40, 40)
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' of block 1 was replaced while it was offloaded"):
        engine.acquire(handles[1])
    with pytest.raises(RuntimeError, match="the offload device must be 'cuda', 'cuda:N' or 'cpu', got 'meta'"):
        _C.OffloadEngine(torch.device("meta"), 2, _C.PinnedPool(-1))
    with pytest.raises(RuntimeError, match="a slot ring needs at least one slot, got 0"):
        _C.OffloadEngine(torch.device("cpu"), 0, _C.PinnedPool(-1))
    engine.restore(handles[2], torch.device("cpu"))
    with pytest.raises(RuntimeError, match="block 2 was detached from the offload engine"):
        engine.acquire(handles[2])


def test_grad_recording_forward_is_refused() -> None:
    block = nn.Linear(4, 4)
    engine = _engine("cpu", 2)
    handle = engine.add_block(["weight", "bias"], [block.weight, block.bias])
    with pytest.raises(RuntimeError, match="parameter 'weight' requires grad, and grad mode is on"):
        engine.acquire(handle)
    with torch.no_grad():
        engine.acquire(handle)
    engine.release(handle)
    with torch.inference_mode():
        engine.acquire(handle)
    engine.release(handle)


def test_unpackable_tensors_are_refused_by_name() -> None:
    engine = _engine("cpu", 2)
    meta = nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(RuntimeError, match="parameter 'w' is on the meta device"):
        engine.add_block(["w"], [meta])
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(RuntimeError, match="parameter 's' has layout Sparse"):
        engine.add_block(["s"], [sparse])


def test_views_keep_memory_alive_after_the_engine_is_gone() -> None:
    (block,) = _distinct_blocks(1)
    want = block[0].weight.detach().clone()
    engine = _engine("cpu", 2)
    handle = engine.add_block([n for n, _ in block.named_parameters()], list(block.parameters()))
    view = engine.host_view(handle, 0)
    engine.acquire(handle)
    live = block[0].weight
    del engine
    gc.collect()
    assert torch.equal(view, want)
    assert torch.equal(live, want)  # the parameter still points into the slot, which it keeps alive


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
def test_repack_after_replacing_parameters_grows_slots(device: str) -> None:
    blocks = _distinct_blocks(3, width=8)
    engine = _engine(device, 2)
    handles = [engine.add_block([n for n, _ in b.named_parameters()], list(b.parameters())) for b in blocks]
    engine.acquire(handles[0])
    engine.release(handles[0])
    small_slot = engine.slot_bytes
    engine.materialize(handles[1])
    with torch.no_grad():
        blocks[1][0].weight.mul_(2)
        blocks[1].append(nn.Linear(64, 64).requires_grad_(False).to(blocks[1][0].weight.device))
    want = [p.detach().clone().cpu() for p in blocks[1].parameters()]
    engine.repack(handles[1], [n for n, _ in blocks[1].named_parameters()], list(blocks[1].parameters()))
    assert all(p.numel() == 0 for p in blocks[1].parameters())
    for _ in range(2):
        for i, handle in enumerate(handles):
            engine.acquire(handle)
            engine.prefetch(handles[(i + 1) % 3])
            if i == 1:
                assert all(torch.equal(p.cpu(), w) for p, w in zip(blocks[1].parameters(), want))
            engine.release(handle)
    assert engine.slot_bytes > small_slot
