"""Calibrating an offloaded model and re-planning it: what ``group.calibrate`` and ``group.replan`` do.

A plan made at enable before anything ran knows only bytes; the first calibration measures this
machine (per-block compute, the step, the activation peak, H2D bandwidth) and plans again. A plan also
goes stale when the work per step changes (another resolution or batch size): ``observe_step`` tells
when a measured step left the prediction's tolerance, and a new calibration re-plans.

Re-applying a plan whose resident set or depth differs means offloading again: every parameter is
brought back to host memory with its current values (``disable_layerwise_offload(model, "cpu")``) and
offload is enabled with the new plan and the arguments enable was first given. The new group replaces
the old one on the model (``get_offload_group(model)``); the new plan is computed, and refused if it does
not fit, before anything is undone, and if enabling it fails all the same (or the disable is cut short)
the previous layout is applied again before the error is raised. A group that streams blocks from disk
is never re-enabled (it would go through host memory): a new layout for it is refused, or kept out by a
calibration.

From another thread, applying a new layout waits for a forward that runs in the model (between two
blocks or inside a resident block too, which a block's own gate does not see), and forwards that start
meanwhile wait for it: the disable would otherwise take a resident block's weights from under a running
``F.linear`` (``engine/threads.py``, ``ModelForwards``). A re-plan that waited for another thread's
re-plan or disable finds its group gone and raises ``STALE_GROUP_ERROR``.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from fastoffload_ext.engine.messages import STALE_GROUP_ERROR, warn_caller
from fastoffload_ext.engine.state import host_values_of
from fastoffload_ext.errors import OffloadConfigError, OffloadStateError
from fastoffload_ext.planning.budgets import format_bytes
from fastoffload_ext.planning.calibration import calibrate_costs, time_step_ms
from fastoffload_ext.planning.codec_choice import carry_choice, choose_codec_plan
from fastoffload_ext.planning.compressed import estimate_block, estimate_tensors
from fastoffload_ext.planning.costs import BlockCosts, DiskCosts, module_packed_bytes, packed_bytes
from fastoffload_ext.planning.layout import MEASURED_RESERVE, activation_reserve
from fastoffload_ext.planning.planner import plan_offload

logger = logging.getLogger(__name__)


def _block_bytes(group: Any) -> list[int]:
    """Each block's packed bytes (what a slot holds), from the host copy when the block is offloaded."""
    sizes = [module_packed_bytes(block) for block in group.blocks]
    for index, state in zip(group.offloaded_indices, group.states):
        sizes[index] = packed_bytes([t.numel() * t.element_size() for t in host_values_of(state).values()])
    return sizes


def transfer_bytes(group: Any, sizes: list[int]) -> list[int]:
    """What each block's copy moves now: the engine's compressed bytes for blocks it sends coded.

    Read after the calibration step, so a ``compress="auto"`` engine has decided; a block still
    measuring counts raw. A resident block has no host copy to measure: with ``compress=True`` it
    counts the sampled estimate (``compressed.py``), with "auto" raw (the engine decides later).
    """
    moved = list(sizes)
    engine = group.engine
    mode = getattr(group, "compress_mode", "off")
    if engine is None or mode == "off":
        return moved
    if mode == "on":
        for index in group.resident:
            moved[index] = estimate_block(group.blocks[index])
    for index, state in zip(group.offloaded_indices, group.states):
        handle = getattr(state, "handle", None)
        if handle is None or engine.is_removed(handle):
            continue
        info = engine.codec_info(handle)
        if info["mode"] == "compressed":
            moved[index] = int(info["compressed_bytes"])
    return moved


