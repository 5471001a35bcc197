"""Section 4, overhead: host-side cost per block per step vs parameters per block.

What is timed is exactly the per-block work of one step, with no compute around it: for every block
of an L-block model, ``hook.pre_forward(block)`` (acquire its weights, issue the prefetch of the next
block) then ``hook.post_forward(block, None)`` (release). The loop is timed with
``torch.utils.benchmark.Timer`` on a host clock (``benchmarks.utils.time_host_runs_ns``); device work
it queues is drained after each timed run, outside the clock, so the figure is what the Python thread pays — the cost that, on W3, decides whether the
copy or the CPU sets the pace. docs/DESIGN.md ("Workloads and targets"): <= 20 us + 0.3 us per parameter.

Three figures per row, timed in interleaved rounds in one process (``benchmarks/interleave.py``; host
speed drifts): ``us/block`` is the hook's entry points called directly as above; ``call us`` is the
block called the way a model calls it (``block(x)``: ``nn.Module.__call__``, the hook manager's
wrapper and its single-hook fast path, the forward, an identity here) less the same call on a block
with no offload, i.e. what offload adds to a model's step per block; ``general us`` is that call with
the fast path turned off for the row (the wrapper's general path, every hook through its
``pre_forward``/``post_forward``), so ``general / call`` is what the fast path saves. The spread beside
each is (slowest - fastest round) / median.

Parameter counts 4, 16, 64, 136 (a W3 block: 4 Linears x 2 + 64 LayerNorms x 2) and 512
(``--quick``: 4, 136, 512), each parameter a 128-byte bf16 tensor (the copy is not what is measured). On
the host the engine runs with ``device="cpu"``; on a GPU machine the same rows run on CUDA too.

The second table (``benchmarks/block_cost.py``) is the same cost inside whole forwards of real blocks,
offloaded against resident, with the copy separated from the fixed cost.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks import block_cost
from benchmarks.interleave import run_interleaved
from benchmarks.utils import Column, Context, Table, median, time_host_runs_ns
from fastoffload_ext import ModuleHookManager, disable_layerwise_offload, enable_layerwise_offload

TITLE = "overhead: host cost per block per step (acquire + prefetch issue + release)"

TABLES = {
    "overhead": Table(
        title="Host cost per block per step, us (pre_forward + post_forward; median); target 20 us + 0.3 us/param",
        columns=[
            Column("device", "device"),
            Column("backend", "backend"),
            Column("params", "params", "d"),
            Column("us_per_block", "us/block", ".2f"),
            Column("call_us", "call us", ".2f"),
            Column("call_spread", "spread", ".0%"),
            Column("general_us", "general us", ".2f"),
            Column("general_spread", "spread", ".0%"),
            Column("x_general", "general/call", ".2f"),
            Column("us_per_param", "us/param", ".3f"),
            Column("target_us", "target us", ".1f"),
            Column("x_target", "x target", ".2f"),
            Column("pass", "pass"),
        ],
    ),
    **block_cost.TABLES,
}

PARAM_COUNTS = (4, 16, 64, 136, 512)
QUICK_PARAM_COUNTS = (4, 136, 512)
NUM_BLOCKS = 8
# 128 bytes of bf16 each: with device="cpu" the engine's "copy" is a synchronous memcpy inside the
# timed loop, so parameters are kept small enough that the figure is the per-block work, not memcpy.
ELEMENTS_PER_PARAM = 64


class ParamBlock(nn.Module):
    def __init__(self, num_params: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(ELEMENTS_PER_PARAM, dtype=torch.bfloat16), requires_grad=False)
            for _ in range(num_params))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ParamStack(nn.Module):
    def __init__(self, num_params: int, num_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ParamBlock(num_params) for _ in range(num_blocks))


def target_us(params: int) -> float:
    return 20.0 + 0.3 * params


def _steps_for(step: Callable[[], None], drain: Callable[[], None], run_seconds: float) -> int:
    """Steps per timed run so that one run lasts about ``run_seconds``."""
    one = max(time_host_runs_ns(step, number=1, runs=1, between=drain)[0] / 1e9, 1e-6)
    return max(1, min(10_000, int(run_seconds / one)))


def call_paths(blocks: list[nn.Module], hooks: list[Any], plain: list[nn.Module], drain: Callable[[], None],
               run_seconds: float, rounds: int) -> dict[str, Any]:
    """Per-block microseconds of ``block(x)`` through the fast path and the general path, each less the
    same call on a block without offload, from interleaved rounds (median, and the rounds' spread)."""
    x = torch.zeros(1)
    points = [hook.eager_points for hook in hooks]

    def calls(modules: list[nn.Module]) -> Callable[[], None]:
        def step() -> None:
            for module in modules:
                module(x)
        return step

    def general() -> None:
        for hook in hooks:
            hook.eager_points = None  # the instance attribute hides the pair: the wrapper's general path
        try:
            calls(blocks)()
        finally:
            for hook, pair in zip(hooks, points):
                hook.eager_points = pair

    steps = {"plain": calls(plain), "call": calls(blocks), "general": general}
    number = {name: _steps_for(step, drain, run_seconds) for name, step in steps.items()}
    result = run_interleaved({name: (lambda name=name, step=step: [
        ns / 1e3 / len(blocks) for ns in time_host_runs_ns(step, number=number[name], runs=1, between=drain)])
        for name, step in steps.items()}, rounds)
    plain_us = result.rounds["plain"]
    out: dict[str, Any] = {"plain_us": statistics.median(plain_us)}
    for name in ("call", "general"):
        added = [value - base for value, base in zip(result.rounds[name], plain_us)]
        middle = statistics.median(added)
        out[f"{name}_us"] = middle
        out[f"{name}_spread"] = (max(added) - min(added)) / middle if middle > 0 else None
        out[f"{name}_rounds_us"] = added
    out["x_general"] = out["general_us"] / out["call_us"] if out["call_us"] > 0 else None
    return out


def run(ctx: Context) -> None:
    enable, disable, manager_class = enable_layerwise_offload, disable_layerwise_offload, ModuleHookManager
    devices = [torch.device("cpu")]
    if ctx.cuda:
        devices.append(ctx.device)
    else:
        ctx.note("no CUDA device: host cost measured with device='cpu' only")
    counts = QUICK_PARAM_COUNTS if ctx.quick else PARAM_COUNTS
    ctx.progress.add(len(devices) * 2 * len(counts))
    run_seconds = 0.02 if ctx.quick else 0.1
    repeats = ctx.iters(7, quick=5)

    for device in devices:
        for backend in ("ext", "python"):
            for params in counts:
                labels = {"device": device.type, "backend": backend, "params": params}
                holder: dict[str, Any] = {}

                def row(device: torch.device = device, backend: str = backend, params: int = params,
                        holder: dict[str, Any] = holder) -> dict[str, Any]:
                    model = ParamStack(params, NUM_BLOCKS)
                    holder["model"] = model
                    group = enable(model, backend=backend, device=device, prefetch_depth=ctx.options.prefetch_depth)
                    if group is None:
                        raise RuntimeError("enable_layerwise_offload returned None")
                    holder["group"] = group
                    blocks = list(model.blocks)
                    hooks = [manager_class.get_from(block).get_forward_hook("LayerwiseOffloadHook") for block in blocks]
                    pairs = list(zip(blocks, hooks))

                    def step() -> None:
                        for block, hook in pairs:
                            hook.pre_forward(block)
                            hook.post_forward(block, None)

                    def drain() -> None:
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)

                    with torch.inference_mode():
                        for _ in range(3):
                            step()
                        drain()
                        steps = _steps_for(step, drain, run_seconds)
                        per_step_ns = time_host_runs_ns(step, number=steps, runs=repeats, between=drain)
                        per_block_ns = [ns / len(blocks) for ns in per_step_ns]
                        plain = list(ParamStack(params, NUM_BLOCKS).blocks)
                        paths = call_paths(blocks, hooks, plain, drain, run_seconds / 2, repeats)
                    us = median(per_block_ns) / 1e3
                    target = target_us(params)
                    stats = dict(group.stats())
                    return {"us_per_block": us, "us_per_param": us / params, "target_us": target,
                            "x_target": us / target, "pass": us <= target, "steps_per_run": steps,
                            "runs_us": [v / 1e3 for v in per_block_ns], **paths, "stats": stats}

                def cleanup(holder: dict[str, Any] = holder) -> None:
                    model, group = holder.pop("model", None), holder.pop("group", None)
                    if model is not None and group is not None:
                        disable(model)

                ctx.run_row("overhead", labels, row, cleanup=cleanup)
    block_cost.run(ctx, devices)
