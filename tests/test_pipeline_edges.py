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


# ---- diffusers integration: casts of an offloaded transformer ---------------------------------------

CASTS = {
    "model.to(dtype)": lambda pipe: pipe.transformer.to(torch.float16),
    "model.to(dtype=)": lambda pipe: pipe.transformer.to(dtype=torch.bfloat16),
    "model.to(device, dtype)": lambda pipe: pipe.transformer.to("cpu", torch.float64),
    "model.to(tensor)": lambda pipe: pipe.transformer.to(torch.zeros(1, dtype=torch.float16)),
    "model.half()": lambda pipe: pipe.transformer.half(),
    "model.bfloat16()": lambda pipe: pipe.transformer.bfloat16(),
    "model.double()": lambda pipe: pipe.transformer.double(),
    "model.type(dtype)": lambda pipe: pipe.transformer.type(torch.float16),
    "pipe.to(dtype)": lambda pipe: pipe.to(torch.float16),
    "pipe.to(device, dtype)": lambda pipe: pipe.to("cpu", torch.float16),
    "pipe.to(dtype=)": lambda pipe: pipe.to(dtype=torch.bfloat16),
}


@pytest.fixture(scope="module")
def resident_video() -> torch.Tensor:
    from tests._pipelines import call_arguments, tiny_pipeline

    with torch.inference_mode():
        return tiny_pipeline()(**call_arguments()).frames


@pytest.mark.parametrize("cast", list(CASTS))
def test_a_cast_of_an_offloaded_transformer_is_refused_before_anything_is_cast(cast: str,
                                                                                resident_video: torch.Tensor) -> None:
    """The cast reached the resident parts (and, from pipe.to, the other components) and the blocks' placeholders,
    not their host copy: the model was left half cast, and the engine refused it only at the next forward."""
    from fastoffload_ext.errors import OffloadStateError
    from fastoffload_ext.integrations.diffusers import offload_transformer
    from tests._pipelines import call_arguments, tiny_pipeline

    pipe = tiny_pipeline()
    offload_transformer(pipe, device="cpu")
    with pytest.raises(OffloadStateError, match=r"^fastoffload: (WanTransformer3DModel\.(to|half|bfloat16|double|type)"
                                                r"\(\)|pipe\.to\(torch\.\w+\)) would cast the layerwise-offloaded "
                                                r"(WanTransformer3DModel|pipe\.transformer) to torch\.\w+, but the "
                                                r"weights of its offloaded blocks live in the offload engine's host "
                                                r"copy.*nothing was cast.*disable_layerwise_offload"):
        CASTS[cast](pipe)
    for component in (pipe.transformer, pipe.text_encoder, pipe.vae):
        assert {p.dtype for p in component.parameters()} == {torch.float32}
    with torch.inference_mode():
        assert torch.equal(pipe(**call_arguments()).frames, resident_video)


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_a_cast_that_leaves_every_offloaded_parameter_as_it_is_runs_bit_exact(backend: str) -> None:
    from fastoffload_ext.integrations.diffusers import offload_transformer

    class Pipe:
        def __init__(self) -> None:
            self.transformer, self.reference = make_pair(3, dtype=torch.bfloat16)
            for model in (self.transformer, self.reference):
                model.proj_in.float()  # the parts outside the blocks in another dtype

    pipe = Pipe()
    offload_transformer(pipe, device="cpu", backend=backend)
    assert pipe.transformer.to(torch.bfloat16) is pipe.transformer  # only proj_in is cast
    assert pipe.transformer.bfloat16() is pipe.transformer
    assert pipe.transformer.proj_in.weight.dtype == torch.bfloat16
    pipe.reference.to(torch.bfloat16)
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(pipe.transformer(x), pipe.reference(x))


# ---- LazyModule: a component changed after it loaded ------------------------------------------------


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)


def _load_tuned(proxy: object) -> None:
    proxy.load_state_dict({k: v + 1 for k, v in _linear().state_dict().items()})  # type: ignore[attr-defined]


def _add_in_place(proxy: object) -> None:
    with torch.no_grad():
        proxy.weight.mul_(2)  # type: ignore[attr-defined]


def _replace_parameter(proxy: object) -> None:
    proxy.weight = torch.nn.Parameter(torch.ones(4, 4))


def _add_submodule(proxy: object) -> None:
    proxy.adapter = torch.nn.Linear(4, 4)


