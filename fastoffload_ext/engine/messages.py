"""The engine's user-facing texts that more than one module raises, each written once.

Kept apart from the modules that raise them so that a state class and the sharing coordinator can
share a message without importing each other.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

__all__ = ["CAST_ERROR", "COPY_ENTRY", "COPY_ERROR", "COPY_WHY", "DETACHED_ERROR", "DROPPED_COPY_ERROR",
           "EDITED_COPY_ERROR", "EDITED_COPY_SAVE_WARNING", "EDITED_COPY_WARNING", "GRAD_ERROR", "IN_PLACE_ERROR", "LOST_EDIT_WARNING",
           "REBUILD_FAILED_NOTE", "REPLACED_ERROR", "STALE_SAVE_WARNING", "SHARED_LOAD_ERROR",
           "UNPACKABLE_LOAD_ERROR", "SHARED_MUTATION_ERROR", "STALE_GROUP_ERROR", "scalar_type_name", "warn_caller"]

# The compiled core raises the same advice from OffloadEngine::check_grad (csrc/offload_engine.cpp);
# tests/test_binding_surface.py keeps the two texts identical.
GRAD_ERROR = ("fastoffload: {where} is offloaded, its parameter '{name}' requires grad, and grad mode is on. "
              "An offloaded parameter is a placeholder between forwards, so its gradient would have nowhere to "
              "live and an optimizer step would never reach its host copy. Freeze the offloaded blocks "
              "(model.blocks.requires_grad_(False): gradients still flow through them to the input and to "
              "parameters outside the blocks), or run under torch.no_grad() or torch.inference_mode(); to train a "
              "block, keep it resident.")

SHARED_MUTATION_ERROR = ("fastoffload: mutate_params_scope() is refused on this block: the host copy is shared by {n} "
                         "ranks of this host; mutate before enabling offload, or enable with share_host_copy=False")

# The next three (and IN_PLACE_ERROR, REPLACED_ERROR) are raised by the compiled core too (csrc/offload_engine.cpp), with the same text.
DETACHED_ERROR = ("fastoffload: block {index} was detached from the offload engine; re-enable offload to use it "
                  "again")

IN_PLACE_ERROR = ("fastoffload: parameter '{name}' of block {index} was changed in place while it was offloaded (its "
                  "placeholder or device slot holds no lasting copy), so the change would be silently lost. Change a "
                  "block's parameters inside mutate_params_scope(), which rebuilds the host copy, or disable offload "
                  "first.")
REPLACED_ERROR = ("fastoffload: parameter '{name}' of block {index} was replaced while it was offloaded, so its new "
                  "value would be silently overwritten. Change a block's parameters inside mutate_params_scope(), which "
                  "rebuilds the host copy, or disable offload first.")
# Disable is the way out of an IN_PLACE_ERROR, so it must not raise it: it restores and says what was lost.
LOST_EDIT_WARNING = ("fastoffload: parameter '{name}' of block {index} was changed while it was offloaded (in place, by a "
                     "cast and a cast back, or rebound to a value of another shape), and its placeholder or device "
                     "slot held no lasting copy, so offload was disabled with its value from before that change. Apply "
                     "the change again now, or next time inside mutate_params_scope().")

# state_dict() of a block whose placeholder took such a change: the values saved are the host copy's.
STALE_SAVE_WARNING = ("fastoffload: parameter '{name}' of block {index} was changed while it was offloaded (in place, by "
                      "a cast and a cast back, or rebound to a value of another shape), and its placeholder or device "
                      "slot held no lasting copy, so state_dict() holds its value from before that change, and the next "
                      "forward refuses the block. Apply the change inside mutate_params_scope(), or disable offload "
                      "first.")

# An in-place edit of a copy of an offloaded block's host value (state_dict.py), which never reaches the model: a
# state_dict() entry (a resident model's shares the parameter's storage) or a cpu_named_parameters tensor that was a
# copy. {entry} and {why} are COPY_ENTRY and COPY_WHY of its source; {what} is "was changed in place" or "was changed
# in place and then dropped"; {more} names how many other entries of the block were too.
_EDITED_COPY = "{entry} (parameter '{name}' of block {index}{more}) {what}, but {why}"
COPY_ENTRY = {"state_dict": "state_dict() entry '{key}'", "host": "cpu_named_parameters entry '{key}'"}
COPY_WHY = {
    "state_dict": ("while a block is offloaded, state_dict() returns copies of its host values, so the change did not "
                   "reach the model (a resident model's entries share the parameters' storage)"),
    "host": ("that entry was a copy, so the change did not reach the model: cpu_named_parameters gives views of a "
             "block's host copy only while it is held raw in this process's memory, not stored compressed, in the "
             "disk tier or shared with other processes, and a view stops being one when the copy is rebuilt or "
             "dropped (a load_state_dict(), a mutate_params_scope(), compressed travel chosen)"),
}
# The block's forward, and a mutate_params_scope() on it, while the edited copy is alive and not loaded.
EDITED_COPY_ERROR = ("fastoffload: " + _EDITED_COPY + ". The block refuses to run while the edited copy is alive and "
                     "not loaded, rather than run with its old values. Load the changed values with "
                     "model.load_state_dict(state_dict), or drop the edited dict and make the change inside "
                     "mutate_params_scope(); to keep a changed copy apart from the model, clone it before changing it.")
# Once, for a copy edited and dropped before anything said so: the edit is gone, the block has its old values.
DROPPED_COPY_ERROR = ("fastoffload: " + _EDITED_COPY + ", and the block keeps its old values. Refused once to say so "
                      "(the next call runs): apply the change again with model.load_state_dict(state_dict) before "
                      "dropping the dict, or inside mutate_params_scope(); to keep a changed copy apart from the "
                      "model, clone it before changing it.")
# Disable with such an edited copy: it is the way out, so it warns.
EDITED_COPY_WARNING = ("fastoffload: " + _EDITED_COPY + "; offload was disabled with the parameter's value from "
                       "before that change. Apply the change again now (model.load_state_dict() of the changed "
                       "values), and clone a copy before changing it to keep it apart from the model.")
# A later state_dict() of the block, whose values are the model's.
EDITED_COPY_SAVE_WARNING = ("fastoffload: " + _EDITED_COPY + "; this state_dict() holds the model's value from "
                            "before that change, not the edit's, and the block refuses to run while the edited copy "
                            "is alive and not loaded. Load the changed values with model.load_state_dict(state_dict), "
                            "or clone a copy before changing it to keep it apart from the model.")

# Added to the error of a mutate_params_scope() or load_state_dict() whose closing rebuild of the host copy failed.
REBUILD_FAILED_NOTE = ("fastoffload: the block's host copy was not rebuilt, so the block keeps the values of the scope (or "
                       "load) as ordinary tensors on the device, which its forwards, state_dict() and a disable use. "
                       "Fix what the error names, then open and close mutate_params_scope() on the block again to "
                       "offload it.")

CAST_ERROR = ("fastoffload: parameter '{name}' of block {index} was cast or moved to {now} on {now_device} after offload "
              "was enabled (its host copy holds {was} for {device}); .half(), .to(dtype) and .to(device) do not reach "
              "an offloaded block's host copy. Cast or move the model before enable_layerwise_offload, or disable "
              "offload, cast, and enable it again.")

SHARED_LOAD_ERROR = ("fastoffload: load_state_dict() is refused on block {index}: its host copy is shared by {n} ranks "
                     "of this host, whose weights would change under them. Load the weights before "
                     "enable_layerwise_offload, or enable with share_host_copy=False")

UNPACKABLE_LOAD_ERROR = ("fastoffload: load_state_dict() is refused on block {index}: its parameter '{name}' {what}, so "
                         "the block could not be offloaded again after the load. Make it a dense tensor (or remove it) "
                         "inside mutate_params_scope() on the block first")

# A LayerwiseOffloadGroup that a disable or a re-plan took off its model (engine/group.py, planning/replan.py).
STALE_GROUP_ERROR = ("fastoffload: this offload group is no longer the one on its model (offload was disabled or "
                     "re-planned); use get_offload_group(model) for the current one")


def scalar_type_name(dtype: torch.dtype) -> str:
    """The core's name of a dtype ("Float", "Half", "BFloat16"), so both backends' messages read alike."""
    return torch.empty(0, dtype=dtype).type().removeprefix("torch.").removesuffix("Tensor")


# copy.deepcopy, pickle and torch.save(model) of a model with offload hooks: what they would need to copy
# (the engine, its pinned host copy, locks, streams) cannot be copied, and a copy that shared them
# would be two models driving one set of device slots.
COPY_ERROR = ("fastoffload: a model with layerwise offload enabled cannot be copied or pickled (copy.deepcopy, "
              "pickle, torch.save(model)): its offloaded weights live in the offload engine's host copy and device "
              "slots. Save or copy model.state_dict() instead (it holds the real values), or call "
              "disable_layerwise_offload(model, 'cpu') first and enable offload on each copy")


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# torch's module machinery, which runs this package's hooks (state_dict(), load_state_dict(), a forward).
_TORCH_MODULES_DIR = os.path.dirname(os.path.abspath(torch.nn.modules.module.__file__)) + os.sep


def warn_caller(message: str) -> None:
    """A RuntimeWarning attributed to the first frame outside this package and outside torch's module
    machinery that ran its hooks (the user's call)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith((_PACKAGE_DIR, _TORCH_MODULES_DIR)):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RuntimeWarning, stacklevel=level)

