"""An offloaded transformer inside a real diffusers WanPipeline (tiny random configs), and the
pipeline-level operations on it: pipe.to, model.to/cuda/cpu, enable_model_cpu_offload,
enable_sequential_cpu_offload."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fastoffload_ext import disable_layerwise_offload, get_offload_group
from fastoffload_ext.engine.graph_forward import get_graph_forward
from fastoffload_ext.errors import OffloadConfigError, OffloadStateError
from fastoffload_ext.integrations.diffusers import bound, offload_transformer
from tests._models import OFFLOAD_DEVICES, make_pair, params_equal
from tests._pipelines import EXAMPLE, call_arguments, tiny_pipeline

ROOT = Path(__file__).resolve().parents[1]


def _video(pipe: object) -> torch.Tensor:
    with torch.inference_mode():
        return pipe(**call_arguments()).frames.cpu()  # type: ignore[operator]


@pytest.fixture(scope="module")
def expected() -> torch.Tensor:
    return _video(tiny_pipeline())


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", ["ext", "python"])
def test_offloaded_transformer_in_the_pipeline_is_bit_exact(device: str, backend: str) -> None:
    resident = _video(tiny_pipeline(device))
    pipe = tiny_pipeline(device)
    groups = offload_transformer(pipe, device=device, backend=backend)
    assert list(groups) == ["transformer"] and groups["transformer"].backend == backend
    assert len(groups["transformer"].states) == 3
    assert torch.equal(_video(pipe), resident)
    assert torch.equal(_video(pipe), resident)  # a second request starts from the cyclic prefetch


def test_cuda_graphs_on_a_device_they_cannot_run_on_are_refused_and_nothing_stays_offloaded() -> None:
    pipe = tiny_pipeline()
    with pytest.raises(OffloadConfigError, match="OffloadedCUDAGraph needs a CUDA device"):
        offload_transformer(pipe, device="cpu", backend="ext", cuda_graph=True)
    assert get_offload_group(pipe.transformer) is None and "forward" not in vars(pipe.transformer)


@pytest.mark.cuda
def test_the_transformer_replayed_from_a_cuda_graph_in_the_pipeline_is_bit_exact() -> None:
    resident = _video(tiny_pipeline("cuda"))
    pipe = tiny_pipeline("cuda")
    offload_transformer(pipe, device="cuda", backend="ext", cuda_graph=True)
    # Two requests; both guidance branches of every step replay the one graph, each answer kept.
    assert torch.equal(_video(pipe), resident)
    assert torch.equal(_video(pipe), resident)
    stats = get_graph_forward(pipe.transformer).stats()
    steps = call_arguments()["num_inference_steps"]
    assert stats == {"graphs": 1, "captures": 1, "replays": 2 * 2 * steps, "eager": 0}, stats
    disable_layerwise_offload(pipe.transformer)
    assert get_graph_forward(pipe.transformer) is None


def test_pipe_to_the_offload_device_keeps_the_offload(expected: torch.Tensor) -> None:
    pipe = tiny_pipeline()
    offload_transformer(pipe, device="cpu")
    assert pipe.to("cpu") is pipe
    assert pipe.transformer.to("cpu") is pipe.transformer
    assert pipe.transformer.cpu() is pipe.transformer
    assert get_offload_group(pipe.transformer) is not None
    assert torch.equal(_video(pipe), expected)


@pytest.mark.parametrize("move", ["pipe.to", "model.to", "model.cuda", "model.to_kwarg"])
def test_a_move_away_from_the_offload_device_is_refused_and_nothing_moves(move: str, expected: torch.Tensor) -> None:
    pipe = tiny_pipeline()
    offload_transformer(pipe, device="cpu")
    model = pipe.transformer
    calls = {"pipe.to": lambda: pipe.to("cuda"), "model.to": lambda: model.to("cuda:0", torch.float32),
             "model.cuda": lambda: model.cuda(), "model.to_kwarg": lambda: model.to(device="meta")}
    with pytest.raises(OffloadStateError, match=r"^fastoffload: (WanTransformer3DModel\.(to|cuda)\(\)|"
                                                r"pipe\.to\('cuda'\)) "
                                                r"would move the layerwise-offloaded (WanTransformer3DModel|pipe\."
                                                r"transformer) to (cuda|meta).*, but its blocks are offloaded to cpu "
                                                r".*disable_layerwise_offload"):
        calls[move]()
    assert all(p.device.type == "cpu" for p in pipe.text_encoder.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert torch.equal(_video(pipe), expected)


@pytest.mark.parametrize("args", [("meta", None), (torch.device("meta"), None)])
def test_pipe_to_a_device_with_a_none_dtype_is_refused_before_any_component_moves(args: tuple[Any, ...],
                                                                                   expected: torch.Tensor) -> None:
    """diffusers reads ``pipe.to(device, None)`` as a move to ``device``: the None dtype hid the device from the
    check, the text encoder went to meta, and only then did the transformer's own guard refuse."""
    pipe = tiny_pipeline()
    offload_transformer(pipe, device="cpu")
    with pytest.raises(OffloadStateError, match=r"^fastoffload: pipe\.to\('meta'\) would move the layerwise-offloaded "
                                                r"pipe\.transformer to meta"):
        pipe.to(*args)
    for component in (pipe.text_encoder, pipe.vae, pipe.transformer):
        assert {p.device.type for p in component.parameters()} == {"cpu"}
    assert torch.equal(_video(pipe), expected)