def _coded_table(group: Any, table: BlockCosts) -> BlockCosts:
    """``table`` with coded sizes: the engine's where it sends blocks coded, else sampled from the weights
    (a resident block's own tensors, an offloaded one's host copy)."""
    if table.compressed:
        return table
    moved = list(table.block_bytes)
    offloaded = dict(zip(group.offloaded_indices, group.states))
    for index, block in enumerate(group.blocks):
        state = offloaded.get(index)
        moved[index] = (estimate_tensors(list(host_values_of(state).values())) if state is not None
                        else estimate_block(block))
    return dataclasses.replace(table, transfer_bytes=tuple(moved))


def _with_current_sizes(group: Any, table: BlockCosts | None) -> BlockCosts | None:
    """The last calibration's ``table`` with the blocks' sizes as they are now: a ``mutate_params_scope``
    may have grown a block since (an adapter's parameters), and the engine's slots follow the real sizes,
    so a plan from the old ones would hold more device memory than it counts."""
    if table is None or table.blocks != len(group.blocks):
        return table
    sizes = _block_bytes(group)
    if tuple(sizes) == table.block_bytes:
        return table
    moved = transfer_bytes(group, sizes) if table.compressed else None
    return dataclasses.replace(table, block_bytes=tuple(sizes), transfer_bytes=moved)


def _check_current(group: Any) -> None:
    from fastoffload_ext.engine.layerwise import get_offload_group

    if get_offload_group(group.model_ref) is not group:
        raise OffloadStateError(STALE_GROUP_ERROR)
    for _, hooks in group.model_hooks.blocks if group.model_hooks is not None else ():
        hooks.finish_interrupted_load()  # a load that raised part-way is no scope
    inside = {id(state.module_ref) for state in group.states if getattr(state, "mutating", False)}
    mutating = [index for index, block in enumerate(group.blocks) if id(block) in inside]
    if mutating:
        raise OffloadStateError(f"fastoffload: offloaded block {mutating[0]} is inside mutate_params_scope(); a "
                                "re-plan offloads every block again and would take its weights from under the "
                                "scope. Calibrate or re-plan after the scope has exited")


def calibrate(group: Any, step: Callable[[], Any], *, replan: bool = True, repeats: int = 5,
              h2d_gbps: float | None = None) -> BlockCosts:
    """Measures the group's cost table with ``step`` (one forward); re-plans a planned group from it, then
    times ``step`` on the layout now applied: that time is what later steps are compared with
    (``OffloadPlan.drifted``)."""
    _check_current(group)
    if not group.blocks:
        lists = ", ".join(repr(name) for name in getattr(group, "list_names", [group.list_name]))
        raise OffloadConfigError(f"fastoffload: nothing to calibrate: this offload holds no block (the block list "
                                 f"{lists} is empty), so there is no cost to measure; calibrate a model whose "
                                 "block list has blocks")
    settings = group.enable_kwargs
    given = settings.get("activation_reserve")
    sizes = _block_bytes(group)
    # The hooks' fixed cost is fitted against this layout's simulated gaps; the bytes a copy moves are
    # read after the step ran (an "auto" codec decides during it).
    costs, measured = calibrate_costs(group.blocks, step, group.device, sizes, activation_reserve=given,
                                      h2d_gbps=h2d_gbps, repeats=repeats, resident=group.resident,
                                      depth=group.prefetch_depth, cyclic=group.cyclic,
                                      transfer_bytes=lambda: transfer_bytes(group, sizes))
    if given is None:
        # The measured peak replaces enable's stand-in (10 % of the free memory under "auto", else 0) for
        # this and every later re-plan; where nothing was measured (the host as the device) it stands.
        if measured.activation_bytes is not None:
            settings[MEASURED_RESERVE] = measured.activation_bytes
        costs = costs.with_activation_bytes(activation_reserve(settings) or 0)
    group.costs = costs
    if group.plan is not None and group.plan.calibrated and measured.step_ms > 0:
        verdict = "outside" if group.plan.drifted(measured.step_ms) else "within"
        logger.info("measured step %.3f ms against the plan's reference %.3f ms: %s the %.0f %% tolerance",
                    measured.step_ms, group.plan.reference_step_ms, verdict, 100 * group.plan.tolerance)
    try:
        now = replan_group(group, costs, keep_layout=True) if replan and group.plan is not None else group
    except OffloadConfigError as error:
        if given is not None or measured.activation_bytes is None:
            raise
        raise OffloadConfigError(
            f"fastoffload: this step's activations peaked at {format_bytes(measured.activation_bytes)} (with "
            "the allocator's slack), which the plan now keeps as its activation reserve, and no layout fits "
            f"device_budget {format_bytes(group.plan.device_budget)} beside it; the layout enable applied is kept, "
            "but its steps use more device memory than the budget. Raise device_budget, or enable again with an "
            f"activation_reserve of your own. The planner's refusal: {error}") from error
    if now.plan is not None:
        now.plan = dataclasses.replace(now.plan, measured_step_ms=time_step_ms(step, now.device))
        logger.info("the applied plan's step: %.3f ms measured, %.3f ms predicted", now.plan.measured_step_ms,
                    now.plan.predicted_step_ms)
    return costs


