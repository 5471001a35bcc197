"""Argument validation for ``enable_layerwise_offload``: raw arguments in, one frozen
:class:`OffloadOptions` out, every error raised before anything changes.

The phases of enable (layerwise.py) read only the options; a new argument is a new field here and a
check in :func:`check_arguments` (which enable runs before anything changes, also before ``is_replace``
undoes the offload already on the model) or, when it needs the blocks' sizes, in the layout that
:func:`validate_arguments` resolves after it.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fastoffload_ext import _backend, codec
from fastoffload_ext.engine import sharing
from fastoffload_ext.engine.model_checks import check_block_kinds, find_block_lists, tied_block_indices
from fastoffload_ext.errors import OffloadConfigError, OffloadStateError
from fastoffload_ext.storage.options import DiskOptions, check_storage_arguments
from fastoffload_ext.planning.budgets import parse_size
from fastoffload_ext.planning.layout import check_layout_arguments, check_prefetch_depth, resolve_layout
from fastoffload_ext.planning.plan import OffloadPlan

logger = logging.getLogger(__name__)

__all__ = ["BACKENDS", "DEFAULT_PIN_BACKING", "PIN_BACKINGS", "CheckedArguments", "OffloadOptions", "check_arguments",
           "check_flags", "choose_backend",
           "effective_prefetch_depth", "resolve_device",
           "validate_arguments"]

BACKENDS = ("auto", "ext", "python")
PIN_BACKINGS = ("host_alloc", "register", "pageable")
DEVICE_FORMS_ERROR = "fastoffload: device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}"
# mmap + cudaHostRegister: measured on the H200 (2026-11-29, one fresh 1 GiB allocation) at 382 ms/GiB
# against 622 ms/GiB for cudaHostAlloc, with the same H2D bandwidth from either (55.4 vs 55.5 GB/s at
# 1 GiB, 54.5 vs 54.8 at 16 MiB).
DEFAULT_PIN_BACKING = "register"


@dataclass(frozen=True)
class OffloadOptions:
    """The validated arguments of one ``enable_layerwise_offload`` call."""

    device: torch.device
    backend: str  # "ext" or "python": "auto" is decided here
    list_name: str  # the lists' names joined by "+" when there are several
    blocks: nn.ModuleList  # every block of every list, in ring order
    resident: tuple[int, ...]  # indices (in ring order) of the blocks kept on the device, never hooked
    prefetch_depth: int
    cyclic: bool
    is_replace: bool
    pin_backing: str
    allow_pageable_fallback: bool
    pinned_limit_bytes: int  # 0: no limit
    share_host_copy: bool | str
    process_group: Any
    compress: str = "off"  # the engine's codec mode: "off", "on" or "auto" (fastoffload_ext.codec)
    plan: OffloadPlan | None = None  # the planner's plan behind ``resident``/``prefetch_depth``, if any
    settings: dict[str, Any] | None = None  # the budget arguments, resolved, for a later re-plan

    weights: Any = None  # a checkpoint to build from (storage/); None: the model's own tensors
    # With weights=: the disk tier's budget (bytes, or "auto": what the process may use, measured when the
    # tiers are planned); the blocks beyond it stay on disk. None: no limit.
    host_budget_bytes: int | str | None = None
    disk_options: DiskOptions | None = None
    lists: tuple[tuple[str, nn.ModuleList], ...] = ()  # (attribute name, list) in ring order

    @property
    def offloaded_indices(self) -> tuple[int, ...]:
        resident = set(self.resident)
        return tuple(i for i in range(len(self.blocks)) if i not in resident)

    @property
    def block_names(self) -> list[str]:
        """Each block's name in the model (``blocks.3``), in ring order."""
        return ring_block_names(self.lists or ((self.list_name, self.blocks),))

    @property
    def offloaded(self) -> list[nn.Module]:
        return [self.blocks[i] for i in self.offloaded_indices]


