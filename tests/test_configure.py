"""apply_offload_config: resolves through the device policy, then acts, and reports why.

Two kinds of test: with a recording stand-in for ``enable_layerwise_offload`` (to pin down exactly what
is called, when, and with which arguments), and with the real engine on the host device
(``device="cpu"``) to check the end result: hooks attached, outputs bit-identical to the resident model.
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fastoffload_ext.engine.layerwise
import fastoffload_ext.policy.platform
from fastoffload_ext import policy
from fastoffload_ext.pipeline.configure import AppliedOffload, LayerwiseAction, apply_offload_config
from fastoffload_ext.engine.hooks import ModuleHookManager
from fastoffload_ext.pipeline.lazy import LazyModule, is_lazy_module
from fastoffload_ext.policy.resolution import ResolutionView, UnknownPathError

LAYERWISE_ON = {"engine": {"offload": {"dit_layerwise": True}}}


class TinyDiT(nn.Module):
    """A transformer-shaped model: an embedding, then a ModuleList of residual blocks."""

    def __init__(self, blocks: int = 3, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                    for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return x


def tiny_dit(seed: int = 0) -> TinyDiT:
    torch.manual_seed(seed)
    return TinyDiT()


class RecordingEnable:
    """Stands in for enable_layerwise_offload and records every call."""

    def __init__(self, result: Any = "group") -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []
        self.result = result

    def __call__(self, model: Any, **kwargs: Any) -> Any:
        self.calls.append((model, kwargs))
        return self.result


@pytest.fixture
def fake_enable(monkeypatch: pytest.MonkeyPatch) -> RecordingEnable:
    recorder = RecordingEnable()
    monkeypatch.setattr(fastoffload_ext.engine.layerwise, "enable_layerwise_offload", recorder)
    return recorder


@pytest.fixture
def unified_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fastoffload_ext.policy.platform, "has_unified_memory", lambda device_id=0: True)
    monkeypatch.setattr(fastoffload_ext.policy.platform, "device_name", lambda device_id=0: "Test iGPU")


class CountingLoaders:
    def __init__(self, *names: str) -> None:
        self.loads: list[str] = []
        self.loaders: dict[str, Callable[[], nn.Module]] = {name: self._loader(name) for name in names}

    def _loader(self, name: str) -> Callable[[], nn.Module]:
        def load() -> nn.Module:
            self.loads.append(name)
            return tiny_dit() if name == "transformer" else nn.Linear(4, 4)
        return load


# ---- what gets done, decided by the config --------------------------------------------------------

def test_layerwise_applied_to_a_module(fake_enable: RecordingEnable) -> None:
    model = tiny_dit()
    applied = apply_offload_config(LAYERWISE_ON, transformer=model, device="cpu",
                                   layerwise_options={"prefetch_depth": 2, "resident_blocks": 1})
    assert applied.layerwise is LayerwiseAction.APPLIED
    assert applied.layerwise_result == "group"
    assert fake_enable.calls == [(model, {"device": "cpu", "prefetch_depth": 2, "resident_blocks": 1})]


def test_layerwise_off_in_config_calls_nothing(fake_enable: RecordingEnable) -> None:
    applied = apply_offload_config({}, transformer=tiny_dit(), device="cpu")
    assert applied.layerwise is LayerwiseAction.DISABLED
    assert applied.layerwise_result is None
    assert fake_enable.calls == []


def test_policy_turning_layerwise_off_is_explained(fake_enable: RecordingEnable, unified_device: None) -> None:
    applied = apply_offload_config(LAYERWISE_ON, transformer=tiny_dit(), device="cpu")
    assert applied.layerwise is LayerwiseAction.DISABLED
    assert fake_enable.calls == []
    assert applied.resolution.decided_by("engine.offload.dit_layerwise") == "apply_unified_memory_offload_policy"
    text = applied.explain()
    assert text.splitlines()[0] == ("Layerwise offload: disabled [engine.offload.dit_layerwise = False "
                                    "(set by apply_unified_memory_offload_policy)]")
    assert "decided by apply_unified_memory_offload_policy (input: True)" in text


def test_layerwise_without_transformer_warns(fake_enable: RecordingEnable, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fastoffload_ext.pipeline.configure"):
        applied = apply_offload_config(LAYERWISE_ON)
    assert applied.layerwise is LayerwiseAction.NO_TRANSFORMER
    assert fake_enable.calls == []
    assert [r.getMessage() for r in caplog.records] == [
        "engine.offload.dit_layerwise is on but no transformer was given, so nothing is offloaded; pass transformer= "
        "to apply_offload_config"]


def test_engine_declining_is_reported_as_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fastoffload_ext.engine.layerwise, "enable_layerwise_offload", RecordingEnable(result=None))
    applied = apply_offload_config(LAYERWISE_ON, transformer=tiny_dit())
    assert applied.layerwise is LayerwiseAction.SKIPPED


def test_components_load_now_when_lazy_loading_is_off(fake_enable: RecordingEnable) -> None:
    loaders = CountingLoaders("text_encoder", "vae")
    applied = apply_offload_config({"engine": {"offload": {"lazy_module_load": False}}}, components=loaders.loaders)
    assert loaders.loads == ["text_encoder", "vae"]
    assert applied.lazy_components == ()
    assert all(type(component) is nn.Linear for component in applied.components.values())


def test_components_are_wrapped_when_lazy_loading_is_on(fake_enable: RecordingEnable) -> None:
    loaders = CountingLoaders("text_encoder", "vae")
    applied = apply_offload_config({"engine": {"offload": {"lazy_module_load": True}}}, components=loaders.loaders)
    assert loaders.loads == []
    assert applied.lazy_components == ("text_encoder", "vae")
    vae = applied.components["vae"]
    assert is_lazy_module(vae) and vae.lazy_name == "vae"
    vae(torch.ones(4))
    assert loaders.loads == ["vae"]


def test_policy_turns_lazy_loading_on_for_unified_memory(fake_enable: RecordingEnable, unified_device: None) -> None:
    loaders = CountingLoaders("text_encoder", "vae")
    applied = apply_offload_config({"engine": {"offload": {"vae": True}}}, components=loaders.loaders)
    assert applied.lazy_components == ("text_encoder", "vae")
    assert loaders.loads == []
    assert applied.resolution.decided_by("engine.offload.lazy_module_load") == "fill_lazy_module_load"
    assert applied.config["engine"]["offload"]["vae"] is False
    assert ("Lazy components: text_encoder, vae "
            "[engine.offload.lazy_module_load = True (set by fill_lazy_module_load)]") in applied.explain()


def test_training_keeps_components_resident_on_unified_memory(fake_enable: RecordingEnable,
                                                               unified_device: None) -> None:
    loaders = CountingLoaders("vae")
    applied = apply_offload_config({"mode": "finetuning"}, components=loaders.loaders)
    assert applied.lazy_components == ()
    assert loaders.loads == ["vae"]


def test_lazy_transformer_by_name_is_offloaded_on_every_load(fake_enable: RecordingEnable) -> None:
    loaders = CountingLoaders("transformer", "vae")
    config = {"engine": {"offload": {"dit_layerwise": True, "lazy_module_load": True}}}
    applied = apply_offload_config(config, transformer="transformer", components=loaders.loaders, device="cpu")
    assert applied.layerwise is LayerwiseAction.ON_LOAD
    assert loaders.loads == [] and fake_enable.calls == []  # nothing loaded to register the offload
    proxy = applied.components["transformer"]
    first = proxy.materialize()
    assert fake_enable.calls == [(first, {"device": "cpu"})]
    del first
    fake_enable.calls.clear()  # held, the released instance would come back instead of a reload
    proxy.release()
    second = proxy.materialize()
    assert loaders.loads == ["transformer", "transformer"]
    assert fake_enable.calls == [(second, {"device": "cpu"})]


def test_eager_transformer_by_name_is_offloaded_once(fake_enable: RecordingEnable) -> None:
    loaders = CountingLoaders("transformer")
    config = {"engine": {"offload": {"dit_layerwise": True, "lazy_module_load": False}}}
    applied = apply_offload_config(config, transformer="transformer", components=loaders.loaders, device="cpu")
    assert applied.layerwise is LayerwiseAction.APPLIED
    assert fake_enable.calls == [(applied.components["transformer"], {"device": "cpu"})]


def test_user_lazy_transformer_is_not_loaded_to_register(fake_enable: RecordingEnable) -> None:
    loads: list[int] = []
    proxy = LazyModule("transformer", lambda: loads.append(1) or tiny_dit())
    applied = apply_offload_config(LAYERWISE_ON, transformer=proxy, device="cpu")
    assert applied.layerwise is LayerwiseAction.ON_LOAD
    assert loads == [] and fake_enable.calls == []
    loaded = proxy.materialize()
    assert fake_enable.calls == [(loaded, {"device": "cpu"})]


def test_already_loaded_lazy_transformer_is_offloaded_now(fake_enable: RecordingEnable) -> None:
    proxy = LazyModule("transformer", tiny_dit)
    loaded = proxy.materialize()
    apply_offload_config(LAYERWISE_ON, transformer=proxy, device="cpu")
    assert fake_enable.calls == [(loaded, {"device": "cpu"})]
    assert proxy.materialize() is loaded


def test_whole_module_offloads_are_reported_not_dropped(fake_enable: RecordingEnable,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    config = {"engine": {"use_fsdp_inference": True, "offload": {"vae": True, "text_encoder": True}}}
    with caplog.at_level(logging.INFO, logger="fastoffload_ext.pipeline.configure"):
        applied = apply_offload_config(config)
    assert applied.not_applied == ("engine.use_fsdp_inference", "engine.offload.text_encoder", "engine.offload.vae")
    assert ("Resolved on but not performed by fastoffload_ext, act on them in your pipeline: "
            "engine.use_fsdp_inference, engine.offload.text_encoder, engine.offload.vae") in caplog.text
    assert "Offload applied: layerwise disabled, lazy components: none" in caplog.text
    assert "your pipeline must act on them): engine.use_fsdp_inference, engine.offload.text_encoder" \
        in applied.explain()


def test_conflict_rule_removes_fsdp_from_not_applied(fake_enable: RecordingEnable) -> None:
    config = {"engine": {"use_fsdp_inference": True, "offload": {"dit_layerwise": True, "dit": True}}}
    applied = apply_offload_config(config, transformer=tiny_dit(), device="cpu")
    assert applied.not_applied == ()
    assert applied.config["engine"]["use_fsdp_inference"] is False


def test_custom_steps(fake_enable: RecordingEnable) -> None:
    def force_layerwise(view: ResolutionView) -> dict[str, Any]:
        return {"engine.offload.dit_layerwise": True}

    model = tiny_dit()
    applied = apply_offload_config({}, transformer=model, device="cpu",
                                   steps=(*policy.DEVICE_POLICY_STEPS, force_layerwise))
    assert applied.layerwise is LayerwiseAction.APPLIED
    assert applied.resolution.decided_by("engine.offload.dit_layerwise") == "force_layerwise"


def test_config_is_not_mutated(fake_enable: RecordingEnable, unified_device: None) -> None:
    config = {"engine": {"offload": {"dit_layerwise": True, "vae": True}}}
    before = copy.deepcopy(config)
    apply_offload_config(config, transformer=tiny_dit())
    assert config == before


def test_result_is_read_only(fake_enable: RecordingEnable) -> None:
    applied = apply_offload_config({}, components=CountingLoaders("vae").loaders)
    assert isinstance(applied, AppliedOffload)
    with pytest.raises(TypeError):
        applied.components["vae"] = None  # type: ignore[index]


# ---- errors: all raised before anything is loaded or hooked ----------------------------------------

def test_loaded_module_instead_of_loader(fake_enable: RecordingEnable) -> None:
    with pytest.raises(TypeError, match=r"fastoffload: components\['vae'\] is a loaded Linear; pass a loader instead, "
                                        r"e\.g\. components=\{'vae': build_vae\}"):
        apply_offload_config(LAYERWISE_ON, transformer=tiny_dit(), components={"vae": nn.Linear(2, 2)})
    assert fake_enable.calls == []


def test_lazy_module_instead_of_loader(fake_enable: RecordingEnable) -> None:
    loads: list[int] = []
    proxy = LazyModule("vae", lambda: loads.append(1) or nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"fastoffload: components\['vae'\] is already a LazyModule; pass its "
                                        r"loader"):
        apply_offload_config({}, components={"vae": proxy})
    assert loads == []


def test_non_callable_component(fake_enable: RecordingEnable) -> None:
    with pytest.raises(TypeError, match=r"fastoffload: components\['vae'\] is str, not a loader; pass a zero-argument "
                                        r"callable"):
        apply_offload_config({}, components={"vae": "stabilityai/sd-vae"})


def test_components_not_a_mapping(fake_enable: RecordingEnable) -> None:
    with pytest.raises(TypeError, match=r"fastoffload: components must be a mapping of name -> loader, got list"):
        apply_offload_config({}, components=[tiny_dit])  # type: ignore[arg-type]


def test_transformer_name_not_in_components(fake_enable: RecordingEnable) -> None:
    loaders = CountingLoaders("vae")
    with pytest.raises(ValueError, match=r"fastoffload: transformer='dit' names no component; components has 'vae'\. "
                                         r"Pass the transformer module, or the key of its loader in components"):
        apply_offload_config(LAYERWISE_ON, transformer="dit", components=loaders.loaders)
    assert loaders.loads == []


def test_transformer_of_the_wrong_kind(fake_enable: RecordingEnable) -> None:
    with pytest.raises(TypeError, match=r"fastoffload: transformer must be an nn.Module, a LazyModule or the name of a "
                                        r"component, got dict"):
        apply_offload_config(LAYERWISE_ON, transformer={"blocks": []})  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["device", "model"])
def test_reserved_layerwise_options(fake_enable: RecordingEnable, key: str) -> None:
    with pytest.raises(ValueError, match=rf"fastoffload: layerwise_options may not contain '{key}': pass the "
                                         r"transformer as transformer= and the device as device= to "
                                         r"apply_offload_config"):
        apply_offload_config(LAYERWISE_ON, transformer=tiny_dit(), layerwise_options={key: "cpu"})
    assert fake_enable.calls == []


def test_loader_returning_none(fake_enable: RecordingEnable) -> None:
    with pytest.raises(ValueError, match=r"fastoffload: loader for component vae returned None; the loader must return "
                                         r"the built component"):
        apply_offload_config({"engine": {"offload": {"lazy_module_load": False}}}, components={"vae": lambda: None})


def test_resolution_errors_propagate(fake_enable: RecordingEnable) -> None:
    def typo(view: ResolutionView) -> dict[str, Any]:
        return {"engine.offload.layerwise": True}

    with pytest.raises(UnknownPathError, match=r"fastoffload: resolution step typo set 'engine.offload.layerwise'"):
        apply_offload_config({}, transformer=tiny_dit(), steps=[typo])
    assert fake_enable.calls == []


# ---- with the real engine on the host device ---------------------------------------------------------

def _hooked_blocks(model: TinyDiT) -> list[bool]:
    flags = []
    for block in model.blocks:
        manager = ModuleHookManager.get_from(block)
        flags.append(manager is not None and manager.get_forward_hook("LayerwiseOffloadHook") is not None)
    return flags


def test_real_engine_offloads_and_matches_the_resident_model() -> None:
    model = tiny_dit(seed=1)
    resident = copy.deepcopy(model)
    x = torch.randn(5, 8)
    with torch.no_grad():
        expected = resident(x)
    applied = apply_offload_config(LAYERWISE_ON, transformer=model, device="cpu")
    assert applied.layerwise is LayerwiseAction.APPLIED
    assert applied.layerwise_result is fastoffload_ext.engine.layerwise.get_offload_group(model)
    assert _hooked_blocks(model) == [True, True, True]
    with torch.no_grad():
        for _ in range(3):  # repeated steps, with the wrap-around prefetch
            assert torch.equal(model(x), expected)


def test_real_engine_on_a_lazy_transformer_survives_release() -> None:
    proxy = LazyModule("transformer", lambda: tiny_dit(seed=2))
    x = torch.randn(5, 8)
    with torch.no_grad():
        expected = tiny_dit(seed=2)(x)
    applied = apply_offload_config({"engine": {"offload": {"dit_layerwise": True, "lazy_module_load": True}}},
                                   transformer=proxy, device="cpu")
    assert applied.layerwise is LayerwiseAction.ON_LOAD
    assert proxy.is_materialized is False
    with torch.no_grad():
        assert torch.equal(proxy(x), expected)
    assert _hooked_blocks(proxy.materialize()) == [True, True, True]
    assert proxy.release() is True
    with torch.no_grad():
        assert torch.equal(proxy(x), expected)  # the reloaded instance is offloaded again
    assert fastoffload_ext.engine.layerwise.get_offload_group(proxy.materialize()) is not None


def test_real_engine_untouched_when_the_policy_says_no(unified_device: None) -> None:
    model = tiny_dit()
    applied = apply_offload_config(LAYERWISE_ON, transformer=model, device="cpu")
    assert applied.layerwise is LayerwiseAction.DISABLED
    assert fastoffload_ext.engine.layerwise.get_offload_group(model) is None
    assert _hooked_blocks(model) == [False, False, False]


def test_real_engine_rejects_a_model_without_blocks() -> None:
    with pytest.raises(ValueError, match=r"^fastoffload: No nn\.ModuleList found in the model for layerwise "
                                         r"offloading\. "):
        apply_offload_config(LAYERWISE_ON, transformer=nn.Linear(2, 2), device="cpu")


def test_layerwise_stand_in_matches_the_engine_signature() -> None:
    """The stand-in above is only valid while the engine accepts what apply_offload_config passes."""
    import inspect

    parameters = inspect.signature(fastoffload_ext.engine.layerwise.enable_layerwise_offload).parameters
    assert list(parameters)[:2] == ["model", "is_replace"]
    for keyword in ("device", "resident_blocks", "cyclic", "prefetch_depth", "backend", "pin_backing"):
        assert parameters[keyword].kind is inspect.Parameter.KEYWORD_ONLY


# ---- every argument is checked before any loader runs ----------------------------------------------------

EAGER_LAYERWISE = {"engine": {"offload": {"dit_layerwise": True, "lazy_module_load": False}}}


@pytest.mark.parametrize("options, error, message", [
    ({"prefetch_depth": -1}, ValueError, r"prefetch_depth must be an integer >= 0 \(blocks copied ahead\) or 'auto', got -1"),
    ({"prefetch_dept": 2}, TypeError, r"fastoffload: layerwise_options does not fit enable_layerwise_offload \(got "
                                      r"an unexpected keyword argument 'prefetch_dept'\); pass only its keyword "
                                      r"arguments"),
    ({"cyclic": "yes"}, ValueError, r"cyclic must be True or False, got 'yes'"),
    ({"pin_backing": "locked"}, ValueError, r"pin_backing must be one of 'host_alloc', 'register', 'pageable', got "
                                            r"'locked'"),
    ({"resident_blocks": -2}, ValueError, r"resident_blocks must be None or an integer >= 0, got -2"),
    ({"backend": "cuda"}, ValueError, r"backend must be one of 'auto', 'ext', 'python', got 'cuda'"),
    ({"share_host_copy": "yes"}, ValueError, r"share_host_copy must be True, False or 'auto', got 'yes'"),
])
def test_bad_layerwise_options_fail_before_any_loader_runs(options: dict[str, Any], error: type[Exception],
                                                           message: str) -> None:
    loaders = CountingLoaders("transformer", "vae")
    with pytest.raises(error, match=message):
        apply_offload_config(EAGER_LAYERWISE, transformer="transformer", components=loaders.loaders, device="cpu",
                             layerwise_options=options)
    assert loaders.loads == []


def test_bad_device_fails_before_any_loader_runs() -> None:
    loaders = CountingLoaders("transformer", "vae")
    with pytest.raises(ValueError, match=r"fastoffload: device must be 'cuda', 'cuda:N' or 'cpu', got 'tpu'"):
        apply_offload_config(EAGER_LAYERWISE, transformer="transformer", components=loaders.loaders, device="tpu")
    assert loaders.loads == []
    # A device the policy never uses (layerwise offload off) is not judged: nothing would use it.
    applied = apply_offload_config({"engine": {"offload": {"lazy_module_load": False}}}, transformer="transformer",
                                   components=loaders.loaders, device="tpu")
    assert applied.layerwise is LayerwiseAction.DISABLED and sorted(loaders.loads) == ["transformer", "vae"]


def test_layerwise_options_not_a_mapping() -> None:
    with pytest.raises(TypeError, match=r"fastoffload: layerwise_options must be a mapping of enable_layerwise_offload "
                                        r"keyword arguments, got list"):
        apply_offload_config(LAYERWISE_ON, transformer=tiny_dit(),
                             layerwise_options=[("prefetch_depth", 2)])  # type: ignore[arg-type]


# ---- applying a config again ------------------------------------------------------------------------
#
# A second apply_offload_config for a transformer that has layerwise offload is refused before anything
# loads, unless layerwise_options asks to replace it (is_replace=True). Before, a lazy transformer got a
# second offload transform stacked on the first: every later load then failed ("already enabled"), or,
# loaded already, the second call raised from deep inside the engine.

ALREADY_LAZY = ("fastoffload: the lazy transformer 'transformer' already has layerwise offload registered by an "
                "earlier apply_offload_config call (it offloads every instance it loads); applying it again would "
                "offload it twice. To replace that offload with this call's options, pass "
                "layerwise_options={..., 'is_replace': True}; to keep it, do not apply the config to this transformer "
                "again (or pass a config with engine.offload.dit_layerwise=False)")
LAZY_CONFIG = {"engine": {"offload": {"dit_layerwise": True, "lazy_module_load": True}}}


class CountingTransformer:
    """A lazy transformer's loader that counts its loads; every instance has the same weights."""

    def __init__(self) -> None:
        self.loads = 0

    def __call__(self) -> TinyDiT:
        self.loads += 1
        return tiny_dit(seed=3)


