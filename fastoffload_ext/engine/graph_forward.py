"""``model(...)`` replayed from CUDA graphs: one per input signature, captured on first use.

:class:`~fastoffload_ext.engine.graphs.OffloadedCUDAGraph` replays one captured forward, and its caller
must hold the graph and call it. Code that calls the model itself (a diffusers pipeline's denoising loop,
FastVideo's stages) cannot. ``graph_forward(model)`` puts a forward on the model's instance that does it
for them::

    enable_layerwise_offload(model, backend="ext")
    graph_forward(model)            # model(...) now replays a graph per input signature
    with torch.inference_mode():
        for t in timesteps:
            out = model(latents, t)    # the first call of a signature warms up, captures and replays

What a call does:

- Outside ``torch.no_grad()`` / ``inference_mode()``, it runs eagerly (a graph records no autograd).
- Its signature is the structure of the arguments, each tensor's shape, dtype and device, and every other
  value as it is. A new signature runs ``warmup_steps`` eager forwards, is captured, and replays; a known
  one replays. All of them share the model's fixed slots and one memory pool, and each replays after the
  others' captures and replays, and after complete eager forwards, without a new capture.
- The output is a copy: a replay's own output is overwritten by the next replay, and a pipeline that calls
  the model twice a step (guidance) keeps both answers.
- After the weights change (``load_state_dict``, ``mutate_params_scope()``, an adapter), or an eager
  forward that raised part-way, a graph is captured again at its next call.
- A call under other numeric settings (TF32, reduced-precision reductions, deterministic algorithms) gets a
  graph of its own; a module, parameter or adapter state changed since a capture (an adapter injected, switched,
  scaled, disabled, merged; ``model.train()``) makes the graph capture again (see ``OffloadedCUDAGraph.replay``).
- It runs eagerly, with one warning saying why, where a graph cannot serve the call: autocast on, a tensor argument
  on another device, an argument that is not a tensor, a number, a string, or a container of them, or a new
  signature once ``max_graphs`` are captured (a Python float that changes every step would need a graph
  per call: pass it as a tensor).
- A forward that cannot be captured (one that synchronizes with the host, for example) raises
  :class:`~fastoffload_ext.errors.OffloadConfigError` with the reason; the model keeps its weights and runs
  eagerly after ``remove_graph_forward(model)``, and torch's allocator and current stream are as they were.

``disable_layerwise_offload`` removes the forward with the offload (engine/guards.py), and the graphs go
with it. The forward holds the model weakly, so a dropped model frees its graphs with it.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import math
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from fastoffload_ext.engine.graphs import OffloadedCUDAGraph, capturable_group, check_graph_slots
from fastoffload_ext.engine.guards import is_guard, mark, remove_guard
from fastoffload_ext.engine.hooks import DEAD_MODULE_ERROR
from fastoffload_ext.engine.layerwise import LayerwiseOffloadGroup, get_offload_group
from fastoffload_ext.engine.messages import warn_caller
from fastoffload_ext.errors import OffloadConfigError, OffloadStateError
from fastoffload_ext.planning.slots import cyclic_slot_assignment

logger = logging.getLogger(__name__)

__all__ = ["GraphedForward", "get_graph_forward", "graph_forward", "remove_graph_forward"]

_GRAPHED = "_fastoffload_graphed"  # on the instance forward graph_forward() sets: its GraphedForward


class _Unkeyable(Exception):
    """An argument a signature cannot hold (the message says which)."""


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
          torch.memory_format, enum.Enum)


def _signature(value: Any, where: str) -> Hashable:
    """What a graph is captured for: the structure, each tensor's shape, dtype and device, every other value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, float):  # 0.0 == -0.0, but a forward can tell them apart (x * t, 1 / t)
        return (float, value, math.copysign(1.0, value))
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_signature(v, f"{where}[{i}]") for i, v in enumerate(value)))
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise _Unkeyable(f"{where} is a dict with keys that are not strings")
        return (type(value), tuple((key, _signature(value[key], f"{where}[{key!r}]")) for key in sorted(value)))
    raise _Unkeyable(f"{where} is a {type(value).__name__}, not a tensor, a number, a string or a container of them")


