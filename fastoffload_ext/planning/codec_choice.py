"""Raw or coded copies under a budget: ``compress="auto"`` with a plan picks the faster predicted one.

On a GPU a coded copy moves about three quarters of the bytes, but the engine keeps two device staging
buffers of the largest coded block for the decoder, and that room comes out of the resident set. At
the same budget the two kinds of plan therefore keep different blocks resident: at half of W1's bytes
the coded plan moves fewer bytes (ten coded blocks against eight raw ones), at half of W4's (eight
large blocks) it moves more (six coded against four raw) and is slower. Each kind is planned with
its own memory (``planner._memory``: staging counted only where blocks are coded) and the faster
predicted plan wins. Coded copies must win by ``CODED_MARGIN``: the simulation does not see the
decoder's kernels sharing memory bandwidth with the compute, so a tie goes to raw copies.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection

from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning.budgets import format_bytes
from fastoffload_ext.planning.costs import BlockCosts
from fastoffload_ext.planning.plan import OffloadPlan
from fastoffload_ext.planning.planner import plan_offload

logger = logging.getLogger(__name__)

CODED_MARGIN = 0.02


def _raw(costs: BlockCosts) -> BlockCosts:
    return dataclasses.replace(costs, transfer_bytes=None)


def choose_codec_plan(raw: BlockCosts, coded: BlockCosts, device_budget: int | None = None, *,
                      host_budget: int | None = None, resident: Collection[int] | None = None,
                      prefetch_depth: int | None = None, cyclic: bool = True,
                      margin: float = CODED_MARGIN, cuda_graph: bool = False,
                      keep_resident: Collection[int] = ()) -> OffloadPlan:
    """The faster predicted of the raw plan (``raw``'s bytes, no staging) and the coded one (``coded``'s
    ``transfer_bytes``, staging counted), each within the budgets; ``plan.compressed`` says which.

    The coded plan wins only when predicted at least ``margin`` faster, or when the raw one does not
    fit (a host budget only coded copies fit). Raises the raw plan's refusal when neither fits.
    """
    if not 0.0 <= margin < 1.0:
        raise OffloadConfigError(f"fastoffload: choose_codec_plan's margin must be in [0, 1), got {margin!r}")
    kwargs = dict(host_budget=host_budget, resident=resident, prefetch_depth=prefetch_depth, cyclic=cyclic,
                  cuda_graph=cuda_graph, keep_resident=keep_resident)
    raw_plan: OffloadPlan | None = None
    refusal: OffloadConfigError | None = None
    try:
        raw_plan = plan_offload(_raw(raw), device_budget, **kwargs)
    except OffloadConfigError as error:
        refusal = error
    coded_plan: OffloadPlan | None = None
    if coded.compressed:
        try:
            coded_plan = plan_offload(coded, device_budget, **kwargs)
        except OffloadConfigError:
            coded_plan = None
    if raw_plan is None:
        if coded_plan is None:
            assert refusal is not None
            raise refusal
        return _noted(coded_plan, "only coded copies fit the budgets")
    if not coded.compressed:
        return _noted(raw_plan, "no block's coded copy is smaller than its raw one")
    if coded_plan is None:
        return _noted(raw_plan, "no layout with coded copies fits the budgets")
    if not coded_plan.compressed:
        return _noted(raw_plan, "the best layout copies no coded block")
    coded_ms, raw_ms = coded_plan.predicted_step_ms, raw_plan.predicted_step_ms
    if coded_ms < raw_ms * (1.0 - margin):
        return _noted(coded_plan, f"coded copies predicted {coded_ms:.3f} ms against {raw_ms:.3f} ms raw "
                                  f"(with {len(raw_plan.resident)} resident)")
    staging = (f": the decode's staging takes {format_bytes(coded_plan.staging_bytes)} of the budget"
               if coded_plan.staging_bytes else "")
    return _noted(raw_plan, f"raw copies predicted {raw_ms:.3f} ms against {coded_ms:.3f} ms coded "
                            f"(with {len(coded_plan.resident)} resident{staging})")


_NOTE = "; compress='auto': "


def _noted(plan: OffloadPlan, reason: str) -> OffloadPlan:
    logger.debug("compress='auto' with a plan: %s", reason)
    return dataclasses.replace(plan, why=f"{plan.why}{_NOTE}{reason}")


def carry_choice(old: OffloadPlan, new: OffloadPlan) -> OffloadPlan:
    """``new`` (the same layout re-scored) with ``old``'s reason for raw or coded copies, if it had one."""
    reason = old.why.partition(_NOTE)[2]
    return _noted(new, reason) if reason and _NOTE not in new.why else new


__all__ = ["CODED_MARGIN", "carry_choice", "choose_codec_plan"]
