"""Edge cases of the layers above the engine: the pipeline kit, the device policy and the integrations.

Each test pins one behaviour that was wrong (a lost value, a silent wrong answer or an unhelpful error)
and is kept so it stays right.
"""
from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest
import torch

from fastoffload_ext import get_offload_group
from tests._models import make_pair

# ---- FastVideo integration: modules imported while installed ----------------------------------------


@pytest.fixture
def fastvideo_integration() -> Iterator[types.ModuleType]:
    from tests._fastvideo import import_fastvideo

    import_fastvideo("fastvideo.hooks.layerwise_offload")
    from fastoffload_ext.integrations import fastvideo as integration

    integration.uninstall()
    yield integration
    integration.uninstall()


def _late_fastvideo_module(name: str) -> types.ModuleType:
    """A FastVideo module imported while the integration is installed (it imports the entry point by name)."""
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec("from fastvideo.hooks.layerwise_offload import enable_layerwise_offload", module.__dict__)
    return module


def test_fastvideo_module_imported_while_installed_gets_fastvideo_back_on_uninstall(
        fastvideo_integration: types.ModuleType) -> None:
    import fastvideo.hooks.layerwise_offload as fv_offload

    original = fv_offload.enable_layerwise_offload
    fastvideo_integration.install(device="cpu")
    late = _late_fastvideo_module("fastvideo._edge_late_import")
    try:
        assert late.enable_layerwise_offload is fv_offload.enable_layerwise_offload is not original
        assert fastvideo_integration.uninstall() is True
        assert late.enable_layerwise_offload is original
    finally:
        sys.modules.pop("fastvideo._edge_late_import", None)


def test_fastvideo_module_imported_between_installs_runs_the_new_options(
        fastvideo_integration: types.ModuleType) -> None:
    fastvideo_integration.install(device="cpu", prefetch_depth=2)
    late = _late_fastvideo_module("fastvideo._edge_between_installs")
    try:
        fastvideo_integration.install(device="cpu", backend="python")
        model, reference = make_pair(3)
        late.enable_layerwise_offload(model)
        group = get_offload_group(model)
        assert group is not None and (group.backend, group.prefetch_depth) == ("python", 1)
        x = torch.randn(2, 16)
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
    finally:
        sys.modules.pop("fastvideo._edge_between_installs", None)


# ---- diffusers integration: which denoisers to offload ----------------------------------------------


def test_offload_transformer_names_given_as_a_string_is_refused_clearly() -> None:
    from fastoffload_ext.integrations.diffusers import offload_transformer
    from tests._pipelines import tiny_pipeline

    pipe = tiny_pipeline()
    with pytest.raises(TypeError, match=r"^fastoffload: offload_transformer\(\) names must be a sequence of "
                                        r"attribute names, got the string 'transformer'"):
        offload_transformer(pipe, names="transformer", device="cpu")
    assert get_offload_group(pipe.transformer) is None


def test_offload_transformer_name_without_a_module_offloads_nothing_and_says_so() -> None:
    from fastoffload_ext.integrations.diffusers import offload_transformer
    from tests._pipelines import tiny_pipeline

    pipe = tiny_pipeline()
    assert pipe.transformer_2 is None
    with pytest.raises(ValueError, match=r"^fastoffload: offload_transformer\(\) cannot offload pipe\.transformer_2: "
                                         r"it holds None, not an nn\.Module"):
        offload_transformer(pipe, names=("transformer", "transformer_2"), device="cpu")
    # Checked before anything is offloaded: a half-applied call would leave pipe.transformer offloaded
    # without the pipeline's wrappers (enable_model_cpu_offload would then hook it).
    assert get_offload_group(pipe.transformer) is None
    assert "enable_model_cpu_offload" not in vars(pipe)


# ---- apply_offload_config: layerwise options the engine accepts ------------------------------------


