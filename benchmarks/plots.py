"""PNG plots for people: bandwidth vs size, forward time per workload with its floor, host overhead.

Each function takes the section's result dict (as stored in results.json) and returns the written
path, or None when the section has nothing to plot. matplotlib is optional; ``run.py`` says when it
is missing.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any


def _pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _rows(section: dict[str, Any], table: str) -> list[dict[str, Any]]:
    return [row for row in section.get("tables", {}).get(table, []) if not row.get("error") and not row.get("skipped")]


def _save(plt: Any, figure: Any, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _label_log2_axes(axis: Any, ticks: Sequence[Any], tick_labels: list[str], xlabel: str, ylabel: str,
                     title: str) -> None:
    """A log2 x axis ticked at ``ticks``, the labels and title, a light grid and the legend."""
    axis.set_xscale("log", base=2)
    axis.set_xticks(ticks)
    axis.set_xticklabels(tick_labels)
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)


def plot_bandwidth(section: dict[str, Any], out_dir: str) -> str | None:
    from benchmarks.bandwidth import D2H, SOURCES
    rows = [row for row in _rows(section, "copy") if row.get("bytes")]
    if not rows:
        return None
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(8, 5))
    sizes = [row["bytes"] / 2**20 for row in rows]
    for key, label in SOURCES + D2H:
        values = [row.get(key) for row in rows]
        if any(v is not None for v in values):
            axis.plot(sizes, [v if v is not None else float("nan") for v in values], marker="o",
                      linestyle="--" if key.startswith("d2h") else "-", label=label)
    peak = section.get("meta", {}).get("peak_h2d_gbps")
    if peak:
        axis.axhline(peak, color="grey", linewidth=0.8, linestyle=":", label=f"peak {peak:.1f} GB/s")
    _label_log2_axes(axis, sizes, [f"{s:g}" for s in sizes], "copy size, MiB", "GB/s",
                     "Host <-> device copy bandwidth")
    return _save(plt, figure, out_dir, "bandwidth.png")


def plot_forward(section: dict[str, Any], out_dir: str) -> str | None:
    rows = [row for row in _rows(section, "forward") if row.get("ms") is not None]
    workloads = list(dict.fromkeys(row["workload"] for row in rows))
    if not workloads:
        return None
    plt = _pyplot()
    columns = min(len(workloads), 3)
    lines = (len(workloads) + columns - 1) // columns
    figure, axes = plt.subplots(lines, columns, figsize=(5 * columns, 3.8 * lines), squeeze=False)
    colors = {"resident": "#4c72b0", "ext": "#55a868", "python": "#c44e52", "diffusers": "#8172b2",
              "diffusers leaf": "#b3a2d9", "accelerate": "#ccb974"}
    for index, workload in enumerate(workloads):
        axis = axes[index // columns][index % columns]
        mine = [row for row in rows if row["workload"] == workload and row["backend"] != "floor"]
        floor = next((row["ms"] for row in rows if row["workload"] == workload and row["backend"] == "floor"), None)
        names = [row["backend"] for row in mine]
        values = [row["ms"] for row in mine]
        bars = axis.bar(names, values, color=[colors.get(n, "grey") for n in names])
        for bar, row in zip(bars, mine):
            ratio = row.get("x_floor") or row.get("x_resident")
            if ratio:
                axis.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                              ha="center", va="bottom", fontsize=8)
        if floor:
            axis.axhline(floor, color="black", linestyle="--", linewidth=1, label=f"floor {floor:.1f} ms")
            axis.legend(fontsize=8, loc="upper left")
        if values and floor and max(values) > 6 * floor:
            axis.set_yscale("log")
        axis.set_title(workload, fontsize=10)
        axis.set_ylabel("ms per forward")
        axis.tick_params(axis="x", labelsize=8)
    for index in range(len(workloads), lines * columns):
        axes[index // columns][index % columns].axis("off")
    figure.suptitle("Forward time per workload and backend (bar label: x floor; x resident without a GPU)")
    return _save(plt, figure, out_dir, "forward.png")


def plot_overhead(section: dict[str, Any], out_dir: str) -> str | None:
    rows = [row for row in _rows(section, "overhead") if row.get("us_per_block") is not None]
    if not rows:
        return None
    from benchmarks.overhead import PARAM_COUNTS, target_us
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for key in dict.fromkeys((row["device"], row["backend"]) for row in rows):
        mine = sorted((row for row in rows if (row["device"], row["backend"]) == key), key=lambda r: r["params"])
        axis.plot([r["params"] for r in mine], [r["us_per_block"] for r in mine], marker="o",
                  label=f"{key[1]} on {key[0]}")
    axis.plot(PARAM_COUNTS, [target_us(p) for p in PARAM_COUNTS], color="black", linestyle="--",
              label="target 20 us + 0.3 us/param")
    axis.set_yscale("log")
    _label_log2_axes(axis, PARAM_COUNTS, [str(p) for p in PARAM_COUNTS], "parameters per block",
                     "us per block per step (host)", "Host cost per block: acquire + prefetch issue + release")
    return _save(plt, figure, out_dir, "overhead.png")


PLOTTERS = {"bandwidth": plot_bandwidth, "forward": plot_forward, "overhead": plot_overhead}
