"""The figures of the models section's rows, from one model's interleaved rounds, and its summary lines.

Each offloader is held to the floor of what it moves: max(resident, its offloaded bytes / peak H2D),
round by round. ext runs once per block-list selection (``ext``: default settings, FastVideo's rule
of the first list only; ``ext all lists``: ``block_lists="all"``), and every peer is compared with the
ext configuration that offloads the same lists (the ``vs ext`` column). An ext row also carries the
depth-k schedule bound (``benchmarks/schedule_bound.py``): where the floor is missed because that
bound is above it, the note says so.
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.interleave import Interleaved
from benchmarks.utils import GB, MiB

EXT_TARGET = 1.05  # x floor, eager, default settings
# x floor on the rows where host work, not the copy, set the pace (Flux 1024 tokens with the first list,
# Wan-1.3B at 4096): at most 1.02x resident, or 1.02x the floor where the transfer floor is higher.
TIGHT_TARGET = 1.02
# A peer whose per-round ratio to ext has its median within this band below 1.0, and which ext matched or beat in
# at least one round, is tied with ext rather than faster: host speed drifts by more than that between the rounds
# of one process (docs/DESIGN.md, "Measuring on a noisy host"). A peer faster in every round is faster.
TIE_BAND = 0.02


def peer_verdict(x_ext: float, x_ext_max: float) -> str:
    """``"slower"``, ``"tied"`` or ``"faster"``: the peer against ext, from the median and the highest of its
    per-round ratios (peer ms / ext ms)."""
    if x_ext > 1.0:
        return "slower"
    return "tied" if x_ext >= 1.0 - TIE_BAND and x_ext_max >= 1.0 else "faster"


@dataclass
class ExtConfig:
    """One ext configuration of a model: which lists it offloads and what it measured before the rounds."""

    name: str  # the rows' backend: "ext" or "ext all lists"
    lists: list[str]
    kwargs: dict[str, Any]
    offloaded_bytes: int = 0
    largest_block: int = 0
    peak: dict[str, int] = field(default_factory=dict)
    equal: dict[str, bool] = field(default_factory=dict)

    @property
    def floor_name(self) -> str:
        return "floor" + self.name[len("ext"):]


def ratio(values: Sequence[float]) -> tuple[float, str]:
    """Median of per-round ratios and their range as text."""
    return float(statistics.median(values)), f"[{min(values):.3f}, {max(values):.3f}]"


def floors(resident: Sequence[float], transfer_ms: float) -> list[float]:
    return [max(r, transfer_ms) for r in resident]


def transfer_ms(nbytes: int, peak_gbps: float | None) -> float | None:
    return nbytes / (peak_gbps * GB) * 1e3 if peak_gbps else None


def matching_config(configs: Sequence[ExtConfig], parts: frozenset[str]) -> ExtConfig:
    """The ext configuration whose lists differ least from the block lists a peer offloads (ties: the wider)."""
    lists = {part for part in parts if any(part in config.lists for config in configs)}
    return min(reversed(configs), key=lambda config: len(lists.symmetric_difference(config.lists)))


def floor_row(config: ExtConfig, resident: Sequence[float], transfer: float, peak_gbps: float) -> dict[str, Any]:
    return {"ms": float(statistics.median(floors(resident, transfer))), "x_floor": 1.0,
            "note": f"max(resident, {config.offloaded_bytes / GB:.2f} GB ({', '.join(config.lists)}) / "
                    f"{peak_gbps:.1f} GB/s = {transfer:.1f} ms)"}


def bound_figures(ext: Sequence[float], bounds: Sequence[float], floor_ms: float, x_floor: float,
                  slots: int) -> tuple[dict[str, Any], str | None]:
    """ext against the schedule bound, and the note when the bound explains a missed floor."""
    if not bounds or len(bounds) != len(ext):
        return {}, None
    bound = float(statistics.median(bounds))
    values = {"bound_ms": bound, "x_bound": ratio([e / b for e, b in zip(ext, bounds)])[0]}
    note = None
    if x_floor > EXT_TARGET and bound / floor_ms > EXT_TARGET:
        note = (f"the floor is out of reach with {slots} slots: the best schedule of these blocks (per-block compute "
                f"from CUDA events on the resident model, copies at peak H2D, copy i+k+1 issued when block i frees its slot) "
                f"is {bound:.1f} ms = {bound / floor_ms:.3f}x floor")
    return values, note


def peer_values(result: Interleaved, name: str, label: str, config: ExtConfig, peer_bytes: int,
                peak_gbps: float | None) -> dict[str, Any]:
    """A peer's figures in its session: against resident, its own floor and the matching ext configuration."""
    resident = result.rounds[f"resident|{label}"]
    values: dict[str, Any] = {"ms": result.median_ms(name), "spread": result.spread(name),
                              "x_resident": result.ratio(name, f"resident|{label}"), "vs_ext": config.name}
    per_round = result.ratios(name, f"{config.name}|{label}")
    x_ext, values["x_ext_range"] = ratio(per_round)
    values["x_ext"], values["x_ext_max"] = x_ext, max(per_round)
    values["pass"] = x_ext > 1.0  # the ext configuration that moves the same lists is faster (the summary names ties)
    transfer = transfer_ms(peer_bytes, peak_gbps)
    if transfer:
        values["x_floor"], values["range"] = ratio([p / f for p, f in zip(result.rounds[name],
                                                                          floors(resident, transfer))])
        leads, resident_leads = result.leads.get(name), result.leads.get(f"resident|{label}")
        if leads and resident_leads:  # its step after a readback, as for ext (benchmarks/steady.py)
            values["x_floor_readback"] = ratio([p / f for p, f in zip(leads, floors(resident_leads, transfer))])[0]
    return values


