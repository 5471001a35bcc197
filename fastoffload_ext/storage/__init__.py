"""Offload beyond host RAM: build the host copy straight from a safetensors checkpoint, and keep the
blocks that do not fit in ``host_budget`` on disk, streamed every step through pinned staging buffers.

See docs/DESIGN.md, section "Disk tier".
"""
from __future__ import annotations

from fastoffload_ext.storage.checkpoint import Checkpoint, TensorEntry, open_checkpoint
from fastoffload_ext.storage.options import DiskOptions
from fastoffload_ext.storage.tiers import TierPlan, plan_tiers

__all__ = ["Checkpoint", "DiskOptions", "TensorEntry", "TierPlan", "open_checkpoint", "plan_tiers"]
