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


def test_summary_ratios_are_taken_round_by_round_where_the_rows_shared_rounds() -> None:
    # The host ran slow in round 2 for both: each round's ratio is 10x; the medians' ratio would read 12x.
    rows = [{"workload": "W3", "backend": "ext", "ms": 30.0, "rounds_ms": [25.0, 60.0, 30.0]},
            {"workload": "W3", "backend": "python", "ms": 360.0, "rounds_ms": [250.0, 600.0, 300.0],
             "bit_equal": True},
            {"workload": "W3", "backend": "accelerate", "ms": 900.0, "rounds_ms": [900.0], "bit_equal": True}]
    assert summarize(rows) == [
        "W3: python backend (FastVideo's algorithm) / ext = 10.00x",
        "W3: fastest other offloader: python 360.00 ms; it / ext = 10.00x"]
    # Timed on its own (one round of its own): against the median.
    alone = [rows[0], {**rows[2], "ms": 240.0, "rounds_ms": [240.0]}]
    assert summarize(alone)[-1] == "W3: fastest other offloader: accelerate 240.00 ms; it / ext = 8.00x"


def _results(**tables) -> dict:
    sections: dict = {}
    for key, table_rows in tables.items():
        section, table = key.split("__")
        sections.setdefault(section, {"tables": {}})["tables"][table] = table_rows
    return {"sections": sections}


def test_targets_summary_does_not_pass_a_host_cost_whose_rows_did_not_all_run() -> None:
    from benchmarks.run import targets_summary

    ran = [{"device": "cpu", "backend": "ext", "params": p, "us_per_block": 5.0, "x_target": 0.2, "pass": True}
           for p in (4, 512)]
    failed = {"device": "cpu", "backend": "ext", "params": 136, "error": "RuntimeError: boom"}
    assert targets_summary(_results(overhead__overhead=ran)) == [
        "host cost per block on cpu: ext at most 0.20x target (worst at 4 params, 5.0 us): PASS"]
    assert targets_summary(_results(overhead__overhead=ran + [failed])) == [
        "host cost per block on cpu: ext at most 0.20x target (worst at 4 params, 5.0 us); 1 row(s) did not run "
        "(136 params): FAIL"]
    assert targets_summary(_results(overhead__overhead=[failed])) == [
        "host cost per block on cpu: ext did not run (136 params): FAIL"]


def test_targets_summary_names_a_budgets_row_that_did_not_run() -> None:
    from benchmarks.run import targets_summary

    rows = [{"workload": "W1", "budget": "50%", "error": "OutOfMemoryError: CUDA out of memory"},
            {"workload": "W2", "budget": "all", "skipped": "setup failed"}]
    assert targets_summary(_results(budgets__budgets=rows)) == [
        "budgets W1 50%: did not run (OutOfMemoryError: CUDA out of memory)",
        "budgets W2 all: did not run (setup failed)"]
