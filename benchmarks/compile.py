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
    rows = _CompileRows(ctx, workload)
    ctx.run_row("compile", rows.labels("resident eager"), rows.resident_eager)
    ctx.run_row("compile", rows.labels("resident compiled"), rows.resident_compiled)
    transfer_ms = workload.info["weight_bytes"] / (peak * GB) * 1e3 if peak else None
    candidates = [v for v in (rows.seen.get("compiled_ms"), transfer_ms) if v is not None]
    rows.floor = max(candidates) if candidates else None
    ctx.run_row("compile", rows.labels("floor"), lambda: {
        "ms": rows.floor, "x_floor": 1.0,
        "note": (f"max(compiled resident, {workload.info['weight_bytes'] / GB:.2f} GB / {peak:.1f} GB/s)"
                 if peak else "")})
    ctx.run_row("compile", rows.labels("ext eager"), rows.offloaded(rows.ext_eager))
    ctx.run_row("compile", rows.labels("ext compiled"), rows.offloaded(rows.ext_compiled))
    if workload.name.startswith("W3"):
        if ctx.cuda:
            ctx.run_row("compile", rows.labels("ext reduce-overhead"), rows.offloaded(rows.ext_reduce_overhead))
        else:
            ctx.skip("compile", rows.labels("ext reduce-overhead"),
                     "needs a CUDA GPU (reduce-overhead replays CUDA graphs)")


class _CompileRows:
    """One workload's rows over one host model and two inputs of one shape; ``seen`` carries the
    figures and reference outputs that later rows are judged by."""

    def __init__(self, ctx: Context, workload: Workload) -> None:
        self.ctx = ctx
        self.workload = workload
        self.device = ctx.device
        self.host_model = workload.build_host()
        self.x = workload.make_inputs(self.device)[0]
        # two different inputs of one shape: no recompile
        self.inputs = [self.x, tuple(t.roll(1, dims=-1) for t in self.x)]
        # W3 compiled is host-bound to within a few percent of its floor (the compiled block has 136 inputs), so
        # a handful of iterations right after compiling reads host jitter: 4 iterations once gave 1.36x.
        self.iters = ctx.iters(10, quick=8)
        self.seen: dict[str, Any] = {}
        self.floor: float | None = None

    def labels(self, variant: str) -> dict[str, str]:
        return {"workload": self.workload.name, "variant": variant}

    def forward_ms(self, fn: Callable[[], Any]) -> float:
        with torch.inference_mode():
            return median(self.ctx.time_ms(fn, warmup=3, iters=self.iters))

    def outputs(self, run: Callable[..., Any]) -> list[torch.Tensor]:
        with torch.inference_mode():
            return [self.workload.output(run(*args)).to("cpu", copy=True) for args in self.inputs]

    def first_step_s(self, model: torch.nn.Module) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model(*self.x)
        if self.ctx.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    def judged(self, ms: float) -> dict[str, Any]:
        result: dict[str, Any] = {"ms": ms, "x_floor": ms / self.floor if self.floor else None}
        if self.seen.get("eager_ms"):
            result["x_eager"] = ms / self.seen["eager_ms"]
        return result

    def resident_eager(self) -> dict[str, Any]:
        model = self.host_model.to(self.device)
        self.seen["eager_want"] = self.outputs(model)
        self.seen["resident_ms"] = ms = self.forward_ms(lambda: model(*self.x))
        return {"ms": ms}

    def resident_compiled(self) -> dict[str, Any]:
        _fresh_dynamo()
        model = self.host_model.to(self.device)
        _compile_blocks(self.workload, model)
        try:
            compile_s = self.first_step_s(model)
            self.seen["want"] = self.outputs(model)
            self.seen["compiled_ms"] = ms = self.forward_ms(lambda: model(*self.x))
        finally:
            _uncompile_blocks(self.workload, model)
            self.host_model.to("cpu")
        resident_ms = self.seen.get("resident_ms")
        return {"ms": ms, "compile_s": compile_s, **_dynamo_counts(),
                "note": f"{ms / resident_ms:.3f}x resident eager" if resident_ms else ""}

    def offloaded(self, body: Callable[[torch.nn.Module], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        """A row that runs ``body`` on the host model offloaded (ext), then restores it and dynamo."""
        from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload

        def row() -> dict[str, Any]:
            model = self.host_model
            move_non_block_modules(model, self.device)
            enable_layerwise_offload(model, backend="ext", device=self.device)
            try:
                return body(model)
            finally:
                disable_layerwise_offload(model, device="cpu")
                _uncompile_blocks(self.workload, model)
                _fresh_dynamo()
        return row

    def ext_eager(self, model: torch.nn.Module) -> dict[str, Any]:
        self.seen["eager_ms"] = ms = self.forward_ms(lambda: model(*self.x))
        return {**self.judged(ms), "bit_equal": _same(self.outputs(model), self.seen.get("eager_want"))}

    def ext_compiled(self, model: torch.nn.Module) -> dict[str, Any]:
        _fresh_dynamo()
        _compile_blocks(self.workload, model)
        return self._compiled_figures(model)

    def ext_reduce_overhead(self, model: torch.nn.Module) -> dict[str, Any]:
        _fresh_dynamo()
        compiled = torch.compile(model, mode="reduce-overhead")
        return {**self._compiled_figures(compiled),
                "note": "whole model compiled; dynamo compiles each block body, inductor replays it as a CUDA graph"}

    def _compiled_figures(self, model: Callable[..., Any]) -> dict[str, Any]:
        """First step (the compile), outputs, timed steps, and the graphs dynamo built over them."""
        compile_s = self.first_step_s(model)
        graphs_after_first = _dynamo_counts()["graphs"]
        got = self.outputs(model)
        ms = self.forward_ms(lambda: model(*self.x))
        counts = _dynamo_counts()
        return {**self.judged(ms), "compile_s": compile_s, **counts,
                "recompiles": counts["graphs"] - graphs_after_first,
                "bit_equal": _same(got, self.seen.get("want"))}


def _same(got: list[torch.Tensor], want: list[torch.Tensor] | None) -> bool | None:
    if want is None:
        return None
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
