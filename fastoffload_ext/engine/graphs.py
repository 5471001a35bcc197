"""Capture a whole offloaded forward — copies, event waits and compute — in one CUDA graph.

With the ``ext`` backend every block is copied into a static device slot, so the addresses a forward
touches can be the same on every step. That is what CUDA-graph replay needs, and it removes the last
host cost of offload: launching hundreds of small kernels and the per-block hook calls. On a model
whose blocks have many small parameters (W3 in docs/DESIGN.md, "Workloads and targets") an eager
offloaded step is bound by the host; a replayed one runs at the PCIe floor.

Usage::

    enable_layerwise_offload(model, backend="ext")
    graph = OffloadedCUDAGraph(model, example_input)   # warm-up + capture
    out = graph(fresh_input)                           # copy into the static input, replay

What capture needs, and how it is provided:
- the same slot for a block on every step: :func:`cyclic_slot_assignment` gives each block a fixed
  slot such that any ``prefetch_depth + 1`` consecutive blocks (wrapping around) use different slots.
  With ``L`` blocks that takes ``ceil(L / floor(L / (depth + 1)))`` slots: depth + 1 when it divides
  L, more otherwise (an odd cycle cannot be two-coloured: 5 blocks at depth 1 take 3 slots). That is
  more device memory than eager offload holds and the planner counts (``prefetch_depth + 1`` slots):
  under a ``device_budget`` the capture is refused before anything changes when the extra slots do
  not fit (:func:`check_graph_slots`; ``plan_offload(..., cuda_graph=True)`` plans for them), and
  without one the graph takes them and says so (``graph.num_slots``, ``group.stats()["num_slots"]``);
- no wait on an event recorded before the capture: the engine forks its copy stream into the capture
  and skips the first block's "ready" wait, whose copy the previous step's wrap-around prefetch issued
  (see ``CopyEngine::begin_capture`` in csrc/copy_engine.h);
- replays leave the state they started from: the last block prefetches the first into the same slot
  it was captured from, and the copy stream is joined back before the capture ends.

A replay is valid while the slots hold what they held when the capture began. A complete eager forward, or
the capture of another graph of the same model, leaves them so (the same fixed slots, the same blocks in
them): the next replay first makes the current stream wait for the copies that forward issued, and runs.
Loading or editing a block's weights (``load_state_dict``, ``mutate_params_scope()``, an adapter), or an
eager forward that raised part-way, invalidates it, and the next replay raises (``recapture()`` makes a new
one); after ``disable_layerwise_offload`` it raises for good. A cast, a rebind (``param.data = t``)
or an in-place write to an offloaded parameter since the capture is refused at the next replay, as the
next eager forward refuses it; so is an in-place edit of a ``state_dict()`` entry of an offloaded block
that was not loaded back (``engine/state_dict.py``). As with any CUDA graph, tensors outside the blocks are read at the
addresses they had at capture: after assigning a new module or parameter there, call ``recapture()``.
A replay runs none of the model's Python either, so it refuses (``recapture()``) once the model's modules,
parameter or buffer objects, train/eval mode, or a peft adapter's state (injected, active, disabled, merged,
scaled) changed since the capture (``_ModelWatch``).
The output of a replay is a static tensor that the next replay overwrites: clone it to keep it.
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fastoffload_ext.engine.layerwise import LayerwiseOffloadGroup, get_offload_group
from fastoffload_ext.errors import OffloadConfigError, OffloadStateError
from fastoffload_ext.planning.budgets import format_bytes
from fastoffload_ext.planning.slots import cyclic_slot_assignment

logger = logging.getLogger(__name__)


def _device_budget(group: LayerwiseOffloadGroup) -> int | None:
    """The device budget (bytes) the group runs under: the one enable applied ("auto" resolved), else its
    plan's (a plan applied without a ``device_budget``); None without a plan."""
    if group.plan is None:
        return None
    applied = group.enable_kwargs.get("device_budget_bytes")
    return applied if applied is not None else group.plan.device_budget


def run_order_slot_assignment(group: LayerwiseOffloadGroup) -> tuple[list[int], int]:
    """:func:`cyclic_slot_assignment` along the order the blocks run in: the ring's, or the one the first pass
    learned where the prefetches follow another (engine/run_order.py). Indexed by the group's states."""
    assignment, num_slots = cyclic_slot_assignment(len(group.states), group.prefetch_depth)
    watch = group.run_order
    if watch is None or watch.outcome != "rewired" or watch.run_order is None:
        return assignment, num_slots
    by_state = [0] * len(assignment)
    for k, rank in enumerate(watch.run_order):
        by_state[rank] = assignment[k]
    return by_state, num_slots