def test_a_disabled_transformer_copies_and_pickles_as_before(expected: torch.Tensor) -> None:
    pipe = tiny_pipeline()
    offload_transformer(pipe, device="cpu")
    model = pipe.transformer
    disable_layerwise_offload(model, device="cpu")
    left = [k for m in model.modules() for k, v in vars(m).items() if callable(v) and k != "processor"]
    assert not left  # no guard stays on an instance (an attention module's processor is diffusers' own)
    torch.save(model, io.BytesIO())
    copy = deepcopy(model)
    copy.to(torch.float64)  # casts the copy alone
    assert next(copy.parameters()).dtype == torch.float64 and next(model.parameters()).dtype == torch.float32
    offload_transformer(pipe, device="cpu")  # guarded again
    with pytest.raises(OffloadStateError):
        pipe.transformer.half()
    assert torch.equal(_video(pipe), expected)


def test_moves_are_unchecked_after_disable() -> None:
    pipe = tiny_pipeline()
    offload_transformer(pipe, device="cpu")
    disable_layerwise_offload(pipe.transformer, device="cpu")
    moved = pipe.transformer.to(device="meta")
    assert moved is pipe.transformer and next(moved.parameters()).device.type == "meta"


def test_model_cpu_offload_keeps_the_layerwise_offload(expected: torch.Tensor) -> None:
    pipe = tiny_pipeline()
    groups = offload_transformer(pipe, device="cpu")
    pipe.enable_model_cpu_offload(device="cpu")
    assert hasattr(pipe.text_encoder, "_hf_hook") and hasattr(pipe.vae, "_hf_hook")
    assert not hasattr(pipe.transformer, "_hf_hook")
    assert get_offload_group(pipe.transformer) is groups["transformer"]
    assert torch.equal(_video(pipe), expected)
    # maybe_free_model_hooks re-enables the hooks at the end of every call, through the same wrapper.
    assert not hasattr(pipe.transformer, "_hf_hook")
    assert torch.equal(_video(pipe), expected)


def _text_encoder_hook(pipe: Any) -> Any:
    return next(hook for hook in pipe._all_hooks if hook.model is pipe.text_encoder)


