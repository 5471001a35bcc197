"""What users do to an offloaded model, on both backends: never silently wrong.

In-place edits, casts, state_dict/load_state_dict, lazy (conjugate/negative) views and weights tied by
storage. Each either works exactly as on the resident model or raises a message that says what to do,
with every value intact afterwards.
"""
from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext.errors import OffloadStateError

from ._models import make_pair, params_equal

BACKENDS = ["ext", "python"]
IN_PLACE = ("fastoffload: parameter '{name}' of block {index} was changed in place while it was offloaded (its "
            "placeholder or device slot holds no lasting copy), so the change would be silently lost. Change a "
            "block's parameters inside mutate_params_scope(), which rebuilds the host copy, or disable offload first.")
CAST = ("fastoffload: parameter '{name}' of block {index} was cast or moved to {now} on cpu after offload was enabled "
        "(its host copy holds {was} for cpu); .half(), .to(dtype) and .to(device) do not reach an offloaded block's "
        "host copy. Cast or move the model before enable_layerwise_offload, or disable offload, cast, and enable it "
        "again.")
LOST_EDIT = ("fastoffload: parameter '{name}' of block {index} was changed while it was offloaded (in place, by a cast "
             "and a cast back, or rebound to a value of another shape), and its placeholder or device slot held no "
             "lasting copy, so offload was disabled with its value from before that change. Apply the change again now, "
             "or next time inside mutate_params_scope().")

STALE_SAVE = ("fastoffload: parameter '{name}' of block {index} was changed while it was offloaded (in place, by a "
              "cast and a cast back, or rebound to a value of another shape), and its placeholder or device slot held "
              "no lasting copy, so state_dict() holds its value from before that change, and the next forward refuses "
              "the block. Apply the change inside mutate_params_scope(), or disable offload first.")


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(seed))


def _frozen_pair(n_blocks: int = 3) -> tuple[nn.Module, nn.Module]:
    model, reference = make_pair(n_blocks)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    return model, reference


