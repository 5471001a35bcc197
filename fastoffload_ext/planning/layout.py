"""From ``enable_layerwise_offload``'s arguments to a layout: which blocks stay resident, how deep to prefetch.

Without a budget and without ``"auto"`` it is what it always was (FastVideo's defaults: depth 1, no
resident block; ``resident_blocks=N`` keeps the first N), plus resident sets given as block indices.
``None`` for either means that default without a budget and "the planner chooses" with one.
With ``device_budget`` (bytes, ``"20GiB"`` or ``"auto"``) or ``resident_blocks``/``prefetch_depth`` set
to ``"auto"``, the planner chooses what was left open, from measured costs when the group was
calibrated and from bytes alone before that. Everything here runs before enable changes anything, so a
refusal leaves the model as it was.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning.budgets import AUTO, format_bytes, parse_size
from fastoffload_ext.planning.calibration import cached_h2d_gbps
from fastoffload_ext.planning.codec_choice import choose_codec_plan
from fastoffload_ext.planning.compressed import estimate_transfer_bytes
from fastoffload_ext.planning.costs import BlockCosts, DiskCosts, module_device_bytes, module_host_bytes, module_packed_bytes
from fastoffload_ext.planning.memory import device_free_bytes, probe_host
from fastoffload_ext.planning.plan import OffloadPlan
from fastoffload_ext.planning.planner import plan_offload

logger = logging.getLogger(__name__)

# With device_budget="auto" and no measured activation peak, this share of the free device memory is
# kept back for activations; calibrate() replaces it by the measured peak.
AUTO_RESERVE_FRACTION = 0.10


@dataclasses.dataclass(frozen=True)
class Layout:
    """What enable applies: resident block indices, prefetch depth, and the plan behind them (if any)."""

    resident: tuple[int, ...]
    prefetch_depth: int
    plan: OffloadPlan | None
    settings: dict[str, Any]  # the budget arguments as given, for a later re-plan
    # compress="auto" under a plan: the codec mode the plan was made for ("on" or "off"); None: as asked.
    compress: str | None = None


def _resident_spec(value: object, n: int, list_name: str) -> tuple[int, ...] | str | None:
    """None, "auto", or the resident indices; raises on anything else."""
    if value is None or (isinstance(value, str) and value == AUTO):
        return value  # type: ignore[return-value]
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value <= n:
            raise OffloadConfigError(f"fastoffload: resident_blocks must be an integer between 0 and the {n} blocks of "
                                     f"{list_name!r}, got {value!r}")
        return tuple(range(value))
    if isinstance(value, Collection) and not isinstance(value, (str, bytes, bool)):
        items = list(value)
        if all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in items):
            return tuple(sorted(set(items)))
        raise OffloadConfigError(f"fastoffload: resident_blocks indices must be integers in 0..{n - 1} (the blocks of "
                                 f"{list_name!r}), got {value!r}")
    raise OffloadConfigError(f"fastoffload: resident_blocks must be an integer between 0 and the {n} blocks of "
                             f"{list_name!r}, got {value!r}" + ("" if isinstance(value, bool) else
                                                 "; or pass a collection of block indices, or 'auto'"))


def check_prefetch_depth(value: object) -> int | str | None:
    """``prefetch_depth`` as given: None, "auto" or an integer >= 0; raises on anything else."""
    if value is None or (isinstance(value, str) and value == AUTO):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise OffloadConfigError("fastoffload: prefetch_depth must be an integer >= 0 (blocks copied ahead) or "
                                 f"'auto', got {value!r}")
    return value


def _offload_bytes(blocks: Sequence[nn.Module]) -> list[int]:
    return [module_packed_bytes(block) for block in blocks]


def _host_credit(blocks: Sequence[nn.Module]) -> int:
    """Bytes the blocks hold in host memory now: packing frees them block by block, so they count as free."""
    return sum(module_host_bytes(block) for block in blocks)


def default_costs(blocks: Sequence[nn.Module], device: torch.device, activation_bytes: int) -> BlockCosts:
    """Bytes only: compute unknown (taken as free), bandwidth measured once per process when it can be."""
    return BlockCosts([0.0] * len(blocks), _offload_bytes(blocks), cached_h2d_gbps(device),
                      activation_bytes=activation_bytes, overlap=device.type == "cuda", calibrated=False)


# Where a calibration leaves the activation peak it measured, in the group's settings.
MEASURED_RESERVE = "measured_activation_reserve"


def activation_reserve(settings: dict[str, Any]) -> int | None:
    """The activation reserve a re-plan counts: the caller's ``activation_reserve``, else the peak a
    calibration measured, else the one enable applied (10 % of the free memory under "auto", else 0)."""
    for key in ("activation_reserve", MEASURED_RESERVE, "activation_reserve_bytes"):
        if settings.get(key) is not None:
            return int(settings[key])
    return None


def check_reserve_has_budget(activation_reserve: object, device_budget: object, resident_blocks: object,
                             prefetch_depth: object, plan: object) -> None:
    """``activation_reserve`` is a part of the device budget a plan keeps for activations: without a plan
    (no ``device_budget``, no ``"auto"``, no ``plan``) nothing would count it, so it is refused."""
    planned = device_budget is not None or plan is not None or AUTO in (resident_blocks, prefetch_depth)
    if activation_reserve is not None and not planned:
        raise OffloadConfigError("fastoffload: activation_reserve is the part of a device_budget kept for activations, "
                                 "and no device_budget was given (nor resident_blocks or prefetch_depth 'auto', nor a "
                                 "plan), so nothing would count it; pass device_budget=... (or 'auto'), or leave "
                                 "activation_reserve out")


def _budgets(settings: dict[str, Any], blocks: Sequence[nn.Module], device: torch.device,
             costs: BlockCosts | None) -> tuple[int | None, int | None, int]:
    """(device budget, host budget, activation reserve) in bytes."""
    device_budget = settings["device_budget"]
    reserve = settings["activation_reserve"]
    if reserve is None:
        reserve = costs.activation_bytes if costs is not None and costs.calibrated else None
    if device_budget == AUTO:
        free = device_free_bytes(device) + sum(module_device_bytes(block, device) for block in blocks)
        if reserve is None:
            reserve = int(free * AUTO_RESERVE_FRACTION)
        device_budget = free
    host_budget = settings["host_budget"]
    if host_budget == AUTO:
        host_budget = probe_host().usable + _host_credit(blocks)
    return device_budget, host_budget, int(reserve or 0)


def _check_host(host_budget: int | None, blocks: Sequence[nn.Module], resident: tuple[int, ...],
                explicit: bool, compress: str = "off") -> None:
    if host_budget is None:
        return
    offloaded = [block for i, block in enumerate(blocks) if i not in set(resident)]
    need = sum(map(module_packed_bytes, offloaded))
    if need > host_budget and compress == "on":
        # compress=True keeps only the coded copies on the host ("auto" holds both while it measures);
        # sampled only when the raw bytes would not fit, so enable pays for it only then.
        need = sum(estimate_transfer_bytes(offloaded))
    if need > host_budget:
        source = "host_budget" if explicit else "the host memory this process may use"
        raise OffloadConfigError(
            f"fastoffload: the offloaded blocks need {format_bytes(need)} of host memory, more than {source} "
            f"({format_bytes(host_budget)}); keep more blocks resident (resident_blocks, or a device_budget), free "
            "host memory, or raise host_budget")


def resolve_layout(blocks: Sequence[nn.Module], device: torch.device, list_name: str, *, resident_blocks: object,
                   prefetch_depth: object, device_budget: object = None, host_budget: object = AUTO,
                   activation_reserve: object = None, plan: OffloadPlan | None = None, cyclic: bool = True,
                   costs: BlockCosts | None = None, compress: str = "off",
                   disk: Callable[[], DiskCosts | None] | None = None, tied: Collection[int] = ()) -> Layout:
    """The resident set and depth enable should apply; raises OffloadConfigError before anything changes.

    ``tied``: blocks whose weights are tied to another block or to the rest of the model; a plan keeps
    them resident (kept in the settings as ``tied_resident``, for the re-plans).

    ``disk``: with ``weights=``, what gives the disk tier the plan must count (None when every block
    fits the host budget); called only when a plan is made, since it may read from the disk.

    ``compress``: the engine's codec mode. With "on" a bytes-only plan counts the coded bytes each copy
    will move (sampled, ``compressed.py``) and the decode's staging; with "auto" and a plan, the raw and
    the coded plan are both made and the faster predicted one is applied (``codec_choice.py``):
    ``Layout.compress`` is then the mode that plan needs. Without a plan "auto" decides per step later.
    """
    n = len(blocks)
    resident = _resident_spec(resident_blocks, n, list_name)
    depth = check_prefetch_depth(prefetch_depth)
    settings = {"device_budget": parse_size(device_budget, "device_budget"),
                "host_budget": parse_size(host_budget, "host_budget"),
                "activation_reserve": parse_size(activation_reserve, "activation_reserve", allow_auto=False)}
    if plan is not None:
        return _from_plan(plan, blocks, device, list_name, settings, resident_blocks, prefetch_depth, costs, compress,
                          cyclic, tied)
    planned = settings["device_budget"] is not None or resident == AUTO or depth == AUTO
    check_reserve_has_budget(settings["activation_reserve"], settings["device_budget"], resident, depth, None)
    if not planned:
        fixed = resident if isinstance(resident, tuple) else ()
        _, host, _ = _budgets(settings, blocks, device, costs)
        _check_host(host, blocks, fixed, settings["host_budget"] != AUTO, compress)
        return Layout(fixed, 1 if depth is None else int(depth), None, settings)
    if settings["device_budget"] is None:
        settings["device_budget"] = AUTO  # "auto" residency or depth without a budget: what the device has free
    budget, host, reserve = _budgets(settings, blocks, device, costs)
    fixed_resident = None if resident in (None, AUTO) else resident
    fixed_depth = None if depth in (None, AUTO) else int(depth)  # type: ignore[arg-type]
    # device_budget_bytes: the budget enable applied, in bytes ("auto" resolved), for checks made later (a
    # CUDA-graph capture's fixed slots, engine/graphs.py).
    settings.update(fixed_resident=fixed_resident, fixed_depth=fixed_depth, activation_reserve_bytes=reserve,
                    device_budget_bytes=budget, tied_resident=tuple(sorted(tied)))
    if n == 0:
        return Layout((), fixed_depth if fixed_depth is not None else 1, None, settings)
    table = costs if costs is not None and costs.blocks == n else default_costs(blocks, device, reserve)
    table = table.with_activation_bytes(reserve)
    found = disk() if disk is not None and table.disk is None else None
    if found is not None:
        table = dataclasses.replace(table, disk=found)
    # Blocks on the meta device (weights= builds from a checkpoint) have no values to estimate coded sizes
    # from: "auto" then plans raw copies and leaves the choice to the engine's per-step chooser.
    chooses = compress == "auto" and not _on_meta(blocks)
    if compress == "on" or chooses:
        coded = table if table.compressed else dataclasses.replace(
            table, transfer_bytes=tuple(estimate_transfer_bytes(blocks)))
    if chooses:
        chosen = choose_codec_plan(table, coded, budget, host_budget=host, resident=fixed_resident,
                                   prefetch_depth=fixed_depth, cyclic=cyclic, keep_resident=tied)
    else:
        chosen = plan_offload(coded if compress == "on" else table, budget, host_budget=host,
                              resident=fixed_resident, prefetch_depth=fixed_depth, cyclic=cyclic, keep_resident=tied)
    logger.info("%s", chosen)
    return Layout(chosen.resident, chosen.prefetch_depth, chosen, settings,
                  _planned_mode(chosen, compress) if chooses else None)


def _on_meta(blocks: Sequence[nn.Module]) -> bool:
    return any(p.device.type == "meta" for block in blocks for p in block.parameters())


def _planned_mode(plan: OffloadPlan, compress: str) -> str | None:
    """The codec mode a plan needs under compress="auto": it was made for coded copies or for raw ones."""
    if compress != "auto":
        return None
    return "on" if plan.compressed else "off"


def _check_plan_form(plan: object, n: int, list_name: str, resident_blocks: object, prefetch_depth: object) -> None:
    if not isinstance(plan, OffloadPlan):
        raise OffloadConfigError(f"fastoffload: plan must be an OffloadPlan from plan_offload(), got "
                                 f"{type(plan).__name__}")
    if plan.blocks != n:
        raise OffloadConfigError(f"fastoffload: the plan was made for {plan.blocks} blocks, but {list_name!r} has "
                                 f"{n}; make a plan from this model's costs")
    if resident_blocks is not None or prefetch_depth is not None:
        raise OffloadConfigError("fastoffload: pass either plan= or resident_blocks/prefetch_depth, not both: the "
                                 f"plan already sets resident {list(plan.resident)} and depth {plan.prefetch_depth}")


PLAN_SIZES_ERROR = ("fastoffload: the plan was made for blocks of other sizes than {list_name!r} has (block {index}: "
                    "{planned} in the plan, {actual} here): it was made for another model, or this one changed since "
                    "(a cast such as model.half()), so its device and host bytes are not this model's; make a plan "
                    "from this model's costs (plan_offload on a table of these sizes, or enable with device_budget=... "
                    "and use group.plan)")


PLAN_RESERVE_ERROR = ("fastoffload: the plan's layout holds {layout} of device memory, which with activation_reserve "
                      "{reserve} makes {need}, more than device_budget {budget}; make the plan with this reserve "
                      "(plan_offload(costs.with_activation_bytes(reserve), budget)), lower activation_reserve, or "
                      "raise device_budget")


def _check_plan_sizes(plan: OffloadPlan, blocks: Sequence[nn.Module], list_name: str) -> None:
    """A plan counts the block sizes it was made from: on blocks of other sizes its figures, and the budget
    checks made with them, would be another model's."""
    actual = _offload_bytes(blocks)
    for index, (planned, size) in enumerate(zip(plan.costs.block_bytes, actual)):
        if planned != size:
            raise OffloadConfigError(PLAN_SIZES_ERROR.format(list_name=list_name, index=index,
                                                             planned=format_bytes(planned), actual=format_bytes(size)))


