"""LoRA adapters (peft, through diffusers' adapter methods) on an offloaded diffusers transformer, on both
backends: every forward, merge, unmerge, save and load gives bit for bit what the resident model gives."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("peft", reason="peft is not installed (scripts/setup_env.sh installs it)")
pytest.importorskip("diffusers", reason="diffusers is not installed (scripts/setup_env.sh installs it)")

from peft import LoraConfig  # noqa: E402
from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

from fastoffload_ext import (LayerwiseOffloadHook, disable_layerwise_offload, enable_layerwise_offload,  # noqa: E402
                             get_offload_group)
from fastoffload_ext.errors import OffloadStateError  # noqa: E402
from fastoffload_ext.integrations.diffusers import offload_transformer  # noqa: E402
from tests._models import OFFLOAD_DEVICES, count_calls, params_equal  # noqa: E402
from tests._pipelines import call_arguments, tiny_pipeline, wan  # noqa: E402

BACKENDS = ["ext", "python"]
ORDERS = ["adapter-then-offload", "offload-then-adapter"]
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.2", "proj_out"]  # proj_out sits outside the block list


def _transformer(device: str) -> nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(**wan.TINY.transformer).to(device)


def _add(model: nn.Module, name: str = "a", seed: int = 1) -> None:
    torch.manual_seed(seed)  # init_lora_weights=False: B is random too, so the adapter changes the output
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS, init_lora_weights=False),
                      adapter_name=name)


def _forward(model: nn.Module, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x, text = torch.randn(1, 16, 3, 8, 8, generator=g), torch.randn(1, 16, 32, generator=g)
    with torch.inference_mode():
        return model(x.to(device), torch.tensor([500], device=device), text.to(device), return_dict=False)[0].cpu()


def _pair(device: str, backend: str, order: str) -> tuple[nn.Module, nn.Module]:
    """An offloaded transformer with adapter "a" (added before or after the offload) and its resident twin."""
    reference, model = _transformer(device), _transformer(device)
    _add(reference)
    if order == "adapter-then-offload":
        _add(model)
    assert enable_layerwise_offload(model, device=device, backend=backend) is not None
    if order == "offload-then-adapter":
        _add(model)
    _forward(model, device)  # a step first: the cyclic prefetch has a block loaded when the merge comes
    return model, reference


def _training_steps(model: nn.Module, reference: nn.Module, device: str, seed: int,
                    steps: int = 2) -> Iterator[list[dict[str, torch.Tensor]]]:
    """SGD steps on the adapters' weights of both models, one input each; yields each step's gradients by name
    (the offloaded model's, then the reference's)."""
    g = torch.Generator().manual_seed(seed)
    x, text = torch.randn(1, 16, 3, 8, 8, generator=g).to(device), torch.randn(1, 16, 32, generator=g).to(device)
    optimizers = []
    for m in (model, reference):
        trained = [p for name, p in m.named_parameters() if "lora_" in name]
        assert trained and all(p.requires_grad for p in trained)
        optimizers.append(torch.optim.SGD(trained, lr=0.1))
    for _ in range(steps):
        grads = []
        for m, optimizer in zip((model, reference), optimizers):
            optimizer.zero_grad()
            m(x, torch.tensor([500], device=device), text, return_dict=False)[0].square().mean().backward()
            grads.append({name: p.grad.clone() for name, p in m.named_parameters() if p.grad is not None})
            optimizer.step()
        yield grads


def _same_grads(grads: list[dict[str, torch.Tensor]]) -> bool:
    """Whether a step of ``_training_steps`` gave both models the same gradients, bit for bit, by name."""
    return grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


def _merge_each_layer(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()


def _same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", ORDERS)
def test_an_adapter_runs_bit_exact_and_saves_its_real_weights(device: str, backend: str, order: str) -> None:
    model, reference = _pair(device, backend, order)
    assert not torch.equal(_forward(reference, device), _forward(_transformer(device), device))  # it changes things
    assert torch.equal(_forward(model, device), _forward(reference, device))
    assert _same_state(model, reference)  # the wrapped layers renamed the offloaded weights (to_q.base_layer.weight)
    saved, expected = get_peft_model_state_dict(model, adapter_name="a"), get_peft_model_state_dict(reference, adapter_name="a")
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k].cpu(), expected[k].cpu()) for k in saved)
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


MERGES: dict[str, Callable[[nn.Module], Any]] = {
    "fuse_lora": lambda m: m.fuse_lora(lora_scale=0.5),
    "fuse_lora, safe": lambda m: m.fuse_lora(safe_fusing=True),
    "peft layer merge": _merge_each_layer,
}


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("merge", list(MERGES))
def test_a_merge_and_unmerge_give_what_the_resident_model_gives(device: str, backend: str, order: str,
                                                                merge: str) -> None:
    model, reference = _pair(device, backend, order)
    MERGES[merge](reference)
    MERGES[merge](model)
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    assert layers and all(layer.merged for layer in layers)
    assert torch.equal(_forward(model, device), _forward(reference, device))
    assert _same_state(model, reference)
    reference.unfuse_lora()
    model.unfuse_lora()
    assert not any(layer.merged for layer in layers)
    assert torch.equal(_forward(model, device), _forward(reference, device))
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_fuse_lora_materializes_each_block_once(monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference = _pair("cpu", "ext", "adapter-then-offload")
    scopes: list[nn.Module] = []
    original = LayerwiseOffloadHook.mutate_params_scope

    def counted(hook: LayerwiseOffloadHook) -> Any:
        scopes.append(hook.state.module_ref)
        return original(hook)

    monkeypatch.setattr(LayerwiseOffloadHook, "mutate_params_scope", counted)
    model.fuse_lora()
    assert scopes == list(model.blocks)  # one scope per block, in order, however many layers each holds
    reference.fuse_lora()
    assert torch.equal(_forward(model, "cpu"), _forward(reference, "cpu"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_adapter_loaded_from_a_state_dict_into_the_offloaded_model(backend: str) -> None:
    reference = _transformer("cpu")
    _add(reference)
    lora = {f"transformer.{k}": v for k, v in get_peft_model_state_dict(reference, adapter_name="a").items()}
    model = _transformer("cpu")
    enable_layerwise_offload(model, device="cpu", backend=backend)
    _forward(model, "cpu")
    model.load_lora_adapter(lora, adapter_name="a", prefix="transformer")
    assert torch.equal(_forward(model, "cpu"), _forward(reference, "cpu"))
    model.fuse_lora()  # the loaded layers are guarded too
    reference.fuse_lora()
    assert torch.equal(_forward(model, "cpu"), _forward(reference, "cpu"))
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


ADAPTER_STEPS: list[tuple[str, Callable[[nn.Module], Any]]] = [
    ("set_adapters", lambda m: m.set_adapters(["a", "b"], weights=[0.7, 0.3])),
    ("disable_lora", lambda m: m.disable_lora()),
    ("enable_lora", lambda m: m.enable_lora()),
    ("fuse both", lambda m: m.fuse_lora(adapter_names=["a", "b"])),
    ("unfuse", lambda m: m.unfuse_lora()),
    ("delete_adapters", lambda m: m.delete_adapters("b")),
    ("unload_lora", lambda m: m.unload_lora()),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sequence_of_adapter_operations_stays_bit_exact(backend: str) -> None:
    model, reference = _pair("cpu", backend, "adapter-then-offload")
    _add(reference, "b", seed=2)
    _add(model, "b", seed=2)
    for step, apply in ADAPTER_STEPS:
        apply(reference)
        apply(model)
        assert torch.equal(_forward(model, "cpu"), _forward(reference, "cpu")), step
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_adapter_added_after_enable_trains_inside_the_offloaded_blocks(device: str, backend: str) -> None:
    # Its weights are the blocks' own ordinary tensors (the host copy holds the frozen base weights only), so
    # gradients and optimizer steps reach them as on the resident model.
    model, reference = _pair(device, backend, "offload-then-adapter")
    for grads in _training_steps(model, reference, device, seed=5):
        assert _same_grads(grads)
        assert any(".blocks." in f".{k}" for k in grads[0])  # adapters inside the offloaded blocks trained
    assert torch.equal(_forward(model, device), _forward(reference, device))
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_adapter_trains_under_gradient_checkpointing(device: str, backend: str) -> None:
    # diffusers' enable_gradient_checkpointing (non-reentrant torch.utils.checkpoint): the blocks run again in
    # backward, as on the resident model, and the adapters' gradients are the resident model's.
    model, reference = _pair(device, backend, "offload-then-adapter")
    for m in (model, reference):
        m.enable_gradient_checkpointing()
    calls = {id(m): count_calls(m.blocks) for m in (model, reference)}
    for step, grads in enumerate(_training_steps(model, reference, device, seed=6), start=1):
        assert _same_grads(grads)
        assert calls[id(model)] == calls[id(reference)] == [2 * step] * len(model.blocks)
    assert torch.equal(_forward(model, device), _forward(reference, device))
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fused_adapter_that_a_forward_unmerges_stays_unmerged(device: str, backend: str) -> None:
    # peft unmerges a merged layer inside its forward when the adapters are disabled: in an offloaded block
    # that writes the running step's weights, which the block's release must keep.
    model, reference = _pair(device, backend, "adapter-then-offload")
    for m in (model, reference):
        m.fuse_lora()
        m.disable_lora()
    for step in range(3):
        assert torch.equal(_forward(model, device), _forward(reference, device)), step
        assert _same_state(model, reference), step
    assert not any(layer.merged for layer in model.modules() if isinstance(layer, BaseTunerLayer))
    for m in (model, reference):
        m.enable_lora()
    assert torch.equal(_forward(model, device), _forward(reference, device))
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("merge", ["fuse_lora", "peft layer merge"])
def test_a_merge_into_a_block_that_refuses_changes_nothing(backend: str, merge: str) -> None:
    model, _ = _pair("cpu", backend, "adapter-then-offload")
    with torch.no_grad():
        model.blocks[1].norm2.weight.add_(1.0)  # an in-place write to an offloaded placeholder: the block refuses
    scales = [dict(m.scaling) for m in model.modules() if isinstance(m, BaseTunerLayer)]
    with pytest.raises(OffloadStateError, match=r"would merge adapter weights into the offloaded block blocks\.1, "
                                                r"which refuses: .*Nothing was merged"):
        if merge == "fuse_lora":
            model.fuse_lora(lora_scale=0.5)
        else:
            model.blocks[1].attn1.to_q.merge()
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    assert not any(layer.merged for layer in layers)
    assert [dict(m.scaling) for m in layers] == scales


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("remove", ["delete_adapters", "unload_lora", "peft merge_and_unload"])
def test_removed_adapter_weights_leave_the_host_copy(backend: str, remove: str) -> None:
    """Held by the blocks' host copy (added before the offload), a removed adapter's weights would still be copied
    every step and, trainable, refuse every grad-mode forward with nothing left to freeze them through."""
    from peft import get_peft_model

    model, reference = _pair("cpu", backend, "adapter-then-offload")
    for m in (model, reference):
        _add(m, "b", seed=2)
    for m in (model, reference):  # b is added after the enable, so a rebuild takes it into the host copy
        m.fuse_lora(adapter_names=["a", "b"])
        m.unfuse_lora()
    group = get_offload_group(model)
    with_adapters = group.stats()["weight_bytes"]
    if remove == "peft merge_and_unload":
        config = LoraConfig(r=4, lora_alpha=4, target_modules=["to_k"], init_lora_weights=False)
        torch.manual_seed(3)
        wrapped = get_peft_model(model, config)
        torch.manual_seed(3)
        wrapped_reference = get_peft_model(reference, config)
        for m in (wrapped, wrapped_reference):
            m.merge_and_unload()
    else:
        for m in (model, reference):
            getattr(m, remove)(*(["a"] if remove == "delete_adapters" else []))
    assert group.stats()["weight_bytes"] < with_adapters
    held = {id(p) for p in model.parameters()}
    assert all(id(p) in held for state in group.states for p in state.offloaded_parameters().values())
    model.requires_grad_(False)
    reference.requires_grad_(False)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 16, 3, 8, 8, generator=g).requires_grad_(True)
    text = torch.randn(1, 16, 32, generator=g)
    grads = []
    for m in (model, reference):  # guidance-style: the gradient of the input through the frozen blocks
        x.grad = None
        m(x, torch.tensor([500]), text, return_dict=False)[0].square().sum().backward()
        grads.append(x.grad.clone())
    assert torch.equal(grads[0], grads[1])
    assert torch.equal(_forward(model, "cpu"), _forward(reference, "cpu"))
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pipelines_lora_loading_fusing_and_unloading_runs_bit_exact(device: str, backend: str) -> None:
    """diffusers' pipeline-level calls, with their defaults: load_lora_weights asks for low_cpu_mem_usage=True."""
    donor = _transformer("cpu")
    _add(donor)
    lora = {f"transformer.{k}": v for k, v in get_peft_model_state_dict(donor, adapter_name="a").items()}
    reference, pipe = tiny_pipeline(device), tiny_pipeline(device)
    group = offload_transformer(pipe, device=device, backend=backend)["transformer"]
    bare = group.stats()["weight_bytes"]

    def video(p: Any) -> torch.Tensor:
        with torch.inference_mode():
            return p(**call_arguments()).frames.cpu()

    for p in (reference, pipe):
        p.load_lora_weights(dict(lora), adapter_name="x")
    assert torch.equal(video(pipe), video(reference))
    for p in (reference, pipe):
        p.fuse_lora(lora_scale=0.8)
        p.unload_lora_weights()
    assert torch.equal(video(pipe), video(reference))
    assert group.stats()["weight_bytes"] == bare  # the fused weights stay; the adapter's own are gone
    disable_layerwise_offload(pipe.transformer)
    assert params_equal(pipe.transformer, reference.transformer)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_set_lora_device_switches_adapters_as_on_the_resident_pipeline(device: str, backend: str) -> None:
    """diffusers' documented switch between two adapters (move one to the CPU, the other to the device) on an
    offloaded transformer: the offloaded adapter weights stay in the host copy, and every step is bit-exact."""
    loras = {}
    for name, seed in (("x", 1), ("y", 2)):
        donor = _transformer("cpu")
        _add(donor, "a", seed=seed)
        loras[name] = {f"transformer.{k}": v for k, v in get_peft_model_state_dict(donor, adapter_name="a").items()}
    reference, pipe = tiny_pipeline(device), tiny_pipeline(device)
    group = offload_transformer(pipe, device=device, backend=backend)["transformer"]

    def video(p: Any) -> torch.Tensor:
        with torch.inference_mode():
            return p(**call_arguments()).frames.cpu()

    for p in (reference, pipe):
        for name, lora in loras.items():
            p.load_lora_weights(dict(lora), adapter_name=name)
    held = group.stats()["weight_bytes"]
    for active, parked in (("x", "y"), ("y", "x"), ("x", "y")):
        for p in (reference, pipe):
            p.set_lora_device(adapter_names=[parked], device="cpu")
            p.set_lora_device(adapter_names=[active], device=device)
            p.set_adapters(active)
        assert torch.equal(video(pipe), video(reference)), active
    proj = pipe.transformer.proj_out  # outside the block list: resident, moved as diffusers moves it
    assert proj.lora_A["y"].weight.device.type == "cpu" and proj.lora_A["x"].weight.device.type == device
    assert group.stats()["weight_bytes"] == held
    disable_layerwise_offload(pipe.transformer)
    assert params_equal(pipe.transformer, reference.transformer)