def test_model_cpu_offload_sends_the_text_encoder_back_when_the_offloaded_transformer_runs(
        expected: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastoffload_ext.integrations import diffusers as integration

    # On the CPU every component is on the CPU already, so the hand-over would find nothing to send back: it is
    # told the text encoder is on its execution device, and accelerate's offload is recorded instead of run.
    monkeypatch.setattr(integration, "on_execution_device", lambda hook: True)
    pipe = tiny_pipeline()
    offload_transformer(pipe, device="cpu")
    events: list[str] = []
    pipe.text_encoder.register_forward_pre_hook(lambda module, args: events.append("text encoder"))
    pipe.transformer.register_forward_pre_hook(lambda module, args: events.append("transformer"))
    pipe.enable_model_cpu_offload(device="cpu")
    for _ in range(2):  # maybe_free_model_hooks enables the offload again after each call: one hand-over, not two
        hook = _text_encoder_hook(pipe)
        monkeypatch.setattr(hook, "offload", lambda: events.append("offload"))
        events.clear()
        assert torch.equal(_video(pipe), expected)
        first = events.index("offload")  # each transformer forward sends the text encoder back as it starts
        assert "transformer" not in events[:first] and "text encoder" not in events[first:]
        assert events[first:] == ["offload", "transformer"] * events.count("transformer")
    pipe.remove_all_hooks()  # the hook it served is gone: the transformer sends nothing back any more
    events.clear()
    assert torch.equal(_video(pipe), expected)
    assert "offload" not in events and "transformer" in events


@pytest.mark.cuda
def test_model_cpu_offload_on_cuda_keeps_the_text_encoder_off_the_gpu_while_the_transformer_runs() -> None:
    reference = tiny_pipeline()
    reference.enable_model_cpu_offload(device="cuda")
    want = _video(reference)
    pipe = tiny_pipeline()
    offload_transformer(pipe, device="cuda")
    pipe.enable_model_cpu_offload(device="cuda")
    seen: list[str] = []
    pipe.transformer.register_forward_pre_hook(
        lambda module, args: seen.append(next(pipe.text_encoder.parameters()).device.type))
    for _ in range(2):
        seen.clear()
        assert torch.equal(_video(pipe), want)
        assert seen and set(seen) == {"cpu"}


def test_sequential_cpu_offload_is_refused() -> None:
    pipe = tiny_pipeline()
    offload_transformer(pipe, device="cpu")
    with pytest.raises(OffloadStateError, match=r"^fastoffload: enable_sequential_cpu_offload would put accelerate's "
                                                r"per-parameter hooks on the layerwise-offloaded pipe\.transformer"):
        pipe.enable_sequential_cpu_offload(device="cpu")
    assert not any(hasattr(m, "_hf_hook") for m in pipe.transformer.modules())


@pytest.mark.parametrize("backend", ["ext", "python"])
@pytest.mark.parametrize("call", ["model", "attention module"])
def test_projection_fusion_is_refused_while_offloaded_and_nothing_is_fused(backend: str, call: str,
                                                                           expected: torch.Tensor) -> None:
    """diffusers fuses q/k/v by concatenating their weights through ``.data``: for an offloaded block those are
    empty placeholders, and the fused layer would be empty. Refused up front; after a disable it works."""
    pipe = tiny_pipeline()
    offload_transformer(pipe, device="cpu", backend=backend)
    model = pipe.transformer
    attention = model.blocks[1].attn1
    before = {name for name, _ in model.named_modules()}
    fuse = model.fuse_qkv_projections if call == "model" else attention.fuse_projections
    what = "WanTransformer3DModel.fuse_qkv_projections()" if call == "model" else "WanAttention.fuse_projections()"
    with pytest.raises(OffloadStateError, match=rf"^fastoffload: {re.escape(what)} on the layerwise-offloaded "
                                                r"WanTransformer3DModel would build fused projections .* nothing was "
                                                r"fused\. .*disable_layerwise_offload"):
        fuse()
    assert {name for name, _ in model.named_modules()} == before and not attention.fused_projections
    assert torch.equal(_video(pipe), expected)
    disable_layerwise_offload(model, device="cpu")
    reference = tiny_pipeline().transformer
    model.fuse_qkv_projections()
    reference.fuse_qkv_projections()
    assert params_equal(model, reference)


def _cache_config(name: str) -> Any:
    from diffusers import FirstBlockCacheConfig, TaylorSeerCacheConfig

    # A first-block threshold this high skips the other blocks on most steps of the tiny model.
    return FirstBlockCacheConfig(threshold=0.5) if name == "first block" else TaylorSeerCacheConfig()


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("cache", ["first block", "TaylorSeer"])
@pytest.mark.parametrize("order", ["cache, then offload", "offload, then cache"])
def test_diffusers_caches_on_the_offloaded_transformer_are_bit_exact(device: str, cache: str, order: str) -> None:
    """A cache skips blocks or whole forwards from one step to the next: the offload loads what runs."""
    reference, pipe = tiny_pipeline(device), tiny_pipeline(device)
    reference.transformer.enable_cache(_cache_config(cache))
    if order == "cache, then offload":
        pipe.transformer.enable_cache(_cache_config(cache))
    offload_transformer(pipe, device=device)
    if order == "offload, then cache":
        pipe.transformer.enable_cache(_cache_config(cache))
    for _ in range(2):  # the second request starts from the cache state and the cyclic prefetch the first left
        with torch.inference_mode():
            expected = reference(**call_arguments(steps=4)).frames.cpu()
            assert torch.equal(pipe(**call_arguments(steps=4)).frames.cpu(), expected)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", ["ext", "python"])
def test_layerwise_casting_enabled_before_the_offload_moves_the_storage_dtype_bit_exact(device: str,
                                                                                        backend: str) -> None:
    reference, pipe = tiny_pipeline(device), tiny_pipeline(device)
    uncast = tiny_pipeline(device)
    full = offload_transformer(uncast, device=device, backend=backend)["transformer"].stats()
    for p in (reference, pipe):
        p.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    stats = offload_transformer(pipe, device=device, backend=backend)["transformer"].stats()
    assert stats["weight_bytes"] < full["weight_bytes"] / 2  # float8 instead of float32, norms skipped
    assert torch.equal(_video(pipe), _video(reference))
    assert torch.equal(_video(pipe), _video(reference))


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_layerwise_casting_enabled_while_offloaded_is_refused_and_nothing_is_cast(backend: str,
                                                                                  expected: torch.Tensor) -> None:
    pipe = tiny_pipeline()
    offload_transformer(pipe, device="cpu", backend=backend)
    model = pipe.transformer
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    with pytest.raises(OffloadStateError, match=r"^fastoffload: WanTransformer3DModel\.enable_layerwise_casting\(\) "
                                                r"on the layerwise-offloaded WanTransformer3DModel would cast the "
                                                r"offloaded blocks' placeholders .*nothing was cast\. Enable layerwise "
                                                r"casting before offloading the model"):
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    assert {name: p.dtype for name, p in model.named_parameters()} == dtypes
    assert torch.equal(_video(pipe), expected)
    disable_layerwise_offload(model, device="cpu")  # the refusal goes with the offload
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    assert model.blocks[0].attn1.to_q.weight.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", ["ext", "python"])
@pytest.mark.parametrize("order", ["compile, then offload", "offload, then compile"])
def test_regional_compilation_of_the_offloaded_transformer_is_bit_exact(device: str, backend: str, order: str) -> None:
    """diffusers' ``compile_repeated_blocks()`` compiles each block's forward; the offload hooks run around it, and the
    compiled blocks read the weights each step loads (bit-equal to the resident model compiled the same way)."""
    reference, pipe = tiny_pipeline(device), tiny_pipeline(device)
    reference.transformer.compile_repeated_blocks(fullgraph=True)
    if order == "compile, then offload":
        pipe.transformer.compile_repeated_blocks(fullgraph=True)
    offload_transformer(pipe, device=device, backend=backend)
    if order == "offload, then compile":
        pipe.transformer.compile_repeated_blocks(fullgraph=True)
    for _ in range(2):
        assert torch.equal(_video(pipe), _video(reference))
    disable_layerwise_offload(pipe.transformer)
    assert params_equal(pipe.transformer, reference.transformer)


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_save_pretrained_of_the_offloaded_transformer_saves_its_weights(backend: str, tmp_path: Path) -> None:
    from diffusers import WanTransformer3DModel

    pipe, reference = tiny_pipeline(), tiny_pipeline().transformer
    offload_transformer(pipe, device="cpu", backend=backend)
    _video(pipe)  # a request first: the cyclic prefetch leaves a block loaded
    pipe.transformer.save_pretrained(tmp_path)
    saved, expected = WanTransformer3DModel.from_pretrained(tmp_path).state_dict(), reference.state_dict()
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)


