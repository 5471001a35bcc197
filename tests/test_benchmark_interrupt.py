"""A benchmark run cut short by SIGTERM (a `timeout` around it) still writes the rows it measured."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sigterm_keeps_the_rows_measured_so_far(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    # The run's journals go under its own TMPDIR, so only this run's journal is watched.
    env = {**os.environ, "BENCHMARKS_INJECT_FAULT": "overhead:hang", "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(scratch)}
    command = [sys.executable, "-m", "benchmarks", "--quick", "--device", "cpu", "--only", "overhead,lazy",
               "--no-progress", "--no-plots", "--out", str(tmp_path / "out")]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    journal_seen = False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not journal_seen:
        # The injected row is written before the section hangs; wait for it in the run's journal.
        for journal in scratch.glob("fastoffload-bench-*/overhead.jsonl"):
            journal_seen = journal_seen or "a row before the injected fault" in journal.read_text()
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    assert journal_seen, output
    assert process.returncode == 0, output
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["sections"]["overhead"]["status"] == "interrupted: the rows measured before it are kept"
    assert results["sections"]["lazy"]["status"] == "not run: the run was interrupted"
    rows = [row for table in results["sections"]["overhead"]["tables"].values() for row in table]
    assert any(row.get("note") == "a row before the injected fault" for row in rows), rows