def _group_of(proxy: LazyModule) -> Any:
    return fastoffload_ext.engine.layerwise.get_offload_group(proxy.materialize())


def _runs_exactly(proxy: Any, x: torch.Tensor) -> None:
    with torch.no_grad():
        assert torch.equal(proxy(x), tiny_dit(seed=3)(x))


@pytest.mark.parametrize("loaded_first", [False, True], ids=["before-first-load", "after-first-load"])
def test_applying_again_to_a_lazy_transformer_is_refused_up_front(loaded_first: bool) -> None:
    from fastoffload_ext.errors import OffloadConfigError

    loader = CountingTransformer()
    proxy = LazyModule("transformer", loader)
    x = torch.randn(5, 8)
    if loaded_first:
        proxy.materialize()
    assert apply_offload_config(LAZY_CONFIG, transformer=proxy, device="cpu").layerwise is LayerwiseAction.ON_LOAD
    group = _group_of(proxy) if loaded_first else None
    loads = loader.loads
    with pytest.raises(OffloadConfigError) as refused:
        apply_offload_config(LAZY_CONFIG, transformer=proxy, device="cpu")
    assert str(refused.value) == ALREADY_LAZY
    assert loader.loads == loads and proxy.is_materialized is loaded_first  # nothing loaded to refuse
    # The first call's offload stands, once: on the loaded instance, and on every reload.
    _runs_exactly(proxy, x)
    if loaded_first:
        assert _group_of(proxy) is group
    assert _hooked_blocks(proxy.materialize()) == [True, True, True]
    assert proxy.release() is True
    _runs_exactly(proxy, x)
    assert _group_of(proxy) is not None and _group_of(proxy).prefetch_depth == 1