def test_bound_restores_the_slot_after_an_error() -> None:
    pipe = tiny_pipeline()
    encoder = pipe.text_encoder
    with pytest.raises(KeyError):
        with bound(pipe, "text_encoder", None):
            assert pipe.text_encoder is None
            raise KeyError("stage failed")
    assert pipe.text_encoder is encoder


def test_declined_offload_leaves_the_pipeline_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pipe = tiny_pipeline()
    assert offload_transformer(pipe) == {}
    assert get_offload_group(pipe.transformer) is None
    assert "enable_model_cpu_offload" not in vars(pipe)


def test_the_example_runs_end_to_end_on_the_cpu_bit_exact() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(EXAMPLE), "--device", "cpu", "--check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "by backend ext on cpu" in done.stdout or "by backend python on cpu" in done.stdout
    assert "text_encoder loaded after the run: False, vae: False" in done.stdout
    assert "bit-exact: True" in done.stdout


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_a_denoiser_that_refuses_undoes_the_ones_offloaded_before_it(backend: str) -> None:
    class Pipe:
        def __init__(self) -> None:
            self.transformer, self.reference = make_pair(3)
            self.transformer_2, _ = make_pair(3, seed=1)
            # A weight tied between a block and the rest of the model: enable refuses transformer_2.
            self.transformer_2.blocks[1].up.weight = self.transformer_2.proj_in.weight

    pipe = Pipe()
    with pytest.raises(OffloadConfigError, match=r"^fastoffload: parameter proj_in\.weight is the same tensor as "
                                                 r"blocks\.1\.up\.weight"):
        offload_transformer(pipe, device="cpu", backend=backend, resident_blocks=1)
    assert get_offload_group(pipe.transformer) is None and get_offload_group(pipe.transformer_2) is None
    assert all(not hasattr(m, "_hook_manager") for m in pipe.transformer.modules())
    assert params_equal(pipe.transformer, pipe.reference)
    assert all(isinstance(p, nn.Parameter) and p.device.type == "cpu" for p in pipe.transformer.parameters())
    # A retry without the refused denoiser offloads the first one, bit-exact.
    groups = offload_transformer(pipe, names=("transformer",), device="cpu", backend=backend)
    assert list(groups) == ["transformer"]
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(pipe.transformer(x), pipe.reference(x))