DISK_REPLAN_ERROR = (
    "fastoffload: this offload streams {disk} blocks from disk (built with weights=), and the new plan ({plan}) "
    "changes its layout; applying it would bring every block into host memory first, which a model larger "
    "than the host's RAM cannot survive. Nothing was changed. To apply it: disable_layerwise_offload(model, "
    "'meta'), then enable_layerwise_offload(model, weights=..., plan=plan) again")

DISK_PLAN_ERROR = (
    "fastoffload: the new plan ({plan}) reads {disk} blocks from disk every step, but a re-plan applies a layout "
    "from host memory, where those blocks do not fit the host budget. Nothing was changed. To apply it: "
    "disable_layerwise_offload(model, 'meta'), then enable_layerwise_offload(model, weights=..., plan=plan) again")


# A new layout for a group that streams from disk is only worth a word when predicted this much faster.
DISK_REPLAN_GAIN = 0.01


SHARED_REPLAN_ERROR = (
    "fastoffload: this offload was enabled as a collective of {ranks} ranks (torch.distributed with the "
    "host copy shared), and the new plan ({plan}) changes its layout; applying it takes a disable and an enable "
    "on every rank at once, which one rank's re-plan cannot start (it would wait for the others until the "
    "group's timeout). Nothing was changed. To apply it, on every rank: disable_layerwise_offload(model, 'cpu'), "
    "then enable_layerwise_offload(model, ..., plan=plan)")


def _collective_ranks(group: Any) -> int:
    """The ranks an enable of this group is a collective of (0: it is none): a re-plan on one rank alone
    cannot apply a new layout there."""
    from fastoffload_ext.engine.sharing import collective_expected

    arguments = group.enable_kwargs.get("arguments", {})
    process_group = arguments.get("process_group")
    if not collective_expected(arguments.get("share_host_copy", "auto"), arguments.get("backend", "auto"),
                               process_group):
        return 0
    import torch.distributed as dist

    return dist.get_world_size(process_group)


def _kept(group: Any, table: BlockCosts) -> Any:
    """The layout now applied, scored again from ``table`` (for a group whose layout a re-plan cannot change)."""
    old = group.plan
    return plan_offload(table, old.device_budget, host_budget=old.host_budget, resident=old.resident,
                        prefetch_depth=old.prefetch_depth, cyclic=group.cyclic, cuda_graph=old.cuda_graph)


TABLE_SIZES_ERROR = ("fastoffload: the cost table's block sizes are not those of {list_name!r} (block {index}: {table} "
                     "in the table, {actual} here); nothing was changed. A plan from them would count other bytes than "
                     "the engine holds; build the table from this model (group.calibrate(step) measures one), or call "
                     "group.replan() to plan from the last calibration with the blocks' current sizes")


