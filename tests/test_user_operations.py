"""User-facing operations on an offloaded model and their combinations, on both backends.

Nested mutation scopes, loads and forwards inside a scope, re-entrant blocks, ...: each either gives
exactly what the resident model gives, or raises a message that says what to do, with every value
intact afterwards.
"""
from __future__ import annotations

import sys

import pytest
import torch

import fastoffload_ext as fo

from ._models import OFFLOAD_DEVICES, make_pair, offload_hook, params_equal, place_outside_blocks

BACKENDS = ["ext", "python"]


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(seed))


def _frozen_pair(n_blocks: int = 3, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    model, reference = make_pair(n_blocks, seed=seed)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    return model, reference


# ---- mutate_params_scope ------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("edit_first", [False, True])
def test_nested_mutate_scopes_on_one_block_keep_every_value(backend: str, edit_first: bool) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    hook = offload_hook(model.blocks[1])
    with torch.no_grad():
        with hook.mutate_params_scope():
            if edit_first:
                for m in (model, reference):
                    m.blocks[1].o.weight.mul_(2)
            with hook.mutate_params_scope():
                for m in (model, reference):
                    m.blocks[1].o.bias.add_(1)
            # Still inside the outer scope: the weights are still real.
            assert torch.equal(model.blocks[1].o.weight, reference.blocks[1].o.weight)
            model.blocks[1].up.weight.add_(3)
            reference.blocks[1].up.weight.add_(3)
        for _ in range(2):
            assert torch.equal(model(_x()), reference(_x()))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_state_dict_inside_a_mutate_scope_keeps_the_loaded_values(backend: str) -> None:
    model, _ = _frozen_pair()
    other, _ = _frozen_pair(seed=5)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    hook = offload_hook(model.blocks[1])
    with torch.no_grad():
        with hook.mutate_params_scope():
            model.blocks[1].o.weight.mul_(2)
            model.load_state_dict(other.state_dict())
            assert torch.equal(model.blocks[1].o.weight, other.blocks[1].o.weight)
        for _ in range(2):
            assert torch.equal(model(_x()), other(_x()))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, other)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("edit", [False, True])
def test_a_forward_inside_a_mutate_scope_keeps_every_value(backend: str, edit: bool) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    hook = offload_hook(model.blocks[1])
    with torch.no_grad():
        with hook.mutate_params_scope():
            if edit:
                for m in (model, reference):
                    m.blocks[1].o.weight.mul_(2)
            assert torch.equal(model(_x()), reference(_x()))  # e.g. checking a merged LoRA before leaving
            assert torch.equal(model.blocks[1].o.weight, reference.blocks[1].o.weight)
        for _ in range(2):
            assert torch.equal(model(_x()), reference(_x()))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fault", [KeyboardInterrupt, RuntimeError])
def test_a_load_that_raises_part_way_leaves_no_block_inside_a_scope(backend: str, fault: type[BaseException]) -> None:
    from fastoffload_ext.planning import BlockCosts, module_packed_bytes

    model, reference = _frozen_pair(4)
    other, _ = _frozen_pair(4, seed=5)
    block = module_packed_bytes(model.blocks[0])
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=5 * block // 2)
    assert group.resident == ()

    def interrupt(*args: object) -> None:
        raise fault("interrupted while loading")

    # Block 2's offload pre-hook has run (its weights are real for the copy) when this one raises.
    for m in (model, reference):
        handle = m.blocks[2].register_load_state_dict_pre_hook(interrupt)
        with pytest.raises(fault, match="interrupted while loading"):
            m.load_state_dict(other.state_dict())
        handle.remove()
    # No scope is open: a re-plan is not refused, and block 2 is offloaded again, with what the load had copied.
    fresh = group.replan(BlockCosts([1.0] * 4, [block] * 4, 1e-3))
    hook = offload_hook(model.blocks[2])
    with torch.no_grad():
        with hook.mutate_params_scope():
            model.blocks[2].o.weight.mul_(2)
        reference.blocks[2].o.weight.mul_(2)
        assert all(p.numel() == 0 for p in model.blocks[2].parameters())
        assert torch.equal(model(_x()), reference(_x()))
    fo.disable_layerwise_offload(fresh.model_ref)
    assert params_equal(model, reference)


# ---- blocks that call themselves ----------------------------------------------------------------

