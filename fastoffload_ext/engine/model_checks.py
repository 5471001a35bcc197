"""What enable checks on the model before anything changes: where the block list is, what its blocks
are, where their parameters are, and that no offloaded weight is tied to another place.

Ties are found by storage, not by object: ``blocks[0].o.weight = nn.Parameter(proj_in.weight.data)``
makes a second Parameter over the same bytes, and offloading it would silently untie the two (the
other side would never see a change again, and disable would hand back two copies).
"""
from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fastoffload_ext.errors import OffloadConfigError

__all__ = ["ALL_LISTS", "check_block_kinds", "check_block_lists_form", "check_devices", "check_repeated_blocks",
           "check_tied_parameters", "check_weight_hooks", "find_block_list", "find_block_lists", "storage_key",
           "tied_block_indices"]

ALL_LISTS = "all"


def find_block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The first direct-child ``nn.ModuleList`` of ``model`` and its attribute name."""
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            return name, child
    # FastVideo's text follows the prefix unchanged: callers that search the message for it still find it.
    raise OffloadConfigError("fastoffload: No nn.ModuleList found in the model for layerwise offloading. Keep the "
                             "blocks in an nn.ModuleList that is a direct child of the model, or name the lists with "
                             "block_lists=")


def _named_lists(model: nn.Module) -> dict[str, nn.ModuleList]:
    return {name: child for name, child in model.named_children() if isinstance(child, nn.ModuleList)}


def lists_left_out(model: nn.Module, offloaded: Sequence[str]) -> list[tuple[str, int, int]]:
    """The direct-child ``ModuleList``s with blocks that the offload leaves where they are, as (name, blocks,
    parameter bytes): on Flux with FastVideo's rule, the 38 single-stream blocks."""
    return [(name, len(blocks), sum(p.numel() * p.element_size() for p in blocks.parameters()))
            for name, blocks in _named_lists(model).items() if len(blocks) and name not in offloaded]


def find_block_lists(model: nn.Module, block_lists: str | Sequence[str] | None) -> list[tuple[str, nn.ModuleList]]:
    """The block lists to offload, in the order their blocks run (one ring across all of them).

    None: FastVideo's rule, the first direct-child ``ModuleList``. ``"all"``: every non-empty
    direct-child ``ModuleList`` in registration order, which is the order a model's forward runs them
    in for the DiTs this targets (Flux, HunyuanVideo: double-stream, then single-stream blocks). A
    sequence of attribute names: those lists, in that order (for a model that registers them in
    another order than it runs them).
    """
    if block_lists is None:
        name, blocks = find_block_list(model)
        later = [other for other, found in _named_lists(model).items() if len(found) > 0]
        if len(blocks) == 0 and later:
            # FastVideo's rule finds no block to hook here and raises; offloading nothing would leave the
            # blocks of the lists after it where they are, with no sign that offload never started.
            raise OffloadConfigError(f"fastoffload: No nn.ModuleList found in the model for layerwise offloading: its "
                                     f"first nn.ModuleList, {name!r}, is empty. Name the lists that hold the blocks "
                                     f"with block_lists= (this model has blocks in: {', '.join(later)})")
        return [(name, blocks)]
    lists = _named_lists(model)
    check_block_lists_form(block_lists, ", ".join(lists) or "none")
    if block_lists == ALL_LISTS:
        chosen = [(name, blocks) for name, blocks in lists.items() if len(blocks) > 0]
        if not chosen:
            find_block_list(model)  # FastVideo's error when there is no list at all
            raise OffloadConfigError("fastoffload: block_lists='all' found only empty nn.ModuleLists in the model; "
                                     "there are no blocks to offload")
        return chosen
    names = _check_names(block_lists, lists)
    if not any(len(lists[name]) for name in names):
        raise OffloadConfigError(f"fastoffload: block_lists names only empty nn.ModuleLists ({', '.join(names)}); there "
                                 "are no blocks to offload. Name a list that holds the blocks, or pass "
                                 "block_lists=None")
    return [(name, lists[name]) for name in names]


def check_block_lists_form(block_lists: Any, known: str | None = None) -> None:
    """The forms ``block_lists`` takes whatever the model: None, ``"all"`` or a non-empty sequence of
    names (``known``: the model's lists, for the message, when there is a model)."""
    if block_lists is None or block_lists == ALL_LISTS:
        return
    if isinstance(block_lists, str):
        raise OffloadConfigError(f"fastoffload: block_lists must be None, {ALL_LISTS!r} or a list of attribute "
                                 f"names, got the string {block_lists!r}; write block_lists=[{block_lists!r}] "
                                 "for one list")
    if not isinstance(block_lists, Sequence) or not block_lists or not all(isinstance(n, str) for n in block_lists):
        has = f" (this model has: {known})" if known is not None else ""
        raise OffloadConfigError(f"fastoffload: block_lists must be None, {ALL_LISTS!r} or a non-empty list of "
                                 f"attribute names of direct-child nn.ModuleLists{has}, got {block_lists!r}")