def _numerics() -> Hashable:
    """The global settings that choose the kernels a forward launches, and so its bits: a graph replays the ones
    its capture chose, so a call under other settings needs a graph of its own."""
    matmul = torch.backends.cuda.matmul
    return (torch.get_float32_matmul_precision(), matmul.allow_bf16_reduced_precision_reduction,
            matmul.allow_fp16_reduced_precision_reduction, torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.deterministic, torch.are_deterministic_algorithms_enabled())


def _key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    return (tuple(_signature(value, f"argument {i}") for i, value in enumerate(args)),
            tuple((key, _signature(kwargs[key], f"keyword argument {key!r}")) for key in sorted(kwargs)), _numerics())


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _copy_output(value: Any) -> Any:
    """A copy of a replay's output (the next replay overwrites it), keeping its container types."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _copy_output(getattr(value, f.name))
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_copy_output(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_output(v) for v in value)
    if isinstance(value, dict):
        return type(value)((key, _copy_output(v)) for key, v in value.items())
    inner = getattr(value, "__dict__", None)
    if not isinstance(value, _PLAIN) and isinstance(inner, dict) and _tensors(list(inner.values())):
        raise OffloadConfigError(
            f"fastoffload: the forward returns a {type(value).__name__} holding tensors, which graph_forward cannot "
            "copy, and the next replay would overwrite them under the caller; return tensors, or tuples, lists, dicts "
            "or dataclasses of them (return_dict=False), or run the model eagerly: remove_graph_forward(model)")
    return value


class _ModelGraph(OffloadedCUDAGraph):
    """An :class:`OffloadedCUDAGraph` that holds its model weakly: the model holds it (through its forward)."""

    def __init__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], warmup_steps: int,
                 pool: Any) -> None:
        self._setup(model, args, kwargs, warmup_steps, pool)

    @property  # type: ignore[override]
    def model(self) -> nn.Module:
        model = self._model_ref()
        if model is None:
            raise OffloadStateError(DEAD_MODULE_ERROR)
        return model

    @model.setter
    def model(self, value: nn.Module) -> None:
        self._model_ref = weakref.ref(value)


class GraphedForward:
    """The CUDA graphs behind one offloaded model's forward (see the module doc); ``stats()`` says what ran."""

    def __init__(self, model: nn.Module, group: LayerwiseOffloadGroup, max_graphs: int, warmup_steps: int) -> None:
        self._model_ref = weakref.ref(model)
        self.group = group
        self.max_graphs = max_graphs
        self.warmup_steps = warmup_steps
        self.pool: Any = None  # one memory pool for all the graphs, made at the first capture
        self.graphs: dict[Hashable, _ModelGraph] = {}
        self.counts = {"captures": 0, "replays": 0, "eager": 0}
        self._warned: set[str] = set()
        self._capturing = False

    def stats(self) -> dict[str, int]:
        """How many graphs are held, and how many calls captured, replayed and ran eagerly."""
        return {"graphs": len(self.graphs), **self.counts}

    def _eager(self, model: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any], why: str | None) -> Any:
        if why is not None and why not in self._warned:
            self._warned.add(why)
            warn_caller(f"fastoffload: {type(model).__name__}'s graph forward runs this call eagerly: {why}")
        self.counts["eager"] += 1
        return forward(*args, **kwargs)

    def __call__(self, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        model = self._model_ref()
        if model is None:
            raise OffloadStateError(DEAD_MODULE_ERROR)
        if self._capturing:  # a warm-up or the capture itself
            return forward(*args, **kwargs)
        if torch.is_grad_enabled() or get_offload_group(model) is not self.group:
            # A forward autograd records (a graph records none); an offload enabled anew.
            return self._eager(model, forward, args, kwargs, None)
        if torch.is_autocast_enabled(self.group.device.type):
            return self._eager(model, forward, args, kwargs,
                               "autocast is on; a graph replays the precision of its capture, and autocast's cache of "
                               "cast weights cannot live in a graph's memory")
        try:
            key = _key(args, kwargs)
        except _Unkeyable as error:
            return self._eager(model, forward, args, kwargs, f"{error}")
        graph = self.graphs.get(key)
        if graph is None:
            elsewhere = [t for t in _tensors((args, kwargs)) if t.device != self.group.device]
            if elsewhere:
                return self._eager(model, forward, args, kwargs,
                                   f"a tensor argument is on {elsewhere[0].device}, not {self.group.device}")
            if len(self.graphs) >= self.max_graphs:
                return self._eager(model, forward, args, kwargs,
                                   f"{len(self.graphs)} input signatures are captured already (max_graphs="
                                   f"{self.max_graphs}) and this call's is new; inputs whose shapes or values change "
                                   "on every call need a graph each (pass changing numbers as tensors), or raise "
                                   "max_graphs")
            graph = self._capture(model, args, kwargs)
            self.graphs[key] = graph
        try:
            output = graph(*args, **kwargs)
        except OffloadStateError:
            if get_offload_group(model) is not self.group:
                raise
            # The weights changed, or an eager forward raised part-way, since the capture.
            self._capture_again(graph)
            output = graph(*args, **kwargs)
        self.counts["replays"] += 1
        return _copy_output(output)

    def _capture(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _ModelGraph:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self._capturing = True
        try:
            graph = _ModelGraph(model, args, kwargs, self.warmup_steps, self.pool)
        except (OffloadConfigError, OffloadStateError):
            raise
        except Exception as error:
            raise OffloadConfigError(
                f"fastoffload: {type(model).__name__}'s forward cannot be captured in a CUDA graph ({error}); its "
                "weights are as they were. Run it eagerly: remove_graph_forward(model)") from error
        finally:
            self._capturing = False
        self.counts["captures"] += 1
        logger.info("Captured %s's forward for a new input signature (%d graphs)", type(model).__name__,
                    len(self.graphs) + 1)
        return graph

    def _capture_again(self, graph: _ModelGraph) -> None:
        self._capturing = True
        try:
            graph.recapture()
        finally:
            self._capturing = False
        self.counts["captures"] += 1


def get_graph_forward(model: nn.Module) -> GraphedForward | None:
    """The :class:`GraphedForward` that :func:`graph_forward` put on ``model``, or None."""
    forward = model.__dict__.get("forward")
    return getattr(forward, _GRAPHED, None) if is_guard(forward) else None


def graph_forward(model: nn.Module, *, max_graphs: int = 4, warmup_steps: int = 2) -> GraphedForward:
    """Make ``model(...)`` replay CUDA graphs of its offloaded forward, one per input signature.

    Args:
        model: a model with layerwise offload enabled, ``backend="ext"``, on a CUDA device.
        max_graphs: how many input signatures get a graph; a call with a new one beyond them runs eagerly
            (with a warning). Each graph holds its own activations.
        warmup_steps: eager forwards before each capture.

    Returns:
        The :class:`GraphedForward` (``stats()``). Calling this again on the same model returns it as it is.

    Raises:
        OffloadConfigError: the model is not offloaded, not with ``backend="ext"``, or not on CUDA; a
            ``max_graphs`` or ``warmup_steps`` below 1; or the fixed slots a capture needs would exceed
            the group's ``device_budget``. Nothing is changed.
    """
    for name, value in (("max_graphs", max_graphs), ("warmup_steps", warmup_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OffloadConfigError(f"fastoffload: graph_forward() needs {name} >= 1 (an int), got {value!r}")
    group = capturable_group(model)
    existing = get_graph_forward(model)
    if existing is not None:
        return existing
    check_graph_slots(group, cyclic_slot_assignment(len(group.states), group.prefetch_depth)[1])
    return _install(model, GraphedForward(model, group, max_graphs, warmup_steps))


def _install(model: nn.Module, graphed: GraphedForward) -> GraphedForward:
    """Puts ``graphed`` behind ``model``'s forward, on the instance."""
    own = model.__dict__.get("forward")  # a forward set on the instance before: kept, and called eagerly
    model_ref = weakref.ref(model)
    unbound = type(model).forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        model = model_ref()
        if model is None:
            raise OffloadStateError(DEAD_MODULE_ERROR)
        eager = own if own is not None else unbound.__get__(model)
        return graphed(eager, args, kwargs)

    setattr(forward, _GRAPHED, graphed)
    object.__setattr__(model, "forward", mark(forward, own))  # taken off at disable, graphs with it
    return graphed


def remove_graph_forward(model: nn.Module) -> bool:
    """Takes :func:`graph_forward`'s forward off ``model`` (its graphs are freed); whether there was one."""
    return get_graph_forward(model) is not None and remove_guard(model, "forward")