def resolve_device(device: str | torch.device | int | None) -> torch.device | None:
    """The offload device, or None when none was given and CUDA is not available."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return None
    if isinstance(device, int):
        device = torch.device("cuda", device)
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise OffloadConfigError(DEVICE_FORMS_ERROR.format(device=device)) from error
    if resolved.type == "cpu":
        if resolved.index not in (None, 0, -1):
            raise OffloadConfigError(f"fastoffload: device {str(device)!r} names a CPU index, but the host is one "
                                     "device for offload; pass device='cpu'")
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise OffloadConfigError(DEVICE_FORMS_ERROR.format(device=str(device)) + ": layerwise offload moves weights "
                                 "between host memory and a CUDA device ('cpu' runs the same engine with the host as "
                                 "its device, for tests)")
    if not torch.cuda.is_available():
        raise OffloadStateError(f"fastoffload: device {str(device)!r} was asked for but CUDA is not available; pass "
                                "device='cpu' to run the offload engine on the host, or None to skip offloading on "
                                "machines without CUDA")
    index = resolved.index if resolved.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise OffloadConfigError(f"fastoffload: device {str(device)!r} does not exist: {torch.cuda.device_count()} "
                                 "CUDA device(s) visible; pass one of those (or check CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", index)


def choose_backend(backend: str, device: torch.device) -> str:
    """ "ext" or "python" for ``backend`` on ``device``; "auto" takes "ext" when it can run there."""
    if backend not in BACKENDS:
        raise OffloadConfigError(f"fastoffload: backend must be one of {', '.join(map(repr, BACKENDS))}, got "
                                 f"{backend!r}")
    ext_usable = _backend.ext_available() and (device.type == "cpu" or _backend.ext_has_cuda())
    if backend == "ext":
        _backend.require_ext()
        if not ext_usable:
            raise OffloadStateError("fastoffload: backend='ext' on a CUDA device needs the compiled core built with "
                                    "CUDA, but it was built CPU-only; rebuild with FASTOFFLOAD_CUDA=1 pip install "
                                    "--no-build-isolation . or use backend='python'")
        return "ext"
    if backend == "python":
        return "python"
    if not ext_usable:
        logger.info("Layerwise offload uses the python backend: %s", _backend.REASON if not _backend.ext_available()
                    else "the compiled core was built without CUDA")
        return "python"
    return "ext"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The compiled core takes sizes as a C++ size_t; a larger Python int would fail inside the binding.
MAX_BYTES = 2**63 - 1


def check_knobs(prefetch_depth: Any, cyclic: Any, pinned_limit_bytes: Any, pin_backing: Any) -> None:
    """The arguments that need nothing but themselves to be checked."""
    check_prefetch_depth(prefetch_depth)
    if not isinstance(cyclic, bool):
        raise OffloadConfigError(f"fastoffload: cyclic must be True or False, got {cyclic!r}")
    if pinned_limit_bytes is not None and (not _is_int(pinned_limit_bytes) or pinned_limit_bytes < 0):
        raise OffloadConfigError("fastoffload: pinned_limit_bytes must be None or an integer >= 0 (bytes), got "
                                 f"{pinned_limit_bytes!r}")
    if pinned_limit_bytes is not None and pinned_limit_bytes > MAX_BYTES:
        raise OffloadConfigError(f"fastoffload: pinned_limit_bytes must be at most 2**63 - 1 bytes, got "
                                 f"{pinned_limit_bytes!r}; pass None for no limit")
    if pin_backing is not None and (not isinstance(pin_backing, str) or pin_backing not in PIN_BACKINGS):
        raise OffloadConfigError(f"fastoffload: pin_backing must be one of {', '.join(map(repr, PIN_BACKINGS))}, got "
                                 f"{pin_backing!r}")


def check_flags(is_replace: Any, allow_pageable_fallback: Any) -> None:
    """Flags that must be real booleans: a string such as "no" is truthy and would silently mean True."""
    for name, value in (("is_replace", is_replace), ("allow_pageable_fallback", allow_pageable_fallback)):
        if not isinstance(value, bool):
            raise OffloadConfigError(f"fastoffload: {name} must be True or False, got {value!r}")


def effective_prefetch_depth(prefetch_depth: int, offloaded_blocks: int) -> int:
    """``prefetch_depth`` clamped to the number of offloaded blocks.

    Copying further ahead than every block there is changes nothing (the targets wrap onto blocks
    already in a slot), but each unit of depth is a device slot: an unbounded depth would allocate
    unbounded bookkeeping (10**9 raised std::bad_alloc in the core) for no effect.
    """
    if prefetch_depth > offloaded_blocks:
        logger.info("prefetch_depth=%d is more than the %d offloaded blocks; using %d", prefetch_depth,
                    offloaded_blocks, offloaded_blocks)
        return offloaded_blocks
    return prefetch_depth


@dataclass(frozen=True)
class CheckedArguments:
    """What :func:`check_arguments` found: the block lists and the settings that need no block's size."""

    lists: tuple[tuple[str, nn.ModuleList], ...]
    list_name: str  # the lists' names joined by "+" when there are several
    blocks: nn.ModuleList  # every block of every list, in ring order
    backend: str
    share_host_copy: bool | str
    compress_mode: str
    disk_budget: int | str | None  # with weights=: the parsed host_budget (the disk tier's)


