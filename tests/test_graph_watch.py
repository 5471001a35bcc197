"""CUDA-graph replays (``OffloadedCUDAGraph``, ``graph_forward``) against what the model's Python would do now.

A replay runs the kernels its capture launched and none of the model's Python, so whatever the forward took from
Python (the module tree, the adapters' state, the mode, the arguments' exact values, torch's numeric settings)
must be what it was at the capture, or the graph is captured again, or the call runs eagerly; and whatever the
caller gets back must be its own. On the CPU the replay's checks run on a real engine with a stand-in for the
captured graph; on a GPU, graph_forward's answers are compared bit for bit with the resident model's.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext.engine import graph_forward as gf
from fastoffload_ext.engine import graphs
from fastoffload_ext.engine.graph_forward import graph_forward
from fastoffload_ext.errors import OffloadConfigError, OffloadStateError

from ._models import Stack, make_pair, params_equal, place_outside_blocks
from .test_graphs import _stand_in_graph

peft = pytest.importorskip("peft", reason="peft is not installed (scripts/setup_env.sh installs it)")
from peft import LoraConfig, inject_adapter_in_model  # noqa: E402
from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: E402


def _inject(model: nn.Module, name: str = "a", seed: int = 1) -> None:
    torch.manual_seed(seed)  # init_lora_weights=False: B is random too, so the adapter changes the output
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=["qkv", "proj_out"], init_lora_weights=False),
                            model, adapter_name=name)


def _layers(model: nn.Module) -> list[BaseTunerLayer]:
    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


ADAPTER_CHANGES: dict[str, Callable[[nn.Module], Any]] = {  # in this order on the GPU
    "switched": lambda m: [layer.set_adapter("a") for layer in _layers(m)],
    "scaled": lambda m: [layer.set_scale("a", 0.5) for layer in _layers(m)],
    "merged (a layer outside the blocks)": lambda m: m.proj_out.merge(),
    "disabled": lambda m: [layer.enable_adapters(False) for layer in _layers(m)],
}


@pytest.mark.parametrize("where", ["a block", "outside the blocks"])
def test_a_replay_refuses_an_adapter_injected_since_the_capture(where: str) -> None:
    model, _ = make_pair(3)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    with torch.no_grad():
        model(torch.randn(2, 4, 16))
    graph, replays = _stand_in_graph(model, group)
    assert graph.replay() == "output"
    torch.manual_seed(1)
    target = "qkv" if where == "a block" else "proj_out"
    inject_adapter_in_model(LoraConfig(r=4, target_modules=[target], init_lora_weights=False), model)
    with pytest.raises(OffloadStateError, match="added, replaced or removed .* Call recapture"):
        graph.replay()
    assert replays == [1]


@pytest.mark.parametrize("change", sorted(ADAPTER_CHANGES))
def test_a_replay_refuses_an_adapter_state_changed_since_the_capture(change: str) -> None:
    model, _ = make_pair(3)
    _inject(model, "a")
    _inject(model, "b", seed=2)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    with torch.no_grad():
        model(torch.randn(2, 4, 16))
    graph, replays = _stand_in_graph(model, group)
    assert graph.replay() == "output"
    ADAPTER_CHANGES[change](model)
    with pytest.raises(OffloadStateError, match="since this graph was captured.*Call recapture"):
        graph.replay()
    assert replays == [1]


def test_a_replay_refuses_a_model_switched_to_train_mode() -> None:
    model, _ = make_pair(3)
    model.eval()
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    graph, replays = _stand_in_graph(model, group)
    model.train()
    with pytest.raises(OffloadStateError, match="switched to train mode"):
        graph.replay()
    model.eval()
    assert graph.replay() == "output" and replays == [1]


def test_a_replay_ignores_modules_made_elsewhere() -> None:
    model, _ = make_pair(3)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    graph, replays = _stand_in_graph(model, group)
    nn.Linear(4, 4)  # another model built meanwhile: registrations, but none in this model
    assert graph.replay() == "output" and graph.replay() == "output" and replays == [1, 1]


@pytest.mark.parametrize("captured, given", [(0.0, -0.0), (1, 1.0), (1, True), (2.0, 2)])
def test_a_replay_refuses_a_number_that_only_compares_equal(captured: Any, given: Any) -> None:
    # A forward tells them apart: x * -0.0 flips the signs of zeros, x * 1.0 of an int tensor is a float tensor.
    with pytest.raises(OffloadConfigError, match="must match the captured input"):
        graphs._copy_inputs((torch.zeros(2), captured), (torch.ones(2), given))
    assert gf._key((torch.zeros(2), captured), {}) != gf._key((torch.zeros(2), given), {})


def test_a_signature_holds_the_numeric_settings() -> None:
    key = gf._key((torch.zeros(2),), {})
    before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = not before
    try:
        assert gf._key((torch.zeros(2),), {}) != key
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before
    assert gf._key((torch.zeros(2),), {}) == key


class _Result:
    """An output type that is neither a tensor, a container nor a dataclass."""

    def __init__(self, sample: torch.Tensor) -> None:
        self.sample = sample


class _ReturnsObject(Stack):
    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        return _Result(super().forward(x))


class _StaticGraph:
    """A stand-in for _ModelGraph: a static output made at the capture, which each replay overwrites in place."""

    def __init__(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], warmup_steps: int,
                 pool: Any) -> None:
        self.model_ref = weakref.ref(model)
        with torch.no_grad():
            self.static = type(model).forward(model, *args)

    def __call__(self, x: torch.Tensor) -> Any:
        model = self.model_ref()
        self.static.sample.copy_(type(model).forward(model, x).sample)
        return self.static


def test_an_output_graph_forward_cannot_copy_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gf, "_ModelGraph", _StaticGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    torch.manual_seed(0)
    model = _ReturnsObject(3)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    gf._install(model, gf.GraphedForward(model, group, 4, 2))
    cond, uncond = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    with torch.no_grad(), pytest.raises(OffloadConfigError, match="returns a _Result holding tensors.*cannot copy"):
        first = model(cond)
        model(uncond)  # without the refusal: the first answer is overwritten under the caller
        assert torch.equal(first.sample, type(model).forward(model, cond).sample)


def test_a_call_under_autocast_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gf, "_ModelGraph", _StaticGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    model, reference = make_pair(3)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    graphed = gf._install(model, gf.GraphedForward(model, group, 4, 2))
    x = torch.randn(2, 4, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(RuntimeWarning, match="autocast is on"):
            out = model(x)
        assert torch.equal(out, reference(x))
    assert graphed.stats() == {"graphs": 0, "captures": 0, "replays": 0, "eager": 1}


# ----------------------------------------------------------------------------------------------- on a GPU


def _cuda_pair(dtype: torch.dtype = torch.bfloat16) -> tuple[Any, Any]:
    model, reference = make_pair(4, dtype, d=256)
    reference.cuda()
    place_outside_blocks(model, "cuda")
    return model, reference


def _inject_both(model: nn.Module, reference: nn.Module) -> None:
    for m in (model, reference):  # peft puts each adapter on its base layer's device
        _inject(m, "a")
        _inject(m, "b", seed=2)


@pytest.mark.cuda
def test_graph_forward_follows_adapters_injected_switched_scaled_and_disabled() -> None:
    model, reference = _cuda_pair()
    fo.enable_layerwise_offload(model, backend="ext")
    graphed = graph_forward(model)
    x = torch.randn(2, 64, 256, device="cuda").bfloat16()
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        _inject_both(model, reference)
        assert torch.equal(model(x), reference(x)), "an adapter injected after the capture"
        for change in ADAPTER_CHANGES:
            ADAPTER_CHANGES[change](reference)
            ADAPTER_CHANGES[change](model)
            assert torch.equal(model(x), reference(x)), change
    assert graphed.stats()["captures"] >= 2
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.cuda
def test_graph_forward_under_autocast_and_other_matmul_settings_is_bit_exact() -> None:
    model, reference = _cuda_pair(torch.float32)
    fo.enable_layerwise_offload(model, backend="ext")
    graph_forward(model)
    x = torch.randn(2, 64, 256, device="cuda")
    precision = torch.get_float32_matmul_precision()
    try:
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                expected = reference(x)
                with pytest.warns(RuntimeWarning, match="autocast is on"):
                    out = model(x)
            assert out.dtype == expected.dtype and torch.equal(out, expected), "autocast"
            torch.set_float32_matmul_precision("high" if precision == "highest" else "highest")
            assert torch.equal(model(x), reference(x)), "another float32 matmul precision"
    finally:
        torch.set_float32_matmul_precision(precision)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


class _Scaled(Stack):
    def forward(self, x: torch.Tensor, t: float = 1.0) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) * t


@pytest.mark.cuda
def test_graph_forward_tells_minus_zero_from_zero() -> None:
    torch.manual_seed(0)
    model = _Scaled(3, 256).bfloat16()
    torch.manual_seed(0)
    reference = _Scaled(3, 256).bfloat16().cuda()
    place_outside_blocks(model, "cuda")
    fo.enable_layerwise_offload(model, backend="ext")
    graph_forward(model)
    x = torch.randn(2, 64, 256, device="cuda").bfloat16()
    with torch.no_grad():
        for t in (0.0, -0.0, 0.0):
            out, expected = model(x, t), reference(x, t)
            assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), t


def test_a_replay_refuses_an_edited_state_dict_entry_until_it_is_loaded() -> None:
    model, reference = make_pair(3)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    graph, replays = _stand_in_graph(model, group)
    saved = model.state_dict()
    assert graph.replay() == "output"  # an unedited dict held by the caller changes nothing
    saved["blocks.1.o.weight"].mul_(2)
    with pytest.raises(OffloadStateError, match="state_dict.. entry 'blocks.1.o.weight'"):
        graph.replay()
    assert replays == [1]
    model.load_state_dict(saved)
    with pytest.raises(OffloadStateError, match="recapture"):
        graph.replay()
    fo.disable_layerwise_offload(model)
    with torch.no_grad():
        reference.blocks[1].o.weight.mul_(2)
    assert params_equal(model, reference)


@pytest.mark.cuda
def test_graph_forward_refuses_an_edited_state_dict_entry_then_follows_its_load() -> None:
    model, reference = _cuda_pair()
    fo.enable_layerwise_offload(model, backend="ext")
    graph_forward(model)
    x = torch.randn(2, 64, 256, device="cuda").bfloat16()
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        assert torch.equal(model(x), reference(x))  # replayed
        saved = model.state_dict()
        saved["blocks.2.o.weight"].mul_(2)
        with pytest.raises(OffloadStateError, match="state_dict.. entry 'blocks.2.o.weight'"):
            model(x)
        model.load_state_dict(saved)
        reference.blocks[2].o.weight.mul_(2)
        assert torch.equal(model(x), reference(x))
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
