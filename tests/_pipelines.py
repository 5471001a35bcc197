"""The tiny WanPipeline of examples/wan_pipeline.py, for tests that need a real diffusers pipeline."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("diffusers", reason="diffusers is not installed (scripts/setup_env.sh installs it)")
pytest.importorskip("transformers", reason="transformers is not installed (scripts/setup_env.sh installs it)")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "wan_pipeline.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("wan_pipeline_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


wan = load_example()


def tiny_pipeline(device: str = "cpu", seed: int = 0) -> Any:
    """A resident tiny WanPipeline: every component built from the example's seeded loaders."""
    build = wan.loaders(wan.TINY, wan.torch.float32, seed, device)
    return wan.make_pipeline(wan.TINY, build["transformer"]().to(device), build["text_encoder"](), build["vae"]())


def call_arguments(steps: int = 2, seed: int = 0) -> dict[str, Any]:
    return wan.call_arguments(wan.TINY, steps, seed)