def test_merges_go_straight_to_peft_after_disable() -> None:
    model, reference = _pair("cpu", "ext", "adapter-then-offload")
    disable_layerwise_offload(model)
    model.fuse_lora()
    reference.fuse_lora()
    assert params_equal(model, reference)
    assert torch.equal(_forward(model, "cpu"), _forward(reference, "cpu"))


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_pipeline_fuse_lora_on_the_offloaded_transformer(device: str, backend: str) -> None:
    reference, pipe = tiny_pipeline(device), tiny_pipeline(device)
    _add(reference.transformer)
    offload_transformer(pipe, device=device, backend=backend)
    _add(pipe.transformer)
    for p in (reference, pipe):
        p.fuse_lora(components=["transformer"], lora_scale=0.7)
    with torch.inference_mode():
        expected = reference(**call_arguments()).frames.cpu()
        assert torch.equal(pipe(**call_arguments()).frames.cpu(), expected)


def test_peft_injected_after_enable_loads_and_merges_bit_exact() -> None:
    """peft's own functions (get_peft_model, set_peft_model_state_dict, merge_and_unload) rather than the
    model's adapter methods: the load rebuilds the blocks' host copies with the adapter inside."""
    from peft import get_peft_model, set_peft_model_state_dict

    def config() -> LoraConfig:
        return LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False)

    torch.manual_seed(1)
    lora = get_peft_model_state_dict(get_peft_model(_transformer("cpu"), config()))
    reference = get_peft_model(_transformer("cpu"), config())
    set_peft_model_state_dict(reference, lora)
    base = _transformer("cpu")
    enable_layerwise_offload(base, device="cpu")
    model = get_peft_model(base, config())
    set_peft_model_state_dict(model, lora)
    assert torch.equal(_forward(model, "cpu"), _forward(reference, "cpu"))
    merged, expected = model.merge_and_unload(), reference.merge_and_unload()
    assert torch.equal(_forward(merged, "cpu"), _forward(expected, "cpu"))
    disable_layerwise_offload(base)
    assert params_equal(merged, expected)