def check_arguments(model: nn.Module, device: torch.device, *, is_replace: bool, resident_blocks: Any, cyclic: Any,
                    prefetch_depth: Any, backend: str, pin_backing: Any, allow_pageable_fallback: bool,
                    pinned_limit_bytes: Any, share_host_copy: bool | str, process_group: Any,
                    compress: bool | str = False, device_budget: Any = None, host_budget: Any = "auto",
                    activation_reserve: Any = None, plan: Any = None, weights: Any = None,
                    disk_options: Any = None, block_lists: Any = None) -> CheckedArguments:
    """Every refusal that needs only the arguments and the model's structure (its block lists), none of its
    blocks' sizes or values, in a fixed order; the first bad one raises. Enable runs it before it changes
    anything, also before ``is_replace`` undoes the offload on the model: a bad argument leaves that offload
    in place and running."""
    check_knobs(prefetch_depth, cyclic, pinned_limit_bytes, pin_backing)
    check_flags(is_replace, allow_pageable_fallback)
    lists = find_block_lists(model, block_lists)
    list_name, blocks = lists[0] if len(lists) == 1 else _ring(lists)
    check_block_kinds(list(blocks), list_name, 0)  # before the layout, which sizes every block
    # With weights= the host budget is the disk tier's to keep (the blocks beyond it stay on disk), not a
    # limit for the planner to refuse.
    disk_budget = parse_size(host_budget, "host_budget") if weights is not None else None
    chosen = choose_backend(backend, device)
    check_layout_arguments(len(blocks), list_name, resident_blocks=resident_blocks, prefetch_depth=prefetch_depth,
                           device_budget=device_budget, host_budget=host_budget,
                           activation_reserve=activation_reserve, plan=plan)
    share_host_copy = check_storage_arguments(weights, disk_options, chosen, share_host_copy)
    sharing.resolve(share_host_copy, chosen, process_group)  # refuses share_host_copy=True without a group
    return CheckedArguments(lists=tuple(lists), list_name=list_name, blocks=blocks, backend=chosen,
                            share_host_copy=share_host_copy, compress_mode=codec.resolve_compress(compress, chosen),
                            disk_budget=disk_budget)