# ---- in-place edits -----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("edit", ["mul_", "zero_"])
def test_in_place_edit_of_an_offloaded_parameter_is_never_lost_silently(backend: str, edit: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.no_grad():
        model(_x())  # the edit lands between steps, on the placeholder
        weight = model.blocks[1].o.weight
        weight.mul_(2) if edit == "mul_" else weight.zero_()
        with pytest.raises(RuntimeError) as raised:
            model(_x())
    assert str(raised.value) == IN_PLACE.format(name="o.weight", index=1)
    # The refused edit is still on the placeholder: disable says it keeps the value from before it.
    with pytest.warns(RuntimeWarning, match=r"parameter 'o\.weight' of block 1 was changed while it was offloaded "
                                            r".* disabled with its value from before that change"):
        fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)  # the host copy was never touched


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_in_place_edit_during_a_forward_is_never_lost_silently(backend: str, mode: str) -> None:
    # Inside inference_mode() the parameters must stay ordinary tensors while their block runs: bound to an
    # inference tensor they would count no versions, and the write would vanish with the slot.
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    writes: list[bool] = []

    def write_once(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if not writes:
            writes.append(module.weight.is_inference())
            module.weight.mul_(2)

    model.blocks[1].o.register_forward_pre_hook(write_once)
    with getattr(torch, mode)():
        model(_x())  # the edit lands on the block's device copy, while it runs
        with pytest.raises(RuntimeError) as raised:
            model(_x())
    assert writes == [False]
    assert str(raised.value) == IN_PLACE.format(name="o.weight", index=1)
    with pytest.warns(RuntimeWarning, match=r"parameter 'o\.weight' of block 1 was changed while it was offloaded "
                                            r".* disabled with its value from before that change"):
        fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)  # the host copy was never touched


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_parameters_stay_ordinary_tensors_while_their_block_runs(backend: str, mode: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    seen: list[bool] = []
    model.blocks[2].o.register_forward_pre_hook(lambda module, args: seen.append(module.weight.is_inference()))
    with getattr(torch, mode)():
        for _ in range(2):
            assert torch.equal(model(_x()), reference(_x()))
    assert seen == [False, False]
    assert not model.blocks[2].o.weight.is_inference()  # the placeholder between steps too
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_edit_inside_mutate_params_scope_is_kept(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    hook = fo.ModuleHookManager.get_from(model.blocks[1]).get_forward_hook(fo.LayerwiseOffloadHook.name())
    with hook.mutate_params_scope(), torch.no_grad():
        model.blocks[1].o.weight.mul_(2)
    with torch.no_grad():
        reference.blocks[1].o.weight.mul_(2)
        for _ in range(2):
            assert torch.equal(model(_x()), reference(_x()))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("raises", [False, True])
def test_disable_inside_mutate_params_scope_keeps_the_scope_values(backend: str, raises: bool) -> None:
    """A disable inside the scope (say, in the caller's own error handling) makes the block an ordinary module
    with the scope's values; the scope's exit then has nothing to rebuild. It turned the block's parameters back
    into placeholders on a model with no offload left (python backend), or raised that the block was detached,
    in place of the caller's own error (ext)."""
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    hook = fo.ModuleHookManager.get_from(model.blocks[1]).get_forward_hook(fo.LayerwiseOffloadHook.name())
    with pytest.raises(KeyError, match="caller's") if raises else contextlib.nullcontext():
        with hook.mutate_params_scope(), torch.no_grad():
            model.blocks[1].o.weight.mul_(2)
            fo.disable_layerwise_offload(model)
            model.blocks[1].o.weight.add_(1)
            if raises:
                raise KeyError("the caller's error")
    assert fo.get_offload_group(model) is None
    with torch.no_grad():
        reference.blocks[1].o.weight.mul_(2)
        reference.blocks[1].o.weight.add_(1)
        assert torch.equal(model(_x()), reference(_x()))
    assert params_equal(model, reference)


# ---- parameters replaced while offloaded ---------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_a_parameter_replaced_by_a_new_object_runs_and_is_kept(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    new = torch.randn(48, 16, generator=torch.Generator().manual_seed(7))
    model.blocks[1].qkv.weight = nn.Parameter(new.clone(), requires_grad=False)
    reference.blocks[1].qkv.weight = nn.Parameter(new.clone(), requires_grad=False)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(_x()), reference(_x()))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_value_rebound_while_offloaded_survives_disable(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    new = torch.randn(48, 16, generator=torch.Generator().manual_seed(8))
    model.blocks[1].qkv.weight.data = new.clone()
    reference.blocks[1].qkv.weight.data = new.clone()
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rebound_value_is_refused_at_the_next_forward_and_is_still_there_after_disable(backend: str) -> None:
    # The python backend bound the host copy over it: the forward ran the old weights, and the release
    # then dropped the new value for good.
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    new = torch.randn(48, 16, generator=torch.Generator().manual_seed(9))
    model.blocks[1].qkv.weight.data = new.clone()
    with torch.no_grad(), pytest.raises(RuntimeError, match="parameter 'qkv.weight' of block 1 was replaced while"):
        model(_x())
    # The refusal's advice is to disable first: doing so keeps the value it refused to overwrite.
    fo.disable_layerwise_offload(model)
    reference.blocks[1].qkv.weight.data = new.clone()
    assert params_equal(model, reference)
    with torch.no_grad():
        assert torch.equal(model(_x()), reference(_x()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("edit", ["in_place", "rebind", "half"])
def test_an_edit_made_while_offloaded_is_refused_by_mutate_params_scope(backend: str, edit: str) -> None:
    # The scope binds the host copy: on the ext backend it silently dropped the edit, and the scope's exit
    # then packed the old values as if they were the caller's.
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.no_grad():
        model(_x())
        weight = model.blocks[1].o.weight
        if edit == "in_place":
            weight.mul_(2)
        elif edit == "rebind":
            weight.data = torch.ones(16, 16)
        else:
            model.blocks[1].half()
    hook = fo.ModuleHookManager.get_from(model.blocks[1]).get_forward_hook(fo.LayerwiseOffloadHook.name())
    want = {"in_place": "was changed in place while it was offloaded", "rebind": "was replaced while it was offloaded",
            "half": "was cast or moved to Half"}[edit]
    with pytest.raises(RuntimeError, match=want), hook.mutate_params_scope():
        pass
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fo.disable_layerwise_offload(model)
    lost = [str(w.message) for w in caught if "offload was disabled with its value" in str(w.message)]
    if edit == "in_place":
        # The placeholder held no values to change: the block comes back as it was, and disable says so.
        assert lost == [LOST_EDIT.format(name="o.weight", index=1)]
        assert params_equal(model, reference)
    elif edit == "rebind":
        assert lost == []
        assert torch.equal(model.blocks[1].o.weight, torch.ones(16, 16))
    else:
        assert lost == []
        reference.blocks[1].half()
        assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_disable_after_an_unapplied_in_place_edit_restores_and_warns(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.no_grad():
        model(_x())
        model.blocks[2].qkv.weight.zero_()
        model.blocks[2].qkv.weight.add_(1)
    with pytest.warns(RuntimeWarning) as caught:
        fo.disable_layerwise_offload(model)
    assert [str(w.message) for w in caught] == [LOST_EDIT.format(name="qkv.weight", index=2)]
    assert params_equal(model, reference)
    # An edit inside the scope, or on a model whose blocks ran since, is no loss: disable says nothing.
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    hook = fo.ModuleHookManager.get_from(model.blocks[0]).get_forward_hook(fo.LayerwiseOffloadHook.name())
    with hook.mutate_params_scope(), torch.no_grad():
        model.blocks[0].o.weight.mul_(3)
    with torch.no_grad():
        reference.blocks[0].o.weight.mul_(3)
        assert torch.equal(model(_x()), reference(_x()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


# ---- casts after enable -------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cast", ["half", "to_float64"])
def test_cast_after_enable_is_refused_and_disable_follows_it(backend: str, cast: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    dtype = torch.float16 if cast == "half" else torch.float64
    model.half() if cast == "half" else model.to(torch.float64)
    with torch.no_grad(), pytest.raises(RuntimeError) as raised:
        model(_x().to(dtype))
    core_name = {torch.float16: "Half", torch.float64: "Double"}[dtype]
    assert str(raised.value) == CAST.format(name="qkv.weight", index=0, now=core_name, was="Float")
    fo.disable_layerwise_offload(model)
    reference.to(dtype)
    # The restored model is what the cast made of the resident model: never float32 in disguise.
    assert params_equal(model, reference)
    with torch.no_grad():
        assert torch.equal(model(_x().to(dtype)), reference(_x().to(dtype)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cast_and_a_cast_back_is_refused_and_disable_says_what_was_lost(backend: str) -> None:
    """``half().float()`` swaps each placeholder for another of the same dtype: the rounding the resident model
    takes never reached the host copy. The next forward refuses on both backends (the python backend ran the
    unrounded weights), and a disable restores the values from before the cast and says so."""
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.no_grad():
        model(_x())
    model.half().float()
    replaced = ("fastoffload: parameter 'qkv.weight' of block 0 was replaced while it was offloaded, so its new value "
                "would be silently overwritten.")
    with torch.no_grad(), pytest.raises(RuntimeError) as raised:
        model(_x())
    assert str(raised.value).startswith(replaced)
    with pytest.warns(RuntimeWarning) as saved:
        state = model.state_dict()
    assert [str(w.message) for w in saved] == [STALE_SAVE.format(name="qkv.weight", index=i) for i in range(3)]
    assert {w.filename for w in saved} == {__file__}  # the caller's line, not torch's hook machinery
    assert torch.equal(state["blocks.0.qkv.weight"], reference.blocks[0].qkv.weight)  # as the warning says
    with pytest.warns(RuntimeWarning) as caught:
        fo.disable_layerwise_offload(model)
    assert [str(w.message) for w in caught] == [LOST_EDIT.format(name="qkv.weight", index=i) for i in range(3)]
    # The blocks hold their values from before the cast, as the warning says; the rest of the model, which
    # was resident, took the rounding as the resident model does.
    assert params_equal(model.blocks, reference.blocks)
    reference.half().float()
    rest = [(name, p) for name, p in model.named_parameters() if not name.startswith("blocks.")]
    assert rest and all(torch.equal(p, reference.get_parameter(name)) for name, p in rest)


# ---- state_dict and load_state_dict -------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_holds_the_real_values(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    assert all(torch.equal(saved[k], want[k]) for k in want)
    # The values are copies: writing into them cannot reach the offloaded weights behind the engine's back, and
    # the block refuses to run while such an edited copy is alive (a resident model's forward would see the edit).
    got["blocks.0.o.weight"].zero_()
    with torch.no_grad(), pytest.raises(OffloadStateError, match="state_dict.. entry 'blocks.0.o.weight'"):
        model(_x())
    del got
    with torch.no_grad():
        assert torch.equal(model(_x()), reference(_x()))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_state_dict_taken_while_a_block_runs_keeps_its_values(backend: str) -> None:
    """From a hook inside block 1's forward: block 1's values are its device slot, which the cyclic prefetch
    of block 0 overwrites after block 1 releases; the saved values must not follow it."""
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    saved: dict[str, torch.Tensor] = {}

    def save(module: nn.Module, args: object) -> None:
        if not saved:
            saved.update(model.state_dict())

    model.blocks[1].o.register_forward_pre_hook(save)
    with torch.no_grad():
        model(_x())
    want = reference.state_dict()
    assert saved.keys() == want.keys()
    assert [k for k in want if not torch.equal(saved[k], want[k])] == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_state_dict_updates_the_host_copy(backend: str) -> None:
    model, _ = _frozen_pair()
    other, _ = make_pair(3, seed=9)
    other.requires_grad_(False)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend, prefetch_depth=2)
    with torch.no_grad():
        model(_x())  # slots hold the old weights now
    result = model.load_state_dict(other.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(_x()), other(_x()))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, other)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("edit", ["in place", "cast", "rebound"])
def test_a_load_that_a_block_refuses_changes_nothing(backend: str, edit: str) -> None:
    """Block 2 refuses the load (an edit made while it was offloaded would be overwritten): the load must
    refuse before the modules ahead of it (the rest of the model, blocks 0 and 1) have loaded anything."""
    model, _ = _frozen_pair()
    other, _ = make_pair(3, seed=9)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.no_grad():
        model(_x())
    before = {name: value.clone() for name, value in model.state_dict().items()}
    weight = model.blocks[2].o.weight
    with torch.no_grad():
        if edit == "in place":
            weight.mul_(2)
        elif edit == "cast":
            model.blocks[2].o.double()
        else:
            weight.data = torch.ones(16, 16)
    message = {"in place": "was changed in place while it was offloaded", "cast": "was cast or moved to Double",
               "rebound": "was replaced while it was offloaded"}[edit]
    with pytest.raises(RuntimeError, match=message):
        model.load_state_dict(other.state_dict())
    # An in-place edit of a placeholder is still there to lose: state_dict() says it saves the value from before it.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        after = model.state_dict()
    assert [str(w.message)[:60] for w in caught] == ([STALE_SAVE.format(name="o.weight", index=2)[:60]]
                                                     if edit == "in place" else [])
    changed = [name for name in before if not name.startswith("blocks.2.")
               and not torch.equal(after[name], before[name])]
    assert changed == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("keep_vars", [False, True])
def test_a_submodules_state_dict_holds_the_real_values(backend: str, keep_vars: bool) -> None:
    # torch runs only the hooks of the module state_dict() is called on and below: a submodule of a block
    # (block.attn.state_dict(), as a LoRA or a per-layer checkpoint takes it) gave the (0, 0) placeholders.
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    for name in ("blocks.1.o", "blocks.2.norms", "blocks.2.norms.1", "blocks.0"):
        got = model.get_submodule(name).state_dict(prefix="p.", keep_vars=keep_vars)
        want = reference.get_submodule(name).state_dict(prefix="p.", keep_vars=keep_vars)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), name
    got, want = model.state_dict(), reference.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_state_dict_into_a_submodule_of_a_block(backend: str) -> None:
    # It raised a size mismatch against the placeholders, where the resident model loads.
    model, reference = _frozen_pair()
    other, _ = make_pair(3, seed=9)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    for name in ("blocks.1.o", "blocks.2.norms", "blocks.0.up"):
        for m in (model, reference):
            result = m.get_submodule(name).load_state_dict(other.get_submodule(name).state_dict())
            assert result.missing_keys == [] and result.unexpected_keys == []
    assert all(p.numel() == 0 for p in model.blocks.parameters())  # offloaded again, not left materialized
    got, want = model.state_dict(), reference.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(_x()), reference(_x()))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_submodule_replaced_inside_a_mutate_scope_saves_its_own_values(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    hook = fo.ModuleHookManager.get_from(model.blocks[1]).get_forward_hook(fo.LayerwiseOffloadHook.name())
    with hook.mutate_params_scope():
        # Swapped: each name now holds the other's module, and a new one comes in.
        model.blocks[1].qkv, model.blocks[1].up = model.blocks[1].up, model.blocks[1].qkv
        model.blocks[1].extra = nn.Linear(16, 16).requires_grad_(False)
    reference.blocks[1].qkv, reference.blocks[1].up = reference.blocks[1].up, reference.blocks[1].qkv
    reference.blocks[1].extra = nn.Linear(16, 16).requires_grad_(False)
    with torch.no_grad():
        reference.blocks[1].extra.load_state_dict(model.blocks[1].extra.state_dict())
    for name in ("qkv", "up", "extra", ""):
        got = model.blocks[1].get_submodule(name).state_dict()
        want = reference.blocks[1].get_submodule(name).state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


# ---- lazy conjugate / negative bits -------------------------------------------------------------

class Scale(nn.Module):
    """A block whose weight multiplies its input elementwise (complex or real)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Scales(nn.Module):
    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Scale(w) for w in weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_conjugate_and_negative_views_keep_their_values(backend: str, bit: str) -> None:
    gen = torch.Generator().manual_seed(5)
    dtype = torch.complex64 if bit == "conj" else torch.float32
    bases = [torch.randn(8, dtype=dtype, generator=gen) for _ in range(3)]
    lazy = [b.conj() if bit == "conj" else torch._neg_view(b) for b in bases]
    model = Scales(lazy)
    assert model.blocks[0].weight.is_conj() or model.blocks[0].weight.is_neg()
    values = [b.resolve_conj().resolve_neg() for b in lazy]
    x = torch.randn(8, dtype=dtype, generator=gen)
    want = x * values[0] * values[1] * values[2]
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model)
    assert all(torch.equal(block.weight, v) for block, v in zip(model.blocks, values))


# ---- tied weights by storage --------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_sharing_storage_are_refused_like_tied_ones(backend: str) -> None:
    model, reference = _frozen_pair()
    model.blocks[0].o.weight = nn.Parameter(model.proj_in.weight.data, requires_grad=False)
    with pytest.raises(ValueError) as raised:
        fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    assert str(raised.value) == (
        "fastoffload: parameter proj_in.weight shares its storage with blocks.0.o.weight, which would be offloaded: "
        "weights tied between an offloaded block and the rest of the model are not supported. Untie them (clone "
        "one), or keep that block resident with resident_blocks")
    assert fo.get_offload_group(model) is None and all(p.numel() > 0 for p in model.parameters())
    model, _ = _frozen_pair()
    model.blocks[2].up.weight = nn.Parameter(model.blocks[1].up.weight.data, requires_grad=False)
    with pytest.raises(ValueError) as raised:
        fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    assert str(raised.value) == (
        "fastoffload: parameter blocks.2.up.weight shares its storage with blocks.1.up.weight: tied weights across "
        "offloaded blocks are not supported (offloading one would turn the other into a placeholder). Untie them "
        "(clone one), or keep those blocks resident with resident_blocks")
    model, _ = _frozen_pair()
    fused = model.blocks[1].up.weight.data
    model.blocks[1].o.weight = nn.Parameter(fused[: fused.shape[1]], requires_grad=False)  # a view of the same block's
    with pytest.raises(ValueError) as raised:
        fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    assert str(raised.value) == (
        "fastoffload: parameter blocks.1.up.weight shares its storage with blocks.1.o.weight in the same block: "
        "parameters of one offloaded block that share a storage (views of one tensor) are not supported (its host "
        "copy holds each parameter apart, so a write through one would not reach the other). Give each its own "
        "storage (clone one), or keep that block resident with resident_blocks")
    assert fo.get_offload_group(model) is None and all(p.numel() > 0 for p in model.parameters())


# ---- a detached block ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_a_detached_block_refuses_to_run_with_the_same_text(backend: str) -> None:
    from fastoffload_ext.engine.messages import DETACHED_ERROR

    model, reference = _frozen_pair()
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    state = group.states[1]
    fo.disable_layerwise_offload(model)
    with pytest.raises(RuntimeError) as raised:
        state.acquire()
    assert str(raised.value).split("\n")[0] == DETACHED_ERROR.format(index=1)
    assert params_equal(model, reference)
