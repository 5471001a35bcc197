"""Entry point: ``python -m benchmarks [--quick] [--out DIR] [--only SECTION,...] ...``.

Runs the sections in order (bandwidth first: its 1 GiB pinned H2D figure is the ``peak`` every floor
divides by) in a child process, so that nothing a section does can take the run down: a segfault in
the engine, a lost CUDA context, a hang (each section has a wall-clock limit) cost that section's
remaining rows, and a fresh child takes the sections that had not started. One child for all of them
when nothing goes wrong, because each new process pays imports and CUDA init (~10 s on the H200
host). Rows reach the parent through JSON-lines journals the child appends to as it goes; the parent
prints one table per section as it completes, then writes ``results.json`` (every figure),
``results.txt`` (the tables), ``RESULTS.md`` (the run as Markdown, ``benchmarks/results_md.py``) and PNG
plots into ``--out``; ``--results-md docs/RESULTS.md`` also renders the run into the repository's page.

Budget: the full run is sized for well under 10 minutes on one H200 host (16 cores, PCIe Gen5),
``--quick`` for under 3; without a GPU the sections run scaled down on the host (``device="cpu"``) in
a few minutes on 2 cores, and every row that cannot run says why.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

SECTIONS = ("bandwidth", "forward", "graphs", "compile", "startup", "overhead", "lazy", "ranks", "codec", "budgets",
            "disk", "training", "models")

# Wall-clock limits per section, seconds (full, quick); a safety net against hangs, not a budget. The
# quick forward's 150 s (300 s on the host) cut a 2-core AMD EPYC without bf16 instructions off after W1:
# there its scaled-down forwards take about 450 s (W2-cpu's resident step alone 1.85 s).
SECTION_TIMEOUTS = {
    "bandwidth": (120, 60),
    "forward": (420, 300),
    "graphs": (240, 120),
    "compile": (600, 240),
    "startup": (300, 150),
    "overhead": (240, 120),
    "lazy": (120, 60),
    "ranks": (600, 300),
    "codec": (600, 300),
    "budgets": (900, 420),
    "disk": (900, 400),
    "training": (300, 180),
    "models": (1500, 400),
}


# The sections' environment variables, shown by --help (tests/test_benchmark_cli.py checks that every
# BENCHMARK_* variable a section reads is listed here).
ENVIRONMENT = {
    "BENCHMARK_BUDGETS_WORKLOADS": "budgets: only these workloads, in this order (W1,W2,W3,W4,wan-1.3b,flux); "
                                   "the full section fits two GPU commands: W1,W2,W3,W4 then flux,wan-1.3b",
    "BENCHMARK_MODELS": "models: only these models (wan-1.3b,flux,wan-14b; default all, --quick: wan-1.3b)",
    "BENCHMARK_MODEL_PEERS": "models: 'all', or peer names (fastvideo,sglang,mmgp,diffusers,diffusers leaf,"
                             "accelerate): those peers on every model (default: fewer on the 14B model)",
    "BENCHMARK_MODELS_GRAPHS": "models: 0 leaves out the CUDA-graph rows (their capture and rounds), for a run "
                               "that is after the peers' rows",
    "BENCHMARK_MODELS_BUDGET_S": "models: seconds within which every peer must finish (default 360); a peer "
                                 "that would not is skipped and its rows say so",
}


def _epilog() -> str:
    lines = ["environment variables:"]
    for name, text in ENVIRONMENT.items():
        lines += textwrap.wrap(text, width=100, initial_indent=f"  {name}  ", subsequent_indent=" " * 6)
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_epilog(),
        description="fastoffload_ext benchmark suite: bandwidth, forward (W1-W4 + a transformers model vs "
                    "floor), CUDA graphs, torch.compile, start-up, host overhead, lazy pipeline, several ranks "
                    "of one host, codec, residency planner under device budgets, disk tier and start-up from "
                    "a checkpoint, real models against peers. Tables on stdout, results.json + PNGs in --out.")
    parser.add_argument("--quick", action="store_true", help="fewer sizes, rounds and iterations in every section")
    parser.add_argument("--out", default=None, help="output folder (default: $OUT if set, else ./results)")
    parser.add_argument("--prefetch-depth", type=int, default=1, metavar="K",
                        help="blocks copied ahead by the ext/python backends (default 1)")
    parser.add_argument("--resident-blocks", type=int, default=None, metavar="N",
                        help="keep the first N blocks on the GPU (ext/python backends)")
    parser.add_argument("--only", default=None, metavar="SECTION[,SECTION]",
                        help="run only these sections: " + ", ".join(SECTIONS))
    parser.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="where models run (default: cuda when available)")
    parser.add_argument("--no-isolate", action="store_true",
                        help="run sections in this process (debugging; a crash then ends the run)")
    parser.add_argument("--timeout-scale", type=float, default=1.0,
                        help="multiply every section's wall-clock limit (default 1.0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--results-md", default=None, metavar="PATH",
                        help="also render the run into PATH's latest-run block (e.g. docs/RESULTS.md); "
                             "RESULTS.md next to results.json is always written")
    parser.add_argument("--from-json", default=None, metavar="RESULTS_JSON",
                        help="run nothing: render RESULTS_JSON into --results-md and exit")
    # Internal: one section in a child process.
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--journal", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--options", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--header", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.from_json and not args.results_md:
        parser.error("--from-json needs --results-md PATH (the file to render into)")
    if args.prefetch_depth < 0:
        parser.error(f"--prefetch-depth must be >= 0, got {args.prefetch_depth}")
    if args.resident_blocks is not None and args.resident_blocks < 0:
        parser.error(f"--resident-blocks must be >= 0, got {args.resident_blocks}")
    if args.only:
        wanted = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in SECTIONS]
        if unknown:
            parser.error(f"--only: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
        args.sections = [name for name in SECTIONS if name in wanted]
    else:
        args.sections = list(SECTIONS)
    return args


# --------------------------------------------------------------------------------------------------
# Child: the sections, one after the other
# --------------------------------------------------------------------------------------------------

def run_section_here(name: str, options: Any, journal: str) -> None:
    from benchmarks.utils import Context, empty_host_cache, free_memory
    ctx = Context(name, options, journal)
    try:
        module = importlib.import_module(f"benchmarks.{name}")
        _inject_fault(name, ctx)
        module.run(ctx)
    except Exception as error:  # anything outside a row: keep what was recorded, say what happened
        import traceback
        ctx.note(f"section stopped early: {type(error).__name__}: {error}")
        ctx._write({"type": "section_error", "error": f"{type(error).__name__}: {error}",
                    "traceback": traceback.format_exc(limit=10)})
    finally:
        ctx.close()
        # The next section starts clean: no cached device blocks, no cached pinned host blocks.
        free_memory()
        empty_host_cache()


def _inject_fault(name: str, ctx: Any) -> None:
    """Harness self-test: BENCHMARKS_INJECT_FAULT=SECTION[:crash|:hang] breaks that section on purpose."""
    fault = os.environ.get("BENCHMARKS_INJECT_FAULT", "")
    section, _, kind = fault.partition(":")
    if section != name:
        return
    ctx.run_row(next(iter(importlib.import_module(f"benchmarks.{name}").TABLES)), {"injected": "fault"},
                lambda: {"note": "a row before the injected fault"})
    ctx._write({"type": "begin", "table": next(iter(importlib.import_module(f"benchmarks.{name}").TABLES)),
                "labels": {"injected": kind or "crash"}})
    if kind == "hang":
        time.sleep(10**6)
    os.kill(os.getpid(), signal.SIGSEGV)


def _control(journal_dir: str) -> str:
    return os.path.join(journal_dir, "control.jsonl")


def _append(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def child_main(args: argparse.Namespace) -> int:
    """Runs ``args.child`` (comma-separated sections) in order, announcing each in the control file."""
    import torch

    from benchmarks.utils import Options, environment, read_journal, sanitize
    options = Options.from_json(args.options)
    if options.device == "cpu" or not torch.cuda.is_available():
        # On a small shared host, OpenMP's intra-op threads stall each other whenever another process
        # takes a core (a 1 ms forward turned into 250 ms here); one thread keeps host timings stable.
        torch.set_num_threads(1)
    control = _control(args.journal)
    if args.header:
        try:
            header = environment()
        except Exception as error:  # the run goes on without a full header
            header = {"error": f"environment probe failed: {type(error).__name__}: {error}"}
        _append(control, {"type": "env", "header": sanitize(header)})
    for name in args.child.split(","):
        _append(control, {"type": "section_start", "section": name, "time": time.time()})
        journal = os.path.join(args.journal, f"{name}.jsonl")
        run_section_here(name, options, journal)
        if name == "bandwidth":
            for record in read_journal(journal):
                if record.get("type") == "meta" and record.get("key") == "peak_h2d_gbps" and record.get("value"):
                    options.peak_h2d_gbps = record["value"]
        _append(control, {"type": "section_end", "section": name, "time": time.time()})
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (freeing gigabytes of cached pinned blocks one by one): the process
    # exit returns everything at once, and every result is already on disk.
    os._exit(0)


# --------------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------------

def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the child's own session (and the startup section's children)
    except ProcessLookupError:
        pass
    process.wait()


class SectionRunner:
    """Runs the sections in as few child processes as possible, restarting after a crash or a hang.

    One child runs every section in turn (imports and CUDA init are paid once). The parent follows
    the child's control file: a section that outlives its wall-clock limit gets the child killed; a
    child that dies mid-section (signal, lost CUDA context turned fatal, OOM kill) costs that section
    only. Either way a fresh child takes the sections that had not started.
    """

    def __init__(self, args: argparse.Namespace, options: Any, journal_dir: str,
                 on_section_done: Any) -> None:
        self.args = args
        self.options = options
        self.journal_dir = journal_dir
        self.on_section_done = on_section_done
        self.header: dict[str, Any] | None = None
        self.statuses: dict[str, dict[str, Any]] = {}
        self.control_offset = 0  # one control file for every child: never re-read what an earlier one wrote

    def timeout(self, name: str) -> float:
        full, quick = SECTION_TIMEOUTS[name]
        on_host = self.options.device == "cpu" or (self.header is not None and not self.header.get("gpu"))
        return (quick if self.args.quick else full) * self.args.timeout_scale * (2 if on_host else 1)

    def run(self) -> None:
        pending = list(self.args.sections)
        while pending:
            pending = self._run_child(pending)

    def _read_control(self, offset: int) -> tuple[list[dict[str, Any]], int]:
        path = _control(self.journal_dir)
        if not os.path.exists(path):
            return [], offset
        with open(path) as handle:
            handle.seek(offset)
            data = handle.read()
        complete = data[: data.rfind("\n") + 1]
        records = [json.loads(line) for line in complete.splitlines() if line.strip()]
        return records, offset + len(complete.encode())

    def _run_child(self, sections: list[str]) -> list[str]:
        command = [sys.executable, "-m", "benchmarks", "--child", ",".join(sections), "--journal", self.journal_dir,
                   "--options", self.options.to_json()]
        if self.header is None:
            command.append("--header")
        process = subprocess.Popen(command, start_new_session=True)
        current: str | None = None
        started = 0.0  # the current section's start, child's clock (time.time, same host)
        done: list[str] = []
        try:
            while True:
                exited = process.poll() is not None  # before reading: what it wrote before exiting is read now
                records, self.control_offset = self._read_control(self.control_offset)
                for record in records:
                    if record["type"] == "env":
                        self.header = record["header"]
                        self.on_section_done(None, None)  # header available: print it
                    elif record["type"] == "section_start":
                        current, started = record["section"], record["time"]
                        print(f"running {current} ...", file=sys.stderr, flush=True)
                    elif record["type"] == "section_end":
                        self.statuses[record["section"]] = {"status": "ok",
                                                            "wall_s": round(record["time"] - started, 2)}
                        done.append(record["section"])
                        self.on_section_done(record["section"], self.statuses[record["section"]])
                        current = None
                if exited:
                    break
                if current is not None and time.time() - started > self.timeout(current):
                    _kill(process)
                    status = {"status": f"timed out after {self.timeout(current):.0f} s (killed)",
                              "wall_s": round(time.time() - started, 2)}
                    self.statuses[current] = status
                    done.append(current)
                    self.on_section_done(current, status)
                    current = None
                    break
                time.sleep(0.2)
        except KeyboardInterrupt:
            # Ctrl-C or SIGTERM (a `timeout` around the run): what the sections wrote so far is kept, and
            # the outputs are still written, so a run cut short shows every row it measured.
            _kill(process)
            for name in [name for name in sections if name not in done]:
                status = {"status": "interrupted: the rows measured before it are kept" if name == current
                          else "not run: the run was interrupted"}
                if name == current:
                    status["wall_s"] = round(time.time() - started, 2)
                self.statuses[name] = status
                self.on_section_done(name, status)
            return []
        code = process.returncode
        if current is not None:  # died inside a section
            reason = (f"crashed ({signal.Signals(-code).name})" if code is not None and code < 0
                      else f"exited with {code}")
            status = {"status": reason, "returncode": code, "wall_s": round(time.time() - started, 2)}
            self.statuses[current] = status
            done.append(current)
            self.on_section_done(current, status)
        elif code not in (0, None) and not done:
            # Died before the first section started (import error, bad interpreter): do not loop.
            for name in sections:
                status = {"status": f"child exited with {code} before the section started", "returncode": code}
                self.statuses[name] = status
                self.on_section_done(name, status)
            return []
        remaining = [name for name in sections if name not in done]
        if remaining:
            # A later child needs what this one learned: the peak H2D figure.
            peak = _meta(self.journal_dir, "bandwidth", "peak_h2d_gbps")
            if peak:
                self.options.peak_h2d_gbps = peak
        return remaining


def _meta(journal_dir: str, section: str, key: str) -> Any:
    from benchmarks.utils import read_journal
    for record in read_journal(os.path.join(journal_dir, f"{section}.jsonl")):
        if record.get("type") == "meta" and record.get("key") == key:
            return record.get("value")
    return None


def assemble(name: str, records: list[dict[str, Any]], status: dict[str, Any]) -> dict[str, Any]:
    """Turn a journal into the section's result; a row left open by a crash becomes an error row."""
    section: dict[str, Any] = {**status, "tables": {}, "notes": [], "meta": {}}
    open_row: dict[str, Any] | None = None
    for record in records:
        kind = record.get("type")
        if kind == "begin":
            open_row = record
        elif kind == "row":
            section["tables"].setdefault(record["table"], []).append(record["row"])
            open_row = None
        elif kind == "note":
            section["notes"].append(record["text"])
        elif kind == "meta":
            section["meta"][record["key"]] = record["value"]
        elif kind == "section_error":
            section["section_error"] = record["error"]
            section["section_traceback"] = record.get("traceback")
    if open_row is not None and status.get("status") != "ok":
        section["tables"].setdefault(open_row["table"], []).append(
            {**open_row["labels"], "error": f"section process {status.get('status')} during this row"})
    if status.get("status") not in ("ok", None):
        section["notes"].append(f"section process {status['status']}: rows after the last one shown did not run")
    # A section that writes rows as soon as each is measured may order them for reading (arrange_rows).
    arrange = getattr(importlib.import_module(f"benchmarks.{name}"), "arrange_rows", None)
    if arrange is not None:
        section["tables"] = {table: arrange(rows) for table, rows in section["tables"].items()}
    return section