def _with_given_reserve(plan: OffloadPlan, reserve: int | None, budget: int | None, cyclic: bool) -> OffloadPlan:
    """The plan's layout scored again with an ``activation_reserve`` given beside it; refused, with the
    numbers, when the layout and that reserve do not fit the budget (the given one, else the plan's)."""
    if reserve is None or reserve == plan.costs.activation_bytes:
        return plan
    limit = budget if budget is not None else plan.device_budget
    layout = plan.device_bytes - plan.activation_bytes
    if limit is not None and layout + reserve > limit:
        raise OffloadConfigError(PLAN_RESERVE_ERROR.format(layout=format_bytes(layout), reserve=format_bytes(reserve),
                                                           need=format_bytes(layout + reserve),
                                                           budget=format_bytes(limit)))
    return plan_offload(plan.costs.with_activation_bytes(reserve), limit,
                        host_budget=plan.host_budget, resident=plan.resident, prefetch_depth=plan.prefetch_depth,
                        cyclic=cyclic, cuda_graph=plan.cuda_graph)


def check_layout_arguments(n: int, list_name: str, *, resident_blocks: object, prefetch_depth: object,
                           device_budget: object = None, host_budget: object = AUTO, activation_reserve: object = None,
                           plan: object = None) -> None:
    """The refusals of :func:`resolve_layout` that need no block's size: the forms of the arguments, the
    resident indices against the ``n`` blocks, a plan's kind and block count. Enable runs them before it
    changes anything, also before ``is_replace`` undoes the offload on the model (whose blocks hold
    placeholders until then, so their sizes are not known)."""
    resident = _resident_spec(resident_blocks, n, list_name)
    depth = check_prefetch_depth(prefetch_depth)
    budget = parse_size(device_budget, "device_budget")
    parse_size(host_budget, "host_budget")
    reserve = parse_size(activation_reserve, "activation_reserve", allow_auto=False)
    if plan is not None:
        _check_plan_form(plan, n, list_name, resident_blocks, prefetch_depth)
    else:
        check_reserve_has_budget(reserve, budget, resident, depth, None)


