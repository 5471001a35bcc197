"""An in-place edit of a ``state_dict()`` entry of an offloaded block, on both backends: never lost silently.

A resident model's entries share the parameters' storage (``keep_vars=True`` gives the parameters), so an edit
of one (an EMA update, ``sd[k].copy_(new)``) changes the model. An offloaded block's entries are copies of its
host values: the edit is refused at the block's next forward (and warned about at a ``state_dict()`` and at a
disable) until the dict is loaded or dropped, with every value intact, and a load makes the model equal, bit for
bit, to a resident one given the same edit.
"""
from __future__ import annotations

import gc
import io
import warnings
import weakref

import pytest
import torch
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext.engine.state_dict import StateDictHooks
from fastoffload_ext.errors import OffloadStateError

from ._models import make_pair, offload_hook, params_equal

BACKENDS = ["ext", "python"]
BLOCK_PARAMS = 12  # parameters of one block of make_pair's model

_COPY = ("fastoffload: state_dict() entry '{key}' (parameter '{name}' of block {index}{more}) {what}, but while a "
         "block is offloaded, state_dict() returns copies of its host values, so the change did not reach the model "
         "(a resident model's entries share the parameters' storage)")
EDITED = _COPY + (". The block refuses to run while the edited copy is alive and not loaded, rather than run with its "
                  "old values. Load the changed values with model.load_state_dict(state_dict), or drop the edited dict "
                  "and make the change inside mutate_params_scope(); to keep a changed copy apart from the model, "
                  "clone it before changing it.")
DROPPED = _COPY + (", and the block keeps its old values. Refused once to say so (the next call runs): apply the "
                   "change again with model.load_state_dict(state_dict) before dropping the dict, or inside "
                   "mutate_params_scope(); to keep a changed copy apart from the model, clone it before changing it.")
DISABLED = _COPY + ("; offload was disabled with the parameter's value from before that change. Apply the change "
                    "again now (model.load_state_dict() of the changed values), and clone a copy before changing it "
                    "to keep it apart from the model.")
SAVED = _COPY + ("; this state_dict() holds the model's value from before that change, not the edit's, and the block "
                 "refuses to run while the edited copy is alive and not loaded. Load the changed values with "
                 "model.load_state_dict(state_dict), or clone a copy before changing it to keep it apart from the "
                 "model.")


def _text(template: str, key: str, name: str, index: int, more: int = 0) -> str:
    what = "was changed in place and then dropped" if template is DROPPED else "was changed in place"
    return template.format(key=key, name=name, index=index, more=f", and {more} more entries" if more else "",
                           what=what)


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(seed))


def _frozen_pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    model, reference = make_pair(3, seed=seed)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    return model, reference


def _ema(target: dict[str, torch.Tensor], source: dict[str, torch.Tensor], decay: float = 0.9) -> None:
    """timm's ModelEmaV2 update, in place on ``target``'s entries."""
    with torch.no_grad():
        for e, m in zip(target.values(), source.values()):
            e.mul_(decay).add_(m, alpha=1 - decay)


def _records(model: nn.Module) -> list[int]:
    return [len(offload_hook(block).state_dict_hooks.copies) for block in model.blocks]


def _forward_equal(model: nn.Module, reference: nn.Module, steps: int = 2) -> bool:
    with torch.no_grad():
        return all(torch.equal(model(_x(step)), reference(_x(step))) for step in range(steps))


def _quiet_disable(model: nn.Module) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fo.disable_layerwise_offload(model)
    assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("keep_vars", [False, True])