@pytest.mark.parametrize("resident", [{0, 2}, [1], "auto"], ids=["set", "list", "auto"])
def test_apply_offload_config_passes_every_resident_blocks_form_the_engine_takes(resident: object) -> None:
    from fastoffload_ext import enable_layerwise_offload
    from fastoffload_ext.pipeline.configure import LayerwiseAction, apply_offload_config

    model, reference = make_pair(4)
    direct, _ = make_pair(4)
    expected = enable_layerwise_offload(direct, device="cpu", resident_blocks=resident)
    applied = apply_offload_config({"engine": {"offload": {"dit_layerwise": True}}}, transformer=model, device="cpu",
                                   layerwise_options={"resident_blocks": resident})
    assert applied.layerwise is LayerwiseAction.APPLIED
    assert expected is not None and applied.layerwise_result.resident == expected.resident
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("resident", [-1, True, [0, -1], "all"])
def test_apply_offload_config_still_refuses_bad_resident_blocks_before_loading(resident: object) -> None:
    from fastoffload_ext.errors import OffloadConfigError
    from fastoffload_ext.pipeline.configure import apply_offload_config

    loaded: list[str] = []
    with pytest.raises(OffloadConfigError, match=r"^fastoffload: resident_blocks (indices )?must be"):
        apply_offload_config({"engine": {"offload": {"dit_layerwise": True}}}, transformer="dit", device="cpu",
                             components={"dit": lambda: loaded.append("dit") or make_pair(4)[0]},
                             layerwise_options={"resident_blocks": resident})
    assert loaded == []


BAD_LAYERWISE_VALUES = [
    ({"compress": "yes"}, r"compress must be False, True or 'auto', got 'yes'$"),
    ({"block_lists": "transformer_blocks"}, r"block_lists must be None, 'all' or a list of attribute names, got the "
                                            r"string 'transformer_blocks'; write block_lists=\['transformer_blocks'\] "
                                            r"for one list$"),
    ({"block_lists": []}, r"block_lists must be None, 'all' or a non-empty list of attribute names of direct-child "
                          r"nn\.ModuleLists, got \[\]$"),
    ({"device_budget": "lots"}, r"device_budget must be None, a number of bytes, or a size such as '20GiB'"),
    ({"host_budget": -1}, r"host_budget must not be negative, got -1"),
    ({"activation_reserve": "auto"}, r"activation_reserve must be None, a number of bytes, or a size such as"),
    ({"activation_reserve": "1MiB"}, r"activation_reserve is the part of a device_budget kept for activations, and "
                                     r"no device_budget was given"),
    ({"plan": {"resident": [0]}}, r"plan must be an OffloadPlan from plan_offload\(\), got dict$"),
    ({"weights": {"blocks.0.weight": torch.zeros(1)}}, r"weights= takes the path of a safetensors checkpoint"),
    ({"disk_options": object()}, r"disk_options needs weights="),
    ({"is_replace": "no"}, r"is_replace must be True or False, got 'no'$"),
    ({"allow_pageable_fallback": 1}, r"allow_pageable_fallback must be True or False, got 1$"),
]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("options, message", BAD_LAYERWISE_VALUES,
                         ids=[next(iter(options)) + f"-{i}" for i, (options, _) in enumerate(BAD_LAYERWISE_VALUES)])
def test_apply_offload_config_refuses_bad_layerwise_values_before_loading(options: dict[str, object], message: str,
                                                                          lazy: bool) -> None:
    """Values the engine refuses whatever the model: refused before a loader runs. A lazy transformer was
    reported offloaded on load, and then every load raised."""
    from fastoffload_ext.errors import OffloadConfigError
    from fastoffload_ext.pipeline.configure import apply_offload_config

    loaded: list[str] = []
    with pytest.raises(OffloadConfigError, match=r"^fastoffload: " + message):
        apply_offload_config({"engine": {"offload": {"dit_layerwise": True, "lazy_module_load": lazy}}},
                             transformer="dit", device="cpu", layerwise_options=options,
                             components={"dit": lambda: loaded.append("dit") or make_pair(3)[0],
                                         "vae": lambda: loaded.append("vae") or torch.nn.Linear(2, 2)})
    assert loaded == []


# ---- apply_offload_config: what it reports for a lazy transformer the engine will decline --------------


def test_lazy_transformer_the_engine_will_decline_is_reported_skipped(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    from fastoffload_ext.pipeline.configure import LayerwiseAction, apply_offload_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    applied = apply_offload_config({"engine": {"offload": {"dit_layerwise": True, "lazy_module_load": True}}},
                                   transformer="dit", components={"dit": lambda: make_pair(3)[0]})
    # No CUDA and no device: every load would be declined, so "applied on load" would be untrue.
    assert applied.layerwise is LayerwiseAction.SKIPPED
    assert applied.explain().splitlines()[0].startswith("Layerwise offload: skipped")
    assert "no device was given and CUDA is not available" in caplog.text
    assert get_offload_group(applied.components["dit"].materialize()) is None
