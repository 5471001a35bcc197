"""The FastVideo integration against the installed fastvideo package (no FastVideo file edited).

The transformer-loader test runs FastVideo's own ``TransformerLoader.load``, the code that reads the
``dit_layerwise_offload`` flag; only the steps that build a FastVideo model from a checkpoint (config
lookup, model registry, the FSDP loader, which on a machine without CUDA has no device to load onto)
hand it this suite's model instead.
"""
from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from fastoffload_ext import LayerwiseOffloadGroup, LayerwiseOffloadHook, ModuleHookManager, get_offload_group
from fastoffload_ext.engine import hooks as our_hooks
from fastoffload_ext.engine import layerwise as our_layerwise
from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.integrations import fastvideo as integration
from tests._fastvideo import import_fastvideo
from tests._models import OFFLOAD_DEVICES, make_pair

fv_offload = import_fastvideo("fastvideo.hooks.layerwise_offload")
fv_hooks = import_fastvideo("fastvideo.hooks.hooks")
component_loader = import_fastvideo("fastvideo.models.loader.component_loader")
lora_pipeline = import_fastvideo("fastvideo.pipelines.lora_pipeline")

ORIGINAL_ENABLE = fv_offload.enable_layerwise_offload
ORIGINAL_HOOK = fv_offload.LayerwiseOffloadHook
ORIGINAL_MANAGER = fv_hooks.ModuleHookManager


@pytest.fixture(autouse=True)
def _uninstalled() -> Iterator[None]:
    integration.uninstall()
    yield
    integration.uninstall()


def _offload_hook(block: torch.nn.Module) -> Any:
    manager = ModuleHookManager.get_from(block)
    assert manager is not None
    return manager.get_forward_hook("LayerwiseOffloadHook")


class _DitConfig:
    """Stands in for FastVideo's DiT config: the loader only asks it to take the checkpoint's config."""

    arch_config = None

    def update_model_arch(self, config: dict[str, Any]) -> None:
        del config


def _load_through_fastvideo(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, model: torch.nn.Module) -> torch.nn.Module:
    from fastvideo.configs.pipelines.wan import WanT2V480PConfig
    from fastvideo.fastvideo_args import FastVideoArgs
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(tmp_path, "model.safetensors"))
    monkeypatch.setattr(component_loader, "get_diffusers_config", lambda model: {"_class_name": "Stack"})
    monkeypatch.setattr(component_loader.ModelRegistry, "resolve_model_cls", lambda name: (type(model), None))
    monkeypatch.setattr(component_loader, "maybe_load_fsdp_model", lambda **kwargs: model)
    monkeypatch.setattr(component_loader, "record_resolved_attention_backend", lambda config: None)
    config = WanT2V480PConfig()
    config.dit_config = _DitConfig()
    config.dit_precision = "fp32"
    args = FastVideoArgs(model_path=str(tmp_path), inference_mode=True, dit_layerwise_offload=True,
                         pipeline_config=config)
    return component_loader.TransformerLoader().load(str(tmp_path), args)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", ["ext", "python"])
def test_the_loader_flag_runs_this_engine_bit_exact(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, device: str,
                                                      backend: str) -> None:
    model, reference = make_pair(4)
    integration.install(device=device, backend=backend)
    loaded = _load_through_fastvideo(monkeypatch, tmp_path, model)
    assert loaded is model
    group = get_offload_group(model)
    assert isinstance(group, LayerwiseOffloadGroup) and group.backend == backend and len(group.states) == 4
    for block in model.blocks:
        assert type(_offload_hook(block)) is LayerwiseOffloadHook
        assert type(ModuleHookManager.get_from(block)) is our_hooks.ModuleHookManager
    reference.to(device)
    model.proj_in.to(device)
    model.proj_out.to(device)
    x = torch.randn(3, 16, device=device)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), reference(x))


def test_install_rebinds_names_the_loaders_imported_before_the_call() -> None:
    assert component_loader.enable_layerwise_offload is ORIGINAL_ENABLE
    integration.install(device="cpu")
    names = integration.replaced_names()
    assert "fastvideo.models.loader.component_loader.enable_layerwise_offload" in names
    assert "fastvideo.pipelines.lora_pipeline.LayerwiseOffloadHook" in names
    assert "fastvideo.hooks.hooks.ModuleHookManager" in names
    assert component_loader.enable_layerwise_offload is fv_offload.enable_layerwise_offload
    assert component_loader.enable_layerwise_offload is not ORIGINAL_ENABLE
    assert lora_pipeline.LayerwiseOffloadHook is our_layerwise.LayerwiseOffloadHook
    assert fv_hooks.ModuleHookManager is our_hooks.ModuleHookManager
    assert integration.is_installed() and integration.installed_options() == {"device": "cpu"}


