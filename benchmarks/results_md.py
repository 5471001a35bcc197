"""docs/RESULTS.md from results.json, so that the published figures cannot drift from a run.

``render_latest(results)`` turns one run's ``results.json`` into Markdown: the environment, the
summary against the targets, and every section's tables, summary lines and notes. ``update_results_md``
puts that text between two markers in a RESULTS.md file and leaves everything else in the file (the
run history kept by hand below it) as it is. ``python -m benchmarks`` writes ``RESULTS.md`` next to
``results.json`` on every run; ``--results-md docs/RESULTS.md`` also updates the repository's copy,
and ``--from-json results.json --results-md docs/RESULTS.md`` does only that, without running anything.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from benchmarks.utils import GiB, render_markdown_table

BEGIN = "<!-- BEGIN latest run: written by `python -m benchmarks` from results.json; edits here are overwritten -->"
END = "<!-- END latest run -->"

SKELETON = f"""# Results

Every ratio below uses a floor measured in the same run (docs/DESIGN.md, "Workloads and targets").
The latest run is rendered from its `results.json` by the benchmark itself; the history under it is kept
by hand.

{BEGIN}
{END}

## History
"""


def _environment(results: dict[str, Any]) -> list[str]:
    header = results.get("header") or {}
    options = results.get("options") or {}
    ram = header.get("ram_bytes")
    gpu = header.get("gpu") or "none"
    if header.get("gpu_count"):
        gpu += f" x{header['gpu_count']}" + (f", driver {header['driver']}" if header.get("driver") else "")
    return [
        f"- when: {header.get('time')}, host {header.get('host')}",
        f"- gpu: {gpu}; cpu: {header.get('cpu')} ({header.get('cpu_count')} cores"
        + (f", {ram / GiB:.0f} GiB RAM)" if ram else ")"),
        f"- torch {header.get('torch')}, cuda {header.get('cuda_runtime')}, fastoffload_ext "
        f"{header.get('fastoffload_ext')}, active backend {header.get('active_backend')}",
        f"- run: {'quick' if options.get('quick') else 'full'}, device {options.get('device_used')}, "
        f"prefetch_depth {options.get('prefetch_depth')}, resident_blocks {options.get('resident_blocks') or 0}, "
        f"sections {', '.join(options.get('sections') or [])}; {results.get('wall_s', 0):.0f} s",
    ]


def _section(name: str, section: dict[str, Any]) -> list[str]:
    module = importlib.import_module(f"benchmarks.{name}")
    lines = [f"### {module.TITLE}", "", f"Status: {section.get('status')}, {section.get('wall_s', 0):.1f} s."]
    for table_name, table in module.TABLES.items():
        rows = section.get("tables", {}).get(table_name)
        if rows:
            lines += ["", f"{table.title}:", "", render_markdown_table(table, rows)]
    extra = [*section.get("summary", []), *(f"note: {note}" for note in section.get("notes", []))]
    if section.get("section_error"):
        extra.append(f"section error: {section['section_error']}")
    if extra:
        lines += [""] + [f"- {line}" for line in extra]
    return lines


def render_latest(results: dict[str, Any]) -> str:
    """The Markdown of one run: environment, summary against the targets, every section."""
    lines = ["## Latest run", "", *_environment(results)]
    if results.get("targets"):
        lines += ["", "Summary against the targets (ext backend):", ""] + [f"- {line}" for line in results["targets"]]
    for name, section in (results.get("sections") or {}).items():
        lines += [""] + _section(name, section)
    return "\n".join(lines)


def update_results_md(path: str | Path, results: dict[str, Any]) -> None:
    """Replaces the latest-run block of ``path`` (created from a skeleton if absent); keeps the rest."""
    path = Path(path)
    text = path.read_text() if path.exists() else SKELETON
    if BEGIN not in text or END not in text:
        text = text.rstrip("\n") + "\n\n" + BEGIN + "\n" + END + "\n"
    before, rest = text.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(before + BEGIN + "\n" + render_latest(results) + "\n" + END + after)
