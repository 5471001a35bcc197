"""Shared pieces of the benchmark suite: timing, the run context, the row journal, tables, memory probes.

Timing rules (docs/DESIGN.md, "Measuring"): inputs are built before the timed region, there is a warm-up,
GPU work is timed with CUDA events on the compute stream, and the figure reported is the median of at
least ``MIN_ITERS`` timed repetitions. Forward passes are timed back to back with no host
synchronisation between them: the layerwise engines end a forward with the wrap-around prefetch of
block 0 still in flight on their copy stream, and a ``synchronize()`` between iterations would let that
copy finish off the clock, reporting one block's transfer less than the steady state really pays.
That is also why GPU forwards keep their own CUDA-event timer instead of ``torch.utils.benchmark``:
its default timer calls ``torch.cuda.synchronize()`` around every measurement, which would hide exactly
that in-flight prefetch. Host-side work (the CPU "device", the per-block hook cost) is timed with
``torch.utils.benchmark.Timer`` given a plain ``time.perf_counter`` clock, so it never synchronizes.

Every row runs inside :meth:`Context.run_row`, which catches the row's exception, records it as an
error row and carries on, so one broken backend or one OOM never loses the rest of a section. Rows are
appended to a JSON-lines journal as they finish; ``run.py`` runs each section in a child process and
reads that journal back, so even a segfault or a lost CUDA context costs only the row in flight.
"""
from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psutil
import tabulate
import torch
from torch.utils import benchmark

KiB = 1024
MiB = 1024**2
GiB = 1024**3
GB = 1e9  # bandwidths are reported in decimal GB/s, as PCIe and docs/DESIGN.md ("Measured facts behind the defaults") quote them

MIN_ITERS = 5

# Errors after which the CUDA context of this process is unusable: every later CUDA call fails too,
# so the section stops and says why instead of printing one misleading error per remaining row.
_FATAL_CUDA_MARKERS = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "CUDA error: an illegal instruction",
    "cudaErrorLaunchFailure",
)


# --------------------------------------------------------------------------------------------------
# Optional imports
# --------------------------------------------------------------------------------------------------

def try_import(name: str) -> tuple[Any, str]:
    """(module, "") or (None, why it could not be imported)."""
    try:
        return importlib.import_module(name), ""
    except Exception as error:  # an optional dependency may fail in any way at import
        first_line = str(error).splitlines()[0] if str(error) else ""
        return None, f"{name} is not importable ({type(error).__name__}: {first_line})"


def ext_available() -> tuple[bool, str]:
    try:
        import fastoffload_ext
    except Exception as error:
        return False, f"fastoffload_ext is not importable: {error}"
    if not fastoffload_ext.ext_available():
        return False, f"compiled core not loaded: {fastoffload_ext.backend_reason}"
    return True, ""


# --------------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------------

