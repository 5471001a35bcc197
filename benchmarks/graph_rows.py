"""The models section's CUDA-graph rows: the resident model and ext (default settings), each captured whole in one
CUDA graph and replayed, timed as more configurations inside the first session's interleaved rounds.

Why they are there: on a host-bound row an eager forward runs at the pace of Python launching kernels, and on
the H200 machine the host itself runs slower while pinned copies stream (``benchmarks/copy_load.py``), so no
eager layerwise offloader reaches the resident model there. A replayed graph launches nothing from Python:
``OffloadedCUDAGraph`` (``fastoffload_ext.engine.graphs``) captures the copies, event waits and compute of one
offloaded forward. Its floor is max(the resident model replayed as a graph, offloaded bytes / peak H2D), round
by round; the row's note gives it against the eager floor too.

ext's graph runs on an offloaded copy of its own: a capture fixes every block's slot for good (and can take one
slot more), which would change the eager row's schedule and memory. One graph per token count; all of them share
the copy's fixed slots, and each replays after the others' captures and replays. The same copy also runs
``graph_forward`` (``fastoffload_ext.engine.graph_forward``), the forward a pipeline calls (``model(**inputs)``)
replaying graphs of its own: its row, ``ext, graph_forward``, is what that call costs over the bare replay (the
input copies, the signature, the output copy). The copy and the graphs are freed before the peers' sessions.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from benchmarks.interleave import Interleaved, Timer
from benchmarks.link_probe import link_floors
from benchmarks.model_rows import EXT_TARGET, ExtConfig, floors, ratio, transfer_ms
from benchmarks.utils import GB

RESIDENT = "resident, CUDA graph"
FLOOR = "floor, CUDA graph"
EXT = "ext, CUDA graph"
EXT_FORWARD = "ext, graph_forward"


class ResidentGraph:
    """One resident forward captured with static copies of ``inputs``; calling it replays the capture."""

    def __init__(self, model: nn.Module, inputs: dict[str, Any]) -> None:
        from fastoffload_ext.engine.graphs import capture_graph

        self.inputs = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # lazy initialisation and the allocator's growth stay out of the capture
                model(**self.inputs, return_dict=False)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), capture_graph(self.graph):
            self.output = model(**self.inputs, return_dict=False)[0]

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class GraphRows:
    """The graphs of one model: the resident master's and ext's (``config``, on its own offloaded copy), per
    token count, checked bit for bit against ``references`` when built."""

    def __init__(self, master: nn.Module, offloaded: nn.Module, config: ExtConfig, inputs: dict[str, dict[str, Any]],
                 references: dict[str, torch.Tensor]) -> None:
        from fastoffload_ext.engine.graph_forward import graph_forward
        from fastoffload_ext.engine.graphs import OffloadedCUDAGraph

        self.config = config
        self.model = offloaded
        self.inputs = inputs
        # ext's first: OffloadedCUDAGraph says what keeps an offload from being captured.
        self.ext = {label: OffloadedCUDAGraph(offloaded, **kwargs) for label, kwargs in inputs.items()}
        graph_forward(offloaded)
        self.resident = {label: ResidentGraph(master, kwargs) for label, kwargs in inputs.items()}
        self.num_slots = next(iter(self.ext.values())).num_slots
        self.equal = {label: bool(torch.equal(self.resident[label]().cpu(), references[label])
                                  and torch.equal(self._replay(label)[0].cpu(), references[label])
                                  and torch.equal(self._forward(label)[0].cpu(), references[label]))
                      for label in inputs}

    def _replay(self, label: str) -> Any:
        # The graphs share the model's fixed slots: each replays after the others' captures and replays.
        return self.ext[label].replay()

    def _forward(self, label: str) -> Any:
        with torch.inference_mode():
            return self.model(**self.inputs[label], return_dict=False)

    def timers(self, timer: Callable[[Callable[[], Any], int], Timer], iters: int) -> dict[str, Timer]:
        """A round timer per graph and token count; ext's replays once first, untimed."""
        timers: dict[str, Timer] = {}
        for label in self.resident:
            timers[f"{RESIDENT}|{label}"] = timer(self.resident[label], iters)
            replay_timer = timer(lambda label=label: self.ext[label].replay(), iters)

            def measure(label: str = label, replay_timer: Timer = replay_timer) -> Sequence[float]:
                self._replay(label)  # the round's warm-up
                return replay_timer()
            timers[f"{EXT}|{label}"] = measure
            timers[f"{EXT_FORWARD}|{label}"] = timer(lambda label=label: self._forward(label), iters)
        return timers

    def close(self) -> None:
        self.resident.clear()
        self.ext.clear()
        self.model = None  # type: ignore[assignment]