def _check_table_sizes(group: Any, table: BlockCosts) -> None:
    """Refuses a table whose block sizes are not the blocks' own, before anything changes: the slots and
    resident blocks hold the real sizes, so the plan's device and host bytes (and the budget checks made
    with them) would be wrong."""
    for index, (given, actual) in enumerate(zip(table.block_bytes, _block_bytes(group))):
        if given != actual:
            raise OffloadConfigError(TABLE_SIZES_ERROR.format(list_name=group.list_name, index=index,
                                                              table=format_bytes(given), actual=format_bytes(actual)))


def replan(group: Any, costs: BlockCosts | None = None) -> Any:
    """A fresh plan from ``costs`` (default: the last calibration) under the enable-time budgets."""
    return replan_group(group, costs)


def replan_group(group: Any, costs: BlockCosts | None = None, *, keep_layout: bool = False) -> Any:
    """``replan``; a new layout on a group that streams blocks from disk is refused before anything
    changes (``DISK_REPLAN_ERROR``), or with ``keep_layout`` (a calibration's own re-plan) logged,
    the layout kept and its plan scored again from ``costs``."""
    _check_current(group)
    table = costs if costs is not None else _with_current_sizes(group, group.costs)
    if table is None:
        raise OffloadStateError("fastoffload: nothing to re-plan from: call group.calibrate(step) first, or pass a "
                                "BlockCosts table")
    if table.blocks != len(group.blocks):
        # Refused before anything changes: enable would refuse it only after the model was taken apart.
        raise OffloadConfigError(f"fastoffload: the cost table has {table.blocks} blocks, but the offloaded list "
                                 f"'{group.list_name}' has {len(group.blocks)}; nothing was changed. Build the table "
                                 "from this model (group.calibrate(step) measures one)")
    _check_table_sizes(group, table)
    old = group.plan
    if old is None:
        raise OffloadStateError("fastoffload: this offload has a fixed layout (enabled without device_budget or "
                                "'auto'), so there is nothing to re-plan; enable with device_budget=... or "
                                "resident_blocks='auto' to let the planner choose")
    settings = group.enable_kwargs
    reserve = activation_reserve(settings)
    if reserve is not None:
        table = table.with_activation_bytes(reserve)
    if table.disk is None and old.costs.disk is not None:
        table = dataclasses.replace(table, disk=old.costs.disk)  # a calibration measures no disk
    fixed_resident = settings.get("fixed_resident")
    fixed_depth = settings.get("fixed_depth")
    tied = settings.get("tied_resident") or ()  # weights tied across blocks: those blocks stay resident
    auto = settings.get("arguments", {}).get("compress") == "auto" and group.engine is not None
    if group.compress_mode == "on" and not table.compressed:
        # A raw table (one the caller built) for a group that sends coded copies: planned raw, the layout
        # would be scored again with coded sizes and the decoder's staging at enable and could be refused
        # there, after the model was taken apart. It is planned with the coded sizes from the start.
        table = _coded_table(group, table)
    if auto:
        # "auto" under a plan: raw and coded copies are planned again from the measured table.
        new = choose_codec_plan(table, _coded_table(group, table), old.device_budget, host_budget=old.host_budget,
                                resident=fixed_resident, prefetch_depth=fixed_depth, cyclic=group.cyclic,
                                cuda_graph=old.cuda_graph, keep_resident=tied)
    else:
        new = plan_offload(table, old.device_budget, host_budget=old.host_budget, resident=fixed_resident,
                           prefetch_depth=fixed_depth, cyclic=group.cyclic, cuda_graph=old.cuda_graph,
                           keep_resident=tied)
    # Under "auto" a switch between raw and coded copies is a new layout too: the engine's mode changes.
    if new.same_layout(old) and (not auto or new.compressed == (group.compress_mode == "on")):
        group.plan = new
        return group
    ranks = _collective_ranks(group)
    if ranks:
        # Each rank calibrates and re-plans on its own timings: a new layout here would start enable's
        # collective on this rank alone.
        if not keep_layout:
            raise OffloadStateError(SHARED_REPLAN_ERROR.format(ranks=ranks, plan=new))
        logger.warning("%s; keeping the layout enable applied", SHARED_REPLAN_ERROR.format(ranks=ranks, plan=new))
        group.plan = _kept(group, table)
        return group
    disk = group.disk_blocks()
    if disk:
        kept = _kept(group, table)
        if new.predicted_step_ms >= kept.predicted_step_ms * (1 - DISK_REPLAN_GAIN):
            group.plan = kept  # no faster: the layout stays, its prediction from the new table
            return group
        if not keep_layout:
            raise OffloadStateError(DISK_REPLAN_ERROR.format(disk=disk, plan=new))
        logger.warning("%s; keeping the layout enable applied", DISK_REPLAN_ERROR.format(disk=disk, plan=new))
        group.plan = kept
        return group
    if new.disk_blocks:
        # None streams from disk now, but the plan would read some from it: the disable and enable that apply it
        # hold every offloaded block in host memory, and enable would refuse the host budget only after the model
        # was taken apart (the layout that ran is applied again, as a new group).
        if not keep_layout:
            raise OffloadStateError(DISK_PLAN_ERROR.format(disk=new.disk_blocks, plan=new))
        logger.warning("%s; keeping the layout enable applied", DISK_PLAN_ERROR.format(disk=new.disk_blocks, plan=new))
        group.plan = _kept(group, table)
        return group
    logger.info("re-planning %s: %s", group.list_name, new)
    return _apply(group, new, table)