def render_section(name: str, section: dict[str, Any]) -> str:
    from benchmarks.utils import render_table
    module = importlib.import_module(f"benchmarks.{name}")
    parts = [f"== {name}: {module.TITLE} " + "=" * max(0, 90 - len(name) - len(module.TITLE))]
    for table_name, table in module.TABLES.items():
        rows = section["tables"].get(table_name)
        if rows:
            parts.append(render_table(table, rows))
    summarize = getattr(module, "summarize", None)
    if summarize is not None:
        for table_name in module.TABLES:
            lines = summarize(section["tables"].get(table_name, []))
            section.setdefault("summary", []).extend(lines)
            parts.extend("  " + line for line in lines)
    for note in section["notes"]:
        parts.append(f"  note: {note}")
    if section.get("section_error"):
        parts.append(f"  SECTION ERROR: {section['section_error']}")
    parts.append(f"  ({section.get('status')}, {section.get('wall_s', 0):.1f} s)")
    return "\n".join(parts)


def targets_summary(results: dict[str, Any]) -> list[str]:
    """One line per target of docs/DESIGN.md ("Workloads and targets") the run measured, for the ext backend."""
    sections = results["sections"]
    lines: list[str] = []

    def rows(section: str, table: str) -> list[dict[str, Any]]:
        return sections.get(section, {}).get("tables", {}).get(table, [])

    def verdict(ok: Any) -> str:
        return "n/a" if ok is None else ("PASS" if ok else "FAIL")

    peak = sections.get("bandwidth", {}).get("meta", {}).get("peak_h2d_gbps") or \
        sections.get("forward", {}).get("meta", {}).get("peak_h2d_gbps")
    if peak:
        lines.append(f"peak pinned H2D (1 GiB): {peak:.1f} GB/s")
    for row in rows("forward", "forward"):
        if row.get("backend") != "ext":
            continue
        if row.get("error") or row.get("skipped"):
            lines.append(f"forward {row['workload']}: ext did not run ({row.get('error') or row.get('skipped')})"[:160])
        elif row.get("target") and row.get("pass") is not None:
            lines.append(f"forward {row['workload']}: ext {row['ms']:.2f} ms = {row.get('x_floor') or 0:.3f}x floor, "
                         f"{row.get('x_resident') or 0:.3f}x resident; target {row['target']}: {verdict(row['pass'])}"
                         f"; bit-equal {verdict(row.get('bit_equal'))}; memory bound {verdict(row.get('mem_ok'))}")
        elif row.get("ms") is not None:
            lines.append(f"forward {row['workload']}: ext {row['ms']:.2f} ms, "
                         f"bit-equal {verdict(row.get('bit_equal'))}")
    overhead = [row for row in rows("overhead", "overhead") if row.get("backend") == "ext" and row.get("device")]
    for device in dict.fromkeys(row["device"] for row in overhead):
        mine = [row for row in overhead if row["device"] == device and row.get("pass") is not None]
        # A row that errored or was skipped has no verdict: the device's line must not pass without it.
        missing = [row for row in overhead if row["device"] == device and row.get("pass") is None]
        names = ", ".join(f"{row.get('params')} params" for row in missing)
        absent = f"; {len(missing)} row(s) did not run ({names})" if missing else ""
        if not mine:
            lines.append(f"host cost per block on {device}: ext did not run ({names}): FAIL")
            continue
        worst = max(mine, key=lambda row: row["x_target"])
        lines.append(f"host cost per block on {device}: ext at most {worst['x_target']:.2f}x target (worst at "
                     f"{worst['params']} params, {worst['us_per_block']:.1f} us){absent}: "
                     f"{verdict(not missing and all(row['pass'] for row in mine))}")
    for row in rows("startup", "startup"):
        if row.get("backend") == "ext" and row.get("enable_s") is not None:
            lines.append(f"startup {row['workload']}: ext enable {row['enable_s']:.2f} s = "
                         f"{row.get('x_python') or 0:.2f}x python ({verdict(row.get('time_ok'))}); pinned/weights "
                         f"{row.get('pinned_ratio') or 0:.3f} ({verdict(row.get('pinned_ok'))}); peak RSS "
                         f"{verdict(row.get('rss_ok'))}")
    for row in rows("budgets", "budgets"):
        if row.get("error") or row.get("skipped"):
            lines.append(f"budgets {row.get('workload')} {row.get('budget')}: did not run "
                         f"({row.get('error') or row.get('skipped')})"[:160])
        elif row.get("x_best") is not None:
            extra = (f", {row['x_ideal']:.3f}x ideal, {row['x_floor']:.3f}x floor" if row.get("x_ideal") is not None
                     else "")
            lines.append(f"budgets {row['workload']} {row['budget']}: plan {row.get('plan')} = {row['x_best']:.3f}x "
                         f"best grid{extra}; memory within budget {verdict(row.get('mem_ok'))}; bit-equal "
                         f"{verdict(row.get('bit_equal'))}: {verdict(row.get('pass'))}"
                         + (f" ({row['note']})" if row.get("note") else ""))
    for row in rows("budgets", "compressed"):
        if row.get("x_raw") is not None:
            floor = f", {row['x_floor']:.3f}x floor" if row.get("x_floor") is not None else ""
            auto = (f"; compress='auto' picks {row['auto_plan']} = {row['x_auto_raw']:.3f}x raw"
                    if row.get("x_auto_raw") is not None else "")
            lines.append(f"budgets {row['workload']} {row['budget']} compressed: plan {row.get('plan')} = "
                         f"{row['x_raw']:.3f}x the raw plan {row.get('raw_plan')}{floor}{auto}; memory within budget "
                         f"{verdict(row.get('mem_ok'))}; bit-equal {verdict(row.get('bit_equal'))}: "
                         f"{verdict(row.get('pass'))}")
    for row in rows("budgets", "depth"):
        if row.get("x_depth1") is not None and row.get("depth") != 1:
            lines.append(f"budgets {row['workload']} depth {row['depth']}: {row['x_depth1']:.3f}x depth 1: "
                         f"{verdict(row.get('pass'))}")
    for row in rows("lazy", "lazy"):
        if row.get("variant") == "lazy" and row.get("x_eager") is not None:
            lines.append(f"lazy pipeline: peak {row['x_eager']:.2f}x eager, "
                         f"output equal {verdict(row.get('bit_equal'))}")
    return lines


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the run the way Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    if args.from_json:
        from benchmarks.results_md import update_results_md
        with open(args.from_json) as handle:
            update_results_md(args.results_md, json.load(handle))
        print(f"results: {args.results_md} (rendered from {args.from_json})")
        return 0

    out_dir = args.out or os.environ.get("OUT") or "results"
    os.makedirs(out_dir, exist_ok=True)
    journal_dir = tempfile.mkdtemp(prefix="fastoffload-bench-")
    results: dict[str, Any] = {"options": {k: v for k, v in vars(args).items() if k not in ("child", "journal")},
                               "sections": {}}
    texts: list[str] = []
    run_started = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        _run_sections(args, out_dir, journal_dir, results, texts)
    finally:
        signal.signal(signal.SIGTERM, previous)
    results["wall_s"] = round(time.perf_counter() - run_started, 2)
    _summarize_targets(results, texts)
    _write_outputs(args, out_dir, results, texts)
    shutil.rmtree(journal_dir, ignore_errors=True)
    return 0


