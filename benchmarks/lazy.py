"""Section 5, lazy: peak memory of a three-component pipeline, eager vs lazy with a release schedule.

The pipeline is encode (text_encoder) -> denoise (transformer, a few steps) -> decode (vae), each
component a BlockStack of its own size. Variants:
- ``eager``: every component built before the first stage; peak = the sum of the components.
- ``lazy``: every component a ``LazyModule``; ``ReleaseSchedule`` (fastoffload_ext.pipeline.schedule) releases
  each one after the last stage that uses it; peak = the largest component (plus activations).
- ``lazy + layerwise``: as ``lazy``, with the transformer's blocks offloaded layer by layer by its
  loader (``set_materialize_transform`` is not needed: the loader enables the offload itself).

Two figures per variant: the device's ``max_memory_allocated`` (CUDA only) and "live weights", the
parameter bytes of the components loaded at each stage boundary (counted on every machine, so the
eager/lazy ratio shows on a host without a GPU too; an offloaded block's placeholders count 0). The
final output must equal the eager one bit for bit: releasing is a latency cost, never a correctness
one. "wall s" is the whole pipeline's, building its components included (eager before the first stage, lazy
in the stages).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.utils import (Column, Context, MiB, Table, device_allocated, device_peak, free_memory, module_bytes,
                              reset_device_peak)
from benchmarks.workloads import DTYPE, StackSpec, build_stack, build_stack_on_host
from fastoffload_ext import enable_layerwise_offload
from fastoffload_ext.pipeline.lazy import LazyModule, is_lazy_module
from fastoffload_ext.pipeline.schedule import ReleaseSchedule

TITLE = "lazy: peak memory of a 3-component pipeline, eager vs lazy"

TABLES = {
    "lazy": Table(
        title="Pipeline encode -> denoise -> decode: peak memory, eager vs LazyModule + release schedule",
        columns=[
            Column("variant", "variant"),
            Column("peak_gpu_mib", "peak GPU MiB", ".0f"),
            Column("peak_live_mib", "peak live weights MiB", ".0f"),
            Column("x_eager", "x eager", ".2f"),
            Column("sum_mib", "sum MiB", ".0f"),
            Column("max_mib", "max MiB", ".0f"),
            Column("wall_s", "wall s", ".2f"),
            Column("bit_equal", "= eager"),
        ],
    ),
}

COMPONENTS_GPU = {
    "text_encoder": StackSpec("text_encoder", d=2048, blocks=8, tokens=256, n_norms=2, character=""),
    "transformer": StackSpec("transformer", d=3072, blocks=8, tokens=1024, n_norms=4, character=""),
    "vae": StackSpec("vae", d=1536, blocks=6, tokens=1024, n_norms=2, character=""),
}
COMPONENTS_CPU = {
    "text_encoder": StackSpec("text_encoder", d=192, blocks=8, tokens=16, n_norms=2, character=""),
    "transformer": StackSpec("transformer", d=256, blocks=8, tokens=32, n_norms=4, character=""),
    "vae": StackSpec("vae", d=128, blocks=6, tokens=32, n_norms=2, character=""),
}
STAGES = [("encode", ["text_encoder"]), ("denoise", ["transformer"]), ("decode", ["vae"])]
DENOISE_STEPS = 4


def run(ctx: Context) -> None:
    specs = COMPONENTS_GPU if ctx.cuda else COMPONENTS_CPU
    device = ctx.device
    inputs = _inputs(specs, device)
    component_bytes = {name: spec.weight_bytes() for name, spec in specs.items()}
    sum_bytes, max_bytes = sum(component_bytes.values()), max(component_bytes.values())
    common = {"sum_mib": sum_bytes / MiB, "max_mib": max_bytes / MiB}
    ctx.progress.add(3)
    results: dict[str, Any] = {}

    def loader(name: str) -> Callable[[], nn.Module]:
        return lambda: build_stack(specs[name], device, seed=len(name))

    def eager() -> tuple[dict[str, Any], Callable[[str], list[str]]]:
        return {name: loader(name)() for name in specs}, lambda stage: []

    def lazy() -> tuple[dict[str, Any], Callable[[str], list[str]]]:
        components = {name: LazyModule(name, loader(name)) for name in specs}
        return components, _releaser(components)

    def lazy_offloaded() -> tuple[dict[str, Any], Callable[[str], list[str]]]:
        def load_transformer() -> nn.Module:
            model = build_stack_on_host(specs["transformer"], seed=len("transformer"))
            group = enable_layerwise_offload(model, device=device, prefetch_depth=ctx.options.prefetch_depth)
            if group is None:
                raise RuntimeError("enable_layerwise_offload returned None")
            return model

        components = {name: LazyModule(name, loader(name)) for name in specs if name != "transformer"}
        components["transformer"] = LazyModule("transformer", load_transformer)
        return components, _releaser(components)

    for name, make in (("eager", eager), ("lazy", lazy), ("lazy + layerwise transformer", lazy_offloaded)):
        ctx.run_row("lazy", {"variant": name},
                    lambda name=name, make=make: _variant_row(ctx, name, make, inputs, common, results))
    ctx.note("peak live weights: bytes of the parameters of loaded components at each stage boundary (an "
             "offloaded transformer's placeholders count 0); peak GPU: max_memory_allocated over the run, above "
             "what was allocated before it")


def _variant_row(ctx: Context, name: str, make: Callable[[], tuple[dict[str, Any], Callable[[str], list[str]]]],
                 inputs: dict[str, torch.Tensor], common: dict[str, float], results: dict[str, Any]) -> dict[str, Any]:
    """One pipeline variant's row: its peaks and wall time, as a ratio to eager's and checked against it."""
    free_memory()
    base = device_allocated(ctx)
    reset_device_peak(ctx)
    # The wall time counts building the components too: eager builds them all here, a lazy variant in its stages,
    # and leaving eager's out would charge the lazy rows for loads that eager made off the clock.
    started = time.perf_counter()
    components, release = make()
    build_s = time.perf_counter() - started
    try:
        measured = _measure(ctx, components, release, inputs)
    finally:
        components.clear()
        free_memory()
    result: dict[str, Any] = {**common, "peak_live_mib": measured["live_peak"] / MiB,
                              "wall_s": build_s + measured["wall_s"]}
    if ctx.cuda:
        result["peak_gpu_mib"] = (device_peak(ctx) - base) / MiB
    if name == "eager":
        results["eager"] = result
        results["eager_output"] = measured["output"]
        result["x_eager"] = 1.0
    else:
        eager = results.get("eager")
        if eager is not None:
            key = "peak_gpu_mib" if ctx.cuda else "peak_live_mib"
            result["x_eager"] = result.get(key, 0) / eager[key] if eager.get(key) else None
        if "eager_output" in results:
            result["bit_equal"] = bool(torch.equal(measured["output"], results["eager_output"]))
    return result


def _measure(ctx: Context, components: dict[str, Any], release: Callable[[str], list[str]],
             inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Runs the stages in order, releasing after each; the peak of live weights at the stage boundaries."""
    live_peak = 0

    def live_bytes() -> int:
        total = 0
        for value in components.values():
            if is_lazy_module(value) and not value.is_materialized:
                continue
            real = value.materialize() if is_lazy_module(value) else value
            total += module_bytes(real)
        return total

    started = time.perf_counter()
    state: Any = None
    # no_grad, not inference_mode: loaders build parameters inside this scope, and inference tensors
    # would outlive it in the components that are kept.
    with torch.no_grad():
        for stage, _ in STAGES:
            state = _run_stage(stage, components, inputs, state)
            live_peak = max(live_peak, live_bytes())
            release(stage)
    if ctx.cuda:
        torch.cuda.synchronize()
    output = state.detach().to("cpu", copy=True)
    return {"wall_s": time.perf_counter() - started, "live_peak": live_peak, "output": output}


def _releaser(components: dict[str, Any]) -> Callable[[str], list[str]]:
    schedule = ReleaseSchedule.from_stages(STAGES)
    return lambda stage: schedule.release_after(stage, components)


def _inputs(specs: dict[str, StackSpec], device: torch.device) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device=device)
    generator.manual_seed(5)
    return {name: torch.randn(1, spec.tokens, spec.d, device=device, dtype=DTYPE, generator=generator)
            for name, spec in specs.items()}


def _run_stage(stage: str, components: dict[str, Any], inputs: dict[str, torch.Tensor], state: Any) -> torch.Tensor:
    if stage == "encode":
        return components["text_encoder"](inputs["text_encoder"])
    if stage == "denoise":
        latents = inputs["transformer"] + state.float().mean().to(DTYPE)
        for _ in range(DENOISE_STEPS):
            latents = components["transformer"](latents)
        return latents
    if stage == "decode":
        return components["vae"](inputs["vae"] + state.float().mean().to(DTYPE))
    raise ValueError(stage)