CHANGES = {
    "to(dtype)": (lambda proxy: proxy.to(torch.float64), r"its parameter 'weight' was cast from torch\.float32 to "
                                                         r"torch\.float64"),
    "half()": (lambda proxy: proxy.half(), r"its parameter 'weight' was cast from torch\.float32 to torch\.float16"),
    # The rounding stays: a reload would bring back the unrounded weights.
    "half().float()": (lambda proxy: proxy.half().float(), r"its parameter 'weight' was cast from torch\.float32 to "
                                                           r"torch\.float16 and back, which kept the rounding"),
    "to(bf16).to(fp32)": (lambda proxy: proxy.to(torch.bfloat16).to(torch.float32),
                          r"its parameter 'weight' was cast from torch\.float32 to torch\.bfloat16 and back"),
    "load_state_dict": (_load_tuned, r"its parameter 'weight' was written in place, by load_state_dict or an "
                                     r"in-place update"),
    "in-place": (_add_in_place, r"its parameter 'weight' was written in place"),
    "new parameter": (_replace_parameter, r"its parameter 'weight' was replaced"),
    "new submodule": (_add_submodule, r"its submodule 'adapter' was added"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_component_changed_after_it_loaded_is_kept_at_release_with_a_warning(change: str) -> None:
    """release() dropped the change silently: the next use reloaded the component as its loader builds it."""
    from fastoffload_ext import LazyModule

    proxy = LazyModule("vae", _linear)
    make_change, words = CHANGES[change]
    make_change(proxy)
    changed = {k: v.clone() for k, v in proxy.state_dict().items()}
    with pytest.warns(RuntimeWarning, match=r"^fastoffload: deferred module vae was not released: it changed after it "
                                            r"loaded \(" + words):
        assert proxy.release() is False
    assert proxy.is_materialized
    assert all(torch.equal(proxy.state_dict()[k], v) for k, v in changed.items())
    assert proxy.release(discard_changes=True) is True
    assert not proxy.is_materialized
    assert all(torch.equal(proxy.state_dict()[k], v) for k, v in _linear().state_dict().items())


def test_run_pipeline_keeps_a_changed_component_so_every_run_gives_the_same_answer() -> None:
    from fastoffload_ext import LazyModule, run_pipeline
    from fastoffload_ext.pipeline.schedule import Stage

    vae = LazyModule("vae", _linear)
    vae.to(torch.float64)
    stages = [Stage("decode", ["vae"], lambda x, c: c["vae"](x.to(c["vae"].weight.dtype)))]
    x = torch.randn(2, 4)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=r"deferred module vae was not released"):
        first = run_pipeline(stages, {"vae": vae}, x)
        second = run_pipeline(stages, {"vae": vae}, x)
    assert first.dtype == second.dtype == torch.float64 and torch.equal(first, second)


def test_use_moves_and_eval_do_not_keep_a_component() -> None:
    import warnings

    from fastoffload_ext import LazyModule

    class Normed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = _linear()
            self.norm = torch.nn.BatchNorm1d(4)  # persistent buffers, left alone in eval mode

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.linear(x))

    proxy = LazyModule("encoder", Normed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        proxy = proxy.to("cpu").eval()  # what pipelines do at each use
        with torch.no_grad():
            proxy(torch.randn(2, 4))
        with torch.inference_mode():
            proxy(torch.randn(2, 4))
        assert proxy.release() is True


def test_a_transform_registered_on_a_loaded_component_is_no_change_but_an_earlier_change_still_is() -> None:
    from fastoffload_ext import LazyModule

    proxy = LazyModule("vae", _linear)
    proxy.materialize()
    proxy.set_materialize_transform(lambda m: m.to(torch.float64))  # replayed on every reload
    assert proxy.release() is True
    proxy.half()
    proxy.set_materialize_transform(lambda m: m)
    with pytest.warns(RuntimeWarning, match=r"was cast from torch\.float64 to torch\.float16"):
        assert proxy.release() is False


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_copy_of_a_changed_component_is_refused(how: str) -> None:
    import copy
    import pickle

    from fastoffload_ext import LazyModule
    from fastoffload_ext.errors import OffloadStateError

    proxy = LazyModule("vae", _linear)
    copies = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": lambda p: pickle.loads(pickle.dumps(p))}
    assert not copies[how](proxy).is_materialized  # unchanged: the recipe travels
    _load_tuned(proxy)
    with pytest.raises(OffloadStateError, match=r"^fastoffload: cannot copy or pickle deferred module vae: its loaded "
                                                r"component changed after it loaded \(its parameter 'weight' was "
                                                r"written in place"):
        copies[how](proxy)


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_a_lazy_offloaded_transformer_first_used_inside_inference_mode_loads_and_releases(backend: str) -> None:
    """The load ran inside inference_mode: the weights were inference tensors, which offload refuses."""
    from fastoffload_ext import LazyModule
    from fastoffload_ext.pipeline.configure import LayerwiseAction, apply_offload_config

    proxy = LazyModule("transformer", lambda: make_pair(3)[0])
    applied = apply_offload_config({"engine": {"offload": {"dit_layerwise": True}}}, transformer=proxy,
                                   device="cpu", layerwise_options={"backend": backend})
    assert applied.layerwise is LayerwiseAction.ON_LOAD
    reference = make_pair(3)[1]
    x = torch.randn(2, 16)
    for _ in range(2):
        with torch.inference_mode():
            assert torch.equal(proxy(x), reference(x))
            assert not torch.is_grad_enabled()
        assert get_offload_group(proxy.materialize()) is not None
        assert proxy.release() is True


def test_a_load_state_dict_into_a_lazy_offloaded_transformer_is_kept() -> None:
    from fastoffload_ext import LazyModule
    from fastoffload_ext.pipeline.configure import apply_offload_config

    proxy = LazyModule("transformer", lambda: make_pair(3)[0])
    apply_offload_config({"engine": {"offload": {"dit_layerwise": True}}}, transformer=proxy, device="cpu")
    tuned = {k: v * 2 for k, v in make_pair(3)[1].state_dict().items() if k.startswith("blocks.")}
    proxy.load_state_dict(tuned, strict=False)
    reference = make_pair(3)[1]
    reference.load_state_dict(tuned, strict=False)
    x = torch.randn(2, 16)
    with pytest.warns(RuntimeWarning, match=r"its parameter 'blocks\.0\.\w+\.weight' was written in place"):
        assert proxy.release() is False
    with torch.no_grad():
        assert torch.equal(proxy(x), reference(x))


def _fuse_and_unload_lora(text_encoder: object, safe_fusing: bool) -> None:
    """diffusers' fuse_lora(lora_scale=0.5) then unload_lora_weights() on a text encoder: the base layers that come
    back are the loaded ones, each parameter the same object, with the LoRA written into it through ``.data``."""
    from diffusers.loaders.lora_base import _remove_text_encoder_monkey_patch, fuse_text_encoder_lora
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=4, target_modules=["q", "v"], init_lora_weights="gaussian"), text_encoder)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in text_encoder.named_parameters():  # type: ignore[attr-defined]
            if "lora_B" in name:
                param.normal_()  # lora_B starts at zero: a fused LoRA would change nothing
    fuse_text_encoder_lora(text_encoder, lora_scale=0.5, safe_fusing=safe_fusing)
    _remove_text_encoder_monkey_patch(text_encoder)


