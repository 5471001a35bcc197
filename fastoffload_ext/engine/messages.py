"""The engine's user-facing texts that more than one module raises, each written once.

Kept apart from the modules that raise them so that a state class and the sharing coordinator can
share a message without importing each other.
"""
from __future__ import annotations

__all__ = ["GRAD_ERROR", "SHARED_MUTATION_ERROR"]

# The compiled core raises the same advice from OffloadEngine::check_grad (csrc/offload_engine.cpp);
# tests/test_binding_surface.py keeps the two texts identical.
GRAD_ERROR = ("fastoffload: {where} is offloaded, its parameter '{name}' requires grad, and grad mode is on. "
              "Offloaded weights live in device slots that later blocks overwrite, so a backward pass would read "
              "the wrong bytes. Run the forward under torch.no_grad() or torch.inference_mode(), or call "
              "model.requires_grad_(False); to train, keep the block resident.")

SHARED_MUTATION_ERROR = ("fastoffload: mutate_params_scope() is refused on this block: the host copy is shared by {n} "
                         "ranks of this host; mutate before enabling offload, or enable with share_host_copy=False")