def recheck(group: Any) -> Any:
    """After enable encoded the blocks: the plan again with the engine's compressed sizes.

    A plan made with compression counted sampled estimates (``compressed.py``). Scored again with the
    real sizes, the same layout replaces the plan when it still fits its budgets (the usual case: the
    estimate errs high); otherwise the planner chooses again from the real sizes and offload is applied
    anew. Returns the group now on the model.
    """
    plan = group.plan
    if plan is None or not plan.costs.compressed or group.engine is None:
        return group
    sizes = list(plan.costs.block_bytes)
    costs = dataclasses.replace(plan.costs, transfer_bytes=tuple(transfer_bytes(group, sizes)))
    try:
        group.plan = carry_choice(plan, plan_offload(costs, plan.device_budget, host_budget=plan.host_budget,
                                                     resident=plan.resident, prefetch_depth=plan.prefetch_depth,
                                                     cyclic=group.cyclic, cuda_graph=plan.cuda_graph))
        return group
    except OffloadConfigError as error:
        if _collective_ranks(group):
            # Each rank encoded its own blocks: one whose sizes differ would start enable's collective alone.
            logger.warning("fastoffload: the encoded blocks do not fit the plan made from estimates (%s); this "
                           "offload is a collective of several ranks, so the layout enable applied is kept", error)
            return group
        logger.info("the encoded blocks do not fit the plan made from estimates (%s); planning again", error)
    settings = group.enable_kwargs
    try:
        new = plan_offload(costs, plan.device_budget, host_budget=plan.host_budget,
                           resident=settings.get("fixed_resident"), prefetch_depth=settings.get("fixed_depth"),
                           cyclic=group.cyclic, cuda_graph=plan.cuda_graph,
                           keep_resident=settings.get("tied_resident") or ())
    except OffloadConfigError as error:
        logger.warning("fastoffload: the compressed blocks are larger than estimated and no layout fits the budgets "
                       "with them (%s); keeping the layout enable applied", error)
        return group
    return _apply(group, new, costs)


GROWN_OVER_BUDGET = ("fastoffload: mutate_params_scope grew block {block} of '{list_name}' to {size}, more than the "
                     "plan's {slots} slots of {slot} hold: from the next step they take {need} of device memory, above "
                     "device_budget {budget}. Enable offload again with a larger budget (is_replace=True), or keep "
                     "fewer blocks resident")


