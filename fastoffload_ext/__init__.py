"""fastoffload_ext: layerwise CPU offload for PyTorch with a small C++/CUDA core.

A drop-in for FastVideo's pure-Python layerwise offload: ``from fastoffload_ext import
enable_layerwise_offload``. Which backend is active, and why, is in ``active_backend()`` and
``backend_reason``; ``python -m fastoffload_ext`` prints a report.
"""
from __future__ import annotations

from fastoffload_ext._backend import REASON as backend_reason
from fastoffload_ext._backend import active_backend, build_info, ext_available
from fastoffload_ext.pipeline.configure import AppliedOffload, apply_offload_config
from fastoffload_ext.engine.hooks import ForwardHook, ModuleHookManager
from fastoffload_ext.engine.layerwise import (
    LayerwiseOffloadGroup,
    LayerwiseOffloadHook,
    disable_layerwise_offload,
    enable_layerwise_offload,
    get_offload_group,
)
from fastoffload_ext.pipeline.lazy import LazyModule, is_lazy_module
from fastoffload_ext.engine.offload_state import ExtLayerwiseOffloadState, LayerwiseOffloadState
from fastoffload_ext.policy import DEVICE_POLICY_STEPS, UNIFIED_MEMORY_OFFLOAD_PATHS, has_unified_memory
from fastoffload_ext.policy.resolution import ExecutionMode, Resolution, ResolutionView, resolve
from fastoffload_ext.pipeline.schedule import ReleaseSchedule, run_pipeline
from fastoffload_ext.errors import FastOffloadError, OffloadConfigError, OffloadStateError
from fastoffload_ext.planning import BlockCosts, OffloadPlan, parse_size, plan_offload
from fastoffload_ext import _moved

_moved.install(__name__)

__version__ = "0.1.0"

__all__ = [
    "BlockCosts",
    "DEVICE_POLICY_STEPS",
    "OffloadPlan",
    "UNIFIED_MEMORY_OFFLOAD_PATHS",
    "AppliedOffload",
    "ExecutionMode",
    "ExtLayerwiseOffloadState",
    "FastOffloadError",
    "OffloadConfigError",
    "OffloadStateError",
    "LazyModule",
    "ReleaseSchedule",
    "Resolution",
    "ResolutionView",
    "apply_offload_config",
    "has_unified_memory",
    "parse_size",
    "plan_offload",
    "is_lazy_module",
    "resolve",
    "run_pipeline",
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
