"""Section 6, graphs: a whole offloaded forward captured in one CUDA graph and replayed.

W3 (many small parameters, launch- and host-bound) is where replay matters: eager offload pays the
per-block hook calls and ~700 kernel launches per step; a replay pays neither and should run at the
PCIe floor. Rows: resident eager, the floor, ext eager, ext replayed through
``fastoffload_ext.engine.graphs.OffloadedCUDAGraph`` (checked bit for bit against resident on fresh inputs),
and, in the full run, ext eager with every block compiled by inductor (regional compile) with its
compile time. GPU only: without one every row says why it was skipped.
"""
from __future__ import annotations

import time
from typing import Any

import torch

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
    from fastoffload_ext import disable_layerwise_offload as disable
    from fastoffload_ext import enable_layerwise_offload as enable
    from fastoffload_ext.engine.graphs import OffloadedCUDAGraph

    ctx.progress.add(len(variants))
    workload = stack_workload("W3", cpu=False)
    peak = peak_h2d_gbps(ctx)
    host_model = workload.build_host()
    device = ctx.device
    first = workload.make_inputs(device)[0]
    # Three different inputs of one shape (make_inputs is seeded: calling it again repeats the first).
    inputs = [first] + [tuple(t.roll(shift, dims=-1) for t in first) for shift in (1, 2)]
    iters = ctx.iters(10, quick=5)
    shared: dict[str, Any] = {}

    def forward_ms(fn) -> float:
        return median(ctx.time_ms(fn, warmup=2, iters=iters))

    def resident_row() -> dict[str, Any]:
        model = host_model.to(device)
        with torch.inference_mode():
            shared["want"] = [model(*x).to("cpu", copy=True) for x in inputs]
            ms = forward_ms(lambda: model(*inputs[0]))
        host_model.to("cpu")
        shared["resident_ms"] = ms
        return {"ms": ms}

    ctx.run_row("graphs", {"workload": "W3", "variant": "resident"}, resident_row)
    resident_ms = shared.get("resident_ms")
    transfer_ms = workload.info["weight_bytes"] / (peak * GB) * 1e3 if peak else None
    floor = max(v for v in (resident_ms, transfer_ms) if v is not None) if (resident_ms or transfer_ms) else None
    ctx.run_row("graphs", {"workload": "W3", "variant": "floor"},
                lambda: {"ms": floor, "x_floor": 1.0,
                         "note": f"max(resident, {workload.info['weight_bytes'] / GB:.2f} GB / {peak:.1f} GB/s)"})

    def judged(ms: float, limit: float | None) -> dict[str, Any]:
        result: dict[str, Any] = {"ms": ms, "x_floor": ms / floor if floor else None}
        if limit is not None and floor:
            result.update(target=f"<={limit:.2f}x floor", **{"pass": ms / floor <= limit})
        return result

    def equal_on_inputs(run) -> bool:
        with torch.inference_mode():
            return all(torch.equal(run(x).to("cpu"), want) for x, want in zip(inputs, shared["want"]))

    def eager_row() -> dict[str, Any]:
        model = host_model
        move_non_block_modules(model, device)
        enable(model, backend="ext", device=device)
        try:
            equal = equal_on_inputs(lambda x: model(*x))
            with torch.inference_mode():
                ms = forward_ms(lambda: model(*inputs[0]))
        finally:
            disable(model, device="cpu")
        return {**judged(ms, 1.10), "bit_equal": equal}

    ctx.run_row("graphs", {"workload": "W3", "variant": "ext eager"}, eager_row)

    def graph_row() -> dict[str, Any]:
        model = host_model
        move_non_block_modules(model, device)
        enable(model, backend="ext", device=device)
        try:
            started = time.perf_counter()
            graph = OffloadedCUDAGraph(model, inputs[0][0].clone())
            capture_s = time.perf_counter() - started
            equal = equal_on_inputs(lambda x: graph(*x))
            ms = forward_ms(graph.replay)
            slots = graph.num_slots
            del graph
        finally:
            disable(model, device="cpu")
        return {**judged(ms, 1.02), "bit_equal": equal,
                "note": f"capture {capture_s:.2f} s, {slots} fixed slots, fresh inputs each check"}

    ctx.run_row("graphs", {"workload": "W3", "variant": "ext CUDA graph"}, graph_row)

    if not ctx.quick:
        def compile_row() -> dict[str, Any]:
            import torch._dynamo
            model = host_model
            move_non_block_modules(model, device)
            enable(model, backend="ext", device=device)
            try:
                for block in workload.blocks(model):
                    block.compile()
                started = time.perf_counter()
                with torch.inference_mode():
                    model(*inputs[0])
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - started
                with torch.inference_mode():
                    ms = forward_ms(lambda: model(*inputs[0]))
            finally:
                disable(model, device="cpu")
                torch._dynamo.reset()
            return {**judged(ms, None), "note": f"first step (compile) {compile_s:.1f} s; "
                    "bit-equality vs the eager resident model is not expected from inductor"}

        ctx.run_row("graphs", {"workload": "W3", "variant": "ext eager + compile"}, compile_row)