@pytest.mark.parametrize("safe_fusing", [False, True])
def test_a_lora_fused_into_a_lazy_text_encoder_and_unloaded_is_kept_at_release(safe_fusing: bool) -> None:
    """peft merges through ``.data``, which no version counter saw: release() dropped the fused text encoder, and
    the next use reloaded it without the LoRA."""
    from fastoffload_ext import LazyModule
    from tests._pipelines import wan

    build = wan.loaders(wan.TINY, torch.float32, 0, "cpu")["text_encoder"]
    ids = torch.tensor([[3, 4, 5, 6, 1]])
    resident = build()
    _fuse_and_unload_lora(resident, safe_fusing)
    proxy = LazyModule("text_encoder", build)
    _fuse_and_unload_lora(proxy, safe_fusing)
    with torch.no_grad():
        expected = resident(ids).last_hidden_state
        assert not torch.equal(expected, build()(ids).last_hidden_state)  # the LoRA changed the text encoder
        assert torch.equal(proxy(ids).last_hidden_state, expected)
        with pytest.warns(RuntimeWarning, match=r"^fastoffload: deferred module text_encoder was not released: it "
                                                r"changed after it loaded \(its parameter '[\w.]+\.(q|v)\.weight' "
                                                r"was written in place"):
            assert proxy.release() is False
        assert torch.equal(proxy(ids).last_hidden_state, expected)


