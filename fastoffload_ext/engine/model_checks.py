"""What enable checks on the model before anything changes: where the block list is, what its blocks
are, where their parameters are, and that no offloaded weight is tied to another place.

Ties are found by storage, not by object: ``blocks[0].o.weight = nn.Parameter(proj_in.weight.data)``
makes a second Parameter over the same bytes, and offloading it would silently untie the two (the
other side would never see a change again, and disable would hand back two copies).
"""
from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from fastoffload_ext.errors import OffloadConfigError

__all__ = ["check_block_kinds", "check_devices", "check_tied_parameters", "find_block_list", "storage_key"]


def find_block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The first direct-child ``nn.ModuleList`` of ``model`` and its attribute name."""
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            return name, child
    # FastVideo's exact text: callers match it.
    raise OffloadConfigError("No nn.ModuleList found in the model for layerwise offloading.")


def storage_key(param: torch.Tensor) -> tuple[object, ...]:
    """What identifies the bytes behind ``param``: its device and storage address (its identity when
    it has no bytes, which every empty tensor shares)."""
    try:
        storage = param.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage of its own
        return ("object", id(param))
    if storage.nbytes() == 0 or param.device.type == "meta":
        return ("object", id(param))
    return (param.device.type, param.device.index, storage.data_ptr())


def _tie_text(where: str, param: torch.Tensor, other_where: str, other: torch.Tensor) -> str:
    relation = "is the same tensor as" if param is other else "shares its storage with"
    return f"fastoffload: parameter {where} {relation} {other_where}"


def check_tied_parameters(model: nn.Module, list_name: str, blocks: nn.ModuleList,
                          offloaded_indices: Collection[int]) -> None:
    """Refuses storage shared by two offloaded blocks, or by an offloaded block and anything else."""
    owner: dict[tuple[object, ...], tuple[str, torch.Tensor]] = {}
    for index in sorted(offloaded_indices):
        for name, param in blocks[index].named_parameters():
            where = f"{list_name}.{index}.{name}"
            key = storage_key(param)
            if key in owner:
                other_where, other = owner[key]
                raise OffloadConfigError(_tie_text(where, param, other_where, other) + ": tied weights across "
                                         "offloaded blocks are not supported (offloading one would turn the other "
                                         "into a placeholder). Untie them (clone one), or keep those blocks resident "
                                         "with resident_blocks")
            owner[key] = (where, param)
    for name, param in model.named_parameters(remove_duplicate=False):
        key = storage_key(param)
        if key not in owner:
            continue
        if name.startswith(f"{list_name}."):
            index = int(name[len(list_name) + 1:].split(".", 1)[0])
            if index in offloaded_indices:
                continue
        other_where, other = owner[key]
        raise OffloadConfigError(_tie_text(name, param, other_where, other) + ", which would be offloaded: weights "
                                 "tied between an offloaded block and the rest of the model are not supported. Untie "
                                 "them (clone one), or keep that block resident with resident_blocks")


def check_block_kinds(blocks: list[nn.Module], list_name: str, offset: int) -> None:
    """Every offloaded block is a module that runs (not a container) and has initialized parameters."""
    for index, block in enumerate(blocks, start=offset):
        if isinstance(block, (nn.ModuleList, nn.ModuleDict)):
            kind = type(block).__name__
            raise OffloadConfigError(f"fastoffload: {list_name}.{index} is an nn.{kind}, which has no forward of its "
                                     "own, so offload could never load its weights (every forward would fail on empty "
                                     f"placeholders). Make {list_name} hold the blocks themselves: flatten the nested "
                                     "lists into one nn.ModuleList")
        for name, param in block.named_parameters():
            if isinstance(param, nn.parameter.UninitializedParameter):
                raise OffloadConfigError(f"fastoffload: parameter {list_name}.{index}.{name} is not initialized yet (a "
                                         "lazy module such as nn.LazyLinear, which sizes its weights on its first "
                                         "forward); run one forward on the model before enabling offload, so the "
                                         "weights exist")


def check_devices(blocks: list[nn.Module], offset: int, device: torch.device, from_file: bool = False) -> None:
    """Every parameter has values, on the host or on ``device`` (or, ``from_file``, comes from a checkpoint)."""
    for index, block in enumerate(blocks):
        for name, param in block.named_parameters():
            if param.device.type == "meta" and from_file:
                continue
            if param.device.type == "meta":
                raise OffloadConfigError(f"parameter {offset + index}.{name} is on the meta device and has no values "
                                         "to offload; materialize the model first (e.g. to_empty(device=...) then "
                                         "load_state_dict)")
            if param.device.type not in ("cpu", device.type) or (param.device.type == "cuda" and param.device != device):
                raise OffloadConfigError(f"parameter {offset + index}.{name} is on {param.device}, but offload goes to "
                                         f"{device}: move the model to the CPU or to {device} before enabling offload")
