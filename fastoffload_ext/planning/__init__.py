"""Memory budgets and the residency planner.

``plan_offload(costs, device_budget)`` chooses which blocks stay resident and how deep to prefetch
from a cost table (``BlockCosts``: per-block compute, bytes, bandwidth) by simulating the pipeline;
``enable_layerwise_offload(..., plan=...)`` applies the :class:`OffloadPlan`; ``choose_codec_plan`` is
what ``compress="auto"`` does under a budget (the faster predicted of the raw and the coded plan).
Budgets accept bytes, size strings (``"20GiB"``) and ``"auto"`` (``budgets.py``, ``memory.py``); the
cost table is measured on this machine by ``calibration.py``.
"""
from __future__ import annotations

from fastoffload_ext.planning.budgets import AUTO, format_bytes, parse_size
from fastoffload_ext.planning.codec_choice import choose_codec_plan
from fastoffload_ext.planning.costs import BlockCosts, module_packed_bytes, packed_bytes
from fastoffload_ext.planning.plan import OffloadPlan
from fastoffload_ext.planning.planner import plan_offload
from fastoffload_ext.planning.simulate import StepTimeline, simulate_step

__all__ = ["AUTO", "BlockCosts", "OffloadPlan", "StepTimeline", "choose_codec_plan", "format_bytes",
           "module_packed_bytes", "packed_bytes", "parse_size", "plan_offload", "simulate_step"]
