"""Section training: a training step through frozen offloaded blocks under activation checkpointing.

LoRA and adapter training on a model larger than the device keeps the blocks' own weights frozen and
offloaded, and checkpoints each block (diffusers' ``enable_gradient_checkpointing``): the forward saves
only each block's input, and backward runs every block again, last first, before its gradient. So a step
copies every offloaded block twice, once per direction, less the blocks still in a slot where the direction
turns, and the floor is max(the resident model's step, twice the offloaded bytes at the run's peak H2D).

Configurations, timed in interleaved rounds in one process (``benchmarks/interleave.py``):
- ``resident``: every weight on the device;
- ``ext``: the default offload; in backward each block prefetches the one before it, and a training forward
  copies nothing for the next step (the blocks it leaves in the slots are the ones backward runs first, and
  the ones backward leaves are the next forward's first), so a step copies 2 x (blocks - slots) blocks;
- ``ext, forward targets in backward``: the same offload with the forward's targets everywhere, which is what
  the hooks did before they knew the direction (each block then loads on demand in backward, and the copies
  meant for the forward's next block are wasted);
- ``ext, reentrant checkpoint``: ``ext`` with each block under reentrant ``torch.utils.checkpoint``, whose
  forward runs under ``no_grad`` (a training step's all the same: the hooks tell it by the backward pass before).

Each row checks the input's gradient against the resident model's, bit for bit, and gives the device
memory a step needs above what was allocated before it (the resident model's weights count there only for
``resident``: they are allocated before the step).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from benchmarks.interleave import Interleaved, run_interleaved
from benchmarks.utils import (GB, MiB, Column, Context, Table, device_allocated, device_peak, free_memory, module_bytes,
                              reset_device_peak)
from benchmarks.workloads import DTYPE, WORKLOADS, StackSpec, build_stack, build_stack_on_host
from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload

TITLE = "training: a step through frozen offloaded blocks under activation checkpointing"

TABLES = {
    "training": Table(
        title="Training step (checkpointed blocks, gradient to the input): ms, x floor, x resident",
        columns=[
            Column("workload", "workload"),
            Column("config", "config"),
            Column("ms", "ms", ".2f"),
            Column("x_floor", "x floor", ".3f"),
            Column("x_floor_range", "[rounds]"),
            Column("x_resident", "x resident", ".3f"),
            Column("step_mib", "step MiB", ".0f"),
            Column("sync_loads", "sync loads/step", ".1f"),
            Column("copies", "copies/step", ".1f"),
            Column("bit_equal", "= resident"),
        ],
    ),
}

KEYS = ("W1", "W4")
ROUNDS = {"full": 7, "quick": 5}
# On a host without a GPU (bf16 there may run without hardware support): W1 only, in two short rounds, which show
# the copy and load counts; its times are no measure of anything.
HOST_SPECS = (StackSpec("W1-cpu", d=128, blocks=16, tokens=16, n_norms=4, character="transfer-bound (scaled)"),)
HOST_ROUNDS = 2
RESIDENT = "resident"
EXT = "ext"
EXT_BEFORE = "ext, forward targets in backward"
EXT_REENTRANT = "ext, reentrant checkpoint"


class Checkpointed(nn.Module):
    """``model``'s blocks, each under ``torch.utils.checkpoint``: non-reentrant (what diffusers uses) unless
    ``reentrant``."""

    def __init__(self, model: nn.Module, reentrant: bool = False) -> None:
        super().__init__()
        self.blocks = model.blocks
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


def _input(spec: StackSpec, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device)
    generator.manual_seed(2000)
    return torch.randn(1, spec.tokens, spec.d, device=device, dtype=DTYPE, generator=generator)


def _step(model: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        latents = x.detach().clone().requires_grad_(True)
        model(latents).float().square().mean().backward()
        return latents.grad
    return step


def run(ctx: Context) -> None:
    from benchmarks.forward import peak_h2d_gbps

    peak = peak_h2d_gbps(ctx)
    specs = [WORKLOADS[key] for key in KEYS] if ctx.cuda else list(HOST_SPECS)
    ctx.progress.add(len(specs) * 5)
    for spec in specs:
        try:
            _workload(ctx, spec, peak)
        finally:
            free_memory()
    ctx.note("floor: max(resident step, 2 x offloaded bytes / peak H2D): backward runs every checkpointed block again, "
             "so each is copied twice a step; step MiB: device memory a step allocates above what was there before it")


def _workload(ctx: Context, spec: StackSpec, peak: float | None) -> None:
    device = ctx.device
    x = _input(spec, device)
    resident = Checkpointed(build_stack(spec, device).requires_grad_(False))
    host = build_stack_on_host(spec).requires_grad_(False)
    offloaded_bytes = sum(module_bytes(block) for block in host.blocks)  # before enable leaves placeholders there
    offloaded = Checkpointed(host)
    before = Checkpointed(build_stack_on_host(spec).requires_grad_(False))
    reentrant = Checkpointed(build_stack_on_host(spec).requires_grad_(False), reentrant=True)
    groups = {}
    for name, model in ((EXT, offloaded), (EXT_BEFORE, before), (EXT_REENTRANT, reentrant)):
        groups[name] = enable_layerwise_offload(model, device=device, prefetch_depth=ctx.options.prefetch_depth)
    for state in groups[EXT_BEFORE].states:  # the hooks' targets before they knew a step trains
        state.backward_targets, state.training_targets = list(state.prefetch_targets), None
        state.release_wraps = False
    steps = {RESIDENT: _step(resident, x), EXT: _step(offloaded, x), EXT_BEFORE: _step(before, x),
             EXT_REENTRANT: _step(reentrant, x)}
    try:
        reference = steps[RESIDENT]()
        checks = {name: bool(torch.equal(step(), reference)) for name, step in steps.items()}
        memory = {name: _step_bytes(ctx, step) for name, step in steps.items()}
        counts = {name: _counts(group, steps[name]) for name, group in groups.items()}
        iters = ctx.iters(5, quick=3) if ctx.cuda else 1
        rounds = ROUNDS["quick" if ctx.quick else "full"] if ctx.cuda else HOST_ROUNDS
        timed = run_interleaved({name: _timer(ctx, step, iters) for name, step in steps.items()}, rounds)
        # And a step after the timed ones (docs/DESIGN.md, "Measuring"): a prefetch racing the step that reads it
        # spares the first step, whose first block loaded synchronously.
        checks = {name: checks[name] and bool(torch.equal(step(), reference)) for name, step in steps.items()}
        transfer_ms = 2 * offloaded_bytes / (peak * GB) * 1e3 if (ctx.cuda and peak) else None
        floor_rounds = [max(r, transfer_ms or 0.0) for r in timed.rounds[RESIDENT]]
        for name in steps:
            ctx.run_row("training", {"workload": spec.name, "config": name},
                        lambda name=name: {**_row(ctx, timed, name, floor_rounds, checks[name], memory[name],
                                                  counts.get(name)), "offloaded_mib": offloaded_bytes / MiB})
        if transfer_ms is None:
            ctx.skip("training", {"workload": spec.name, "config": "floor"}, "needs a CUDA device and the peak H2D")
        else:
            ctx.run_row("training", {"workload": spec.name, "config": "floor"},
                        lambda: {"ms": max(timed.median_ms(RESIDENT), transfer_ms), "x_floor": 1.0,
                                 "note": f"max(resident, 2 x {offloaded_bytes / GB:.2f} GB / {peak:.1f} GB/s = "
                                         f"{transfer_ms:.2f} ms)"})
    finally:
        for model in (offloaded, before, reentrant):
            disable_layerwise_offload(model, device="cpu")


def _row(ctx: Context, timed: Interleaved, name: str, floor_rounds: list[float], equal: bool,
         step_bytes: int | None, counts: dict[str, float] | None) -> dict[str, Any]:
    mine = timed.rounds[name]
    row: dict[str, Any] = {"ms": timed.median_ms(name), "x_resident": timed.ratio(name, RESIDENT),
                           "spread": timed.spread(name), "bit_equal": equal, "rounds_ms": list(mine)}
    if ctx.cuda:
        ratios = sorted(m / f for m, f in zip(mine, floor_rounds))
        row["x_floor"] = ratios[len(ratios) // 2]
        row["x_floor_range"] = f"[{ratios[0]:.3f}, {ratios[-1]:.3f}]"
    if step_bytes is not None:
        row["step_mib"] = step_bytes / MiB
    if counts is not None:
        row.update(counts)
    return row


def _timer(ctx: Context, step: Callable[[], Any], iters: int) -> Callable[[], list[float]]:
    return lambda: ctx.time_ms(step, warmup=1, iters=iters)


def _step_bytes(ctx: Context, step: Callable[[], Any]) -> int | None:
    """Device bytes one step allocates at its peak above what was allocated before it (CUDA only)."""
    if not ctx.cuda:
        return None
    free_memory()
    base = device_allocated(ctx)
    reset_device_peak(ctx)
    step()
    return device_peak(ctx) - base


def _counts(group: Any, step: Callable[[], Any]) -> dict[str, float]:
    """Synchronous loads and copies over three steps (the ext engine's counters), per step."""
    before = group.stats()
    for _ in range(3):
        step()
    after = group.stats()
    return {key: (after[key] - before[key]) / 3 for key in ("sync_loads", "copies")}


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for row in rows:
        if row.get("config") in (EXT, EXT_BEFORE, EXT_REENTRANT) and row.get("ms") is not None:
            floor = f"{row['x_floor']:.3f}x floor {row.get('x_floor_range', '')}, " if row.get("x_floor") else ""
            lines.append(f"training {row['workload']} {row['config']}: {row['ms']:.2f} ms = {floor}"
                         f"{row['x_resident']:.3f}x resident; gradient bit-equal "
                         f"{'PASS' if row.get('bit_equal') else 'FAIL'}")
    return lines