def test_uninstall_puts_fastvideo_back() -> None:
    integration.install(device="cpu")
    assert integration.uninstall() is True
    assert component_loader.enable_layerwise_offload is ORIGINAL_ENABLE
    assert fv_offload.enable_layerwise_offload is ORIGINAL_ENABLE
    assert lora_pipeline.LayerwiseOffloadHook is ORIGINAL_HOOK
    assert fv_hooks.ModuleHookManager is ORIGINAL_MANAGER
    assert not integration.is_installed() and integration.replaced_names() == []
    assert integration.uninstall() is False


def test_install_twice_replaces_the_options() -> None:
    integration.install(device="cpu", prefetch_depth=2)
    integration.install(device="cpu", backend="python")
    assert integration.installed_options() == {"device": "cpu", "backend": "python"}
    model, reference = make_pair(3)
    component_loader.enable_layerwise_offload(model)
    group = get_offload_group(model)
    assert group is not None and group.backend == "python" and group.prefetch_depth == 1
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    integration.uninstall()
    assert component_loader.enable_layerwise_offload is ORIGINAL_ENABLE


def test_uninstall_leaves_a_name_someone_else_rebound(caplog: pytest.LogCaptureFixture) -> None:
    integration.install(device="cpu")

    def other_patch(model: torch.nn.Module, is_replace: bool = False) -> None:
        del model, is_replace

    # Set by hand, not with monkeypatch: its undo would put back install()'s replacement.
    component_loader.enable_layerwise_offload = other_patch
    try:
        integration.uninstall()
        assert component_loader.enable_layerwise_offload is other_patch
        assert fv_offload.enable_layerwise_offload is ORIGINAL_ENABLE
        assert "component_loader.enable_layerwise_offload changed after install(); left as it is" in caplog.text
    finally:
        component_loader.enable_layerwise_offload = ORIGINAL_ENABLE


def test_fastvideo_lora_scope_reaches_this_engine_and_stays_exact() -> None:
    integration.install(device="cpu")
    model, reference = make_pair(3)
    fv_offload.enable_layerwise_offload(model)
    block = model.blocks[1]
    with torch.no_grad():
        with lora_pipeline._get_hook_ctx(block):
            block.up.weight.add_(0.5)
        reference.blocks[1].up.weight.add_(0.5)
        x = torch.randn(2, 16)
        assert torch.equal(model(x), reference(x))


def test_is_replace_swaps_fastvideo_style_hooks() -> None:
    integration.install(device="cpu")
    model, reference = make_pair(2)
    fv_offload.enable_layerwise_offload(model)
    first = _offload_hook(model.blocks[0])
    fv_offload.enable_layerwise_offload(model, is_replace=True)
    assert _offload_hook(model.blocks[0]) is not first
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_unknown_option_is_refused_and_nothing_changes() -> None:
    with pytest.raises(OffloadConfigError, match=r"^fastoffload: install\(\) got unknown option\(s\) prefetch;"):
        integration.install(prefetch=2)
    assert not integration.is_installed()
    assert component_loader.enable_layerwise_offload is ORIGINAL_ENABLE


def test_fastvideo_arguments_cannot_be_preset() -> None:
    with pytest.raises(OffloadConfigError, match=r"^fastoffload: install\(\) cannot preset is_replace: FastVideo"):
        integration.install(is_replace=True)
    assert not integration.is_installed()