class Progress:
    """A progress bar on stderr: tqdm when importable, else one counter line per step."""

    def __init__(self, desc: str, enabled: bool = True) -> None:
        self.desc = desc
        self.total = 0
        self.done = 0
        self.enabled = enabled
        self._bar = None
        # A bar redraws with carriage returns: right on a terminal, noise in a log. Off a terminal each
        # row gets one plain line instead.
        if enabled and sys.stderr.isatty():
            tqdm_module, _ = try_import("tqdm")
            if tqdm_module is not None:
                self._bar = tqdm_module.tqdm(total=0, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True,
                                             bar_format="{desc}: {n}/{total} {bar} {elapsed} {postfix}")

    def add(self, count: int) -> None:
        self.total += count
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def start(self, label: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(label[:60])
        else:
            position = f"{self.done + 1}/{max(self.total, self.done + 1)}"
            print(f"  [{self.desc} {position}] {label}", file=sys.stderr, flush=True)

    def finish(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# --------------------------------------------------------------------------------------------------
# Run context and journal
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Options:
    """What a section needs to know about the run; travels to child processes as JSON."""

    quick: bool = False
    device: str = "auto"  # "auto" (cuda when available), "cuda" or "cpu": where models run
    prefetch_depth: int = 1
    resident_blocks: int | None = None
    peak_h2d_gbps: float | None = None  # from the bandwidth section of the same run, if it ran
    progress: bool = True

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Options:
        return cls(**json.loads(text))


class Context:
    """One section's run: options, the device, the journal, the progress bar, the row runner."""

    def __init__(self, section: str, options: Options, journal_path: str) -> None:
        self.section = section
        self.options = options
        self.quick = options.quick
        self.cuda = options.device in ("auto", "cuda") and torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self._journal = open(journal_path, "a", buffering=1)  # line-buffered: a crash loses at most the row in flight
        self.progress = Progress(section, enabled=options.progress)
        self.cuda_lost: str | None = None

    # journal -----------------------------------------------------------------------------------
    def _write(self, record: dict[str, Any]) -> None:
        self._journal.write(json.dumps(sanitize(record)) + "\n")
        self._journal.flush()

    def note(self, text: str) -> None:
        """A line printed under the section's tables and kept in the JSON (skips, caveats, sources)."""
        self._write({"type": "note", "text": text})

    def meta(self, key: str, value: Any) -> None:
        """A section-level figure other sections or the summary use (e.g. the peak H2D bandwidth)."""
        self._write({"type": "meta", "key": key, "value": value})

    def skip(self, table: str, labels: dict[str, Any], reason: str) -> None:
        self._write({"type": "row", "table": table, "row": {**labels, "skipped": reason}})

    # rows --------------------------------------------------------------------------------------
    def run_row(self, table: str, labels: dict[str, Any], fn: Callable[[], dict[str, Any]],
                cleanup: Callable[[], None] | None = None) -> dict[str, Any] | None:
        """Run one row; its exception becomes an error row. Returns the row's figures or None."""
        label = " ".join(str(v) for v in labels.values())
        self.progress.start(label)
        if self.cuda_lost is not None:
            self.skip(table, labels, f"CUDA context lost earlier in this section ({self.cuda_lost})")
            self.progress.finish()
            return None
        self._write({"type": "begin", "table": table, "labels": labels})
        started = time.perf_counter()
        try:
            values = fn()
            row = {**labels, **values}
            result: dict[str, Any] | None = values
        except Exception as error:  # a row must never take the section down with it
            message = f"{type(error).__name__}: {error}".strip()
            row = {**labels, "error": message.splitlines()[0][:400] if message else type(error).__name__,
                   "traceback": traceback.format_exc(limit=8)}
            if self.cuda and any(marker in message for marker in _FATAL_CUDA_MARKERS):
                self.cuda_lost = message.splitlines()[0][:120]
            result = None
        finally:
            if cleanup is not None:
                try:
                    cleanup()
                except Exception:
                    pass
            free_memory()
        row["row_wall_s"] = round(time.perf_counter() - started, 3)
        self._write({"type": "row", "table": table, "row": row})
        self.progress.finish()
        return result

    def close(self) -> None:
        self.progress.close()
        self._journal.close()

    # timing ------------------------------------------------------------------------------------
    def iters(self, full: int, quick: int | None = None) -> int:
        return max(MIN_ITERS, quick if (self.quick and quick is not None) else full)

    def time_ms(self, fn: Callable[[], Any], *, warmup: int, iters: int) -> list[float]:
        timer = time_cuda_ms if self.cuda else time_host_ms
        return timer(fn, warmup=warmup, iters=iters)


def read_journal(path: str) -> list[dict[str, Any]]:
    records = []
    if not os.path.exists(path):
        return records
    with open(path) as journal:
        for line in journal:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a half-written last line from a killed child
                pass
    return records


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------

def time_cuda_ms(fn: Callable[[], Any], *, warmup: int, iters: int) -> list[float]:
    """Per-iteration milliseconds from CUDA events on the current stream, iterations back to back."""
    iters = max(MIN_ITERS, iters)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = time_back_to_back(fn, iters)
    torch.cuda.synchronize()
    return times


def time_back_to_back(fn: Callable[[], Any], count: int) -> list[float]:
    """Milliseconds of ``count`` calls run back to back on the current CUDA stream, one wait at the end.

    Call ``n`` is timed from the event after call ``n - 1`` to the one after itself, so device time that the
    host left idle (a host-bound step) counts, and nothing runs between two calls that a loop would not."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    stream = torch.cuda.current_stream()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
    events[0].record(stream)
    for event in events[1:]:
        fn()
        event.record(stream)
    events[-1].synchronize()
    return [float(start.elapsed_time(end)) for start, end in zip(events, events[1:])]


def _host_timer(fn: Callable[[], Any], clock: Callable[[], float] = time.perf_counter) -> benchmark.Timer:
    # time.perf_counter, not the module's default clock: that one synchronizes CUDA on every reading.
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}, timer=clock, num_threads=torch.get_num_threads())


def time_host_ms(fn: Callable[[], Any], *, warmup: int, iters: int) -> list[float]:
    """Per-iteration wall milliseconds of host work, one ``torch.utils.benchmark`` run per iteration."""
    iters = max(MIN_ITERS, iters)
    timer = _host_timer(fn)
    if warmup:
        timer.timeit(warmup)
    return [timer.timeit(1).mean * 1e3 for _ in range(iters)]


def time_host_runs_ns(fn: Callable[[], Any], *, number: int, runs: int,
                      between: Callable[[], None] | None = None,
                      clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Nanoseconds per call of ``fn``, one figure per run of ``number`` calls; ``between`` runs off the clock.

    ``clock=time.thread_time`` counts the CPU time of the calling thread only: what a step costs the host,
    without the time other processes of a shared machine took the core meanwhile."""
    timer = _host_timer(fn, clock)
    per_call = []
    for _ in range(runs):
        per_call.append(timer.timeit(number).mean * 1e9)
        if between is not None:
            between()
    return per_call


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def summary(times_ms: Sequence[float]) -> dict[str, Any]:
    return {"ms": median(times_ms), "ms_min": float(min(times_ms)), "ms_max": float(max(times_ms)),
            "n": len(times_ms)}


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------

def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:
            pass


def device_allocated(ctx: Context) -> int:
    """Device bytes allocated now, the base a peak is measured against (0 without CUDA).

    Collects garbage first. An offloaded model that was dropped is freed only by the cycle collector: its
    modules and hooks reference each other, as with every hook-based offloader. Left for later, the
    collector runs inside the measured region instead, and the freed slots, counted in the base, come
    off the peak: a configuration that allocated two 95 MB slots read a 24 MiB peak.
    """
    if not ctx.cuda:
        return 0
    gc.collect()
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


def reset_device_peak(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def device_peak(ctx: Context) -> int:
    """The most device bytes allocated since the last ``reset_device_peak`` (0 without CUDA)."""
    if not ctx.cuda:
        return 0
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def settled_reserved() -> int:
    """Device bytes torch's caching allocator holds once garbage is collected, the device is idle and the cache is
    emptied: what live tensors occupy, in the allocator's blocks (CUDA only)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved())


def steady_reserve(forward: Callable[[], Any], count: int) -> int:
    """Device bytes torch's caching allocator reserved above what it held at the start, at its peak over ``count``
    forwards run back to back (CUDA only).

    The allocated count misses what a loop whose host runs ahead holds on the device: a tensor freed on the host
    while the device still uses it (``record_stream``) stops counting as allocated at once, and its memory stays
    reserved until the device is done with it. An offloader that allocates each prefetched block afresh is held
    to no number of blocks that way, and this figure shows how many it held. The cache is emptied first, so the
    growth is what these forwards needed."""
    base = settled_reserved()
    torch.cuda.reset_peak_memory_stats()
    time_back_to_back(forward, count)
    torch.cuda.synchronize()
    return max(0, int(torch.cuda.max_memory_reserved()) - int(base))


def empty_host_cache() -> None:
    """Return the pinned blocks cached by torch's host allocator (the python backend's pins)."""
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        function = getattr(torch._C, name, None)
        if function is not None:
            try:
                function()
                return
            except Exception:
                pass


def torch_host_pinned_bytes() -> dict[str, int] | None:
    """Bytes held by torch's caching host allocator, or None when this torch does not report them."""
    stats_fn = getattr(getattr(torch.cuda, "memory", None), "host_memory_stats", None)
    if stats_fn is None or not torch.cuda.is_available():
        return None
    try:
        stats = stats_fn()
    except Exception:
        return None
    if not stats:
        return {"reserved": 0, "allocated": 0}
    # torch >= 2.9: "allocated_bytes" = pinned blocks the allocator owns (handed out + cached), at their
    # power-of-two size, i.e. what is pinned; "active_bytes" = blocks handed out. Older releases named
    # the owned bytes "reserved_bytes".
    owned = stats.get("allocated_bytes.current", stats.get("reserved_bytes.current"))
    active = stats.get("active_bytes.current")
    if owned is None:
        return None
    return {"reserved": int(owned), "allocated": int(active if active is not None else owned)}


def next_pow2(value: int) -> int:
    return 1 if value <= 1 else 1 << (int(value) - 1).bit_length()


def module_bytes(module: torch.nn.Module, *, buffers: bool = False) -> int:
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    if buffers:
        total += sum(b.numel() * b.element_size() for b in module.buffers())
    return total


def rss_bytes() -> int:
    """Resident set size of this process, bytes."""
    return int(psutil.Process().memory_info().rss)


def pss_bytes() -> int:
    """Proportional set size of this process (a page mapped by n processes counts 1/n); 0 where unknown."""
    try:
        return int(getattr(psutil.Process().memory_full_info(), "pss", 0))
    except (psutil.AccessDenied, OSError):
        return 0


def _peak_rss_hwm() -> int:
    """VmHWM, the kernel's own RSS high-water mark, bytes (0 where unreadable).

    psutil reports the current RSS only. The high-water mark also catches a spike that falls between
    two samples of :class:`RssSampler`, and ``reset_peak_rss`` can reset it, so it is read here.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * KiB
    except OSError:
        pass
    return 0


def rss_high_water_bytes() -> int:
    """This process's RSS high-water mark (VmHWM), bytes; 0 where unreadable."""
    return _peak_rss_hwm()


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0, ``clear_refs`` 5). False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Samples this process's RSS in a thread; ``peak`` is the largest sample (and VmHWM when resettable)."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.hwm_reset = False

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self.samples += 1
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self.hwm_reset = reset_peak_rss()
        self.peak = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        if self.hwm_reset:
            self.peak = max(self.peak, _peak_rss_hwm())


# --------------------------------------------------------------------------------------------------
# Environment header
# --------------------------------------------------------------------------------------------------

def _driver_version() -> str | None:
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20)
        if result.returncode == 0 and result.stdout.strip():
            return result.stdout.strip().splitlines()[0]
    except Exception:
        pass
    pynvml, _ = try_import("pynvml")
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else str(version)
        except Exception:
            pass
    return None