def _run_sections(args: argparse.Namespace, out_dir: str, journal_dir: str, results: dict[str, Any],
                  texts: list[str]) -> None:
    """Runs every section (in children unless --no-isolate), printing each table as it completes."""
    # The parent never initialises CUDA: the first child probes the environment and reports it, so the
    # parent's imports overlap with the child's work and no second CUDA context sits on the GPU.
    from benchmarks.utils import Options
    options = Options(quick=args.quick, device=args.device, prefetch_depth=args.prefetch_depth,
                      resident_blocks=args.resident_blocks, progress=not args.no_progress)

    def print_header(header: dict[str, Any]) -> None:
        from benchmarks.utils import format_header
        results["header"] = header
        cuda = bool(header.get("gpu")) and args.device != "cpu"
        results["options"]["device_used"] = "cuda" if cuda else "cpu"
        settings = (f"  run         {'quick' if args.quick else 'full'}   device {'cuda' if cuda else 'cpu'}   "
                    f"prefetch_depth {args.prefetch_depth}   resident_blocks {args.resident_blocks or 0}   sections "
                    f"{','.join(args.sections)}   out {out_dir}")
        text = format_header(header) + "\n" + settings + "\n"
        if not cuda:
            if args.device == "cuda":
                text += "--device cuda: no CUDA device is visible; running on the host instead\n"
            text += ("No CUDA device: bandwidth is skipped; forward, startup, overhead and lazy run on the host "
                     "(device='cpu') at reduced sizes; GPU-only rows say so.\n")
        print(text, flush=True)
        texts.append(text)

    def section_done(name: str | None, status: dict[str, Any] | None) -> None:
        from benchmarks.utils import read_journal
        if name is None:
            print_header(runner.header or {})
            return
        section = assemble(name, read_journal(os.path.join(journal_dir, f"{name}.jsonl")), status or {})
        results["sections"][name] = section
        text = render_section(name, section)
        print(text + "\n", flush=True)
        texts.append(text + "\n")

    runner = SectionRunner(args, options, journal_dir, section_done)
    try:
        if args.no_isolate:
            from benchmarks.utils import environment, sanitize
            runner.header = sanitize(environment())
            section_done(None, None)
            for name in args.sections:
                print(f"running {name} ...", file=sys.stderr, flush=True)
                started = time.perf_counter()
                run_section_here(name, options, os.path.join(journal_dir, f"{name}.jsonl"))
                if name == "bandwidth":
                    options.peak_h2d_gbps = _meta(journal_dir, "bandwidth", "peak_h2d_gbps") or options.peak_h2d_gbps
                section_done(name, {"status": "ok", "wall_s": round(time.perf_counter() - started, 2)})
        else:
            runner.run()
    except KeyboardInterrupt:
        print("interrupted: writing what was measured so far", file=sys.stderr)
        results["interrupted"] = True
    if "header" not in results:
        results["header"] = runner.header or {"error": "no child reported the environment"}