REFUSED_ADDS: dict[str, Callable[[nn.Module], Any]] = {
    "DoRA": lambda m: m.add_adapter(LoraConfig(r=4, target_modules=["to_q"], use_dora=True), adapter_name="b"),
    "PiSSA": lambda m: m.add_adapter(LoraConfig(r=4, target_modules=["to_q"], init_lora_weights="pissa"),
                                     adapter_name="b"),
    "OLoRA": lambda m: m.add_adapter(LoraConfig(r=4, target_modules=["to_q"], init_lora_weights="olora"),
                                     adapter_name="b"),
    "modules_to_save": lambda m: m.add_adapter(LoraConfig(r=4, target_modules=["to_q"], modules_to_save=["norm2"]),
                                               adapter_name="b"),
    "hotswap": lambda m: m.load_lora_adapter({f"transformer.{k}": v for k, v in get_peft_model_state_dict(
        m, adapter_name="a").items()}, adapter_name="a", prefix="transformer", hotswap=True),
    # The adapter's weights padded for a compiled hotswap.
    "enable_lora_hotswap": lambda m: (m.enable_lora_hotswap(target_rank=8, check_compiled="ignore"),
                                      m.load_lora_adapter(_saved(m), adapter_name="c", prefix="transformer")),
    # peft's own entry points: its injection (get_peft_model, inject_adapter_in_model) and its hotswap functions.
    "peft PiSSA": lambda m: _inject(m, LoraConfig(r=4, target_modules=["to_q"], init_lora_weights="pissa")),
    "peft DoRA": lambda m: _inject(m, LoraConfig(r=4, target_modules=["to_q"], use_dora=True)),
    "peft hotswap": lambda m: __import__("peft.utils.hotswap", fromlist=["x"]).hotswap_adapter_from_state_dict(
        m, get_peft_model_state_dict(m, adapter_name="a"), adapter_name="a",
        config=LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS)),
}