def _cpu_name() -> str:
    # psutil has no CPU model name; /proc/cpuinfo is the one place Linux gives it.
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    header: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "ram_bytes": int(psutil.virtual_memory().total),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        header.update({
            "gpu": props.name,
            "gpu_count": torch.cuda.device_count(),
            "gpu_memory_bytes": props.total_memory,
            "gpu_capability": f"{props.major}.{props.minor}",
            "driver": _driver_version(),
        })
        try:
            header["cuda_driver_api"] = torch._C._cuda_getDriverVersion()
        except Exception:
            pass
    else:
        header.update({"gpu": None, "driver": None})
    try:
        import fastoffload_ext
        header["fastoffload_ext"] = getattr(fastoffload_ext, "__version__", None)
        header["build_info"] = fastoffload_ext.build_info()
        header["active_backend"] = fastoffload_ext.active_backend()
        header["backend_reason"] = getattr(fastoffload_ext, "backend_reason", None)
    except Exception as error:
        header["fastoffload_ext"] = f"not importable: {error}"
        header["active_backend"] = None
    for name in ("transformers", "diffusers", "accelerate"):
        module, _ = try_import(name)
        header[name] = getattr(module, "__version__", None) if module is not None else None
    return header


def format_header(header: dict[str, Any]) -> str:
    build = header.get("build_info") or {}
    compiled = build.get("compiled", {}) if isinstance(build, dict) else {}
    lines = [
        "fastoffload_ext benchmarks",
        f"  time        {header.get('time')}   host {header.get('host')}",
        f"  gpu         {header.get('gpu') or 'none'}" + (f" x{header.get('gpu_count')}" if header.get("gpu") else "")
        + (f"   driver {header.get('driver')}" if header.get("driver") else ""),
        f"  cpu         {header.get('cpu')} ({header.get('cpu_count')} cores)   ram "
        + (f"{header['ram_bytes'] / GiB:.0f} GiB" if header.get("ram_bytes") else "?"),
        f"  torch       {header.get('torch')}   cuda {header.get('cuda_runtime')}   python {header.get('python')}",
        f"  package     fastoffload_ext {header.get('fastoffload_ext')}   "
        f"active backend: {header.get('active_backend')}"
        + (f" ({header.get('backend_reason')})" if header.get("backend_reason") else ""),
        "  build       " + (json.dumps(compiled or build, sort_keys=True) if (compiled or build)
                             else "no build info (extension not built)"),
        "  baselines   " + "  ".join(f"{name} {header.get(name) or 'missing'}"
                                     for name in ("transformers", "diffusers", "accelerate")),
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Tables and JSON
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Column:
    key: str
    header: str
    fmt: str = ""  # format spec for numbers; callables for special cases

    def render(self, value: Any) -> str:
        if value is None:
            return "—"
        if isinstance(value, bool):
            return "yes" if value else "NO"
        if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
            return "—"
        if self.fmt and isinstance(value, (int, float)):
            return format(value, self.fmt)
        return str(value)


@dataclasses.dataclass
class Table:
    title: str
    columns: list[Column]


def _note(row: dict[str, Any]) -> str:
    if row.get("error"):
        return "ERROR " + str(row["error"])
    if row.get("skipped"):
        return "skipped: " + str(row["skipped"])
    return str(row.get("note") or "")


def _cells(table: Table, rows: Iterable[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = [c.header for c in table.columns] + ["note"]
    return headers, [[c.render(row.get(c.key)) for c in table.columns] + [_note(row)[:160]] for row in rows]


def _numeric(cell: str) -> bool:
    try:
        float(cell.rstrip("x%"))
        return True
    except ValueError:
        return cell in ("—", "")


def _tabulate(headers: list[str], body: list[list[str]], tablefmt: str) -> str:
    # Figures right-aligned, labels and the note left; cells are already formatted strings, so tabulate
    # must not re-parse "1.000" as a number.
    align = ["right" if i > 0 and i < len(headers) - 1 and all(_numeric(cells[i]) for cells in body) else "left"
             for i in range(len(headers))]
    return tabulate.tabulate(body, headers=headers, tablefmt=tablefmt, disable_numparse=True, colalign=align)


def render_table(table: Table, rows: Iterable[dict[str, Any]]) -> str:
    """The table's title, then the rows through ``tabulate``; error and skip reasons go to a last 'note' column."""
    text = _tabulate(*_cells(table, rows), tablefmt="simple")
    return table.title + "\n" + "\n".join(("  " + line).rstrip() for line in text.splitlines())


def render_markdown_table(table: Table, rows: Iterable[dict[str, Any]]) -> str:
    """The rows as a GitHub Markdown table (no title); a '|' inside a cell is escaped."""
    headers, body = _cells(table, rows)
    body = [[cell.replace("|", "\\|") for cell in cells] for cells in body]
    return _tabulate(headers, body, tablefmt="github")


def sanitize(value: Any) -> Any:
    """JSON-safe copy: NaN/inf -> None, tensors/devices/dtypes -> str, tuples -> lists."""
    if isinstance(value, dict):
        return {str(k): sanitize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [sanitize(v) for v in value]
    if isinstance(value, float):
        return None if (math.isnan(value) or math.isinf(value)) else value
    if isinstance(value, (int, str, bool)) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return sanitize(value.item())
    return str(value)


def gbps(nbytes: float, ms: float | None) -> float | None:
    if not ms or ms <= 0:
        return None
    return nbytes / (ms / 1e3) / GB


def spawn_child(module: str, config: dict[str, Any], timeout: float, result_prefix: str) -> dict[str, Any]:
    """Runs ``python -m module --child CONFIG`` in its own session; returns the JSON after ``result_prefix``.

    A fresh process measures start-up and peak RSS without this one's allocations; its own session
    lets a timeout kill everything it started and nothing else.
    """
    command = [sys.executable, "-m", module, "--child", json.dumps(config)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    name = module.rsplit(".", 1)[-1]
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.communicate()
        raise TimeoutError(f"{name} child did not finish in {timeout:.0f} s") from None
    for line in stdout.splitlines():
        if line.startswith(result_prefix):
            result = json.loads(line[len(result_prefix):])
            if "child_error" in result:
                raise RuntimeError(result["child_error"])
            return result
    tail = (stderr or "").strip().splitlines()[-3:]
    raise RuntimeError(f"{name} child exited with {process.returncode} and no result: " + " | ".join(tail))