def warn_if_grown(group: Any, block: int) -> None:
    """As ``mutate_params_scope`` on ``block`` of ``group`` ends (its parameters still real tensors, before
    the host copy is rebuilt from them): the engine makes its slots as large as the
    largest offloaded block at the next step, so a block the scope grew (an adapter's new parameters) can
    take the slots above the plan's device budget. Warned then, with the numbers; a later calibrate or
    re-plan refuses when no layout fits the grown block."""
    plan = group.plan
    if plan is None or plan.device_budget is None or plan.num_slots == 0:
        return
    size = module_packed_bytes(group.blocks[block])
    if size <= plan.slot_bytes:
        return
    need = plan.device_bytes + plan.num_slots * (size - plan.slot_bytes)
    if need > plan.device_budget:
        warn_caller(GROWN_OVER_BUDGET.format(block=block, list_name=group.list_name, size=format_bytes(size),
                                             slots=plan.num_slots, slot=format_bytes(plan.slot_bytes),
                                             need=format_bytes(need), budget=format_bytes(plan.device_budget)))


# Fewer bytes than this read at enable say too little about the disk's speed to predict with.
MIN_MEASURED_READ_BYTES = 32 << 20


def read_gbps(reader: Any) -> float | None:
    """The disk's read rate so far (GB/s): the reader's bytes over the time it had a read in flight;
    None when it has read too little to tell."""
    stats = dict(reader.stats())
    busy = stats["wall_seconds"] - stats["idle_seconds"]
    if stats["bytes_read"] < MIN_MEASURED_READ_BYTES or busy <= 0:
        return None
    return stats["bytes_read"] / busy / 1e9


def with_disk_tier(group: Any) -> None:
    """After enable from a checkpoint with a disk tier: the plan scored again, same layout, with the disk's
    reads in it at the read rate measured while enable read the host tier (the plan was chosen with the
    probe's, ``storage.disk_costs``), so its prediction and ``why`` say what a step costs. A re-plan
    keeps the disk tier in its table."""
    plan, source = group.plan, group.checkpoint
    if plan is None or source is None or not source.tiers.disk:
        return
    gbps = read_gbps(group.engine.reader)
    if gbps is None and plan.costs.disk is not None:
        gbps = plan.costs.disk.read_gbps  # the probe's, which the plan already counts
    if gbps is None:
        logger.info("fastoffload: %d blocks are in the disk tier; enable read too little to measure the disk, so the "
                    "plan leaves the disk's reads out", len(source.tiers.disk))
        return
    disk = DiskCosts(read_gbps=gbps, host_budget=int(source.host_budget),
                     staging_buffers=source.options.staging_buffers)
    group.plan = plan_offload(dataclasses.replace(plan.costs, disk=disk), plan.device_budget,
                              host_budget=plan.host_budget, resident=plan.resident,
                              prefetch_depth=plan.prefetch_depth, cyclic=group.cyclic,
                              cuda_graph=plan.cuda_graph)
    logger.info("fastoffload: %s", group.plan.why)


# What enable resolved from the caller's own resident_blocks / prefetch_depth, and the activation peak a
# calibration measured: a plan applied again by a re-plan goes through enable(plan=...), which records
# none of them, so they are carried to the new group by hand.
_CALLER_FIXED = ("fixed_resident", "fixed_depth", MEASURED_RESERVE)


def _carry_fixed(old: Any, new: Any) -> None:
    new.enable_kwargs.update({key: old.enable_kwargs.get(key) for key in _CALLER_FIXED})