def validate_arguments(model: nn.Module, device: torch.device, *, is_replace: bool, resident_blocks: Any, cyclic: Any,
                       prefetch_depth: Any, backend: str, pin_backing: Any, allow_pageable_fallback: bool,
                       pinned_limit_bytes: Any, share_host_copy: bool | str, process_group: Any,
                       compress: bool | str = False, device_budget: Any = None, host_budget: Any = "auto",
                       activation_reserve: Any = None, plan: Any = None, weights: Any = None,
                       disk_options: Any = None, block_lists: Any = None,
                       checked: CheckedArguments | None = None) -> OffloadOptions:
    """Checks every argument (``device`` already resolved): :func:`check_arguments` (unless ``checked``
    holds what it returned for these arguments), then the layout.

    The resident set and depth come from ``planning.layout``: as given without a budget, from the
    planner with ``device_budget`` or ``"auto"`` (refused there when nothing fits).
    """
    if checked is None:
        checked = check_arguments(model, device, is_replace=is_replace, resident_blocks=resident_blocks, cyclic=cyclic,
                                  prefetch_depth=prefetch_depth, backend=backend, pin_backing=pin_backing,
                                  allow_pageable_fallback=allow_pageable_fallback,
                                  pinned_limit_bytes=pinned_limit_bytes, share_host_copy=share_host_copy,
                                  process_group=process_group, compress=compress, device_budget=device_budget,
                                  host_budget=host_budget, activation_reserve=activation_reserve, plan=plan,
                                  weights=weights, disk_options=disk_options, block_lists=block_lists)
    blocks, list_name = checked.blocks, checked.list_name
    # compress=True makes the copies move (and the host pin) the coded bytes: the planner counts those;
    # under a plan, "auto" (which only the compiled core runs) has the planner pick raw or coded copies.
    planned_compress = "on" if compress is True else ("auto" if compress == "auto" and checked.backend == "ext"
                                                      else "off")
    layout = resolve_layout(list(blocks), device, list_name, compress=planned_compress,
                            resident_blocks=resident_blocks,
                            prefetch_depth=prefetch_depth, device_budget=device_budget,
                            host_budget=None if weights is not None else host_budget,
                            activation_reserve=activation_reserve, plan=plan, cyclic=cyclic,
                            disk=_disk_costs(weights, ring_block_names(checked.lists), blocks, checked.disk_budget,
                                             disk_options, device, backend),
                            tied=tied_block_indices(model, list(blocks)))
    depth = effective_prefetch_depth(layout.prefetch_depth, len(blocks) - len(layout.resident))
    compress_mode = checked.compress_mode
    if compress_mode == "auto" and layout.compress is not None:
        compress_mode = layout.compress  # the plan was made for coded (or raw) copies: the engine must match
    return OffloadOptions(device=device, backend=checked.backend, list_name=list_name, blocks=blocks,
                          resident=layout.resident, prefetch_depth=depth, cyclic=cyclic, is_replace=is_replace,
                          pin_backing=pin_backing or DEFAULT_PIN_BACKING, allow_pageable_fallback=allow_pageable_fallback,
                          pinned_limit_bytes=pinned_limit_bytes or 0, share_host_copy=checked.share_host_copy,
                          process_group=process_group, compress=compress_mode, plan=layout.plan,
                          settings=layout.settings, weights=weights,
                          host_budget_bytes=checked.disk_budget,
                          disk_options=disk_options, lists=checked.lists)


def _disk_costs(weights: Any, block_names: list[str], blocks: nn.ModuleList, host_budget: Any, disk_options: Any,
                device: torch.device, backend: str) -> Callable[[], Any] | None:
    """With ``weights`` on the compiled core: what tells a plan about the disk tier (``storage.disk_costs``).
    Other cases are refused later, by ``check_storage_arguments``."""
    if not isinstance(weights, (str, os.PathLike)) or choose_backend(backend, device) != "ext" or \
            not isinstance(disk_options, (DiskOptions, type(None))):
        return None

    def costs() -> Any:
        from fastoffload_ext.storage.disk_costs import planned_disk_costs
        return planned_disk_costs(weights, block_names, blocks, host_budget, disk_options, device)
    return costs


def _ring(lists: list[tuple[str, nn.ModuleList]]) -> tuple[str, nn.ModuleList]:
    """Several lists as one: the ring is every block in order. The container is not put on the model."""
    return "+".join(name for name, _ in lists), nn.ModuleList(block for _, blocks in lists for block in blocks)


def ring_block_names(lists: Sequence[tuple[str, nn.ModuleList]]) -> list[str]:
    """Each block's name in the model (``transformer_blocks.3``), in ring order: the lists one after another."""
    return [f"{list_name}.{i}" for list_name, one_list in lists for i in range(len(one_list))]