def _saved(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter "a" of ``model`` as a diffusers LoRA state dict."""
    return {f"transformer.{k}": v.clone() for k, v in get_peft_model_state_dict(model, adapter_name="a").items()}


def _inject(model: nn.Module, config: LoraConfig) -> None:
    from peft import inject_adapter_in_model

    inject_adapter_in_model(config, model, adapter_name="b")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("add", list(REFUSED_ADDS))
def test_an_adapter_that_reads_offloaded_base_weights_is_refused_before_anything_changes(backend: str,
                                                                                         add: str) -> None:
    model, reference = _pair("cpu", backend, "adapter-then-offload")
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    with pytest.raises(OffloadStateError, match=r"Nothing was added\. Add the adapter before enable_layerwise_offload"):
        REFUSED_ADDS[add](model)
    assert list(model.peft_config) == ["a"]
    assert [m for m in model.modules() if isinstance(m, BaseTunerLayer)] == layers
    assert torch.equal(_forward(model, "cpu"), _forward(reference, "cpu"))
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_combining_adapters_by_weight_is_refused_before_anything_changes(backend: str) -> None:
    from peft import get_peft_model

    def config() -> LoraConfig:
        return LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k"], init_lora_weights=False)

    torch.manual_seed(1)
    reference = get_peft_model(_transformer("cpu"), config())
    torch.manual_seed(1)
    base = _transformer("cpu")
    enable_layerwise_offload(base, device="cpu", backend=backend)
    model = get_peft_model(base, config())
    with pytest.raises(OffloadStateError, match=r"add_weighted_adapter\(\) on the layerwise-offloaded "
                                                r"WanTransformer3DModel would combine adapters"):
        model.add_weighted_adapter(["default"], [1.0], "combined", combination_type="linear")
    assert list(model.peft_config) == ["default"]
    assert torch.equal(_forward(model, "cpu"), _forward(reference, "cpu"))
    disable_layerwise_offload(base)
    assert params_equal(model, reference)


def test_a_disabled_model_with_an_adapter_copies_and_pickles_on_its_own() -> None:
    import copy
    import io

    model, reference = _pair("cpu", "ext", "adapter-then-offload")
    disable_layerwise_offload(model)
    torch.save(model, io.BytesIO())
    twin = copy.deepcopy(model)
    twin.fuse_lora()
    assert all(m.merged for m in twin.modules() if isinstance(m, BaseTunerLayer))
    assert not any(m.merged for m in model.modules() if isinstance(m, BaseTunerLayer))
    assert params_equal(model, reference)
