"""The compiled core's Python surface: its stub file matches it, every index from Python is
bounds-checked with a message, C++ warnings arrive as Python warnings, and the texts the Python layer
shares with C++ are the same."""
from __future__ import annotations

import ast
import inspect
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext import _backend
from fastoffload_ext.engine import messages
from fastoffload_ext.engine.state import BlockOffloadState

from ._models import make_pair, place_outside_blocks

_C = _backend.require_ext()
STUB = Path(fo.__file__).with_name("_C.pyi")


def _stub_names() -> dict[str, set[str]]:
    """Top-level names of the stub, and for each class the names it declares."""
    tree = ast.parse(STUB.read_text())
    names: dict[str, set[str]] = {"": set()}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[""].add(node.name)
            names[node.name] = {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
        elif isinstance(node, ast.FunctionDef):
            names[""].add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[""].add(node.target.id)
    return names


def _public(obj: object) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


def test_stub_declares_exactly_what_is_bound() -> None:
    stub = _stub_names()
    assert stub[""] == _public(_C)
    for cls in (_C.PinnedPool, _C.OffloadEngine):
        assert stub[cls.__name__] - {"__init__"} == _public(cls), cls.__name__


def test_segment_prefix_comes_from_the_core() -> None:
    assert _C.SEGMENT_PREFIX == "fastoffload-"


def _engine_with_one_block() -> tuple[object, nn.Linear]:
    engine = _C.OffloadEngine(torch.device("cpu"), 2, _C.PinnedPool(-1))
    block = nn.Linear(3, 2).requires_grad_(False)
    engine.add_block([n for n, _ in block.named_parameters()], list(block.parameters()))
    return engine, block


@pytest.mark.parametrize("call", ["slot_block", "slot_state", "slot_address"])
@pytest.mark.parametrize("slot", [-1, 2, 1 << 40])
def test_slot_indices_are_bounds_checked(call: str, slot: int) -> None:
    engine, _ = _engine_with_one_block()
    with pytest.raises(RuntimeError, match=rf"^fastoffload: slot {slot} is out of range \(2 slots\); slots are "
                                           r"numbered from 0"):
        getattr(engine, call)(slot)


@pytest.mark.parametrize("call", ["slot_of", "block_bytes", "is_shared", "is_removed", "is_materialized", "acquire",
                                  "prefetch", "release", "materialize"])
@pytest.mark.parametrize("handle", [-1, 1, 1 << 40])
def test_block_handles_are_bounds_checked(call: str, handle: int) -> None:
    engine, block = _engine_with_one_block()
    before = [engine.host_view(0, j).clone() for j in range(2)]
    with pytest.raises(RuntimeError, match=rf"^fastoffload: block handle {handle} is out of range \(the engine holds "
                                           r"1 blocks\); use a handle returned by add_block"):
        getattr(engine, call)(handle)
    engine.restore(0, torch.device("cpu"))
    assert all(torch.equal(p, want) for p, want in zip(block.parameters(), before))


def test_host_view_index_is_bounds_checked() -> None:
    engine, block = _engine_with_one_block()
    bias = engine.host_view(0, 1).clone()
    with pytest.raises(RuntimeError, match=r"^fastoffload: a parameter index must be >= 0, got -1"):
        engine.host_view(0, -1)
    with pytest.raises(RuntimeError, match=r"fastoffload: block 0 has no tensor 2"):
        engine.host_view(0, 2)
    with pytest.raises(RuntimeError, match=r"^fastoffload: block handle 3 is out of range"):
        engine.host_view(3, 0)
    with pytest.raises(RuntimeError, match=r"^fastoffload: block handle -2 is out of range"):
        engine.restore(-2, torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"^fastoffload: block handle 5 is out of range"):
        engine.repack(5, [], [])
    engine.restore(0, torch.device("cpu"))
    assert torch.equal(block.bias, bias)


def test_grad_error_text_matches_the_core() -> None:
    """The python backend's grad error and the compiled core's carry the same advice."""
    engine = _C.OffloadEngine(torch.device("cpu"), 1, _C.PinnedPool(-1))
    block = nn.Linear(2, 2)
    handle = engine.add_block([n for n, _ in block.named_parameters()], list(block.parameters()))
    with pytest.raises(RuntimeError) as raised:
        engine.acquire(handle)
    want = messages.GRAD_ERROR.format(where=f"block {handle}", name="weight")
    assert str(raised.value).split("\n")[0] == want


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_both_states_implement_the_protocol(backend: str) -> None:
    model, _ = make_pair(2)
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    assert group is not None
    for state in group.states:
        assert isinstance(state, BlockOffloadState)
    for name in ("acquire", "prefetch", "release", "begin_mutation", "end_mutation", "restore", "host_bytes",
                 "weight_bytes", "on_init", "wait_and_replace_params", "prefetch_params", "release_gpu_params"):
        assert inspect.ismethod(getattr(group.states[0], name)), name
    fo.disable_layerwise_offload(model)


@pytest.mark.cuda
def test_pin_fallback_warning_reaches_python_through_enable() -> None:
    model, reference = make_pair(2)
    model.requires_grad_(False)
    place_outside_blocks(model, "cuda")
    reference.cuda()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        group = fo.enable_layerwise_offload(model, device="cuda", backend="ext", pinned_limit_bytes=1,
                                            allow_pageable_fallback=True)
    assert group is not None
    assert any("falling back to pageable memory" in str(w.message) for w in caught), [str(w.message) for w in caught]
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(x.cuda()), reference(x.cuda()))
    fo.disable_layerwise_offload(model, device="cpu")