def rows_for(result: Interleaved, label: str, config: ExtConfig, equal: bool, num_slots: int,
             peak_gbps: float | None, target: float = EXT_TARGET,
             link: tuple[int, Sequence[float]] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(backend, figures) of the graph rows at one token count, from the first session's rounds; ``link`` (probe
    bytes, its ms per round) adds each offloaded row against the floor at each round's link."""
    eager = result.rounds[f"resident|{label}"]
    resident, ext = result.rounds[f"{RESIDENT}|{label}"], result.rounds[f"{EXT}|{label}"]
    resident_ms = float(statistics.median(resident))
    x_eager, eager_range = ratio([g / r for g, r in zip(resident, eager)])
    rows: list[tuple[str, dict[str, Any]]] = [(RESIDENT, {
        "ms": resident_ms, "spread": (max(resident) - min(resident)) / resident_ms, "x_resident": x_eager,
        "range": eager_range, "bit_equal": equal,
        "note": ("the resident forward captured once and replayed (torch.cuda.CUDAGraph); x resident: against "
                 "the eager resident forward")})]
    transfer = transfer_ms(config.offloaded_bytes, peak_gbps)
    floor = floors(resident, transfer) if transfer else None
    at_link = link_floors(resident, config.offloaded_bytes, *link) if transfer and link else None
    values = _offloaded_row(ext, resident, floor, equal, target, at_link)
    notes = [(f"OffloadedCUDAGraph over ext ({', '.join(config.lists)}, default settings otherwise), "
              f"{num_slots} fixed slots; x resident: against the resident graph; {len(ext)} rounds")]
    if floor is not None:
        floor_ms = float(statistics.median(floor))
        rows.append((FLOOR, {"ms": floor_ms, "x_floor": 1.0, "compute_over_copy": resident_ms / transfer,
                             "note": f"max(resident graph, {config.offloaded_bytes / GB:.2f} GB / {peak_gbps:.1f} GB/s "
                                     f"= {transfer:.1f} ms)"}))
        eager_floor = ratio([e / f for e, f in zip(ext, floors(eager, transfer))])[0]
        notes.append(f"{eager_floor:.3f}x the eager floor max(eager resident, transfer)")
    values["note"] = "; ".join(notes)
    rows.append((EXT, values))
    forward = result.rounds.get(f"{EXT_FORWARD}|{label}")
    if forward:
        over_replay, over_range = ratio([f / e for f, e in zip(forward, ext)])
        wrapped = _offloaded_row(forward, resident, floor, equal, target, at_link)
        wrapped["note"] = (f"model(**inputs) through graph_forward (its own graph, the same fixed slots); "
                           f"{over_replay:.3f}x {over_range} the bare replay")
        rows.append((EXT_FORWARD, wrapped))
    return rows


def _offloaded_row(times: Sequence[float], resident: Sequence[float], floor: Sequence[float] | None, equal: bool,
                   target: float, at_link: Sequence[float] | None = None) -> dict[str, Any]:
    """An offloaded graph row's figures, round by round against the resident graph and (given) the floor and the
    floor at each round's link."""
    median = float(statistics.median(times))
    x_resident, resident_range = ratio([t / r for t, r in zip(times, resident)])
    values: dict[str, Any] = {"ms": median, "spread": (max(times) - min(times)) / median, "x_resident": x_resident,
                              "range": resident_range, "bit_equal": equal}
    if floor is not None:
        values["x_floor"], values["range"] = ratio([t / f for t, f in zip(times, floor)])
        values["pass"] = values["x_floor"] <= target
        if target != EXT_TARGET:
            values["target"] = target
    if at_link is not None:
        values["x_link_floor"] = ratio([t / f for t, f in zip(times, at_link)])[0]
    return values