class Recurrent(torch.nn.Module):
    """A block that runs itself once more inside its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, again: bool = True) -> torch.Tensor:
        y = self.lin(x)
        if again:
            y = self(y, again=False)
        return self.lin(y)


class Recurrents(torch.nn.Module):
    def __init__(self, n_blocks: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Recurrent() for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_block_that_calls_itself_is_bit_exact(backend: str) -> None:
    torch.manual_seed(0)
    model = Recurrents().requires_grad_(False)
    torch.manual_seed(0)
    reference = Recurrents().requires_grad_(False)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(_x()), reference(_x()))
    assert all(p.numel() == 0 for p in model.blocks.parameters())  # released after the outer call
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


# ---- a submodule wrapped after enable ------------------------------------------------------------

class _Wrapper(torch.nn.Module):
    """What an adapter library does to a Linear: the Linear becomes ``base_layer``, so its parameters are renamed
    (``qkv.weight`` to ``qkv.base_layer.weight``) while staying the same objects."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base_layer = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_submodule_wrapped_after_enable_runs_saves_loads_and_disables_bit_exact(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.no_grad():
        model(_x())
    for m in (model, reference):
        for block in m.blocks:
            block.qkv = _Wrapper(block.qkv)
    with torch.no_grad():
        assert torch.equal(model(_x()), reference(_x()))
    saved, expected = model.state_dict(), reference.state_dict()
    assert list(saved) == list(expected) and all(torch.equal(saved[k], expected[k]) for k in saved)
    torch.manual_seed(5)
    values = {k: torch.randn_like(v) for k, v in expected.items()}
    model.load_state_dict(values)
    reference.load_state_dict(values)
    with torch.no_grad():
        assert torch.equal(model(_x()), reference(_x()))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_parameter_moved_out_of_its_block_gets_its_values_back_at_disable(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    for m in (model, reference):
        m.extra = m.blocks[0].up  # moved out: the model holds it elsewhere, the block no more
        m.blocks[0].up = torch.nn.Identity()
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)



def _move_out(model: torch.nn.Module, where: str, device: str) -> None:
    """Moves an offloaded submodule or parameter out of its block, the same way on either twin. The block gets a
    seeded stand-in of the same shape, so the forward is unchanged between the twins."""
    torch.manual_seed(11)
    if where == "param":  # rebound into a module outside the blocks
        model.proj_out.weight = model.blocks[1].o.weight
        model.blocks[1].o.weight = torch.nn.Parameter(torch.randn(16, 16, device=device), requires_grad=False)
        return
    moved = model.blocks[0].up
    if where == "after":
        model.extra = moved  # registered after the block list
    elif where == "before":
        model.proj_in.sub = moved  # inside a module loaded before the block list
    else:
        model.blocks[2].extra = moved  # into another block
    model.blocks[0].up = torch.nn.Linear(16, 64).to(device).requires_grad_(False)


def _moved(model: torch.nn.Module, where: str) -> torch.nn.Module:
    return {"param": lambda: model.proj_out, "after": lambda: model.extra, "before": lambda: model.proj_in.sub,
            "block": lambda: model.blocks[2].extra}[where]()


def _same_state(model: torch.nn.Module, reference: torch.nn.Module, skip: tuple[str, ...] = ()) -> bool:
    got, want = model.state_dict(), reference.state_dict()
    return list(got) == list(want) and all(
        got[k].shape == want[k].shape and got[k].dtype == want[k].dtype and torch.equal(got[k].cpu(), want[k].cpu())
        for k in want if k not in skip)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["after", "before", "param", "block"])
