"""Keeps what autograd saved inside an offloaded block valid until backward.

A grad-recording forward through an offloaded block whose own weights are frozen is a real use:
training adapters outside the block list, or guidance that differentiates with respect to the
latents. Autograd then saves some weights for backward, and two things would go wrong without care:

- An op such as ``layer_norm`` saves the parameter object itself. When the block is released, that
  parameter is rebound to its empty placeholder, so backward would see a tensor of shape ``(0,)``.
  The pack hook here saves a detached alias of the parameter's *current* data instead, which keeps
  those bytes alive after the rebinding.
- An op such as ``linear`` saves a view of the weight. On the ext backend that view would point into
  a device slot that later blocks overwrite; with grad mode on the engine therefore binds the
  parameters to a private device copy of the slot (csrc/offload_engine.h), which the saved views
  keep alive. The python backend loads fresh tensors per run, so its views are safe already.

Saved-tensor hooks turn off autograd's own check that a saved tensor was not modified in place, so
the pack hook records the version counter and the unpack hook repeats the check. The hooks run only
when autograd saves something, i.e. when some input of the block requires grad; under
``torch.no_grad()`` or ``inference_mode()`` the guard is never entered.

The block may run inside saved-tensor hooks of the caller's: activation checkpointing
(``torch.utils.checkpoint``, non-reentrant, which diffusers' ``enable_gradient_checkpointing`` uses)
saves nothing and recomputes the block in backward; ``save_on_cpu`` moves what is saved to the host.
Autograd uses the innermost hooks only, so hooks of this guard's own would take the block's tensors from
them: the checkpoint would save every activation and every private weight copy and never recompute, and
a model that fits on the device only because of it would run out of memory, with nothing saying why.
So under the caller's hooks the guard hands them a detached alias of each tensor (the first point
above) and leaves saving, and checking versions, to them, as on the resident model.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from fastoffload_ext.errors import OffloadStateError

logger = logging.getLogger(__name__)

MODIFIED_SAVED_TENSOR_ERROR = (
    "fastoffload: a tensor that an offloaded block saved for backward (shape {shape}) was modified in place after "
    "it was saved: it is at version {now}, saved at version {saved}. Its gradient would be wrong. Clone the tensor "
    "before changing it in place, or change it after backward.")

FUNCTORCH_ERROR = (
    "fastoffload: torch.func's {transform} transform cannot run through an offloaded block: the weights the block "
    "loads would be bound inside the transform and outlive it. Take gradients of the offloaded model with "
    "torch.autograd.grad (or .backward()), forward-mode derivatives with torch.autograd.forward_ad; torch.vmap alone "
    "runs. Or disable offload for the transform.")

# Whether any torch.func transform (vmap, grad, jvp, ...) is running now: one call per block, ~0.04 us.
functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def refuse_differentiating_transforms() -> None:
    """Raises when a torch.func transform that differentiates (grad, vjp, jacrev, jvp, jacfwd, hessian) is running.

    Their levels wrap the tensors an acquire binds to the block's parameters: the python backend left each parameter
    holding a tensor of a level that had ended, and the process crashed at its next use; the compiled core refused
    with an error that named no cause. ``torch.vmap`` alone binds plain tensors and runs. Call before the acquire.
    """
    if not functorch_active():
        return
    functorch = torch._C._functorch
    differentiating = {functorch.TransformType.Grad: "grad", functorch.TransformType.Jvp: "jvp"}
    for interpreter in functorch.get_interpreter_stack() or ():
        transform = differentiating.get(interpreter.key())
        if transform is not None:
            raise OffloadStateError(FUNCTORCH_ERROR.format(transform=transform))


def _pack(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    # detach() shares the storage and the version counter but not the TensorImpl, so rebinding an
    # offloaded parameter to its placeholder later does not change what was saved.
    return tensor.detach(), tensor._version


def _unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    tensor, version = packed
    if tensor._version != version:
        raise OffloadStateError(MODIFIED_SAVED_TENSOR_ERROR.format(shape=tuple(tensor.shape), now=tensor._version,
                                                                   saved=version))
    return tensor


def _callers_hooks() -> tuple[Any, Any] | None:
    """The (pack, unpack) pair of saved-tensor hooks in effect now, or None (no such hooks)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _through(hooks: tuple[Any, Any]) -> tuple[Any, Any]:
    """The caller's hooks, given detached aliases: what they save stays valid when parameters are rebound."""
    outer_pack, outer_unpack = hooks

    def pack(tensor: torch.Tensor) -> Any:
        return outer_pack(tensor.detach())

    return pack, outer_unpack


class SavedTensorGuard:
    """Saved-tensor hooks around one offloaded block's forward (entered by its pre-hook, left by its post-hook).

    Re-entrant calls of the same block nest; the scopes are left in the reverse order.
    """

    def __init__(self) -> None:
        self._scopes: list[Any] = []

    def enter(self) -> None:
        """Starts the hooks when grad mode is on (otherwise records that there is nothing to leave)."""
        if not torch.is_grad_enabled():
            self._scopes.append(None)
            return
        outer = _callers_hooks()
        pack, unpack = (_pack, _unpack) if outer is None else _through(outer)
        scope = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        scope.__enter__()
        self._scopes.append(scope)

    def leave(self) -> None:
        """Ends the scope the matching ``enter`` started (a no-op without one)."""
        if not self._scopes:
            return
        scope = self._scopes.pop()
        if scope is not None:
            scope.__exit__(None, None, None)


__all__ = ["FUNCTORCH_ERROR", "MODIFIED_SAVED_TENSOR_ERROR", "SavedTensorGuard", "functorch_active",
           "refuse_differentiating_transforms"]
