"""The benchmark suite's command line: --help names every environment variable a section reads."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _variables_read_by_sections() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "benchmarks").glob("*.py"):
        names |= set(re.findall(r'"(BENCHMARK_[A-Z0-9_]+)"', path.read_text()))
    return names


def test_help_lists_every_environment_variable_the_sections_read() -> None:
    from benchmarks import run

    read = _variables_read_by_sections()
    assert {"BENCHMARK_BUDGETS_WORKLOADS", "BENCHMARK_MODELS", "BENCHMARK_MODELS_BUDGET_S"} <= read
    assert read == set(run.ENVIRONMENT), f"listed in benchmarks/run.py ENVIRONMENT but not read, or the reverse: " \
                                         f"{sorted(read ^ set(run.ENVIRONMENT))}"
    shown = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout
    assert "environment variables:" in shown
    for name in read:
        assert f"  {name}  " in shown, name
    for section in run.SECTIONS:
        assert section in shown, section
