"""An offloaded transformer inside a diffusers pipeline: the orders and combinations of pipeline calls
that the main integration tests do not take."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from fastoffload_ext import disable_layerwise_offload, get_offload_group
from fastoffload_ext.errors import OffloadStateError
from fastoffload_ext.integrations.diffusers import offload_transformer
from tests._pipelines import call_arguments, tiny_pipeline


def _video(pipe: Any, **overrides: Any) -> torch.Tensor:
    with torch.inference_mode():
        return pipe(**{**call_arguments(), **overrides}).frames.cpu()


@pytest.fixture(scope="module")
def expected() -> torch.Tensor:
    return _video(tiny_pipeline())


def _group_offloaded(module: torch.nn.Module) -> bool:
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    return _is_group_offload_enabled(module)


def _group_options(tmp_path: Path | None = None) -> dict[str, Any]:
    """Offloaded to disk (``tmp_path``), each onload reads back what the last offload wrote, which for an offloaded
    block is its placeholders: the engine refused the block at the first forward, after the text encoder had run
    and with the pipeline's other components hooked. (diffusers' leaf-level offload to disk gives NaNs on the resident
    pipeline too, so the runs that must match keep it in memory.)"""
    options = dict(onload_device=torch.device("cpu"), offload_device=torch.device("cpu"), offload_type="leaf_level")
    return options if tmp_path is None else {**options, "offload_to_disk_path": str(tmp_path)}


GROUP_MESSAGE = (r"^fastoffload: {what} would put diffusers' group offload hooks on the layerwise-offloaded {model}, "
                 r"whose blocks this engine already streams.*nothing was hooked.*disable_layerwise_offload")


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_pipeline_group_offload_is_refused_before_any_component_is_hooked(backend: str, expected: torch.Tensor,
                                                                          tmp_path: Path) -> None:
    pipe = tiny_pipeline()
    offload_transformer(pipe, device="cpu", backend=backend)
    with pytest.raises(OffloadStateError, match=GROUP_MESSAGE.format(what=r"enable_group_offload",
                                                                     model=r"pipe\.transformer")):
        pipe.enable_group_offload(**_group_options(tmp_path))
    assert not any(_group_offloaded(c) for c in (pipe.text_encoder, pipe.vae, pipe.transformer))
    assert torch.equal(_video(pipe), expected)


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_model_group_offload_is_refused_while_offloaded_and_works_after_disable(backend: str, expected: torch.Tensor,
                                                                              tmp_path: Path) -> None:
    pipe = tiny_pipeline()
    offload_transformer(pipe, device="cpu", backend=backend)
    model = pipe.transformer
    what = re.escape("WanTransformer3DModel.enable_group_offload()")
    with pytest.raises(OffloadStateError, match=GROUP_MESSAGE.format(what=what, model="WanTransformer3DModel")):
        model.enable_group_offload(**_group_options(tmp_path))
    assert not _group_offloaded(model)
    assert torch.equal(_video(pipe), expected)
    disable_layerwise_offload(model, device="cpu")  # the refusal goes with the offload
    model.enable_group_offload(**_group_options())
    assert _group_offloaded(model)
    assert torch.equal(_video(pipe), expected)


@pytest.mark.parametrize("exclude", ["transformer", ["transformer"]])
def test_pipeline_group_offload_that_excludes_the_offloaded_transformer_hooks_the_rest(exclude: Any,
                                                                                      expected: torch.Tensor) -> None:
    pipe = tiny_pipeline()
    group = offload_transformer(pipe, device="cpu")["transformer"]
    pipe.enable_group_offload(**_group_options(), exclude_modules=exclude)
    assert _group_offloaded(pipe.text_encoder) and _group_offloaded(pipe.vae)
    assert not _group_offloaded(pipe.transformer) and get_offload_group(pipe.transformer) is group
    assert torch.equal(_video(pipe), expected)
    assert torch.equal(_video(pipe), expected)