def check_graph_slots(group: LayerwiseOffloadGroup, num_slots: int) -> None:
    """Refuses a capture whose ``num_slots`` fixed slots would take a budgeted group above its device budget.

    The planner counts ``prefetch_depth + 1`` slots (``OffloadPlan.num_slots``); a capture may need more
    (:func:`cyclic_slot_assignment`). Each extra slot holds ``plan.slot_bytes`` on top of the plan's
    ``device_bytes``. Where that passes the budget, :class:`OffloadConfigError` says by how much and what
    to change, before the engine's slots change. Without a budget (no plan, or a plan made without one),
    or with a plan that counted the capture (``plan_offload(..., cuda_graph=True)``), nothing is refused.
    """
    plan = group.plan
    budget = _device_budget(group)
    if plan is None or budget is None or num_slots <= plan.num_slots:
        return
    extra = num_slots - plan.num_slots
    need = plan.device_bytes + extra * plan.slot_bytes
    if need <= budget:
        return
    blocks, depth = len(group.states), group.prefetch_depth
    raise OffloadConfigError(
        f"fastoffload: OffloadedCUDAGraph needs {num_slots} fixed device slots for the {blocks} offloaded blocks at "
        f"prefetch_depth {depth} (any {depth + 1} blocks in a row must use different slots, and {depth + 1} does "
        f"not divide {blocks}), {extra} more than the {plan.num_slots} the plan counts: "
        f"{format_bytes(plan.device_bytes)} + {extra} x {format_bytes(plan.slot_bytes)} = {format_bytes(need)}, "
        f"above device_budget {format_bytes(budget)}. Nothing was changed. Plan for the capture: enable with "
        "plan=plan_offload(costs, device_budget, cuda_graph=True), whose slots and device bytes count the graph's "
        "(costs: group.plan.costs, or group.costs after group.calibrate(step)); or keep this layout with a "
        f"device_budget of at least {format_bytes(need)} (plan=group.plan); or enable with a prefetch_depth or "
        "resident set that leaves a multiple of prefetch_depth + 1 blocks offloaded")


def capturable_group(model: nn.Module) -> LayerwiseOffloadGroup:
    """``model``'s offload group, if a CUDA graph can capture it (ext backend, CUDA); else what to change."""
    group = get_offload_group(model)
    if group is None:
        raise OffloadConfigError("fastoffload: OffloadedCUDAGraph needs a model with layerwise offload enabled: "
                                 "call enable_layerwise_offload(model, backend='ext') first")
    if group.backend != "ext" or group.engine is None:
        raise OffloadConfigError("fastoffload: OffloadedCUDAGraph needs backend='ext' (static device slots), but "
                                 f"this model uses backend={group.backend!r}; the python backend allocates new "
                                 "device tensors every step, which a graph cannot replay")
    if group.device.type != "cuda":
        raise OffloadConfigError("fastoffload: OffloadedCUDAGraph needs a CUDA device, but offload runs on "
                                 f"{group.device}")
    return group


# Bumped by torch's global registration hooks whenever any module, parameter or buffer is assigned to a module
# (an adapter injected or unloaded, a layer replaced, load_state_dict(assign=True)): a replay walks its model only
# when it moved.
_registrations = [0]
_watching: list[Any] = []


def _registered(*_: Any) -> None:
    _registrations[0] += 1


def _watch_registrations() -> None:
    if not _watching:
        _watching.extend(register(_registered) for register in (
            torch.nn.modules.module.register_module_module_registration_hook,
            torch.nn.modules.module.register_module_parameter_registration_hook,
            torch.nn.modules.module.register_module_buffer_registration_hook))


def _structure(model: nn.Module) -> tuple[Any, ...]:
    """Each module of ``model`` with its parameter and buffer objects: what the captured kernels were launched on."""
    return tuple((id(module), tuple(map(id, module._parameters.values())), tuple(map(id, module._buffers.values())))
                 for module in model.modules())


def _tuner_layers(model: nn.Module) -> list[nn.Module]:
    """``model``'s peft layers (LoRA and the like), whose forward takes its path from Python state."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    base = getattr(tuners, "BaseTunerLayer", None)
    return [module for module in model.modules() if isinstance(module, base)] if base is not None else []


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(value.items())
    return tuple(value) if isinstance(value, (list, set)) else value


def _tuner_state(layers: list[nn.Module]) -> tuple[Any, ...]:
    """What each peft layer's forward reads besides tensors: the active adapters, whether adapters are disabled,
    which are merged, and each adapter's scale."""
    return tuple((_frozen(state.get("_active_adapter")), state.get("_disable_adapters"),
                  _frozen(state.get("merged_adapters")), _frozen(state.get("scaling")))
                 for state in (layer.__dict__ for layer in layers))