def reserve_values(reserves: Mapping[str, int], name: str, label: str,
                   block_bytes: int) -> tuple[dict[str, Any], str | None]:
    """``name``'s steady reserve at ``label`` (``utils.steady_reserve``) in MiB, and for an offloader a note with
    how far it is from the resident model's, in blocks of ``block_bytes``: what it holds on the device while the
    host runs ahead, beyond the activations both need."""
    own = reserves.get(f"{name}|{label}")
    if own is None:
        return {}, None
    values: dict[str, Any] = {"reserve_mib": own / MiB}
    resident = reserves.get(f"resident|{label}")
    if name == "resident" or resident is None or block_bytes <= 0:
        return values, None
    extra = own - resident
    return values, (f"steady reserve {own / MiB:.0f} MiB, {extra / MiB:+.0f} MiB against the resident model's "
                    f"({extra / block_bytes:+.1f} blocks of {block_bytes / MiB:.0f} MiB)")


def _ext_line(model: str, tokens: str, ext: dict[str, Any]) -> str:
    head = f"{model} {tokens}: {ext['backend']} {ext['ms']:.2f} ms"
    if ext.get("x_floor") is not None:
        target = ext.get("target") or EXT_TARGET
        verdict = "meets" if ext["x_floor"] <= target else "MISSES"
        head += f" = {ext['x_floor']:.3f}x floor {ext.get('range', '')} ({verdict} <={target:.2f}x)"
    if ext.get("x_loaded_floor") is not None:
        head += f", {ext['x_loaded_floor']:.3f}x the floor with copies streaming"
    if ext.get("x_link_floor") is not None:
        head += f", {ext['x_link_floor']:.3f}x the floor at each round's link"
    if ext.get("x_floor_readback") is not None:
        head += f", {ext['x_floor_readback']:.3f}x the floor after a readback"
    if ext.get("x_bound") is not None:
        head += f", {ext['x_bound']:.3f}x schedule bound {ext['bound_ms']:.1f} ms"
        target = ext.get("target") or EXT_TARGET
        if ext.get("x_floor", 0) > target and ext["bound_ms"] > target * ext["ms"] / ext["x_floor"]:
            head += " (the bound is above the floor target)"
    if ext.get("bit_equal") is False:
        head += ", NOT bit-equal"
    return head


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    """Per model, token count and ext configuration: ext against its floor and schedule bound, and the fastest
    peer compared with that configuration, with its ratio."""
    lines = []
    keys = list(dict.fromkeys((row.get("model"), row.get("tokens")) for row in rows
                              if str(row.get("backend", "")).startswith("ext")))
    for model, tokens in keys:
        group = [row for row in rows if row.get("model") == model and row.get("tokens") == tokens]
        for ext in [row for row in group if str(row.get("backend", "")).startswith("ext") and row.get("ms")]:
            lines.append(_ext_line(str(model), str(tokens), ext))
            # Peers only: a budgeted ext row names its configuration in "vs ext" too.
            ran = [row for row in group if row.get("vs_ext") == ext["backend"] and row.get("ms")
                   and not str(row.get("backend", "")).startswith("ext")]
            if not ran:
                continue
            # The fastest by the per-round ratio to ext, the figure the verdict reads (medians of ms come from
            # different rounds).
            best = min(ran, key=lambda row: (row.get("x_ext", float("inf")), row["ms"]))
            exact = "" if best.get("bit_equal") is not False else ", not bit-equal"
            verdicts = {row["backend"]: peer_verdict(row.get("x_ext", 0.0), row.get("x_ext_max", row.get("x_ext", 0.0)))
                        for row in ran}
            tied = [name for name, verdict in verdicts.items() if verdict == "tied"]
            if any(verdict == "faster" for verdict in verdicts.values()):
                answer = "NO"
            elif tied:
                answer = f"tied with {', '.join(tied)} (within {TIE_BAND:.0%}, and ext as fast in some rounds)"
            else:
                answer = "yes"
            lines.append(f"{model} {tokens}: fastest peer vs {ext['backend']}: {best['backend']} {best['ms']:.2f} ms"
                         f"{exact}, {best.get('x_ext', float('nan')):.3f}x {ext['backend']} {best.get('x_ext_range', '')}; "
                         f"{ext['backend']} faster than every peer offloading the same lists: {answer}"
                         + _matched_clause(group, ext["backend"], str(best["backend"])))
    return lines


def _matched_clause(rows: Sequence[dict[str, Any]], ext_backend: str, peer: str) -> str:
    """"; given <peer>'s device memory, ext ran X x it" where the section ran ext under what that peer held
    (``benchmarks/matched_memory.py``), else ""."""
    for row in rows:
        if row.get("peer") == peer and row.get("vs_ext") == ext_backend and row.get("x_peer") is not None:
            return (f"; given {peer}'s device memory, ext ran {row['x_peer']:.3f}x {peer} "
                    f"{row.get('x_peer_range', '')}")
    return ""