def test_an_ema_update_of_state_dict_entries_is_refused_until_loaded(backend: str, keep_vars: bool) -> None:
    model, reference = _frozen_pair()
    other, _ = _frozen_pair(seed=9)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    assert _forward_equal(model, reference)
    before = {key: value.clone() for key, value in reference.state_dict().items()}
    state = model.state_dict(keep_vars=keep_vars)
    _ema(state, other.state_dict())
    _ema(reference.state_dict(keep_vars=keep_vars), other.state_dict())  # resident: the edit reaches the model
    for _ in range(2):  # refused at every forward while the edited dict is alive and not loaded
        with torch.no_grad(), pytest.raises(OffloadStateError) as raised:
            model(_x())
        assert str(raised.value) == _text(EDITED, "blocks.0.qkv.weight", "qkv.weight", 0, BLOCK_PARAMS - 1)
    # Every parameter holds its exact values: the offloaded blocks' from before the edit (as the warning of a
    # state_dict() says, once per block), the resident ones' with it.
    with pytest.warns(RuntimeWarning) as saved:
        now = model.state_dict()
    assert [str(w.message) for w in saved] == [
        _text(SAVED, f"blocks.{i}.qkv.weight", "qkv.weight", i, BLOCK_PARAMS - 1) for i in range(3)]
    assert {w.filename for w in saved} == {__file__}
    edited = reference.state_dict()
    assert [key for key in now if not torch.equal(now[key], before[key] if key.startswith("blocks.")
                                                  else edited[key])] == []
    # The edit changed every block's Linear weights and biases (the LayerNorms' are equal in both models).
    assert sum(not torch.equal(edited[key], before[key]) for key in now if key.startswith("blocks.")) == 3 * 8
    result = model.load_state_dict(state)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert _forward_equal(model, reference)
    # The dict is still a copy: a later edit of it is refused again.
    with torch.no_grad():
        state["blocks.2.o.bias"].add_(1)
    with torch.no_grad(), pytest.raises(OffloadStateError) as raised:
        model(_x())
    assert str(raised.value) == _text(EDITED, "blocks.2.o.bias", "o.bias", 2)
    model.load_state_dict(state)
    reference.load_state_dict(state)
    assert _forward_equal(model, reference)
    _quiet_disable(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["block", "submodule"])