class _ModelWatch:
    """What a captured forward took from Python, which a replay does not run again: the module tree, the
    parameter and buffer objects, the mode (train/eval) and the peft adapters' state."""

    def __init__(self, model: nn.Module) -> None:
        _watch_registrations()
        self.registrations = _registrations[0]
        self.structure = _structure(model)
        self.layers = _tuner_layers(model)
        self.tuners = _tuner_state(self.layers)
        self.training = model.training

    def change(self, model: nn.Module) -> str | None:
        """Why a replay would not do what a forward of ``model`` does now; None when it would."""
        if model.training != self.training:
            return f"the model was switched to {'train' if model.training else 'eval'} mode"
        if _registrations[0] != self.registrations:
            if _structure(model) != self.structure:
                return ("a module, parameter or buffer of the model was added, replaced or removed (an adapter "
                        "injected or unloaded, a layer swapped, load_state_dict(assign=True))")
            self.registrations = _registrations[0]
        if self.layers and _tuner_state(self.layers) != self.tuners:
            return "an adapter was switched, scaled, enabled, disabled, merged or unmerged (set_adapters, disable_lora)"
        return None


def slot_snapshot(engine: Any) -> tuple[tuple[int, str, int], ...]:
    """Each slot's block, state and device address: what a replay finds in the slots, and what it needs."""
    return tuple((engine.slot_block(slot), engine.slot_state(slot), engine.slot_address(slot))
                 for slot in range(engine.num_slots))