def test_missing_fastvideo_module_says_what_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(integration.SOURCES, "fastvideo.no_such_module", ("anything",))
    with pytest.raises(ImportError, match=r"^fastoffload: the FastVideo integration needs an importable fastvideo, "
                                          r"but importing fastvideo.no_such_module failed"):
        integration.install(device="cpu")
    assert not integration.is_installed()
    assert component_loader.enable_layerwise_offload is ORIGINAL_ENABLE


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_fastvideo_hooks_run_under_the_installed_manager_bit_exact(backend: str) -> None:
    # FastVideo's activation trace attaches its own ForwardHook subclass, through the ModuleHookManager name
    # install() rebound, to every module: alone on the modules outside the blocks, next to the offload hook
    # on the blocks. FastVideo's ForwardHook has no eager_points; such a hook must run, not raise.
    trace = import_fastvideo("fastvideo.hooks.activation_trace")
    integration.install(device="cpu", backend=backend)
    seen: list[str] = []

    class Recorder(fv_hooks.ForwardHook):
        @classmethod
        def name(cls) -> str:
            return "Recorder"

        def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
            seen.append(type(module).__name__)
            return output

    model, reference = make_pair(3)
    fv_offload.enable_layerwise_offload(model)
    for module in (model.proj_in, model.blocks[1], model.proj_out):
        trace.ModuleHookManager.get_from_or_default(module).append_forward_hook(Recorder())
    x = torch.randn(2, 16)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), reference(x))
    assert seen == [type(model.proj_in).__name__, type(model.blocks[1]).__name__, type(model.proj_out).__name__] * 2


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_a_block_under_fastvideos_own_hook_manager_is_refused_and_nothing_changes(backend: str) -> None:
    # FastVideo's manager runs no post_forward when a forward raises: the offload hook under it would keep
    # its block's device slot after one failing forward, and every later forward would fail.
    class Recorder(fv_hooks.ForwardHook):
        @classmethod
        def name(cls) -> str:
            return "Recorder"

    model, reference = make_pair(3)
    ORIGINAL_MANAGER.get_from_or_default(model.blocks[1]).append_forward_hook(Recorder())
    with pytest.raises(OffloadConfigError, match=r"^fastoffload: blocks\.1 carries hooks under another hook manager "
                                                 r"\(fastvideo\.hooks\.hooks\.ModuleHookManager\), whose forward does "
                                                 r"not release a block when it raises"):
        our_layerwise.enable_layerwise_offload(model, device="cpu", backend=backend, prefetch_depth=0)
    assert get_offload_group(model) is None
    assert all(ModuleHookManager.get_from(block) is None for block in (model.blocks[0], model.blocks[2]))
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_a_fastvideo_module_imported_while_installed_gets_fastvideos_names_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # A FastVideo module first imported after install() takes the replacements from the source modules, under
    # any name; a second install() must give it the new options, and uninstall() FastVideo's own objects.
    name = f"{integration.PACKAGE}._fastoffload_imported_late"
    late = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, late)
    integration.install(device="cpu", prefetch_depth=2)
    exec("from fastvideo.hooks.layerwise_offload import enable_layerwise_offload, LayerwiseOffloadHook as Hook\n"
         "from fastvideo.hooks.hooks import ModuleHookManager", vars(late))
    assert late.Hook is our_layerwise.LayerwiseOffloadHook and late.ModuleHookManager is our_hooks.ModuleHookManager
    integration.install(device="cpu", backend="python")
    assert f"{name}.enable_layerwise_offload" in integration.replaced_names()
    model, reference = make_pair(3)
    late.enable_layerwise_offload(model)
    group = get_offload_group(model)
    assert group is not None and group.backend == "python" and group.prefetch_depth == 1
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert integration.uninstall() is True
    assert late.enable_layerwise_offload is ORIGINAL_ENABLE
    assert late.Hook is ORIGINAL_HOOK and late.ModuleHookManager is ORIGINAL_MANAGER
    assert integration.uninstall() is False and late.enable_layerwise_offload is ORIGINAL_ENABLE


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_fastvideo_lora_layers_converted_and_merged_in_the_scope_are_bit_exact(monkeypatch: pytest.MonkeyPatch,
                                                                                backend: str) -> None:
    # FastVideo's LoRA pipeline, in each block's mutate_params_scope, wraps the block's linear layers in its LoRA
    # layers (renaming the parameters they hold), and later merges the adapters into the base weights there.
    linear = import_fastvideo("fastvideo.layers.linear")
    lora_linear = import_fastvideo("fastvideo.layers.lora.linear")
    monkeypatch.setattr(lora_linear, "get_local_torch_device", lambda: torch.device("cpu"))

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.to_q = linear.ReplicatedLinear(16, 16, bias=True, params_dtype=torch.float32)
            self.ff = linear.ReplicatedLinear(16, 16, bias=True, params_dtype=torch.float32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.ff(torch.relu(self.to_q(x)[0]))[0]

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
            self.proj_out = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.proj_out(x)

    def build() -> Model:
        model = Model()
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():  # FastVideo's linear layers leave their weights uninitialized
                param.copy_(torch.randn(param.shape, generator=generator))
        return model

    def apply_lora(model: Model) -> None:
        generator = torch.Generator().manual_seed(1)
        for index, block in enumerate(model.blocks):
            with lora_pipeline._get_hook_ctx(block):
                for name in ("to_q", "ff"):
                    layer = lora_linear.get_lora_layer(getattr(block, name))
                    lora_pipeline.replace_submodule(model, f"blocks.{index}.{name}", layer)
        for block in model.blocks:
            with lora_pipeline._get_hook_ctx(block):
                for name in ("to_q", "ff"):
                    a, b = torch.randn(4, 16, generator=generator), torch.randn(16, 4, generator=generator)
                    getattr(block, name).set_lora_weights(a, b, strength=0.5)

    integration.install(device="cpu", backend=backend)
    model, reference = build(), build()
    fv_offload.enable_layerwise_offload(model)
    x = torch.randn(2, 16)
    with torch.no_grad():
        model(x)  # a forward first: the cyclic prefetch leaves a block loaded
        apply_lora(model)
        apply_lora(reference)
        assert isinstance(model.blocks[0].to_q, lora_linear.BaseLayerWithLoRA) and model.blocks[0].to_q.merged
        for _ in range(2):
            assert torch.equal(model(x), reference(x))