def test_a_copy_into_an_entry_of_a_blocks_state_dict_is_refused_until_loaded(backend: str, where: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    module, key = {"block": (model.blocks[1], "o.weight"), "submodule": (model.blocks[1].o, "weight")}[where]
    state = module.state_dict()
    new = torch.randn(16, 16, generator=torch.Generator().manual_seed(5))
    state[key].copy_(new)
    with torch.no_grad():
        reference.blocks[1].o.weight.copy_(new)
        with pytest.raises(OffloadStateError) as raised:
            model(_x())
    assert str(raised.value) == _text(EDITED, key, "o.weight", 1)
    with pytest.warns(RuntimeWarning) as caught:
        now = model.state_dict()["blocks.1.o.weight"]
    assert [str(w.message) for w in caught] == [_text(SAVED, key, "o.weight", 1)]
    assert torch.equal(now, make_pair(3)[1].blocks[1].o.weight)  # the value from before the edit
    module.load_state_dict(state)
    assert _forward_equal(model, reference)
    _quiet_disable(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unedited_state_dict_kept_alive_changes_nothing(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    state, kept_vars = model.state_dict(), model.state_dict(keep_vars=True)
    assert _records(model) == [2 * BLOCK_PARAMS] * 3
    assert _forward_equal(model, reference, steps=3)
    want = reference.state_dict()
    assert all(torch.equal(state[key], want[key]) and torch.equal(kept_vars[key], want[key]) for key in want)
    _quiet_disable(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["dropped", "torch.save"])
def test_a_dropped_state_dict_leaves_nothing_recorded(backend: str, how: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    buffer = io.BytesIO()
    if how == "dropped":
        state = model.state_dict()
        copies = [weakref.ref(value) for key, value in state.items() if key.startswith("blocks.")]
        del state
        assert len(copies) == 3 * BLOCK_PARAMS and all(copy() is None for copy in copies)  # freed at once
    else:
        torch.save(model.state_dict(), buffer)
    gc.collect()
    assert _forward_equal(model, reference)
    assert _records(model) == [0, 0, 0]  # pruned at the first check
    if how == "torch.save":
        buffer.seek(0)
        saved, want = torch.load(buffer), reference.state_dict()
        assert saved.keys() == want.keys() and all(torch.equal(saved[key], want[key]) for key in want)
    _quiet_disable(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_edit_of_a_temporary_state_dict_is_said_once(backend: str) -> None:
    """timm's EMA loop over ``model.state_dict().values()`` drops the dict when it ends: the edit is gone before any
    check, so the next forward says so once, for every block, and the forwards after it run on the old values."""
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if key.startswith("blocks."):
                value.mul_(0.5)
    with torch.no_grad(), pytest.raises(OffloadStateError) as raised:
        model(_x())
    assert str(raised.value) == _text(DROPPED, "blocks.0.qkv.weight", "qkv.weight", 0, 3 * BLOCK_PARAMS - 1)
    assert _records(model) == [0, 0, 0]
    assert _forward_equal(model, reference)
    _quiet_disable(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_disable_with_an_edited_copy_alive_warns_and_keeps_the_values(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    state = model.state_dict()
    state["blocks.1.up.bias"].fill_(3.0)
    state["blocks.1.o.weight"].zero_()
    hooks = offload_hook(model.blocks[1]).state_dict_hooks
    with pytest.warns(RuntimeWarning) as caught:
        fo.disable_layerwise_offload(model)
    assert [str(w.message) for w in caught] == [_text(DISABLED, "blocks.1.o.weight", "o.weight", 1, 1)]
    assert {w.filename for w in caught} == {__file__}
    assert hooks.copies == []
    assert params_equal(model, reference)  # the values from before the edit
    with torch.no_grad():
        assert torch.equal(model(_x()), reference(_x()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_entry_cloned_before_its_edit_never_refuses(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    state = model.state_dict()
    apart = state["blocks.1.o.weight"].clone()
    apart.mul_(2)
    state["blocks.2.qkv.weight"] = state["blocks.2.qkv.weight"].clone().add_(1)  # the copy handed out is dropped
    assert _forward_equal(model, reference, steps=3)
    assert torch.equal(apart, 2 * reference.blocks[1].o.weight)
    _quiet_disable(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mutate_params_scope_is_refused_while_an_edited_copy_is_alive(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    hook = offload_hook(model.blocks[1])
    state = model.state_dict()
    state["blocks.1.down.weight"].add_(1)
    with pytest.raises(OffloadStateError) as raised, hook.mutate_params_scope():
        pass
    assert str(raised.value) == _text(EDITED, "blocks.1.down.weight", "down.weight", 1)
    assert not getattr(hook.state, "mutating", False)
    assert all(param.numel() == 0 for param in model.blocks[1].parameters())  # still offloaded, nothing changed
    del state  # dropped after the refusal said so: the change is made inside the scope instead
    with hook.mutate_params_scope(), torch.no_grad():
        model.blocks[1].down.weight.add_(1)
    with torch.no_grad():
        reference.blocks[1].down.weight.add_(1)
    assert _forward_equal(model, reference)
    _quiet_disable(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_edited_copy_taken_while_its_block_runs_is_refused(backend: str) -> None:
    """A state_dict() from a hook inside block 1's forward saves copies of its live values: recorded too."""
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    saved: dict[str, torch.Tensor] = {}

    def save(module: nn.Module, args: object) -> None:
        if not saved:
            saved.update(model.state_dict())

    handle = model.blocks[1].o.register_forward_pre_hook(save)
    assert _forward_equal(model, reference, steps=1)
    handle.remove()
    saved["blocks.1.o.weight"].mul_(-1)
    with torch.no_grad():
        reference.blocks[1].o.weight.mul_(-1)
        with pytest.raises(OffloadStateError) as raised:
            model(_x())
    assert str(raised.value) == _text(EDITED, "blocks.1.o.weight", "o.weight", 1)
    model.load_state_dict(saved)
    assert _forward_equal(model, reference)
    _quiet_disable(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_state_dict_taken_in_inference_mode_is_recorded(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.inference_mode():
        state = model.state_dict()
        state["blocks.0.norms.1.weight"].add_(0.25)
    assert not state["blocks.0.norms.1.weight"].is_inference()  # as a resident model's entry, it counts versions
    with torch.no_grad(), pytest.raises(OffloadStateError) as raised:
        model(_x())
    assert str(raised.value) == _text(EDITED, "blocks.0.norms.1.weight", "norms.1.weight", 0)
    with torch.no_grad():
        reference.blocks[0].norms[1].weight.add_(0.25)
    model.load_state_dict(state)
    assert _forward_equal(model, reference)
    _quiet_disable(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_forward_checks_the_copies_only_when_some_are_recorded(backend: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    calls: list[int] = []
    check = StateDictHooks.refuse_edited_copies

    def counted(self: StateDictHooks) -> None:
        calls.append(1)
        check(self)

    monkeypatch.setattr(StateDictHooks, "refuse_edited_copies", counted)
    hooks = [offload_hook(block) for block in model.blocks]
    assert all(hook._copies is hook.state_dict_hooks.copies for hook in hooks)
    assert _forward_equal(model, reference)
    assert calls == []  # nothing recorded: one test of an empty list, no call
    state = model.state_dict()
    assert _forward_equal(model, reference)
    assert len(calls) == 2 * 3
    del state
    calls.clear()
    assert _forward_equal(model, reference)
    assert len(calls) == 3 and _records(model) == [0, 0, 0]  # the first forward pruned them: none since
    _quiet_disable(model)
    assert params_equal(model, reference)
