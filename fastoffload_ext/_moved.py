"""Module paths from before the package was split into engine / pipeline / policy.

Each old path is the *same module object* as its new home (an entry in ``sys.modules``), not a copy:
``monkeypatch.setattr(fastoffload_ext.platform, "has_unified_memory", ...)`` must still steer the
policy steps, and ``import fastoffload_ext.layerwise`` must still give FastVideo-style callers the
module whose functions they patch.
"""
from __future__ import annotations

import importlib
import sys

MOVED_MODULES: dict[str, str] = {
    "hooks": "engine.hooks",
    "offload_state": "engine.offload_state",
    "layerwise": "engine.layerwise",
    "sharing": "engine.sharing",
    "graphs": "engine.graphs",
    "lazy": "pipeline.lazy",
    "schedule": "pipeline.schedule",
    "configure": "pipeline.configure",
    "resolution": "policy.resolution",
    "platform": "policy.platform",
}


def install(package: str) -> None:
    parent = sys.modules[package]
    for old, new in MOVED_MODULES.items():
        module = importlib.import_module(f"{package}.{new}")
        sys.modules[f"{package}.{old}"] = module
        setattr(parent, old, module)
