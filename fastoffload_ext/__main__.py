"""``python -m fastoffload_ext``: what is installed, which backend is active, and why.

The first thing to paste into a bug report. It answers the questions that decide which code path a
run takes: did the compiled core load (or is the pure-Python backend running, and for what reason),
was it built with CUDA and for which torch, and what GPUs this process sees. It must work on every
machine the package imports on, so every query that can fail (a broken driver, a device that cannot
be named) prints what went wrong instead of raising, and the exit code is 0.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any, TextIO

import torch

import fastoffload_ext
from fastoffload_ext import _backend


def _device_queries() -> tuple[Callable[[int], str], Callable[[int], bool]]:
    """``(device_name, has_unified_memory)``: the platform module's when it is there, else torch's.

    Imported lazily: the platform module is optional for this report, and a report that fails because
    one helper module is missing or broken would hide the answers it exists to give.
    """
    try:
        platform = importlib.import_module("fastoffload_ext.policy.platform")
        return platform.device_name, platform.has_unified_memory
    except (ImportError, AttributeError):
        return (lambda index: str(torch.cuda.get_device_properties(index).name),
                lambda index: bool(torch.cuda.get_device_properties(index).is_integrated))


def _format_flags(flags: Any) -> str:
    if not flags:
        return "(none recorded)"
    return " ".join(str(flag) for flag in flags)


def report(out: TextIO = sys.stdout) -> None:
    """Writes the report to ``out``."""
    lines = [f"fastoffload_ext {fastoffload_ext.__version__}"]
    lines.append(f"backend:          {fastoffload_ext.active_backend()} ({fastoffload_ext.backend_reason})")
    lines.append(f"torch:            {torch.__version__} (CUDA {torch.version.cuda or 'none: CPU-only torch'})")

    info = fastoffload_ext.build_info()
    compiled = info.get("compiled")
    if compiled is not None:
        flavour = "CUDA" if _backend.ext_has_cuda() else "CPU-only"
        cuda_version = compiled.get("cuda_version") or "-"
        lines.append(f"extension:        {flavour} build for torch {compiled.get('torch')}, CUDA {cuda_version}, "
                     f"alignment {compiled.get('alignment')} B")
    else:
        lines.append("extension:        not loaded")
    if info.get("torch") is not None:
        recorded = "CUDA" if info.get("cuda_build") else "CPU-only"
        lines.append(f"recorded build:   {recorded} for torch {info.get('torch')} (Python {info.get('python')}): "
                     f"{info.get('why')}")
        lines.append(f"build flags:      {_format_flags(info.get('cxx_flags'))}")
    else:
        lines.append("recorded build:   none (no _build_info.json: the extension was never built here)")

    try:
        available = bool(torch.cuda.is_available())
        count = torch.cuda.device_count() if available else 0
    except Exception as error:  # a broken driver install can raise from the probe itself
        lines.append(f"CUDA at runtime:  unavailable ({type(error).__name__}: {error})")
        available, count = False, 0
    else:
        lines.append(f"CUDA at runtime:  {'available' if available else 'not available'}, {count} GPU(s) visible")

    if count:
        device_name, has_unified_memory = _device_queries()
        for index in range(count):
            try:
                memory = "unified memory" if has_unified_memory(index) else "discrete memory"
                lines.append(f"  cuda:{index}  {device_name(index)}, {memory}")
            except Exception as error:
                lines.append(f"  cuda:{index}  could not be queried ({type(error).__name__}: {error})")
    out.write("\n".join(lines) + "\n")


def main() -> int:
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