def _apply(group: Any, plan: Any, costs: BlockCosts) -> Any:
    from fastoffload_ext.engine.layerwise import disable_layerwise_offload, enable_layerwise_offload
    from fastoffload_ext.engine.threads import layout_change

    model = group.model_ref
    arguments = dict(group.enable_kwargs.get("arguments", {}))
    arguments.update(resident_blocks=None, prefetch_depth=None)
    # A forward running in another thread finishes first, on the layout it started with, and forwards that
    # start meanwhile wait for the new one (threads.ModelForwards): the disable below would otherwise take a
    # resident block's weights from under a forward that computes with them.
    # A re-plan is often reached from inside the caller's inference_mode() loop (calibrate, observe_step):
    # the tensors disable and enable make must still be ordinary ones, or every block that becomes
    # resident would hold inference tensors from then on, which autograd and requires_grad_ refuse.
    with layout_change(model), torch.inference_mode(False):
        _check_current(group)  # another thread's disable or re-plan may have come first while this one waited
        try:
            disable_layerwise_offload(model, device="cpu")
            fresh = enable_layerwise_offload(model, **arguments, plan=plan, device_budget=plan.device_budget)
        except BaseException:
            # Enable rolled itself back (a disable cut short did not): the layout that ran before is applied
            # again, so a failed re-plan leaves the model offloaded as it was (with its current values).
            _back_to(group)
            raise
    fresh.costs = costs
    _carry_fixed(group, fresh)
    return fresh


def _back_to(group: Any) -> None:
    """After a re-plan failed part-way: the layout ``group`` ran is applied again with the model's current
    values. A disable cut short (a Ctrl-C between two blocks) left the group on the model with some blocks
    restored and others still offloaded, which no forward runs: it is finished first, as is an offload
    the failed enable left on the model."""
    from fastoffload_ext.engine.layerwise import disable_layerwise_offload, get_offload_group

    model = group.model_ref
    try:
        if get_offload_group(model) is not None:
            disable_layerwise_offload(model, device="cpu")
        reapply(group)
    except BaseException as second:
        logger.error("fastoffload: re-planning failed and the previous layout could not be applied again (%s); the "
                     "model is in host memory without offload", second)


def reapply_refusal(group: Any) -> str | None:
    """Why the offload ``group`` ran cannot be applied again by :func:`reapply` on this rank alone (None: it
    can): one enabled as a collective of several ranks would start enable's collective on this rank only."""
    ranks = _collective_ranks(group)
    if ranks:
        return (f"it was enabled as a collective of {ranks} ranks, which one rank cannot start again alone; on every "
                "rank, enable offload again")
    return None


def reapply(group: Any) -> Any:
    """Enables the layout ``group`` ran on its model again, after a disable took it off: the same arguments,
    resident set, depth and plan, with the model's current values. Returns the new group.

    What a failed re-plan or a failed ``enable_layerwise_offload(is_replace=True)`` does so that the model
    stays offloaded as it was. A group built from ``weights=`` is applied again from the values the disable
    brought into host memory, not from the checkpoint (whose tensors may differ from them by now), its host
    budget counted as for any model in host memory.
    """
    from fastoffload_ext.engine.layerwise import enable_layerwise_offload

    model = group.model_ref
    arguments = dict(group.enable_kwargs.get("arguments", {}))
    if group.checkpoint is not None:
        arguments["host_budget"] = "auto"
    old = group.plan
    with torch.inference_mode(False):
        if old is not None:
            restored = enable_layerwise_offload(model, **arguments, plan=old, device_budget=old.device_budget)
        else:
            arguments["activation_reserve"] = None  # only a plan counts it
            restored = enable_layerwise_offload(model, **arguments, resident_blocks=list(group.resident),
                                                prefetch_depth=group.prefetch_depth)
    restored.costs = group.costs
    _carry_fixed(group, restored)
    return restored


__all__ = ["DISK_PLAN_ERROR", "DISK_REPLAN_ERROR", "GROWN_OVER_BUDGET", "SHARED_REPLAN_ERROR", "TABLE_SIZES_ERROR",
           "calibrate", "read_gbps", "reapply", "reapply_refusal", "recheck", "replan", "replan_group", "transfer_bytes",
           "warn_if_grown", "with_disk_tier"]
