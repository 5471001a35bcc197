"""Loads the compiled core ``fastoffload_ext._C`` or explains why it is not there.

The package must import on every machine: a CPU-only install, a wheel built for another torch, a
source checkout nobody compiled. In each of those cases the layerwise offload still works through the
pure-Python backend (FastVideo's algorithm), and this module says once, as a warning, why the fast
path is off. Nothing here touches CUDA: importing the package never initialises a device.
"""
from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

_BUILD_INFO_PATH = Path(__file__).with_name("_build_info.json")


def _load() -> tuple[ModuleType | None, str]:
    try:
        module = importlib.import_module("fastoffload_ext._C")
    except ImportError as error:
        text = str(error)
        if "undefined symbol" in text:
            return None, (f"fastoffload_ext._C does not match the installed torch {torch.__version__} "
                          f"({text.splitlines()[0]}); rebuild with: pip install --no-build-isolation .")
        return None, ("fastoffload_ext._C is not built (" + text.splitlines()[0] + "); build it with: "
                      "pip install --no-build-isolation .")
    except Exception as error:  # a broken .so can raise anything at import
        return None, f"fastoffload_ext._C failed to load: {type(error).__name__}: {error}"
    built_for = module.build_info().get("torch")
    if built_for != torch.__version__:
        return None, (f"fastoffload_ext._C was built for torch {built_for} but torch {torch.__version__} is "
                      "installed; rebuild with: pip install --no-build-isolation .")
    return module, "compiled core loaded"


_C, REASON = _load()
if _C is None:
    warnings.warn(f"fastoffload: using the pure-Python backend: {REASON}", RuntimeWarning, stacklevel=2)


def ext_available() -> bool:
    """Whether the compiled core is loaded."""
    return _C is not None


def require_ext() -> ModuleType:
    """The compiled core, or an error that says why it is missing and how to get it."""
    if _C is None:
        raise RuntimeError(f"fastoffload: backend='ext' needs the compiled core, but {REASON}. Use backend='python' "
                           "(or 'auto') to run without it.")
    return _C


def ext_has_cuda() -> bool:
    """Whether the compiled core was built with CUDA support."""
    return _C is not None and bool(_C.build_info().get("cuda"))


def build_info() -> dict[str, Any]:
    """What the installed extension was built against, as recorded by setup.py (empty if never built)."""
    info: dict[str, Any] = {}
    if _BUILD_INFO_PATH.exists():
        info.update(json.loads(_BUILD_INFO_PATH.read_text()))
    if _C is not None:
        info["compiled"] = dict(_C.build_info())
    return info


def active_backend() -> str:
    """The backend that ``backend="auto"`` picks: "ext" when the compiled core loaded, else "python"."""
    return "ext" if _C is not None else "python"