@pytest.mark.parametrize("loaded_first", [False, True], ids=["before-first-load", "after-first-load"])
def test_applying_again_with_is_replace_replaces_the_lazy_transformers_offload(loaded_first: bool,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    enable = fastoffload_ext.engine.layerwise.enable_layerwise_offload
    enables: list[dict[str, Any]] = []

    def counting(model: Any, *args: Any, **kwargs: Any) -> Any:
        enables.append(kwargs)
        return enable(model, *args, **kwargs)

    monkeypatch.setattr(fastoffload_ext.engine.layerwise, "enable_layerwise_offload", counting)
    loader = CountingTransformer()
    proxy = LazyModule("transformer", loader)
    x = torch.randn(5, 8)
    if loaded_first:
        proxy.materialize()
    apply_offload_config(LAZY_CONFIG, transformer=proxy, device="cpu")
    applied = apply_offload_config(LAZY_CONFIG, transformer=proxy, device="cpu",
                                   layerwise_options={"is_replace": True, "resident_blocks": [1], "backend": "python"})
    assert applied.layerwise is LayerwiseAction.ON_LOAD
    assert loader.loads == (1 if loaded_first else 0)
    _runs_exactly(proxy, x)
    group = _group_of(proxy)
    assert group.resident == (1,) and group.backend == "python"  # replaced on the loaded instance, or at load
    assert _hooked_blocks(proxy.materialize()) == [True, False, True]
    proxy.release()
    enables.clear()
    _runs_exactly(proxy, x)  # the reload runs the new offload only, not the old one undone by the new one
    assert _group_of(proxy).resident == (1,) and loader.loads == 2
    assert enables == [{"device": "cpu", "resident_blocks": [1], "backend": "python"}]


def test_a_refused_replacement_leaves_the_lazy_transformers_offload_as_it_was() -> None:
    loader = CountingTransformer()
    proxy = LazyModule("transformer", loader)
    x = torch.randn(5, 8)
    apply_offload_config(LAZY_CONFIG, transformer=proxy, device="cpu", layerwise_options={"prefetch_depth": 2})
    group = _group_of(proxy)
    # Three blocks: index 7 is refused by the engine, on the loaded instance, before its offload is undone.
    with pytest.raises(ValueError, match=r"^fastoffload: resident_blocks indices must be integers in 0\.\.2"):
        apply_offload_config(LAZY_CONFIG, transformer=proxy, device="cpu",
                             layerwise_options={"is_replace": True, "resident_blocks": [7]})
    assert _group_of(proxy) is group and group.prefetch_depth == 2
    _runs_exactly(proxy, x)
    proxy.release()
    _runs_exactly(proxy, x)
    assert _group_of(proxy).prefetch_depth == 2  # future loads keep the old offload too


def test_applying_again_to_an_offloaded_module_is_refused_before_any_component_loads() -> None:
    from fastoffload_ext.errors import OffloadConfigError

    model = tiny_dit(seed=3)
    x = torch.randn(5, 8)
    config = {"engine": {"offload": {"dit_layerwise": True, "lazy_module_load": False}}}
    first = apply_offload_config(config, transformer=model, device="cpu").layerwise_result
    loaders = CountingLoaders("vae")
    with pytest.raises(OffloadConfigError, match=r"^fastoffload: the transformer \(TinyDiT\) already has layerwise "
                                                 r"offload; applying it again would offload it twice"):
        apply_offload_config(config, transformer=model, components=loaders.loaders, device="cpu")
    assert loaders.loads == [] and fastoffload_ext.engine.layerwise.get_offload_group(model) is first
    applied = apply_offload_config(config, transformer=model, components=loaders.loaders, device="cpu",
                                   layerwise_options={"is_replace": True, "prefetch_depth": 2})
    assert applied.layerwise is LayerwiseAction.APPLIED and applied.layerwise_result.prefetch_depth == 2
    assert fastoffload_ext.engine.layerwise.get_offload_group(model) is applied.layerwise_result
    with torch.no_grad():
        assert torch.equal(model(x), tiny_dit(seed=3)(x))


def test_is_replace_is_passed_only_where_there_is_an_offload_to_replace(fake_enable: RecordingEnable) -> None:
    proxy = LazyModule("transformer", tiny_dit)
    apply_offload_config(LAYERWISE_ON, transformer=proxy, device="cpu", layerwise_options={"is_replace": True})
    loaded = proxy.materialize()
    assert fake_enable.calls == [(loaded, {"device": "cpu"})]  # a new instance has nothing to replace
