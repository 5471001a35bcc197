"""fastoffload_ext: layerwise CPU offload for PyTorch with a small C++/CUDA core.

A drop-in for FastVideo's pure-Python layerwise offload: ``from fastoffload_ext import
enable_layerwise_offload``. Which backend is active, and why, is in ``active_backend()`` and
``backend_reason``; ``python -m fastoffload_ext`` prints a report.
"""
from __future__ import annotations

from fastoffload_ext._backend import REASON as backend_reason
from fastoffload_ext._backend import active_backend, build_info, ext_available
from fastoffload_ext.hooks import ForwardHook, ModuleHookManager
from fastoffload_ext.layerwise import (
    LayerwiseOffloadGroup,
    LayerwiseOffloadHook,
    disable_layerwise_offload,
    enable_layerwise_offload,
    get_offload_group,
)
from fastoffload_ext.offload_state import ExtLayerwiseOffloadState, LayerwiseOffloadState

__version__ = "0.1.0"

__all__ = [
    "ExtLayerwiseOffloadState",
    "ForwardHook",
    "LayerwiseOffloadGroup",
    "LayerwiseOffloadHook",
    "LayerwiseOffloadState",
    "ModuleHookManager",
    "__version__",
    "active_backend",
    "backend_reason",
    "build_info",
    "disable_layerwise_offload",
    "enable_layerwise_offload",
    "ext_available",
    "get_offload_group",
]
