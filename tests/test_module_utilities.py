"""torch's own module utilities applied to an offloaded model, on both backends: never silently wrong.

Each either gives what it gives on the resident model, bit for bit, or raises a message that says what to do,
with every parameter's value intact after a disable.
"""
from __future__ import annotations

import collections.abc
import contextlib

import pytest
import torch

import fastoffload_ext as fo
from fastoffload_ext.errors import OffloadStateError

from ._models import make_pair, params_equal

BACKENDS = ["ext", "python"]


def _x() -> torch.Tensor:
    return torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))


def _frozen_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    model, reference = make_pair(3)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    return model, reference


@contextlib.contextmanager
def _overwrite_params_on_conversion() -> collections.abc.Iterator[None]:
    """torch's switch that makes ``module.to()``/``.half()`` put a new Parameter in each slot instead of
    rebinding ``param.data``."""
    before = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(before)


def _same_state(model: torch.nn.Module, reference: torch.nn.Module) -> bool:
    got, want = model.state_dict(), reference.state_dict()
    return list(got) == list(want) and all(
        got[k].shape == want[k].shape and got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


# ---- torch.__future__.set_overwrite_module_params_on_conversion(True) ------------------------------------------
# With it, Module._apply (every .to(), .float(), .half(), .cpu()) replaces each parameter by a new Parameter made
# from the one it finds: for an offloaded block, from its empty placeholder. That new object is no offloaded
# parameter, so state_dict() saved it as it is, (0, 0), and a disable left it empty: every block weight was lost.

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("conversion", ["to_cpu", "float"])
def test_a_conversion_that_overwrites_parameters_keeps_every_value(backend: str, conversion: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with _overwrite_params_on_conversion():
        for m in (model, reference):
            m.to("cpu") if conversion == "to_cpu" else m.float()
    assert model.blocks[1].qkv.weight is not None
    assert _same_state(model, reference)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
    with torch.no_grad():
        assert torch.equal(model(_x()), reference(_x()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cast_that_overwrites_parameters_is_followed_by_state_dict_and_disable(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with _overwrite_params_on_conversion():
        model.half()
        reference.half()
    assert _same_state(model, reference)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
    assert model.blocks[0].up.weight.dtype == torch.float16


# ---- what already refuses or works: kept that way --------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_functional_call_with_block_parameters_is_bit_exact_and_changes_nothing(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    torch.manual_seed(4)
    given = {k: torch.randn_like(v) for k, v in reference.named_parameters() if k.startswith(("blocks.1.", "proj_in."))}
    with torch.no_grad():
        got = torch.func.functional_call(model, given, (_x(),))
        want = torch.func.functional_call(reference, given, (_x(),))
        assert torch.equal(got, want)
        assert torch.equal(model(_x()), reference(_x()))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_averaged_model_of_an_offloaded_model_is_refused_with_the_copy_message(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with pytest.raises(OffloadStateError, match="cannot be copied or pickled"):
        torch.optim.swa_utils.AveragedModel(model)
    with torch.no_grad():
        assert torch.equal(model(_x()), reference(_x()))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_load_into_a_parameter_a_conversion_overwrote_is_refused_before_anything_changes(backend: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with _overwrite_params_on_conversion():
        model.to("cpu")
    torch.manual_seed(6)
    values = {k: torch.randn_like(v) for k, v in reference.state_dict().items()}
    with pytest.raises(OffloadStateError, match="block 0: its parameter 'qkv.weight' was replaced by a new, empty "
                                                "Parameter made from its offload placeholder"):
        model.load_state_dict(values)
    assert _same_state(model, reference)  # nothing loaded, not even proj_in, which torch loads first
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
    model.load_state_dict(values)  # the way out the message names
    reference.load_state_dict(values)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("target", ["cpu", "meta"])
def test_a_disable_inside_inference_mode_gives_overwritten_parameters_ordinary_values(backend: str,
                                                                                     target: str) -> None:
    model, reference = _frozen_pair()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with _overwrite_params_on_conversion():
        model.half()
        reference.half()
    with torch.inference_mode():
        fo.disable_layerwise_offload(model, device=target)
    if target == "meta":
        assert all(p.is_meta and p.dtype == torch.float16 for p in model.blocks.parameters())
        return
    assert not any(p.is_inference() for p in model.parameters())
    assert params_equal(model, reference)
