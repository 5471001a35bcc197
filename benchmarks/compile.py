"""Section 7, compile: W1-W4 with every block compiled by inductor, offloaded vs eager.

Per workload: the resident model eager and with regional compile (``block.compile()`` on every block,
the way FastVideo and diffusers compile DiTs), the floor (max of the compiled resident time and the
weight bytes over the run's peak H2D), ext offload eager, and ext offload with the same regional
compile. The compiled offloaded row reports the first step's wall time (compile time), how many graphs
dynamo built, the graph-break sites inside block bodies and at the hooks (the hooks are the only
intended ones: each is a ``torch.compiler.disable`` boundary), the
recompiles over the timed steps (slots rotate; there must be none), and bit-equality with the compiled
resident model. W3, the launch-bound case, also gets ``torch.compile(model, mode="reduce-overhead")``
over the offloaded model, checked against the compiled resident model. Without a GPU the scaled-down
workloads run on the host (inductor's C++ backend) and the reduce-overhead row is skipped.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from benchmarks.forward import peak_h2d_gbps
from benchmarks.utils import GB, Column, Context, Table, median
from benchmarks.workloads import Workload, move_non_block_modules, stack_workload

TITLE = "compile: W1-W4 with regional torch.compile, offloaded vs eager, and reduce-overhead on W3"

TABLES = {
    "compile": Table(
        title="bf16, inference_mode: median ms per forward; floor = max(compiled resident, weight bytes / peak H2D)",
        columns=[
            Column("workload", "workload"),
            Column("variant", "variant"),
            Column("ms", "ms", ".2f"),
            Column("x_floor", "x floor", ".3f"),
            Column("x_eager", "x ext eager", ".3f"),
            Column("compile_s", "1st step s", ".1f"),
            Column("graphs", "graphs"),
            Column("body_breaks", "breaks in blocks"),
            Column("hook_breaks", "breaks at hooks"),
            Column("recompiles", "recompiles"),
            Column("bit_equal", "bit-equal"),
        ],
    ),
}

WORKLOADS = ("W1", "W2", "W3", "W4")
VARIANTS = ("resident eager", "resident compiled", "floor", "ext eager", "ext compiled")
HOOK_MARKERS = ("LayerwiseOffloadHook", "ModuleHookManager", "fastoffload_ext")


def _dynamo_counts() -> dict[str, int]:
    """Graphs built and graph breaks (distinct sites), split into the hooks' and anything else's."""
    from torch._dynamo.utils import counters
    reasons = {**counters["graph_break"], **counters["unimplemented"]}
    hook = sum(1 for reason in reasons if any(m in reason for m in HOOK_MARKERS))
    return {"graphs": counters["stats"]["unique_graphs"], "hook_breaks": hook, "body_breaks": len(reasons) - hook}


def _compile_blocks(workload: Workload, model: torch.nn.Module, **options: Any) -> None:
    for block in workload.blocks(model):
        block.compile(**options)


def _uncompile_blocks(workload: Workload, model: torch.nn.Module) -> None:
    for block in workload.blocks(model):
        block._compiled_call_impl = None


def _fresh_dynamo() -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()


def run(ctx: Context) -> None:
    keys = ("W3",) if ctx.quick else WORKLOADS
    ctx.progress.add(len(keys) * len(VARIANTS) + 1)
    peak = peak_h2d_gbps(ctx)
    for key in keys:
        run_workload(ctx, stack_workload(key, cpu=not ctx.cuda), peak)


def run_workload(ctx: Context, workload: Workload, peak: float | None) -> None:
    from fastoffload_ext import disable_layerwise_offload as disable
    from fastoffload_ext import enable_layerwise_offload as enable
    device = ctx.device
    host_model = workload.build_host()
    x = workload.make_inputs(device)[0]
    inputs = [x, tuple(t.roll(1, dims=-1) for t in x)]  # two different inputs of one shape: no recompile
    # W3 compiled is host-bound to within a few percent of its floor (the compiled block has 136 inputs), so
    # a handful of iterations right after compiling reads host jitter: 4 iterations once gave 1.36x.
    iters = ctx.iters(10, quick=8)
    seen: dict[str, Any] = {}

    def labels(variant: str) -> dict[str, str]:
        return {"workload": workload.name, "variant": variant}

    def forward_ms(fn: Callable[[], Any]) -> float:
        with torch.inference_mode():
            return median(ctx.time_ms(fn, warmup=3, iters=iters))

    def outputs(run: Callable[..., Any]) -> list[torch.Tensor]:
        with torch.inference_mode():
            return [workload.output(run(*args)).to("cpu", copy=True) for args in inputs]

    def first_step_s(model: torch.nn.Module) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model(*x)
        if ctx.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    def resident_eager() -> dict[str, Any]:
        model = host_model.to(device)
        seen["eager_want"] = outputs(model)
        seen["resident_ms"] = ms = forward_ms(lambda: model(*x))
        return {"ms": ms}

    def resident_compiled() -> dict[str, Any]:
        _fresh_dynamo()
        model = host_model.to(device)
        _compile_blocks(workload, model)
        try:
            compile_s = first_step_s(model)
            seen["want"] = outputs(model)
            seen["compiled_ms"] = ms = forward_ms(lambda: model(*x))
        finally:
            _uncompile_blocks(workload, model)
            host_model.to("cpu")
        return {"ms": ms, "compile_s": compile_s, **_dynamo_counts(),
                "note": f"{ms / seen['resident_ms']:.3f}x resident eager" if seen.get("resident_ms") else ""}

    ctx.run_row("compile", labels("resident eager"), resident_eager)
    ctx.run_row("compile", labels("resident compiled"), resident_compiled)
    transfer_ms = workload.info["weight_bytes"] / (peak * GB) * 1e3 if peak else None
    candidates = [v for v in (seen.get("compiled_ms"), transfer_ms) if v is not None]
    floor = max(candidates) if candidates else None
    ctx.run_row("compile", labels("floor"), lambda: {
        "ms": floor, "x_floor": 1.0,
        "note": f"max(compiled resident, {workload.info['weight_bytes'] / GB:.2f} GB / {peak:.1f} GB/s)" if peak else ""})

    def judged(ms: float) -> dict[str, Any]:
        result: dict[str, Any] = {"ms": ms, "x_floor": ms / floor if floor else None}
        if seen.get("eager_ms"):
            result["x_eager"] = ms / seen["eager_ms"]
        return result

    def offloaded(body: Callable[[torch.nn.Module], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        def row() -> dict[str, Any]:
            model = host_model
            move_non_block_modules(model, device)
            enable(model, backend="ext", device=device)
            try:
                return body(model)
            finally:
                disable(model, device="cpu")
                _uncompile_blocks(workload, model)
                _fresh_dynamo()
        return row

    def ext_eager(model: torch.nn.Module) -> dict[str, Any]:
        seen["eager_ms"] = ms = forward_ms(lambda: model(*x))
        return {**judged(ms), "bit_equal": _same(outputs(model), seen.get("eager_want"))}

    def ext_compiled(model: torch.nn.Module) -> dict[str, Any]:
        _fresh_dynamo()
        _compile_blocks(workload, model)
        compile_s = first_step_s(model)
        graphs_after_first = _dynamo_counts()["graphs"]
        got = outputs(model)
        ms = forward_ms(lambda: model(*x))
        counts = _dynamo_counts()
        return {**judged(ms), "compile_s": compile_s, **counts,
                "recompiles": counts["graphs"] - graphs_after_first,
                "bit_equal": _same(got, seen.get("want"))}

    def ext_reduce_overhead(model: torch.nn.Module) -> dict[str, Any]:
        _fresh_dynamo()
        compiled = torch.compile(model, mode="reduce-overhead")
        compile_s = first_step_s(compiled)
        graphs_after_first = _dynamo_counts()["graphs"]
        got = outputs(compiled)
        ms = forward_ms(lambda: compiled(*x))
        counts = _dynamo_counts()
        return {**judged(ms), "compile_s": compile_s, **counts,
                "recompiles": counts["graphs"] - graphs_after_first,
                "bit_equal": _same(got, seen.get("want")),
                "note": "whole model compiled; dynamo compiles each block body, inductor replays it as a CUDA graph"}

    ctx.run_row("compile", labels("ext eager"), offloaded(ext_eager))
    ctx.run_row("compile", labels("ext compiled"), offloaded(ext_compiled))
    if workload.name.startswith("W3"):
        if ctx.cuda:
            ctx.run_row("compile", labels("ext reduce-overhead"), offloaded(ext_reduce_overhead))
        else:
            ctx.skip("compile", labels("ext reduce-overhead"), "needs a CUDA GPU (reduce-overhead replays CUDA graphs)")


def _same(got: list[torch.Tensor], want: list[torch.Tensor] | None) -> bool | None:
    if want is None:
        return None
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
