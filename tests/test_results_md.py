"""docs/RESULTS.md is rendered from results.json: the rendering, on a fixed fixture."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.results_md import BEGIN, END, render_latest, update_results_md
from benchmarks.run import main


@pytest.fixture()
def results() -> dict[str, Any]:
    """A results.json of one quick GPU run, cut down to two workloads of the forward section."""
    return {
        "header": {"time": "2026-12-01T08:00:00+0000", "host": "gpu-host", "gpu": "NVIDIA H200", "gpu_count": 1,
                   "driver": "580.1", "cpu": "Xeon", "cpu_count": 16, "ram_bytes": 128 * 2**30, "torch": "2.14.1",
                   "cuda_runtime": "13.0", "fastoffload_ext": "0.1.0", "active_backend": "ext"},
        "options": {"quick": True, "device_used": "cuda", "prefetch_depth": 1, "resident_blocks": None,
                    "sections": ["forward"]},
        "wall_s": 171.4,
        "targets": ["forward W1: ext 66.82 ms = 1.005x floor, 1.005x resident; target <=1.03x floor: PASS"],
        "sections": {"forward": {
            "status": "ok", "wall_s": 90.25, "notes": ["peak H2D 54.5 GB/s"],
            "summary": ["W1: ext 66.82 ms meets its target <=1.03x floor"],
            "tables": {"forward": [
                {"workload": "W1", "backend": "resident", "ms": 66.47, "x_resident": 1.0, "x_floor": 1.0},
                {"workload": "W1", "backend": "ext", "ms": 66.8249, "x_floor": 1.00532, "x_resident": 1.0053,
                 "spread": 0.0123, "bit_equal": True, "mem_ok": True, "target": "<=1.03x floor", "pass": True},
                {"workload": "W1", "backend": "diffusers", "ms": 69.94, "bit_equal": False,
                 "note": "output != resident: max |diff| 50.2"},
                {"workload": "W2", "backend": "accelerate", "skipped": "slow baseline (~8x floor): skipped under --quick"},
            ]},
        }},
    }


def test_latest_run_renders_environment_summary_and_tables(results: dict[str, Any]) -> None:
    text = render_latest(results)
    lines = text.splitlines()
    assert lines[0] == "## Latest run"
    assert "- gpu: NVIDIA H200 x1, driver 580.1; cpu: Xeon (16 cores, 128 GiB RAM)" in lines
    assert "- run: quick, device cuda, prefetch_depth 1, resident_blocks 0, sections forward; 171 s" in lines
    assert "- forward W1: ext 66.82 ms = 1.005x floor, 1.005x resident; target <=1.03x floor: PASS" in lines
    assert "### forward: median forward time per workload and backend" in lines
    rows = [line for line in lines if line.startswith("| W")]
    assert len(rows) == 4
    ext = [cell.strip() for cell in rows[1].strip("|").split("|")]
    assert ext[:6] == ["W1", "ext", "66.82", "1.005", "1.005", "0.012"]
    assert ext[-4:] == ["yes", "<=1.03x floor", "yes", ""]
    # A '|' inside a note must not open a new column.
    assert rows[2].rstrip(" |").endswith(r"output != resident: max \|diff\| 50.2")
    assert rows[3].rstrip(" |").endswith("skipped: slow baseline (~8x floor): skipped under --quick")
    assert "- W1: ext 66.82 ms meets its target <=1.03x floor" in lines
    assert "- note: peak H2D 54.5 GB/s" in lines


def test_update_replaces_only_the_latest_run_block(tmp_path: Path, results: dict[str, Any]) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text(f"# Results\n\nintro\n\n{BEGIN}\nold figures\n{END}\n\n## History\n\nRun 1: 66.47 ms\n")
    update_results_md(path, results)
    text = path.read_text()
    assert "old figures" not in text
    assert text.startswith("# Results\n\nintro\n\n" + BEGIN + "\n## Latest run\n")
    assert text.endswith(END + "\n\n## History\n\nRun 1: 66.47 ms\n")
    update_results_md(path, results)
    assert path.read_text() == text  # rendering is deterministic: a second write changes nothing


def test_update_creates_the_file_with_an_empty_history(tmp_path: Path, results: dict[str, Any]) -> None:
    path = tmp_path / "docs" / "RESULTS.md"
    update_results_md(path, results)
    text = path.read_text()
    assert text.startswith("# Results\n")
    assert text.index(BEGIN) < text.index("## Latest run") < text.index(END) < text.index("## History")


def test_from_json_renders_without_running_and_needs_a_target(tmp_path: Path, results: dict[str, Any],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    import json

    source = tmp_path / "results.json"
    source.write_text(json.dumps(results))
    target = tmp_path / "RESULTS.md"
    assert main(["--from-json", str(source), "--results-md", str(target)]) == 0
    assert "| W1" in target.read_text()
    with pytest.raises(SystemExit):
        main(["--from-json", str(source)])
    assert "--from-json needs --results-md PATH" in capsys.readouterr().err
