"""ext given the device memory a faster peer took: the models section's like-for-like answer to a peer that wins.

A peer can beat ext with default settings by holding more device memory: FastVideo allocates each prefetched
block afresh and frees it with ``record_stream``, so in a loop that reads nothing back it holds as many blocks
as the host is ahead, where ext holds its k+1 slots whatever the host does. Where a peer was faster than the ext
configuration that offloads the same lists, the section measures what the peer held and gives ext that much as a
``device_budget``:

- the peer's **footprint**: what its set-up and checks left allocated (the modules it keeps on the device, any
  buffers of its own), measured with the allocator's cache emptied, plus its steady reserve
  (``utils.steady_reserve``: the peak over forwards run back to back, which counts blocks freed on the host while
  the device still used them);
- the **budget**: that footprint less the bytes of the modules both keep resident (everything outside the lists
  they offload), so the budget pays for what ``device_budget`` counts (resident blocks, slots, activations);
- ``plan_offload`` on the cost table of the same run (the block clock's per-block compute of the offloaded
  lists, the rest of the step as ``other_ms``, peak H2D, and as the activations the resident model's steady
  reserve: the footprint counts what the allocator reserved, which is more than the allocated peak) picks which blocks stay resident
  and the depth, and the plan runs in interleaved rounds with the resident model, the peer and ext with default
  settings. Its footprint is measured the same way, so the row shows that ext stayed within what the peer took.

This module holds the arithmetic and the row's figures; ``benchmarks/models.py`` builds and times.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.interleave import Interleaved
from benchmarks.model_budget import block_costs
from benchmarks.model_rows import floors, peer_verdict, ratio
from benchmarks.utils import GB
from fastoffload_ext.planning import BlockCosts

__all__ = ["backend_name", "budget_from", "costs_for", "least_ext_bytes", "peer_was_faster", "row_values"]


def backend_name(peer: str) -> str:
    return f"ext, {peer}'s memory"


def peer_was_faster(result: Interleaved, peer_key: str, ext_key: str) -> bool:
    """The peer's per-round ratio to ext says it was faster (``model_rows.peer_verdict``, ties excluded)."""
    per_round = result.ratios(peer_key, ext_key)
    return peer_verdict(float(statistics.median(per_round)), max(per_round)) == "faster"


def budget_from(persistent: int, reserve: int, kept_bytes: int) -> int:
    """The peer's device footprint (``persistent`` + ``reserve``) less the modules both keep on the device."""
    return persistent + reserve - kept_bytes


def least_ext_bytes(prefetch_depth: int, largest_block: int, activation_bytes: int) -> int:
    """What ext with default settings needs beyond the modules it keeps resident: k+1 slots and the activations."""
    return (prefetch_depth + 1) * largest_block + activation_bytes


def costs_for(block_ms: Sequence[float], step_ms: float, lists: Sequence[str], list_sizes: dict[str, int],
              offloaded: Sequence[str], blocks: Sequence[Any], h2d_gbps: float, activation_bytes: int) -> BlockCosts:
    """The planner's table for the ``offloaded`` lists: their blocks' compute (``block_ms`` holds every block of
    ``lists`` in order, ``list_sizes`` their lengths), the rest of the step as ``other_ms``; ``blocks`` are the
    offloaded blocks themselves (their bytes)."""
    chosen: list[float] = []
    start = 0
    for name in lists:
        if name in offloaded:
            chosen.extend(block_ms[start:start + list_sizes[name]])
        start += list_sizes[name]
    if len(chosen) != len(blocks):
        raise ValueError(f"{len(chosen)} block times for {len(blocks)} offloaded blocks")
    return block_costs(blocks, chosen, step_ms - sum(chosen), h2d_gbps, activation_bytes)


def row_values(result: Interleaved, name: str, peer: str, label: str, ext_name: str, transfer: float | None,
               figures: dict[str, Any]) -> dict[str, Any]:
    """The row of ext under the peer's memory: against resident, its floor, ext with default settings and the peer
    (``x peer``), round by round. ``figures``: budget, both footprints, the plan, bit-equality."""
    resident = result.rounds[f"resident|{label}"]
    peer_key = f"{peer}|{label}"
    x_peer, peer_range = ratio(result.ratios(name, peer_key))
    # The verdict reads the peer against this row, as a peer's row reads it against ext.
    peer_over_row = result.ratios(peer_key, name)
    verdict = peer_verdict(float(statistics.median(peer_over_row)), max(peer_over_row))
    values: dict[str, Any] = {
        "ms": result.median_ms(name), "spread": result.spread(name), "x_resident": result.ratio(name, f"resident|{label}"),
        "x_ext": result.ratio(name, f"{ext_name}|{label}"), "vs_ext": ext_name, "peer": peer, "x_peer": x_peer,
        "x_peer_range": peer_range, "bit_equal": figures["bit_equal"], "pass": verdict != "faster",
        "mem_ok": figures["footprint"] <= figures["peer_footprint"]}
    if transfer:
        values["x_floor"], values["range"] = ratio([m / f for m, f in zip(result.rounds[name],
                                                                          floors(resident, transfer))])
    plan = figures["plan"]
    values["note"] = (
        f"device_budget {figures['budget'] / GB:.2f} GB: what {peer} held on the device ({figures['peer_footprint'] / GB:.2f} GB "
        f"at its steady peak) less the {figures['kept'] / GB:.2f} GB both keep resident; plan_offload on this run's "
        f"per-block compute keeps {len(plan.resident)} block(s) resident ({', '.join(map(str, plan.resident)) or 'none'}), "
        f"depth {plan.prefetch_depth}, predicted {plan.predicted_step_ms:.1f} ms; this row held "
        f"{figures['footprint'] / GB:.2f} GB; ran {x_peer:.3f}x {peer} {peer_range} and "
        f"{values['x_ext']:.3f}x {ext_name} in the same rounds")
    return values

