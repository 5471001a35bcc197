"""A model dropped while offloaded is freed at once, as any module is: its host copy and device slots go with
its last reference, not whenever Python's cycle collector next runs.

Every test runs with the collector off, so an object still alive after ``del`` was held by a reference cycle.
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fastoffload_ext as fo
from fastoffload_ext.engine.hooks import DEAD_MODULE_ERROR
from fastoffload_ext.errors import OffloadStateError
from tests import _checkpoints as ckpt
from tests._models import make_pair, offload_hook

D = 16
BLOCK_BYTES = sum(p.numel() * p.element_size() for p in make_pair(1, d=D)[0].blocks[0].parameters())


@contextlib.contextmanager
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


def _forward(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(x)


def _refs(model: torch.nn.Module) -> list[weakref.ref]:
    group = fo.get_offload_group(model)
    assert group is not None
    refs = [weakref.ref(model), weakref.ref(group)] + [weakref.ref(state) for state in group.states]
    return refs + ([weakref.ref(group.engine)] if group.engine is not None else [])


def _assert_freed(refs: list[weakref.ref]) -> None:
    assert [ref() is None for ref in refs] == [True] * len(refs)


def _offloaded(backend: str, n_blocks: int = 4) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """A model offloaded on the host, its resident twin and an input."""
    model, reference = make_pair(n_blocks, d=D)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    return model, reference, torch.randn(3, D)


CONFIGS = [
    pytest.param("ext", {}, id="ext"),
    pytest.param("python", {}, id="python"),
    pytest.param("ext", {"resident_blocks": [1, 3]}, id="ext-resident-gaps"),
    pytest.param("python", {"resident_blocks": [1, 3]}, id="python-resident-gaps"),
    pytest.param("ext", {"prefetch_depth": 2, "cyclic": False}, id="ext-depth2-acyclic"),
    pytest.param("ext", {"device_budget": 4 * BLOCK_BYTES}, id="ext-budget"),
    pytest.param("python", {"device_budget": 4 * BLOCK_BYTES}, id="python-budget"),
]


@pytest.mark.parametrize(("backend", "options"), CONFIGS)
def test_a_dropped_offloaded_model_is_freed_without_the_collector(backend: str, options: dict[str, Any]) -> None:
    with no_collector():
        model, reference = make_pair(6, d=D)
        x = torch.randn(3, D)
        fo.enable_layerwise_offload(model, device="cpu", backend=backend, **options)
        assert torch.equal(_forward(model, x), _forward(reference, x))
        # What else an offload registers on the way: state-dict hooks, a scope's rebuild, a grad forward.
        model.state_dict()
        with offload_hook(fo.get_offload_group(model).states[0].module_ref).mutate_params_scope():
            pass
        for param in model.parameters():
            param.requires_grad_(False)
        model(x.requires_grad_()).sum().backward()
        assert torch.equal(_forward(model, x), _forward(reference, x))
        refs = _refs(model)
        del model
        _assert_freed(refs)


def test_a_compressed_offload_is_freed_without_the_collector() -> None:
    with no_collector():
        model, reference = make_pair(5, dtype=torch.bfloat16, d=32)
        x = torch.randn(2, 32, dtype=torch.bfloat16)
        fo.enable_layerwise_offload(model, device="cpu", compress=True)
        assert torch.equal(_forward(model, x), _forward(reference, x))
        refs = _refs(model)
        del model
        _assert_freed(refs)


def test_an_offload_streamed_from_a_checkpoint_is_freed_without_the_collector(tmp_path: Path) -> None:
    with no_collector():
        reference = ckpt.reference_stack(5)
        path = ckpt.write_single(reference, tmp_path / "model.safetensors")
        model = ckpt.meta_stack(5)
        fo.enable_layerwise_offload(model, device="cpu", weights=path, host_budget=4 * ckpt.block_bytes(reference))
        assert fo.get_offload_group(model).disk_blocks() > 0
        x = ckpt.inputs()
        assert torch.equal(_forward(model, x), _forward(reference, x))
        refs = _refs(model)
        del model
        _assert_freed(refs)


def test_a_checkpoint_offload_with_a_parameter_on_the_model_itself_is_freed_without_the_collector(
        tmp_path: Path) -> None:
    # Wan's transformer keeps scale_shift_table on the model itself, outside every child module. The record of
    # what enable replaced while it read such tensors held the model, and the group's states held that record
    # until the model died: it never did.
    with no_collector():
        reference = ckpt.reference_stack(5)
        torch.manual_seed(3)
        reference.scale_shift_table = torch.nn.Parameter(torch.randn(2, 32, dtype=torch.bfloat16))
        path = ckpt.write_single(reference, tmp_path / "model.safetensors")
        model = ckpt.meta_stack(5)
        model.scale_shift_table = torch.nn.Parameter(torch.empty(2, 32, dtype=torch.bfloat16, device="meta"))
        fo.enable_layerwise_offload(model, device="cpu", weights=path, host_budget=4 * ckpt.block_bytes(reference))
        assert torch.equal(model.scale_shift_table, reference.scale_shift_table)
        x = ckpt.inputs()
        assert torch.equal(_forward(model, x), _forward(reference, x))
        refs = _refs(model)
        del model
        _assert_freed(refs)


def test_a_lazy_component_offloaded_from_a_checkpoint_is_freed_by_its_release(tmp_path: Path) -> None:
    # A pipeline that swaps its transformer in and out: the loader enables offload from weights= each time.
    reference = ckpt.reference_stack(5)
    reference.scale_shift_table = torch.nn.Parameter(torch.randn(2, 32, dtype=torch.bfloat16))
    path = ckpt.write_single(reference, tmp_path / "model.safetensors")
    built: list[weakref.ref] = []

    def load() -> torch.nn.Module:
        model = ckpt.meta_stack(5)
        model.scale_shift_table = torch.nn.Parameter(torch.empty(2, 32, dtype=torch.bfloat16, device="meta"))
        fo.enable_layerwise_offload(model, device="cpu", weights=path, host_budget=4 * ckpt.block_bytes(reference))
        built.append(weakref.ref(model))
        return model

    proxy = fo.LazyModule("transformer", load)
    x = ckpt.inputs()
    for _ in range(2):
        assert torch.equal(_forward(proxy, x), _forward(reference, x))
        assert proxy.release() is True
        assert built[-1]() is None
    assert len(built) == 2


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_a_block_kept_after_its_model_was_dropped_still_runs_bit_exact(backend: str) -> None:
    with no_collector():
        model, reference, x = _offloaded(backend)
        _forward(model, x)
        block = model.blocks[2]
        engine_ref = _refs(model)[-1]
        del model
        assert torch.equal(_forward(block, x), _forward(reference.blocks[2], x))
        del block
        assert engine_ref() is None


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_a_disabled_or_replaced_offload_leaves_nothing_to_collect(backend: str) -> None:
    with no_collector():
        model, reference = make_pair(4, d=D)
        x = torch.randn(3, D)
        first = fo.enable_layerwise_offload(model, device="cpu", backend=backend)
        refs = _refs(model)
        finalizer = first.finalizer
        del first
        fo.enable_layerwise_offload(model, device="cpu", backend=backend, is_replace=True, resident_blocks=1)
        assert not finalizer.alive  # the replaced group's: the disable inside is_replace ran it
        refs += _refs(model)[1:]  # the model is in the list once
        assert torch.equal(_forward(model, x), _forward(reference, x))
        fo.disable_layerwise_offload(model)
        assert torch.equal(_forward(model, x), _forward(reference, x))
        refs.pop(0)  # the model itself, alive and ordinary again
        _assert_freed(refs)
        del model


class _Interrupting(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise KeyboardInterrupt


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_a_model_disabled_after_a_forward_that_ctrl_c_ended_is_freed_at_once(backend: str) -> None:
    with no_collector():
        model, reference, x = _offloaded(backend)
        proj_out = model.proj_out
        model.proj_out = _Interrupting()  # after every block, inside the model's forward
        with pytest.raises(KeyboardInterrupt):
            _forward(model, x)
        model.proj_out = proj_out
        refs = _refs(model)
        fo.disable_layerwise_offload(model)
        assert torch.equal(_forward(model, x), _forward(reference, x))
        del model, proj_out
        _assert_freed(refs)


def test_a_forward_saved_from_a_dropped_block_says_so() -> None:
    with no_collector():
        model, _ = make_pair(3, d=D)
        fo.enable_layerwise_offload(model, device="cpu")
        forward = model.blocks[1].forward
        del model
        with pytest.raises(OffloadStateError, match="belongs to a module that was deleted"):
            forward(torch.randn(2, D))
    assert DEAD_MODULE_ERROR.startswith("fastoffload: ")


def test_a_guarded_diffusers_transformer_is_freed_without_the_collector() -> None:
    pytest.importorskip("diffusers")
    from fastoffload_ext.integrations.diffusers import offload_transformer
    from tests._pipelines import tiny_pipeline

    with no_collector():
        pipe = tiny_pipeline()
        offload_transformer(pipe, device="cpu")
        refs = _refs(pipe.transformer)
        assert pipe.transformer.to("cpu") is pipe.transformer  # the move guard, called once
        del pipe
        _assert_freed(refs)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["ext", "python"])
def test_dropping_an_offloaded_model_gives_its_device_memory_back_at_once(backend: str) -> None:
    with no_collector():
        model, reference = make_pair(6, d=256)
        x = torch.randn(4, 256, device="cuda")
        expected = _forward(reference.cuda(), x)
        del reference
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        model.proj_in.cuda()
        model.proj_out.cuda()
        fo.enable_layerwise_offload(model, device="cuda", backend=backend)
        out = _forward(model, x)
        assert torch.equal(out, expected)
        del out
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() > before  # the slots (ext) or the loaded blocks (python), the projections
        refs = _refs(model)
        del model
        torch.cuda.synchronize()
        _assert_freed(refs)
        assert torch.cuda.memory_allocated() == before