@contextlib.contextmanager
def capture_graph(graph: torch.cuda.CUDAGraph, device: torch.device | str | int | None = None,
                  pool: tuple[int, int] | None = None) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool)`` that, when the capture raises, leaves torch as it was.

    A capture gets a pool of its own unless ``pool`` is shared; it is named here, because a capture that
    failed has no ``graph.pool()`` to ask.
    """
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    stream = torch.cuda.current_stream(device)
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    except BaseException as error:
        _abandon_capture(pool, device, stream, error)
        raise


def _abandon_capture(pool: tuple[int, int], device: torch.device | str | int | None,
                     stream: torch.cuda.Stream, error: BaseException) -> None:
    """Undoes what a capture into ``pool`` that raised leaves behind in torch, so the process goes on as before.

    When the captured work fails (a host sync, a disallowed call), ``capture_end`` raises at the end of the
    stream capture, before it tells the caching allocator and the device's default random generator that
    the capture is over, and ``torch.cuda.graph`` then skips restoring the current stream. The allocator
    would count a capture as underway for good, and while one is, ``torch.cuda.empty_cache()`` hands nothing
    back; the generator would refuse every random draw outside a capture ("Offset increment outside graph
    capture"); the capture's side stream would stay current; and the pool would keep the use the capture
    took, so it is never freed. What cannot be undone is said in a note on ``error``, the capture's own
    exception, which goes on to the caller.
    """
    if torch.cuda.current_stream(device) != stream:
        torch.cuda.set_stream(stream)
    index = device if isinstance(device, int) else None if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is not None and release is not None:
        try:
            end(index, pool)
        except RuntimeError:
            pass  # capture_end got as far as ending it (or capture_begin never started it)
        else:
            release(index, pool)  # the use capture_begin took; a graph whose capture never ended keeps it
    # Past the allocator, capture_end can still raise before it ends the generator's capture ("Invalid
    # capture"), so that is ended whatever the allocator said; ending one that is not underway changes nothing.
    try:
        _end_generator_capture(index)
    except RuntimeError as reset_error:
        if hasattr(error, "add_note"):
            error.add_note(f"fastoffload: after this failed capture, cuda:{index}'s default random generator could "
                           f"not be reset ({reset_error}); random draws there may raise 'Offset increment outside "
                           "graph capture' until a CUDA graph is captured on that device")


def _end_generator_capture(index: int) -> None:
    """Clears the capture flag that a failed capture left on device ``index``'s default random generator.

    torch has no call for it; a capture that succeeds clears it, so one is made of a single tiny kernel. It
    leaves the generator's seed and offset as they were: a capture counts its draws apart from them.
    """
    scratch = torch.zeros(1, device=torch.device("cuda", index))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(index), torch.cuda.graph(graph):
        scratch.add_(1)
    del graph


def _clone_inputs(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone_inputs(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone_inputs(v) for k, v in value.items()}
    return value


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {tuple(value.shape)} {value.dtype}"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return repr(value)


def _copy_inputs(static: Any, fresh: Any, where: str = "input") -> None:
    """Copies ``fresh`` into the captured inputs; anything the graph would not see refuses the replay (an
    extra keyword, a missing one, another shape) instead of being dropped."""
    if isinstance(static, torch.Tensor):
        matches = isinstance(fresh, torch.Tensor) and fresh.shape == static.shape and fresh.dtype == static.dtype
    elif isinstance(static, (list, tuple)):
        matches = isinstance(fresh, (list, tuple)) and len(fresh) == len(static)
    elif isinstance(static, dict):
        matches = isinstance(fresh, dict) and fresh.keys() == static.keys()
    else:
        matches = type(fresh) is type(static) and bool(static == fresh) and (
            not isinstance(static, float) or math.copysign(1.0, static) == math.copysign(1.0, fresh))
    if not matches:
        raise OffloadConfigError(f"fastoffload: {where} must match the captured input, {_describe(static)}, got "
                                 f"{_describe(fresh)}; a replay runs exactly the captured forward, so capture "
                                 "another OffloadedCUDAGraph for other inputs")
    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
    elif isinstance(static, (list, tuple)):
        for i, (s, f) in enumerate(zip(static, fresh, strict=True)):
            _copy_inputs(s, f, f"{where}[{i}]")
    elif isinstance(static, dict):
        for key in static:
            _copy_inputs(static[key], fresh[key], f"{where}[{key!r}]")


class OffloadedCUDAGraph:
    """One captured forward of a layerwise-offloaded model, replayed with fresh inputs.

    It fixes each offloaded block's slot (:func:`cyclic_slot_assignment`), which can take more device
    slots than the ``prefetch_depth + 1`` of eager offload: ``num_slots`` says how many, and the engine
    keeps that many from then on (``group.stats()["num_slots"]``). A group planned under a device
    budget that the extra slots would exceed is refused (:func:`check_graph_slots`) before its slots
    change.
    """

    def __init__(self, model: nn.Module, *example_args: Any, warmup_steps: int = 2,
                 pool: Any = None, **example_kwargs: Any) -> None:
        self._setup(model, example_args, example_kwargs, warmup_steps, pool)

    def _setup(self, model: nn.Module, example_args: tuple[Any, ...], example_kwargs: dict[str, Any],
               warmup_steps: int, pool: Any) -> None:
        group = capturable_group(model)
        if warmup_steps < 1:
            raise OffloadConfigError("fastoffload: warmup_steps must be >= 1 (the first step allocates slots), got "
                                     f"{warmup_steps}")
        self.model = model
        self.group: LayerwiseOffloadGroup = group
        self.engine = group.engine
        self.static_args = _clone_inputs(example_args)
        self.static_kwargs = _clone_inputs(example_kwargs)
        self.warmup_steps = warmup_steps
        self.pool = pool
        # Every offloaded block's engine handle: a replay checks their bindings, as an eager acquire does.
        self.handles = [state.handle for state in group.states]
        watch = group.run_order
        if watch is not None and watch.outcome == "watching" and len(group.list_names) > 1:
            # A ring of several lists may run in another order than registered (engine/run_order.py): one eager
            # pass learns it first, so that the fixed slots follow the order the blocks run in.
            self._warm_up(1)
        assignment, num_slots = run_order_slot_assignment(group)
        check_graph_slots(group, num_slots)
        eager_slots = self.engine.num_slots
        self.engine.set_slot_assignment(assignment, num_slots)
        self.num_slots = num_slots  # the fixed slots the engine holds from now on (also group.stats())
        if num_slots > eager_slots:
            logger.info("The graph's fixed slots are %d, %d more than the %d of eager offload (prefetch_depth + 1 = %d "
                        "does not divide the %d offloaded blocks)", num_slots, num_slots - eager_slots, eager_slots,
                        group.prefetch_depth + 1, len(group.states))
        self.recapture()

    def _check_attached(self) -> None:
        """Refuses a graph whose offload is gone: its slots and host copies were freed with it."""
        if get_offload_group(self.model) is not self.group:
            raise OffloadStateError("fastoffload: layerwise offload of this model was disabled (or enabled again) "
                                    "since this graph was captured; the slots and host copies it copies between "
                                    "are gone, so capture a new OffloadedCUDAGraph")

    def recapture(self) -> None:
        """Warm up and capture again (after its weights changed, or an eager forward that raised part-way)."""
        self._check_attached()
        self._warm_up(self.warmup_steps)
        # compress="auto" decides now: a captured graph bakes in how each block travels.
        self.engine.settle_travel()
        self.engine.join_copies()
        torch.cuda.synchronize(self.group.device)
        before = slot_snapshot(self.engine)
        # The graph this one replaces lives until the new capture ends: a pool shared with other graphs
        # (pool=...) is freed when no graph holds it, and a capture into a freed pool fails.
        previous, self.graph, self.static_output = self.__dict__.get("graph"), None, None
        graph = torch.cuda.CUDAGraph()
        with capture_graph(graph, self.group.device, self.pool), torch.no_grad():
            self.engine.begin_capture()
            try:
                static_output = self.model(*self.static_args, **self.static_kwargs)
            finally:
                self.engine.end_capture()
        del previous
        self.graph, self.static_output = graph, static_output
        self.watch = _ModelWatch(self.model)
        self.generation = self.engine.generation
        self.layout_generation = self.engine.layout_generation
        # The slots a replay starts from. A step that ends where it began (every cyclic forward) lets a replay
        # follow an eager forward that ends there too; one that does not (a forward that skips blocks) cannot.
        self.slots = slot_snapshot(self.engine)
        self.resumable = self.slots == before
        logger.info("Captured an offloaded forward: %d blocks in %d fixed slots", len(self.group.states),
                    self.num_slots)

    def _warm_up(self, steps: int) -> None:
        """``steps`` eager forwards on the static inputs, on a side stream (as torch's graph warm-up)."""
        side = torch.cuda.Stream(self.group.device)
        side.wait_stream(torch.cuda.current_stream(self.group.device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(steps):
                self.model(*self.static_args, **self.static_kwargs)
        torch.cuda.current_stream(self.group.device).wait_stream(side)

    def replay(self) -> Any:
        """Replay with whatever the static inputs hold now; returns the static output."""
        self._check_attached()
        if self.graph is None:
            raise OffloadStateError("fastoffload: the last capture of this graph failed, so there is nothing to "
                                    "replay; call recapture() once the forward can be captured")
        changed = self.watch.change(self.model)
        if changed is not None:
            raise OffloadStateError(f"fastoffload: {changed} since this graph was captured; a replay runs the "
                                    "captured kernels, not the model's Python, so it would not see that. Call "
                                    "recapture() before replaying")
        # A copy of a block's values that state_dict() handed out and the caller changed in place: an eager forward
        # refuses the block at its entry (state_dict.py), and a replay, which runs no hook, refuses it here. A write
        # into the host copy through cpu_named_parameters is applied here, and changes the layout checked next.
        model_hooks = self.group.model_hooks
        for _, block_hooks in model_hooks.blocks if model_hooks is not None else ():
            if block_hooks.copies:
                block_hooks.refuse_edited_copies()
        if self.engine.generation != self.generation:
            self._resume()
        # A cast, a rebind or an in-place write to an offloaded parameter since the capture: an eager forward
        # refuses it at the block's acquire, and a replay, which would not see it either, refuses it here.
        for handle in self.handles:
            self.engine.check_offloaded_bindings(handle)
        self.graph.replay()
        return self.static_output

    def _resume(self) -> None:
        """After eager steps (or another graph's capture) since the last replay: replays on only if the slots hold
        what they held when the capture began, once the copies those steps issued are done."""
        if self.engine.layout_generation != self.layout_generation:
            raise OffloadStateError("fastoffload: a block's weights were loaded or edited (load_state_dict, "
                                    "mutate_params_scope, an adapter, a write into cpu_named_parameters), or the slots "
                                    "were reallocated, since this graph "
                                    "was captured, so its slots and host copies no longer hold what the graph expects; "
                                    "call recapture() before replaying")
        if not self.resumable or slot_snapshot(self.engine) != self.slots:
            raise OffloadStateError("fastoffload: the offloaded model ran eagerly since this graph was captured and "
                                    "did not end with the blocks where the capture began (a forward that raised "
                                    "part-way, or one that skips blocks), so the graph would read the wrong slots; "
                                    "call recapture() before replaying")
        self.engine.join_copies()
        self.generation = self.engine.generation

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _copy_inputs(self.static_args, args)
        _copy_inputs(self.static_kwargs, kwargs, "keyword input")
        return self.replay()


__all__ = ["OffloadedCUDAGraph", "capturable_group", "capture_graph", "check_graph_slots", "cyclic_slot_assignment",
           "run_order_slot_assignment", "slot_snapshot"]
