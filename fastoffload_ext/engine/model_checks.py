"""What enable checks on the model before anything changes: where the block list is, where its
parameters are, and that no offloaded weight is tied to another place."""
from __future__ import annotations

from torch import nn

import torch

from fastoffload_ext.errors import OffloadConfigError

__all__ = ["check_devices", "check_tied_parameters", "find_block_list"]


def find_block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The first direct-child ``nn.ModuleList`` of ``model`` and its attribute name."""
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            return name, child
    # FastVideo's exact text: callers match it.
    raise OffloadConfigError("No nn.ModuleList found in the model for layerwise offloading.")


def check_tied_parameters(model: nn.Module, list_name: str, blocks: nn.ModuleList, first_offloaded: int) -> None:
    """Refuses a parameter shared by two offloaded blocks, or by an offloaded block and anything else."""
    owner: dict[int, str] = {}
    for index in range(first_offloaded, len(blocks)):
        for name, param in blocks[index].named_parameters():
            where = f"{list_name}.{index}.{name}"
            if id(param) in owner:
                raise OffloadConfigError(f"parameter {where} is the same tensor as {owner[id(param)]}: tied weights "
                                         "across offloaded blocks are not supported (offloading one would turn the "
                                         "other into a placeholder). Untie them (clone one), or keep those blocks "
                                         "resident with resident_blocks")
            owner[id(param)] = where
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in owner:
            continue
        if name.startswith(f"{list_name}."):
            index = int(name[len(list_name) + 1:].split(".", 1)[0])
            if index >= first_offloaded:
                continue
        raise OffloadConfigError(f"parameter {name} is the same tensor as {owner[id(param)]}, which would be offloaded: "
                                 "weights tied between an offloaded block and the rest of the model are not supported. "
                                 "Untie them (clone one), or keep that block resident with resident_blocks")


def check_devices(blocks: list[nn.Module], offset: int, device: torch.device) -> None:
    """Every parameter has values, on the host or on ``device``."""
    for index, block in enumerate(blocks):
        for name, param in block.named_parameters():
            if param.device.type == "meta":
                raise OffloadConfigError(f"parameter {offset + index}.{name} is on the meta device and has no values "
                                         "to offload; materialize the model first (e.g. to_empty(device=...) then "
                                         "load_state_dict)")
            if param.device.type not in ("cpu", device.type) or (param.device.type == "cuda" and param.device != device):
                raise OffloadConfigError(f"parameter {offset + index}.{name} is on {param.device}, but offload goes to "
                                         f"{device}: move the model to the CPU or to {device} before enabling offload")