def _from_plan(plan: OffloadPlan, blocks: Sequence[nn.Module], device: torch.device, list_name: str,
               settings: dict[str, Any], resident_blocks: object, prefetch_depth: object,
               costs: BlockCosts | None, compress: str = "off", cyclic: bool = True,
               tied: Collection[int] = ()) -> Layout:
    _check_plan_form(plan, len(blocks), list_name, resident_blocks, prefetch_depth)
    _check_plan_sizes(plan, blocks, list_name)
    if compress == "on" and not plan.costs.compressed:
        # A plan made for raw copies, applied with compress=True: the copies move coded bytes and the decoder
        # keeps its staging on the device, so the same layout is scored (and checked) again with both.
        coded = dataclasses.replace(plan.costs, transfer_bytes=tuple(estimate_transfer_bytes(blocks)))
        plan = plan_offload(coded, plan.device_budget, host_budget=plan.host_budget, resident=plan.resident,
                            prefetch_depth=plan.prefetch_depth, cyclic=cyclic, cuda_graph=plan.cuda_graph)
    elif compress == "off" and plan.costs.compressed:
        # A plan made for coded copies, applied without compression (compress=False, or a backend without the
        # decoder): the copies move and the host pins the raw bytes, so the same layout is scored (and checked
        # against its host budget) again with those; kept as it was, it reported coded blocks that never run.
        raw = dataclasses.replace(plan.costs, transfer_bytes=None)
        plan = plan_offload(raw, plan.device_budget, host_budget=plan.host_budget, resident=plan.resident,
                            prefetch_depth=plan.prefetch_depth, cyclic=cyclic, cuda_graph=plan.cuda_graph)
    budget, host, _ = _budgets(settings, blocks, device, costs)
    plan = _with_given_reserve(plan, settings["activation_reserve"], budget, cyclic)
    if budget is not None and plan.device_bytes > budget:
        raise OffloadConfigError(f"fastoffload: the plan needs {format_bytes(plan.device_bytes)} of device memory, "
                                 f"more than device_budget {format_bytes(budget)}; re-plan with this budget")
    _check_host(host, blocks, plan.resident, settings["host_budget"] != AUTO,
                "on" if plan.compressed and compress != "off" else "off")
    # The budgets given beside the plan are the ones its re-plans keep to: a plan made without them (or
    # with others) would otherwise re-plan to any layout, above the budgets the caller gave here.
    given_host = host if settings["host_budget"] not in (None, AUTO) else plan.host_budget
    if (budget is not None and plan.device_budget != budget) or given_host != plan.host_budget:
        plan = plan_offload(plan.costs, budget if budget is not None else plan.device_budget, host_budget=given_host,
                            resident=plan.resident, prefetch_depth=plan.prefetch_depth, cyclic=cyclic,
                            cuda_graph=plan.cuda_graph)
    # The reserve the plan counts (a re-plan keeps it unless the caller gave one or a calibration measured it).
    reserve = settings["activation_reserve"]
    settings.update(fixed_resident=None, fixed_depth=None, device_budget_bytes=budget,
                    activation_reserve_bytes=reserve if reserve is not None else plan.costs.activation_bytes,
                    tied_resident=tuple(sorted(tied)))
    return Layout(plan.resident, plan.prefetch_depth, plan, settings, _planned_mode(plan, compress))


__all__ = ["AUTO_RESERVE_FRACTION", "MEASURED_RESERVE", "PLAN_RESERVE_ERROR", "PLAN_SIZES_ERROR", "Layout",
           "activation_reserve", "check_layout_arguments", "check_prefetch_depth", "check_reserve_has_budget",
           "default_costs", "resolve_layout"]