def _summarize_targets(results: dict[str, Any], texts: list[str]) -> None:
    """The run against the design's targets: into ``results["targets"]`` and printed."""
    try:
        results["targets"] = targets_summary(results)
    except Exception as error:  # a summary must not cost the results file
        results["targets"] = [f"summary failed: {type(error).__name__}: {error}"]
    if results["targets"]:
        text = "== summary vs docs/DESIGN.md targets (\"Workloads and targets\", ext backend) " + "=" * 26 + "\n" + "\n".join(
            "  " + line for line in results["targets"])
        print(text + "\n", flush=True)
        texts.append(text + "\n")


def _write_outputs(args: argparse.Namespace, out_dir: str, results: dict[str, Any], texts: list[str]) -> None:
    """Plots, results.json, results.txt and the Markdown pages; then where they are and what failed."""
    plot_lines = write_plots(results, out_dir, args.no_plots)
    results["plots"] = plot_lines

    from benchmarks.utils import sanitize
    json_path = os.path.join(out_dir, "results.json")
    with open(json_path, "w") as handle:
        json.dump(sanitize(results), handle, indent=1)
    text_path = os.path.join(out_dir, "results.txt")
    with open(text_path, "w") as handle:
        handle.write("\n".join(texts + plot_lines) + "\n")
    md_paths = write_results_md(sanitize(results), out_dir, args.results_md)
    for line in plot_lines:
        print(line)
    not_ok = [name for name, section in results["sections"].items() if section.get("status") != "ok"]
    errors = sum(1 for section in results["sections"].values() for rows in section["tables"].values()
                 for row in rows if row.get("error"))
    print(f"results: {json_path}  (tables: {text_path}; Markdown: {', '.join(md_paths)})")
    print(f"done in {results['wall_s']:.0f} s: {len(results['sections'])} section(s), {errors} error row(s)"
          + (f", sections not ok: {', '.join(not_ok)}" if not_ok else ""))