def test_a_parameter_moved_out_of_its_block_is_saved_and_loaded_by_object(backend: str, device: str,
                                                                           where: str) -> None:
    model, reference = _frozen_pair()
    reference.to(device)
    place_outside_blocks(model, device)
    fo.enable_layerwise_offload(model, device=device, backend=backend)
    for m in (model, reference):
        _move_out(m, where, device)
    # Saved by object while it is still offloaded, whichever module state_dict() is called on: its host copy,
    # never the empty placeholder.
    for pick in (lambda m: m, lambda m: m.blocks, lambda m: m.blocks[2], lambda m: _moved(m, where)):
        assert _same_state(pick(model), pick(reference))
    x = _x().to(device)
    if where != "param":  # the output projection would read the placeholder: it runs once the load settled it
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
    # A load into the moved submodule alone rebuilds its old block first.
    torch.manual_seed(4)
    part = {k: torch.randn_like(v) for k, v in _moved(reference, where).state_dict().items()}
    _moved(model, where).load_state_dict(part)
    _moved(reference, where).load_state_dict(part)
    assert _same_state(model, reference)
    torch.manual_seed(5)
    values = {k: torch.randn_like(v) for k, v in reference.state_dict().items()}
    model.load_state_dict(values)  # wherever the moved module sits in the load order
    reference.load_state_dict(values)
    # A rebuild of its old block left the moved parameter an ordinary device tensor with storage of its own; a
    # rebuild of the block it sits in now takes it over with its value.
    param = _moved(model, where).weight
    assert param.device.type == device
    assert param.untyped_storage().nbytes() == param.numel() * param.element_size() or where == "block"
    with offload_hook(model.blocks[2]).mutate_params_scope():
        pass
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert _same_state(model, reference)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["sparse", "meta"])
def test_a_failed_rebuild_keeps_the_block_materialized_until_a_scope_ends_cleanly(backend: str, device: str,
                                                                                  kind: str) -> None:
    model, reference = _frozen_pair()
    for m in (model, reference):  # a parameter the forward does not read, so its shape and dtype may change
        m.blocks[1].register_parameter("scale", torch.nn.Parameter(torch.ones(4), requires_grad=False))
    reference.to(device)
    place_outside_blocks(model, device)
    fo.enable_layerwise_offload(model, device=device, backend=backend)
    bad = torch.eye(3).to_sparse() if kind == "sparse" else torch.empty(3, device="meta")
    with pytest.raises((RuntimeError, fo.OffloadStateError), match="sparse|Sparse|meta device") as raised, \
            offload_hook(model.blocks[1]).mutate_params_scope():
        for m in (model, reference):
            with torch.no_grad():
                m.blocks[1].up.weight.mul_(2)
            m.blocks[1].scale.data = torch.arange(6, dtype=torch.float64, device=device)  # new shape and dtype
            m.blocks[1].register_parameter("bad", torch.nn.Parameter(bad, requires_grad=False))
    if sys.version_info >= (3, 11):
        assert any("open and close mutate_params_scope() on the block again" in n for n in raised.value.__notes__)
    # The block holds the scope's values, whatever their shape or dtype: the forward, state_dict() and a disable
    # all use them.
    assert model.blocks[1].up.weight.shape == (64, 16)
    x = _x().to(device)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        assert torch.equal(model(x), reference(x))
    assert _same_state(model, reference, skip=("blocks.1.bad",))
    # A load would stop at the rebuild of that block, with the modules after it not loaded: refused before any loads.
    values = {k: torch.zeros_like(v) for k, v in reference.state_dict().items() if k != "blocks.1.bad"}
    with pytest.raises(fo.OffloadStateError, match="load_state_dict.. is refused on block"):
        model.load_state_dict(values, strict=False)
    assert _same_state(model, reference, skip=("blocks.1.bad",))
    # Fixed, and closed cleanly: offloaded again, with the scope's values.
    with offload_hook(model.blocks[1]).mutate_params_scope():
        del model.blocks[1].bad
    del reference.blocks[1].bad
    assert model.blocks[1].up.weight.numel() == 0
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert _same_state(model, reference)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)

# ---- disable_layerwise_offload ------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_disable_to_the_meta_device(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.no_grad():
        model(_x())
    fo.disable_layerwise_offload(model, device="meta")
    assert fo.get_offload_group(model) is None
    got = dict(model.blocks.named_parameters())
    want = dict(reference.blocks.named_parameters())
    assert got.keys() == want.keys()
    assert all(got[k].is_meta and got[k].shape == want[k].shape and got[k].dtype == want[k].dtype for k in want)
    assert all(not p.requires_grad for p in got.values())


# ---- the hook surface ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_removing_one_blocks_offload_hook_by_hand_leaves_the_rest_running(backend: str) -> None:
    model, reference = _frozen_pair(4)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.no_grad():
        model(_x())  # the fast path has resolved block 1's prefetch target (block 2)
        fo.ModuleHookManager.get_from(model.blocks[2]).remove_forward_hook(fo.LayerwiseOffloadHook.name())
        assert all(p.numel() > 0 for p in model.blocks[2].parameters())  # real values again
        for _ in range(2):
            assert torch.equal(model(_x()), reference(_x()))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["run_detach=False", "remove_from_manager"])
def test_disable_restores_a_block_whose_offload_hook_was_taken_off_without_detaching(backend: str, how: str) -> None:
    # The block keeps its placeholders (its forward fails, as FastVideo's does), but its values are still in
    # the host copy: disable gave the block back empty, the values freed with the engine.
    model, reference = _frozen_pair(4)
    other, _ = _frozen_pair(4, seed=5)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.no_grad():
        model(_x())
    if how == "run_detach=False":
        fo.ModuleHookManager.get_from(model.blocks[2]).remove_forward_hook(fo.LayerwiseOffloadHook.name(),
                                                                            run_detach=False)
    else:
        fo.ModuleHookManager.remove_from_manager(model.blocks[2])
    assert all(p.numel() == 0 for p in model.blocks[2].parameters())
    fo.disable_layerwise_offload(model)
    assert fo.ModuleHookManager.get_from(model.blocks[2]) is None
    assert params_equal(model, reference)
    with torch.no_grad():
        assert torch.equal(model(_x()), reference(_x()))
    # No state-dict hook of the offload is left on the block: it saves and loads as a resident one.
    for m in (model, reference):
        m.load_state_dict(other.state_dict())
    got, want = model.state_dict(), reference.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert params_equal(model, reference)