def test_a_denoiser_offloaded_under_another_name_is_checked_before_the_pipeline_moves() -> None:
    from diffusers import DiffusionPipeline

    class Encoder(nn.Linear):
        @property
        def dtype(self) -> torch.dtype:
            return self.weight.dtype

    class UnetPipeline(DiffusionPipeline):
        def __init__(self, unet: nn.Module, text_encoder: nn.Module) -> None:
            super().__init__()
            self.register_modules(unet=unet, text_encoder=text_encoder)

    model, reference = make_pair(3)
    pipe = UnetPipeline(model, Encoder(4, 4))
    offload_transformer(pipe, names=("unet",), device="cpu")
    # Refused before any component moves: the text encoder went to meta first, and the pipeline was left split.
    with pytest.raises(OffloadStateError, match=r"^fastoffload: pipe\.to\('meta'\) would move the layerwise-offloaded "
                                                r"pipe\.unet to meta"):
        pipe.to("meta")
    assert pipe.text_encoder.weight.device.type == "cpu"
    with pytest.raises(OffloadStateError, match=r"^fastoffload: enable_sequential_cpu_offload would put accelerate's "
                                                r"per-parameter hooks on the layerwise-offloaded pipe\.unet"):
        pipe.enable_sequential_cpu_offload(device="cpu")
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(pipe.unet(x), reference(x))


