"""The overhead section's second table: what offload adds to a model's step, per offloaded block.

The first table times the hook's entry points on blocks whose forward is an identity. This one times
whole forwards of a block stack, resident and offloaded, with real blocks: the W3 block of
docs/DESIGN.md, "Workloads and targets" (4 Linears and 64 LayerNorms, 136 parameters) and a 4-parameter
block (one Linear, one LayerNorm). Both stacks are alive at once and timed in interleaved rounds
(``benchmarks/interleave.py``), so ``added us`` (offloaded minus resident, per block, round by round)
and ``x resident`` (the per-round ratio) are measured where the host ran at the same speed for both.

Each shape runs at two widths (on a GPU a third, W3's own d=1024). At d=64 (the W3-cpu size) a block's weights are ~116 KB; at d=4 they
are a few hundred bytes, so the copy (a memcpy with ``device="cpu"``) costs nothing and ``added us`` is
the fixed cost: the hook manager's dispatch, the hook, the state and the engine's per-parameter work.
The difference between the two widths is the copy. On a CUDA machine the rows run on the device too,
with each run's device work drained off the clock.

The clock is the Python thread's CPU time (``time.thread_time``): the host cost of a step, which is
what decides a launch-bound step such as W3's, without the moments other processes of a shared host
took the core (on a 2-core machine shared by several jobs, wall-clock rounds of the same step differ
by more than the whole effect measured here). No step waits for the device inside the clock, so
nothing the host pays is missed; the time the device itself needs is not what this table is about.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.interleave import run_interleaved
from benchmarks.utils import Column, Context, Table, time_host_runs_ns
from benchmarks.workloads import Block, init_weights_
from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload

TABLE = "block_cost"
TABLES = {
    TABLE: Table(
        title="Offload's added host cost per block in a forward (offloaded - resident, thread CPU time, interleaved "
              "rounds; median)",
        columns=[
            Column("device", "device"),
            Column("backend", "backend"),
            Column("shape", "block"),
            Column("params", "params", "d"),
            Column("d", "d", "d"),
            Column("resident_us", "resident us/block", ".2f"),
            Column("added_us", "added us/block", ".2f"),
            Column("added_spread", "spread", ".0%"),
            Column("x_resident", "x resident", ".3f"),
            Column("x_resident_min", "min", ".3f"),
            Column("x_resident_max", "max", ".3f"),
            Column("bit_equal", "bit-equal"),
        ],
    ),
}

NUM_BLOCKS = 16
WIDTHS = (4, 64)
# On a GPU also W3's own width: 25 MB a block, copied asynchronously, so the host cost should not move.
CUDA_WIDTHS = (4, 64, 1024)
TOKENS = 4
RUNS_PER_ROUND = 5
CLOCK = time.thread_time


class SmallBlock(nn.Module):
    """Four parameters: the fewest a block with a matmul and a norm has."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.linear(x))


class Stack(nn.Module):
    def __init__(self, make: Callable[[], nn.Module], num_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(make() for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


SHAPES: dict[str, Callable[[int], nn.Module]] = {
    "W3 (64 norms)": lambda d: Block(d, 64),
    "linear+norm": SmallBlock,
}


def build_pair(shape: str, d: int, device: torch.device) -> tuple[nn.Module, nn.Module]:
    """Two identical bf16 stacks on ``device``: one stays resident, the caller offloads the other."""
    make = SHAPES[shape]
    resident = init_weights_(Stack(lambda: make(d), NUM_BLOCKS).to(torch.bfloat16), seed=0).eval()
    offloaded = Stack(lambda: make(d), NUM_BLOCKS).to(torch.bfloat16).eval()
    offloaded.load_state_dict(resident.state_dict())
    return resident.to(device), offloaded.to(device)


def compare(steps: dict[str, Callable[[], None]], drain: Callable[[], None], run_seconds: float,
            rounds: int, runs: int = RUNS_PER_ROUND) -> dict[str, Any]:
    """Per-block host microseconds of each step in interleaved rounds; "offloaded" against "resident".

    A round keeps the median of ``runs`` short runs per step: another process taking the core for a
    moment spoils one run, not the round."""
    one = max(time_host_runs_ns(steps["resident"], number=1, runs=1, between=drain, clock=CLOCK)[0] / 1e9, 1e-6)
    number = max(1, min(2_000, int(run_seconds / runs / one)))
    result = run_interleaved({name: (lambda step=step: [
        ns / 1e3 / NUM_BLOCKS for ns in time_host_runs_ns(step, number=number, runs=runs, between=drain, clock=CLOCK)])
        for name, step in steps.items()}, rounds)
    resident, offloaded = result.rounds["resident"], result.rounds["offloaded"]
    added = [b - a for a, b in zip(resident, offloaded)]
    middle = statistics.median(added)
    low, high = result.ratio_spread("offloaded", "resident")
    return {"resident_us": statistics.median(resident), "added_us": middle,
            "added_spread": (max(added) - min(added)) / middle if middle > 0 else None,
            "x_resident": result.ratio("offloaded", "resident"), "x_resident_min": low, "x_resident_max": high,
            "added_rounds_us": added, "resident_rounds_us": list(resident), "steps_per_run": number}


def run(ctx: Context, devices: list[torch.device]) -> None:
    widths = {device: CUDA_WIDTHS if device.type == "cuda" else WIDTHS for device in devices}
    ctx.progress.add(sum(2 * len(SHAPES) * len(w) for w in widths.values()))
    run_seconds = 0.02 if ctx.quick else 0.04
    rounds = ctx.iters(21, quick=9)
    for device in devices:
        for backend in ("ext", "python"):
            for shape in SHAPES:
                for d in widths[device]:
                    _row(ctx, device, backend, shape, d, run_seconds, rounds)


def _row(ctx: Context, device: torch.device, backend: str, shape: str, d: int, run_seconds: float,
         rounds: int) -> None:
    labels = {"device": device.type, "backend": backend, "shape": shape, "d": d}
    holder: dict[str, nn.Module] = {}

    def row() -> dict[str, Any]:
        resident, offloaded = build_pair(shape, d, device)
        holder["model"] = offloaded
        enable_layerwise_offload(offloaded, backend=backend, device=device, prefetch_depth=ctx.options.prefetch_depth)
        x = torch.randn(1, TOKENS, d, dtype=torch.bfloat16, device=device)

        def drain() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        with torch.inference_mode():
            bit_equal = all(torch.equal(resident(x), offloaded(x)) for _ in range(2))
            figures = compare({"resident": lambda: resident(x), "offloaded": lambda: offloaded(x)}, drain,
                              run_seconds, rounds)
        params = sum(1 for _ in offloaded.blocks[0].parameters())
        return {"params": params, "bit_equal": bit_equal, **figures}

    def cleanup() -> None:
        model = holder.pop("model", None)
        if model is not None:
            disable_layerwise_offload(model)

    ctx.run_row(TABLE, labels, row, cleanup=cleanup)