@pytest.mark.parametrize("backend", ["ext", "python"])
@pytest.mark.parametrize("resident_blocks", [None, 3])
def test_a_lora_merged_into_a_lazy_offloaded_transformer_is_kept_at_release(backend: str,
                                                                            resident_blocks: int | None) -> None:
    """The merge ran on the blocks' real weights (in their mutate scope, or resident) but through ``.data``:
    release() dropped the merged transformer, and the reload ran the adapter unmerged, rounded otherwise."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    from fastoffload_ext import LazyModule
    from fastoffload_ext.pipeline.configure import apply_offload_config

    def build() -> torch.nn.Module:
        model = make_pair(3)[0]
        inject_adapter_in_model(LoraConfig(r=2, target_modules=["up"], init_lora_weights="gaussian"), model)
        torch.manual_seed(7)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_()
        return model.requires_grad_(False)

    proxy = LazyModule("transformer", build)
    options = {"backend": backend} if resident_blocks is None else {"backend": backend, "resident_blocks": 3}
    apply_offload_config({"engine": {"offload": {"dit_layerwise": True}}}, transformer=proxy, device="cpu",
                         layerwise_options=options)
    reference = build()
    x = torch.randn(2, 16)
    with torch.no_grad():
        proxy(x)
        for model in (proxy, reference):
            for layer in model.modules():
                if isinstance(layer, BaseTunerLayer):
                    layer.merge()
        expected = reference(x)
        assert torch.equal(proxy(x), expected)
        with pytest.warns(RuntimeWarning, match=r"its parameter 'blocks\.0\.up\.base_layer\.weight' was written "
                                                r"in place"):
            assert proxy.release() is False
        assert torch.equal(proxy(x), expected)


# ---- apply_offload_config: a requested offload the device policy turned off ---------------------------


@pytest.mark.parametrize("platform", ["unified", "mps"])
def test_layerwise_offload_the_policy_turned_off_is_a_warning(platform: str, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """The policy's own line is INFO on unified memory: at the default level nothing named the setting."""
    import logging

    import fastoffload_ext.policy.platform as device_platform
    from fastoffload_ext.pipeline.configure import LayerwiseAction, apply_offload_config

    if platform == "unified":
        monkeypatch.setattr(device_platform, "has_unified_memory", lambda device_id=0: True)
        monkeypatch.setattr(device_platform, "device_name", lambda device_id=0: "Test iGPU")
        step = "apply_unified_memory_offload_policy"
    else:
        monkeypatch.setattr(device_platform, "has_unified_memory", lambda device_id=0: False)
        monkeypatch.setattr(device_platform, "is_mps", lambda: True)
        step = "apply_mps_offload_policy"
    with caplog.at_level(logging.WARNING):
        applied = apply_offload_config({"engine": {"offload": {"dit_layerwise": True}}}, transformer=make_pair(2)[0],
                                       device="cpu")
    assert applied.layerwise is LayerwiseAction.DISABLED
    assert [r.getMessage() for r in caplog.records if r.name == "fastoffload_ext.pipeline.configure"] == [
        f"engine.offload.dit_layerwise was requested but {step} turned it off, so the transformer is not offloaded; "
        "AppliedOffload.explain() says why"]


def test_layerwise_offload_left_off_by_the_config_is_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from fastoffload_ext.pipeline.configure import LayerwiseAction, apply_offload_config

    with caplog.at_level(logging.WARNING):
        applied = apply_offload_config({"engine": {"offload": {"dit_layerwise": False}}}, transformer=make_pair(2)[0],
                                       device="cpu")
    assert applied.layerwise is LayerwiseAction.DISABLED
    assert not caplog.records


# ---- FastVideo integration: an install that fails part-way ----------------------------------------------


def test_fastvideo_install_that_fails_part_way_puts_back_what_it_rebound(
        fastvideo_integration: types.ModuleType) -> None:
    """The names rebound before the failure stayed, with is_installed() False: nothing could put them back."""
    import fastvideo.hooks.hooks as fv_hooks
    import fastvideo.hooks.layerwise_offload as fv_offload

    original = fv_offload.enable_layerwise_offload

    class Refusing(types.ModuleType):
        def __setattr__(self, name: str, value: object) -> None:
            if name == "enable_layerwise_offload":
                raise AttributeError("read-only")
            super().__setattr__(name, value)

    refusing = Refusing("fastvideo.zz_edge_refusing")  # after every FastVideo module in sys.modules order
    types.ModuleType.__setattr__(refusing, "enable_layerwise_offload", original)
    before = {name: dict(vars(module)) for name, module in list(sys.modules.items())
              if name == "fastvideo" or name.startswith("fastvideo.")}
    sys.modules[refusing.__name__] = refusing
    try:
        with pytest.raises(AttributeError, match="read-only"):
            fastvideo_integration.install(device="cpu")
        assert not fastvideo_integration.is_installed()
        changed = [f"{name}.{key}" for name, names in before.items() for key, value in names.items()
                   if vars(sys.modules[name]).get(key) is not value]
        assert changed == []
        assert fv_offload.enable_layerwise_offload is original
        assert fv_hooks.ModuleHookManager.__module__ == "fastvideo.hooks.hooks"
    finally:
        sys.modules.pop(refusing.__name__, None)