def test_from_pipe_casting_the_offloaded_transformer_is_refused_before_any_shared_component_is_cast(
        expected: torch.Tensor) -> None:
    """from_pipe builds a pipeline around the same components and casts it: it cast the shared text encoder
    to float16 and only then reached the offloaded transformer's refusal, so the original pipeline ran on
    with a half-precision encoder."""
    pipe = tiny_pipeline()
    offload_transformer(pipe, device="cpu")
    with pytest.raises(OffloadStateError, match=r"^fastoffload: pipe\.to\(torch\.float16\) would cast the "
                                                r"layerwise-offloaded pipe\.transformer to torch\.float16.*nothing was "
                                                r"cast.*A pipeline that DiffusionPipeline\.from_pipe builds is cast to "
                                                r"its dtype= \(torch_dtype=\) argument, torch\.float32 when none is "
                                                r"given: pass the offloaded model's dtype there$"):
        type(pipe).from_pipe(pipe, dtype=torch.float16)
    for component in (pipe.text_encoder, pipe.vae, pipe.transformer):
        assert {p.dtype for p in component.parameters()} == {torch.float32}
    assert torch.equal(_video(pipe), expected)


def test_a_pipeline_from_pipe_shares_the_offloaded_transformer_with_the_same_rules(expected: torch.Tensor) -> None:
    pipe = tiny_pipeline()
    groups = offload_transformer(pipe, device="cpu")
    other = type(pipe).from_pipe(pipe)  # float32: the tiny pipeline's dtype, so nothing is cast
    assert other.transformer is pipe.transformer and get_offload_group(other.transformer) is groups["transformer"]
    assert torch.equal(_video(other), expected)
    with pytest.raises(OffloadStateError, match=r"^fastoffload: pipe\.to\(torch\.bfloat16\) would cast the "
                                                r"layerwise-offloaded pipe\.transformer"):
        other.to(torch.bfloat16)
    with pytest.raises(OffloadStateError, match=r"^fastoffload: enable_sequential_cpu_offload would put accelerate's "
                                                r"per-parameter hooks on the layerwise-offloaded pipe\.transformer"):
        other.enable_sequential_cpu_offload(device="cpu")
    other.enable_model_cpu_offload(device="cpu")
    assert not hasattr(other.transformer, "_hf_hook") and hasattr(other.text_encoder, "_hf_hook")
    assert torch.equal(_video(other), expected)
    assert {p.dtype for p in other.text_encoder.parameters()} == {torch.float32}
    assert torch.equal(_video(pipe), expected)


def test_a_pipeline_without_an_offloaded_component_is_untouched_by_the_pipeline_rules() -> None:
    offload_transformer(tiny_pipeline(), device="cpu")  # the rules are on every diffusers pipeline from here on
    pipe = tiny_pipeline()
    assert pipe.to(torch.float64) is pipe and {p.dtype for p in pipe.transformer.parameters()} == {torch.float64}
    pipe.to(torch.float32)
    pipe.enable_sequential_cpu_offload(device="cpu")
    assert any(hasattr(m, "_hf_hook") for m in pipe.transformer.modules())
