"""Section 6, graphs: a whole offloaded forward captured in one CUDA graph and replayed.

W3 (many small parameters, launch- and host-bound) is where replay matters: eager offload pays the
per-block hook calls and ~700 kernel launches per step; a replay pays neither and should run at the
PCIe floor. Rows: resident eager, the floor, ext eager, ext replayed through
``fastoffload_ext.engine.graphs.OffloadedCUDAGraph`` (checked bit for bit against resident on fresh inputs),
and, in the full run, ext eager with every block compiled by inductor (regional compile) with its
compile time. GPU only: without one every row says why it was skipped.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from benchmarks.forward import peak_h2d_gbps
from benchmarks.utils import GB, Column, Context, Table, median, summary
from benchmarks.workloads import move_non_block_modules, stack_workload

TITLE = "graphs: offloaded forward captured in a CUDA graph (W3), vs eager and the floor"

TABLES = {
    "graphs": Table(
        title="W3 (bf16): median ms per forward; floor = max(resident, weight bytes / peak H2D)",
        columns=[
            Column("workload", "workload"),
            Column("variant", "variant"),
            Column("ms", "ms", ".2f"),
            Column("x_floor", "x floor", ".3f"),
            Column("bit_equal", "bit-equal"),
            Column("target", "target"),
            Column("pass", "pass"),
        ],
    ),
}


def run(ctx: Context) -> None:
    variants = ["resident", "floor", "ext eager", "ext CUDA graph"] + ([] if ctx.quick else ["ext eager + compile"])
    if not ctx.cuda:
        for variant in variants:
            ctx.skip("graphs", {"workload": "W3", "variant": variant}, "needs a CUDA GPU (graph capture)")
        return
    ctx.progress.add(len(variants))
    rows = _GraphRows(ctx)
    ctx.run_row("graphs", {"workload": "W3", "variant": "resident"}, rows.resident_row)
    rows.floor = rows.floor_ms()
    ctx.run_row("graphs", {"workload": "W3", "variant": "floor"},
                lambda: {"ms": rows.floor, "x_floor": 1.0,
                         "note": f"max(resident, {rows.workload.info['weight_bytes'] / GB:.2f} GB / "
                                 f"{rows.peak:.1f} GB/s)"})
    ctx.run_row("graphs", {"workload": "W3", "variant": "ext eager"}, rows.eager_row)
    ctx.run_row("graphs", {"workload": "W3", "variant": "ext CUDA graph"}, rows.graph_row)
    if not ctx.quick:
        ctx.run_row("graphs", {"workload": "W3", "variant": "ext eager + compile"}, rows.compile_row)


class _GraphRows:
    """The rows of the section over one host copy of W3, three inputs of one shape and one floor."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.workload = stack_workload("W3", cpu=False)
        self.peak = peak_h2d_gbps(ctx)
        self.host_model = self.workload.build_host()
        self.device = ctx.device
        first = self.workload.make_inputs(self.device)[0]
        # Three different inputs of one shape (make_inputs is seeded: calling it again repeats the first).
        self.inputs = [first] + [tuple(t.roll(shift, dims=-1) for t in first) for shift in (1, 2)]
        self.iters = ctx.iters(10, quick=5)
        self.want: list[torch.Tensor] | None = None  # the resident outputs, once its row ran
        self.resident_ms: float | None = None
        self.floor: float | None = None

    def forward_ms(self, fn: Callable[[], Any]) -> float:
        return median(self.ctx.time_ms(fn, warmup=2, iters=self.iters))

    def floor_ms(self) -> float | None:
        transfer_ms = self.workload.info["weight_bytes"] / (self.peak * GB) * 1e3 if self.peak else None
        if not (self.resident_ms or transfer_ms):
            return None
        return max(v for v in (self.resident_ms, transfer_ms) if v is not None)

    def judged(self, ms: float, limit: float | None) -> dict[str, Any]:
        floor = self.floor
        result: dict[str, Any] = {"ms": ms, "x_floor": ms / floor if floor else None}
        if limit is not None and floor:
            result.update(target=f"<={limit:.2f}x floor", **{"pass": ms / floor <= limit})
        return result

    def equal_on_inputs(self, run: Callable[[Any], torch.Tensor]) -> bool:
        if self.want is None:
            raise RuntimeError("no resident outputs to compare with: the resident row failed")
        with torch.inference_mode():
            return all(torch.equal(run(x).to("cpu"), want) for x, want in zip(self.inputs, self.want))

    @contextlib.contextmanager
    def offloaded(self) -> Iterator[nn.Module]:
        """The host model offloaded (ext backend) for one row, back on the host after it."""
        from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload

        model = self.host_model
        move_non_block_modules(model, self.device)
        enable_layerwise_offload(model, backend="ext", device=self.device)
        try:
            yield model
        finally:
            disable_layerwise_offload(model, device="cpu")

    def resident_row(self) -> dict[str, Any]:
        model = self.host_model.to(self.device)
        with torch.inference_mode():
            self.want = [model(*x).to("cpu", copy=True) for x in self.inputs]
            ms = self.forward_ms(lambda: model(*self.inputs[0]))
        self.host_model.to("cpu")
        self.resident_ms = ms
        return {"ms": ms}

    def eager_row(self) -> dict[str, Any]:
        with self.offloaded() as model:
            equal = self.equal_on_inputs(lambda x: model(*x))
            with torch.inference_mode():
                ms = self.forward_ms(lambda: model(*self.inputs[0]))
        return {**self.judged(ms, 1.10), "bit_equal": equal}

    def graph_row(self) -> dict[str, Any]:
        from fastoffload_ext.engine.graphs import OffloadedCUDAGraph

        with self.offloaded() as model:
            started = time.perf_counter()
            graph = OffloadedCUDAGraph(model, self.inputs[0][0].clone())
            capture_s = time.perf_counter() - started
            equal = self.equal_on_inputs(lambda x: graph(*x))
            ms = self.forward_ms(graph.replay)
            slots = graph.num_slots
            del graph
        return {**self.judged(ms, 1.02), "bit_equal": equal,
                "note": f"capture {capture_s:.2f} s, {slots} fixed slots, fresh inputs each check"}

    def compile_row(self) -> dict[str, Any]:
        import torch._dynamo

        try:
            with self.offloaded() as model:
                for block in self.workload.blocks(model):
                    block.compile()
                started = time.perf_counter()
                with torch.inference_mode():
                    model(*self.inputs[0])
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - started
                with torch.inference_mode():
                    ms = self.forward_ms(lambda: model(*self.inputs[0]))
        finally:
            torch._dynamo.reset()
        return {**self.judged(ms, None), "note": f"first step (compile) {compile_s:.1f} s; "
                "bit-equality vs the eager resident model is not expected from inductor"}
