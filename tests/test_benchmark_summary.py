"""The forward section's summary lines: the verdicts the README and the closing notes quote."""
from __future__ import annotations

from benchmarks.forward import summarize


def test_summary_names_the_fastest_other_offloader_and_flags_a_wrong_one() -> None:
    rows = [
        {"workload": "W3", "backend": "floor", "ms": 29.0},
        {"workload": "W3", "backend": "ext", "ms": 30.0, "pass": True, "target": "<=1.10x floor",
         "x_floor": 1.034, "x_resident": 2.9},
        {"workload": "W3", "backend": "python", "ms": 300.0, "bit_equal": True},
        {"workload": "W3", "backend": "diffusers", "ms": 240.0, "bit_equal": True},
        {"workload": "W3", "backend": "diffusers leaf", "ms": 69.0, "bit_equal": False},
        {"workload": "W3", "backend": "accelerate", "ms": None},
    ]
    assert summarize(rows) == [
        "W3: ext 30.00 ms meets its target <=1.10x floor (x floor 1.034, x resident 2.900)",
        "W3: python backend (FastVideo's algorithm) / ext = 10.00x",
        "W3: fastest other offloader: diffusers leaf 69.00 ms, not bit-equal; it / ext = 2.30x",
    ]


def test_summary_without_peers_has_no_peer_line() -> None:
    rows = [{"workload": "W1", "backend": "ext", "ms": 66.0, "pass": False, "target": "<=1.03x floor",
             "x_floor": 1.05, "x_resident": 28.0}]
    assert summarize(rows) == [
        "W1: ext 66.00 ms MISSES its target <=1.03x floor (x floor 1.050, x resident 28.000)"]
