"""Per-block offload states, one class per backend (re-exported from their own modules).

``state.BlockOffloadState`` is the contract; ``python_state.LayerwiseOffloadState`` (FastVideo's
algorithm) and ``ext_state.ExtLayerwiseOffloadState`` (the compiled core) implement it. This module
keeps the old import path working.
"""
from __future__ import annotations

from fastoffload_ext.engine.ext_state import ExtLayerwiseOffloadState
from fastoffload_ext.engine.messages import GRAD_ERROR
from fastoffload_ext.engine.python_state import LayerwiseOffloadState
from fastoffload_ext.engine.state import BlockOffloadState

__all__ = ["BlockOffloadState", "ExtLayerwiseOffloadState", "GRAD_ERROR", "LayerwiseOffloadState"]