def write_plots(results: dict[str, Any], out_dir: str, disabled: bool) -> list[str]:
    from benchmarks.utils import try_import
    if disabled:
        return ["plots skipped: --no-plots"]
    if try_import("matplotlib")[0] is None:
        return ["plots skipped: matplotlib missing"]
    from benchmarks.plots import PLOTTERS
    lines = []
    for name, plotter in PLOTTERS.items():
        if name not in results["sections"]:
            continue
        try:
            path = plotter(results["sections"][name], out_dir)
            if path:
                lines.append(f"plot: {path}")
        except Exception as error:  # a plot must not cost the results
            lines.append(f"plot {name} failed: {type(error).__name__}: {error}")
    return lines


def write_results_md(results: dict[str, Any], out_dir: str, results_md: str | None) -> list[str]:
    """RESULTS.md next to results.json, and the ``--results-md`` file's latest-run block when asked for."""
    from benchmarks.results_md import update_results_md
    paths = [os.path.join(out_dir, "RESULTS.md")] + ([results_md] if results_md else [])
    written = []
    for path in paths:
        try:
            update_results_md(path, results)
            written.append(path)
        except Exception as error:  # a rendering bug must not cost results.json
            print(f"{path}: not written ({type(error).__name__}: {error})", file=sys.stderr)
    return written