def _check_names(block_lists: Any, lists: dict[str, nn.ModuleList]) -> list[str]:
    known = ", ".join(lists) or "none"
    names = list(block_lists)
    for name in names:
        if not isinstance(name, str) or name not in lists:
            raise OffloadConfigError(f"fastoffload: block_lists names {name!r}, which is not a direct-child "
                                     f"nn.ModuleList of the model; choose from: {known}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise OffloadConfigError(f"fastoffload: block_lists names {', '.join(map(repr, repeated))} more than once; "
                                 "each list joins the ring once")
    return names


def storage_key(param: torch.Tensor) -> tuple[object, ...]:
    """What identifies the bytes behind ``param``: its device and storage address (its identity when
    it has no bytes, which every empty tensor shares)."""
    try:
        storage = param.untyped_storage()
        address = storage.data_ptr()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage of its own
        return ("object", id(param))
    if storage.nbytes() == 0 or param.device.type == "meta":
        return ("object", id(param))
    return (param.device.type, param.device.index, address)


def _tie_text(where: str, param: torch.Tensor, other_where: str, other: torch.Tensor) -> str:
    relation = "is the same tensor as" if param is other else "shares its storage with"
    return f"fastoffload: parameter {where} {relation} {other_where}"


def _parameters_outside(model: nn.Module, blocks: Sequence[nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, parameter) of every parameter of ``model`` outside ``blocks``. A block reached by another path
    (``self.alias = self.blocks``) is the same module, and calling it there runs its offload hook: its
    parameters are not outside. A submodule of a block reached from outside the block would run without
    the hook, on placeholders: its parameters are."""
    block_ids = {id(block) for block in blocks}
    inside: list[str] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        if any(prefix.startswith(block_prefix) for block_prefix in inside):
            continue
        if id(module) in block_ids:
            inside.append(f"{prefix}.")
            continue
        for leaf, param in module.named_parameters(recurse=False):
            yield (f"{prefix}.{leaf}" if prefix else leaf), param


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
                if other_where.startswith(f"{list_name}.{index}."):
                    raise OffloadConfigError(_tie_text(where, param, other_where, other) + " in the same block: "
                                             "parameters of one offloaded block that share a storage (views of one "
                                             "tensor) are not supported (its host copy holds each parameter apart, "
                                             "so a write through one would not reach the other). Give each its own "
                                             "storage (clone one), or keep that block resident with resident_blocks")
                raise OffloadConfigError(_tie_text(where, param, other_where, other) + ": tied weights across "
                                         "offloaded blocks are not supported (offloading one would turn the other "
                                         "into a placeholder). Untie them (clone one), or keep those blocks resident "
                                         "with resident_blocks")
            owner[key] = (where, param)
    for name, param in _parameters_outside(model, [blocks[index] for index in offloaded_indices]):
        key = storage_key(param)
        if key in owner:
            other_where, other = owner[key]
            raise OffloadConfigError(_tie_text(name, param, other_where, other) + ", which would be offloaded: "
                                     "weights tied between an offloaded block and the rest of the model are not "
                                     "supported. Untie them (clone one), or keep that block resident with "
                                     "resident_blocks")


def tied_block_indices(model: nn.Module, blocks: Sequence[nn.Module]) -> tuple[int, ...]:
    """The blocks holding a parameter whose storage another block, or the rest of the model, holds too.

    :func:`check_tied_parameters` refuses to offload any of them; a planner that picks the resident set
    keeps them resident instead (a weight tied inside one block is not a tie between owners)."""
    owners: dict[tuple[object, ...], set[int]] = {}
    for index, block in enumerate(blocks):
        for param in block.parameters():
            owners.setdefault(storage_key(param), set()).add(index)
    for _, param in _parameters_outside(model, blocks):
        key = storage_key(param)
        if key in owners:
            owners[key].add(-1)  # the rest of the model
    return tuple(sorted({index for held in owners.values() if len(held) > 1 for index in held if index >= 0}))


def _keeps_values_inside(param: torch.Tensor) -> bool:
    """Whether ``param`` is a wrapper tensor subclass: its values live in inner tensors, and it has no bytes of
    its own to copy (reading its storage raises)."""
    if is_traceable_wrapper_subclass(param):
        return True
    try:
        param.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return not param.is_nested and param.layout == torch.strided
    return False


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
            if param.is_nested:
                # Checked here: the engines would fail deep inside on a tensor without one shape (torch's
                # own "NestedTensorImpl doesn't support sizes" or "incompatible tensor type").
                raise OffloadConfigError(f"fastoffload: parameter {list_name}.{index}.{name} is a nested tensor; only "
                                         "dense (strided) tensors can be offloaded. Hold its values as dense "
                                         "tensors, or keep that module outside the block list")
            if isinstance(param, nn.parameter.UninitializedParameter):
                raise OffloadConfigError(f"fastoffload: parameter {list_name}.{index}.{name} is not initialized yet (a "
                                         "lazy module such as nn.LazyLinear, which sizes its weights on its first "
                                         "forward); run one forward on the model before enabling offload, so the "
                                         "weights exist")
            if _keeps_values_inside(param):
                raise OffloadConfigError(f"fastoffload: parameter {list_name}.{index}.{name} is of type "
                                         f"{type(param).__name__}, a tensor subclass that keeps its values in inner "
                                         "tensors (a torchao or quanto quantized weight, for example) rather than in "
                                         "bytes of its own, which are what this engine offloads. Keep that module "
                                         "outside the block list, or store the blocks in a plain low-precision dtype "
                                         "(diffusers' enable_layerwise_casting before the offload moves them in float8)")


def check_repeated_blocks(blocks: Sequence[nn.Module], names: Sequence[str], offloaded: Collection[int]) -> None:
    """Refuses one module object listed both as an offloaded block and as a resident one: the offload hook
    takes its parameters for placeholders, while moving the resident blocks to the device would rebind
    those placeholders."""
    offloaded = set(offloaded)
    first_offloaded = {}
    for index in sorted(offloaded):
        first_offloaded.setdefault(id(blocks[index]), index)
    for index, block in enumerate(blocks):
        other = first_offloaded.get(id(block))
        if index not in offloaded and other is not None and any(True for _ in block.parameters()):
            raise OffloadConfigError(f"fastoffload: {names[index]} and {names[other]} are one module listed twice, "
                                     f"and {names[index]} would stay resident while {names[other]} is offloaded; "
                                     "keep both resident or offload both (resident_blocks)")


def check_weight_hooks(blocks: Sequence[nn.Module], names: Sequence[str], offloaded: Collection[int]) -> None:
    """Refuses an offloaded block that recomputes its own weight in a torch forward pre-hook (the older
    ``nn.utils.weight_norm`` / ``spectral_norm`` applied to the block itself). Torch runs those hooks
    before the forward that the offload hook wraps, so they would read the empty placeholders: torch's
    weight norm of an empty tensor kills the process with SIGFPE on the CPU."""
    for index in offloaded:
        for hook in blocks[index]._forward_pre_hooks.values():
            if isinstance(hook, (WeightNorm, SpectralNorm)):
                kind = "weight_norm" if isinstance(hook, WeightNorm) else "spectral_norm"
                raise OffloadConfigError(f"fastoffload: {names[index]} has torch.nn.utils.{kind} applied to the "
                                         "block itself: its forward pre-hook recomputes the weight before offload "
                                         "loads the block, from empty placeholders. Use "
                                         f"torch.nn.utils.parametrizations.{kind} (computed inside the forward), "
                                         "apply it to a submodule of the block, or keep the block resident with "
                                         "resident_blocks")


def _tracks_versions(param: torch.Tensor) -> bool:
    """False for a tensor made inside inference_mode (it has no version counter). A parameter rebound in
    an inference_mode disable reports ``is_inference()`` but keeps its counter, and is fine."""
    try:
        param._version  # noqa: B018 (the access is the test)
    except RuntimeError:
        return False
    return True


def check_devices(blocks: list[nn.Module], offset: int, device: torch.device, from_file: bool = False) -> None:
    """Every parameter has values, on the host or on ``device`` (or, ``from_file``, comes from a checkpoint),
    and counts versions: offload tells an in-place write from its own rebinding by the parameters' version
    counters, which a tensor made inside inference_mode does not have."""
    for index, block in enumerate(blocks):
        for name, param in block.named_parameters():
            if not _tracks_versions(param):
                raise OffloadConfigError(f"fastoffload: parameter {offset + index}.{name} is an inference tensor (the "
                                         "model was built or loaded inside torch.inference_mode()), which offload "
                                         "cannot watch for in-place writes; build or load the model outside "
                                         "inference_mode (torch.no_grad() is fine) and run the forward inside it")
            if param.device.type == "meta" and from_file:
                continue
            if param.device.type == "meta":
                raise OffloadConfigError(f"fastoffload: parameter {offset + index}.{name} is on the meta device and "
                                         "has no values to offload; materialize the model first (e.g. "
                                         "to_empty(device=...) then load_state_dict)")
            if param.device.type not in ("cpu", device.type) or (param.device.type == "cuda" and param.device != device):
                raise OffloadConfigError(f"fastoffload: parameter {offset + index}.{name} is on {param.device}, but "
                                         f"offload goes to {device}: move the model to the CPU or to {device} before "
                                         "enabling offload")
