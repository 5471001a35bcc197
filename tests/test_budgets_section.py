"""The budgets benchmark section's grid and summary (pure parts; the section itself runs in the suite)."""
from __future__ import annotations

import pytest

from benchmarks.budgets import grid, summarize
from fastoffload_ext.planning import BlockCosts

MiB = 1024**2


def test_grid_holds_only_configurations_that_fit_and_runs_each_once() -> None:
    costs = BlockCosts([1.0] * 8, [10 * MiB] * 8, 50.0, activation_bytes=MiB)
    configs = grid(costs, 2 * 10 * MiB + MiB)  # room for two slots and nothing else
    # Deeper prefetch does not fit; first-0 runs the same as spread-0, so it is not run twice.
    assert configs == {"spread0/d1": {"resident_blocks": (), "prefetch_depth": 1}}
    roomy = grid(costs, 100 * 10 * MiB)
    # Every block fits at every depth: one configuration, whatever its depth.
    assert list(roomy) == ["spread8/d1"]
    mid = grid(costs, 6 * 10 * MiB + MiB)
    assert mid == {"spread4/d1": {"resident_blocks": (1, 3, 5, 7), "prefetch_depth": 1},
                   "spread3/d2": {"resident_blocks": (1, 4, 6), "prefetch_depth": 2},
                   "spread2/d3": {"resident_blocks": (2, 6), "prefetch_depth": 3},
                   "first4/d1": {"resident_blocks": 4, "prefetch_depth": 1}}


def test_summary_lines() -> None:
    rows = [{"workload": "W1", "budget": "50%", "plan": "8/16 d1", "ms": 35.0, "x_best": 1.01, "best": "plan",
             "x_ideal": 1.02, "x_floor": 0.52, "pass": True},
            {"workload": "W1", "depth": 2, "x_depth1": 0.99, "ratio_lo": 0.98, "ratio_hi": 1.01}]
    assert summarize(rows) == [
        "W1 50%: plan 8/16 d1 35.00 ms = 1.010x best grid (plan), 1.020x ideal, 0.520x floor, pass True",
        "W1 depth 2: 0.990x depth 1 (rounds 0.980..1.010)"]


class _Plan:
    host_bytes = 2 * 10**9
    copy_ms = 40.0
    overhead_ms = 1.0
    host_hooks_ms = 0.0


def _row(**figures) -> dict:
    row = {"x_best": 1.0, "best": "plan", "best_ms": 10.0, "predicted_ms": 10.0, "x_predicted": 1.0,
           "spread": 0.01, "budget_mib": 100.0}
    row.update(figures)
    return row


def _rounds(**rounds_ms: list[float]) -> dict:
    return {name: {"rounds_ms": values} for name, values in rounds_ms.items()}


def test_ideals_put_the_hooks_on_the_compute_side() -> None:
    from benchmarks.budgets import _ideals

    row = _row(ms=44.0, resident_ms=40.0, rounds=_rounds(plan=[44.0], resident=[40.0]))
    _ideals(row, _Plan(), peak_gbps=50.0, total_bytes=4 * 10**9)  # copies: 40 ms moved, 80 ms all
    assert row["ideal_ms"] == 40.0 and row["ideal_hooks_ms"] == 41.0 and row["floor_ms"] == 80.0
    assert row["x_ideal"] == 44.0 / 40.0 and row["x_ideal_hooks"] == 44.0 / 41.0 and row["x_floor"] == 0.55


class _SmallPlan:
    host_bytes = 0  # 100 %: nothing moves, the ideal is the resident model of the same round
    copy_ms = 0.0
    overhead_ms = 0.0
    host_hooks_ms = 0.0


def test_ideal_is_the_median_of_per_round_ratios_when_the_host_speed_flips() -> None:
    from benchmarks.budgets import _ideals

    # W3 at 100 % on the H200: the host flipped between ~10 and ~18 ms a step during the rounds.
    plan = [18.78, 18.44, 18.47, 9.93, 9.81]
    resident = [17.35, 18.21, 9.86, 9.78, 17.72]
    row = _row(ms=18.44, resident_ms=17.35, rounds=_rounds(plan=plan, resident=resident))
    _ideals(row, _SmallPlan(), peak_gbps=50.0, total_bytes=10**8)
    assert row["x_ideal"] == 9.93 / 9.78  # ~1.015, where the ratio of the medians is 1.063
    assert abs(row["x_ideal"] - 1.015) < 1e-3 and abs(18.44 / 17.35 - 1.063) < 1e-3
    assert row["x_ideal_range"] == [9.81 / 17.72, 18.47 / 9.86]
    assert row["x_ideal_rounds"] == f"{9.81 / 17.72:.3f}..{18.47 / 9.86:.3f}"
    assert row["x_ideal_hooks"] == row["x_ideal"]  # no hooks at 100 %


def test_each_round_is_held_to_the_copy_when_the_copy_is_longer() -> None:
    from benchmarks.budgets import _ideals, round_ratios

    # W3 at 75 %: 7.34 ms of copies, shorter than every resident round, so the resident round is the floor.
    plan, resident = [12.7, 12.25, 13.94, 12.46, 13.48], [10.88, 10.59, 13.3, 11.0, 10.42]
    assert round_ratios(plan, resident, at_least_ms=7.34) == [p / r for p, r in zip(plan, resident)]
    # A round whose resident model ran under the copy is held to the copy instead.
    assert round_ratios([12.0, 12.0], [10.0, 6.0], at_least_ms=8.0) == [1.2, 1.5]
    assert round_ratios([12.0], [10.0], add_ms=2.0) == [1.0]

    class _Moving:
        host_bytes = 4 * 10**8  # 8 ms at 50 GB/s
        copy_ms = 8.0
        overhead_ms = 1.0
        host_hooks_ms = 0.5  # below the device's: the larger of the two counts

    row = _row(ms=12.0, resident_ms=8.0, rounds=_rounds(plan=[12.0, 12.0, 9.0], resident=[10.0, 6.0, 9.0]))
    _ideals(row, _Moving(), peak_gbps=50.0, total_bytes=8 * 10**8)  # 16 ms to move every block
    assert row["x_ideal"] == 1.2 and row["x_ideal_range"] == [1.0, 1.5]
    assert row["x_ideal_hooks"] == 12.0 / 11.0 and row["x_ideal_hooks_range"] == [9.0 / 10.0, 12.0 / 8.0]
    assert row["x_floor"] == 12.0 / 16.0 and row["x_floor_range"] == [9.0 / 16.0, 12.0 / 16.0]


def test_blocks_that_stay_in_the_slots_move_nothing_in_the_ideal() -> None:
    from benchmarks.budgets import _ideals
    from fastoffload_ext.planning import plan_offload

    # Two offloaded blocks and two slots: after the first step both stay in the slots and no copy runs.
    costs = BlockCosts([1.0] * 4, [100 * MiB] * 4, 50.0)
    plan = plan_offload(costs, 10**12, resident=(0, 1), prefetch_depth=1)
    assert plan.num_slots == 2 and plan.host_bytes == 200 * MiB and plan.copy_ms == 0.0
    row = _row(ms=4.2, resident_ms=4.0, rounds=_rounds(plan=[4.2, 4.4], resident=[4.0, 4.0]))
    _ideals(row, plan, peak_gbps=50.0, total_bytes=400 * MiB)  # 200 MiB would read 4.19 ms at 50 GB/s
    assert row["copy_ms"] == 0.0 and row["ideal_ms"] == 4.0
    assert row["x_ideal"] == (4.2 / 4.0 + 4.4 / 4.0) / 2 and row["x_ideal_range"] == [4.2 / 4.0, 4.4 / 4.0]


def test_round_ratios_refuse_unmatched_rounds() -> None:
    from benchmarks.budgets import round_ratios

    with pytest.raises(ValueError, match="per-round ratios need the same number of rounds on both sides, got 2 and 1"):
        round_ratios([1.0, 2.0], [1.0])


def test_the_hooks_host_cost_counts_where_the_plan_is_host_bound() -> None:
    from benchmarks.budgets import _ideals

    class _HostBound:
        host_bytes = 0
        copy_ms = 0.0
        overhead_ms = 0.0
        host_hooks_ms = 1.76  # W3 at 75 %: 16 offloaded blocks at 110 us of host time each

    row = _row(ms=12.7, resident_ms=10.88, rounds=_rounds(plan=[12.7, 12.25], resident=[10.88, 10.59]))
    _ideals(row, _HostBound(), peak_gbps=50.0, total_bytes=10**8)
    assert row["hooks_ms"] == 1.76 and row["x_ideal_hooks"] == (12.7 / 12.64 + 12.25 / 12.35) / 2


def test_against_resident_takes_the_host_drift_out_of_the_prediction() -> None:
    from benchmarks.budgets import _against_resident
    from benchmarks.interleave import Interleaved
    from fastoffload_ext.planning import BlockCosts, plan_offload

    costs = BlockCosts([0.05] * 8, [10 * MiB] * 8, 50.0, host_ms=[1.0] * 8, host_overhead_ms=0.1)
    plan = plan_offload(costs, 6 * 10 * MiB)  # 4 resident + 2 slots: predicted 8.4 ms, all resident 8.0
    # The host ran twice as slow in the rounds as in the calibration, on both sides alike.
    rounds = Interleaved({"plan": [16.8, 16.8, 16.8], "resident": [16.0, 16.0, 16.0]})
    figures = _against_resident(rounds, plan)
    assert figures["resident_predicted_ms"] == 8.0 and figures["host_bound"] is True
    assert figures["host_hooks_ms"] == pytest.approx(0.4) and figures["host_ms"] == pytest.approx(8.4)
    assert figures["x_predicted_resident"] == pytest.approx(1.0, rel=1e-12)


def test_notes_name_each_missed_target_and_its_reason() -> None:
    from benchmarks.budgets import _misses
    from benchmarks.workloads import stack_workload

    w1 = stack_workload("W1", cpu=True)
    fine = _row(x_ideal=1.01, x_ideal_hooks=1.0, copy_ms=5.0, resident_ms=10.0, mem_ok=True, x_floor=0.5)
    assert _misses(fine, "50%", w1) == []
    hooks = _row(x_ideal=1.08, x_ideal_hooks=1.02, hooks_ms=0.4, copy_ms=1.0, resident_ms=2.4)
    assert _misses(hooks, "auto", w1) == ["x ideal 1.080: the hooks' fixed cost (0.40 ms a step) accounts for it"]
    slow = _row(x_best=1.07, best="spread15/d1", best_ms=40.0, predicted_ms=45.0, x_predicted=0.95, spread=0.12,
                x_ideal=1.09, x_ideal_hooks=1.08, copy_ms=50.0, resident_ms=42.0, mem_ok=False, peak_mib=101.5)
    notes = _misses(slow, "0%", w1)
    assert notes[0].startswith("x best 1.070: spread15/d1 ran 40.00 ms") and "round spread 12%" in notes[0]
    assert notes[1].startswith("x ideal 1.090: transfer-bound")
    assert notes[2] == "peak 101.5 MiB over the 100.0 MiB budget"
    mixed = _row(x_ideal=1.19, x_ideal_hooks=1.18, copy_ms=88.0, resident_ms=84.0, predicted_ms=107.0,
                 plan_ideal_ms=88.0, mem_ok=True)
    host = _row(x_ideal=1.17, x_ideal_hooks=1.08, copy_ms=7.3, resident_ms=10.9, predicted_ms=11.8,
                plan_ideal_ms=10.0, host_bound=True, host_ms=11.76, host_hooks_ms=1.76)
    assert _misses(host, "75%", w1) == [
        "x ideal 1.170: host-bound; the host was predicted to dispatch the step in 11.76 ms, 1.76 ms of it the "
        "offload hooks, and the plan ran 1.080x the resident model plus those hooks"]
    assert _misses(mixed, "0%", w1) == [
        "x ideal 1.190: the per-block schedule; the plan was predicted 107.00 ms = 1.216x its ideal: copy-bound "
        "blocks expose their copies and compute-bound ones leave the copy stream idle, and the budget keeps too few "
        "copy-bound blocks resident to even that out"]


def test_a_missed_ideal_inside_the_control_rounds_is_noted_as_noise() -> None:
    from benchmarks.budgets import _misses, control_figures
    from benchmarks.workloads import stack_workload

    w3 = stack_workload("W3", cpu=True)
    control = control_figures([1.0, 0.9, 1.2, 1.05, 0.97])
    assert control == {"x_control": 1.0, "x_control_range": [0.9, 1.2], "control": "1.000 [0.900..1.200]"}
    host = dict(x_ideal=1.15, x_ideal_hooks=1.04, hooks_ms=0.9, copy_ms=1.0, resident_ms=10.0)
    notes = _misses(_row(**host, **control), "75%", w3)
    assert notes == ["x ideal 1.150: the hooks' fixed cost (0.90 ms a step) accounts for it",
                     "inside this row's noise: the resident model against itself ran 1.000x [0.900, 1.200] in the "
                     "same rounds"]
    quiet = control_figures([1.0, 0.99, 1.01])
    assert _misses(_row(**host, **quiet), "75%", w3) == notes[:1]
    assert _misses(_row(**host), "75%", w3) == notes[:1]  # rows from before the control have none



def test_an_all_resident_row_that_misses_is_named_as_two_objects_of_one_model() -> None:
    from benchmarks.budgets import _misses
    from benchmarks.workloads import stack_workload

    w3 = stack_workload("W3", cpu=True)
    resident = _row(x_ideal=1.157, x_ideal_hooks=1.157, hooks_ms=0.0, copy_ms=0.0, resident_ms=15.86)
    assert _misses(resident, "auto", w3) == [
        "x ideal 1.157: nothing is offloaded (no copy, no hook), so this is a second resident model object against "
        "the first; the host runs two objects of one model at different speeds (the control times one object "
        "against itself)"]


class _Ctx:
    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


def test_workload_selector_picks_and_orders_what_it_names_and_notes_the_rest() -> None:
    from benchmarks.budgets import selected_keys

    full, quick = _Ctx(quick=False), _Ctx(quick=True)
    assert selected_keys(full, None) == ["W1", "W2", "W3", "W4", "wan-1.3b", "flux"]
    assert selected_keys(quick, " ") == ["W1", "W4", "wan-1.3b", "flux"]
    assert selected_keys(full, "w1, W2,W3,w4") == ["W1", "W2", "W3", "W4"] and not full.notes
    assert selected_keys(full, "Wan-1.3B,flux,flux,W9") == ["wan-1.3b", "flux"]
    assert full.notes == ["BENCHMARK_BUDGETS_WORKLOADS: unknown workload(s) w9 ignored; known: W1, W2, W3, W4, "
                          "wan-1.3b, flux"]


def test_the_auto_choice_reuses_the_configuration_it_runs_the_same_as() -> None:
    from benchmarks.budgets import _auto_config
    from fastoffload_ext.planning import choose_codec_plan, plan_offload

    block = 10 * MiB
    raw = BlockCosts([0.1] * 8, [block] * 8, 50.0)
    coded = BlockCosts([0.1] * 8, [block] * 8, 50.0, transfer_bytes=[int(0.75 * block)] * 8)
    budget = 2 * block + 4 * block
    plans = {"raw": plan_offload(raw, budget), "coded": plan_offload(coded, budget),
             "auto": choose_codec_plan(raw, coded, budget)}
    assert _auto_config(plans) == "raw"  # few large blocks: the staging costs more than coding saves
    plans["auto"] = plans["coded"]
    assert _auto_config(plans) == "coded"
    plans["auto"] = plan_offload(raw, budget, resident=(0, 1, 2))
    assert _auto_config(plans) is None


def test_compressed_row_passes_when_auto_is_as_fast_as_the_faster_kind() -> None:
    from benchmarks.budgets import _judge_compressed

    class _Cuda:
        cuda = True

    shared = {"peak_gbps": 50.0, "block_bytes": [10**9] * 4}  # 80 ms floor
    rounds = _rounds(coded=[40.0, 44.0, 40.0], raw=[40.0] * 3, resident=[10.0, 90.0, 10.0], auto=[34.0, 30.0, 36.0])
    good = _judge_compressed(_Cuda(), {"bit_equal": True, "x_auto_raw": 1.0, "x_auto_coded": 0.85, "ms": 40.0,
                                       "auto_ms": 34.0, "resident_ms": 10.0, "rounds": rounds}, 90 * MiB, 100 * MiB,
                             shared)
    assert good["pass"] is True and good["mem_ok"] is True
    # Per round: the second round's floor is its resident model (90 ms), not the copy of every block.
    assert good["x_floor_auto"] == 34.0 / 80.0 and good["x_floor"] == 40.0 / 80.0
    same = _judge_compressed(_Cuda(), {"bit_equal": True, "x_auto_raw": 1.0, "x_auto_coded": 1.0, "ms": 40.0,
                                       "auto_ms": 40.0, "resident_ms": 10.0, "rounds": rounds,
                                       "auto_config": "raw"}, 90 * MiB, 100 * MiB, shared)
    assert same["x_floor_auto"] == 40.0 / 80.0
    slow = _judge_compressed(_Cuda(), {"bit_equal": True, "x_auto_raw": 1.17, "x_auto_coded": 1.0, "ms": 40.0,
                                       "auto_ms": 40.0, "resident_ms": 10.0, "rounds": rounds}, 90 * MiB, 100 * MiB,
                             shared)
    assert slow["pass"] is False
    over = _judge_compressed(_Cuda(), {"bit_equal": True, "x_auto_raw": 1.0, "x_auto_coded": 1.0, "ms": 40.0,
                                       "auto_ms": 40.0, "resident_ms": 10.0, "rounds": rounds}, 101 * MiB, 100 * MiB,
                             shared)
    assert over["pass"] is False and over["mem_ok"] is False


def test_compressed_row_checks_the_configuration_the_auto_pick_ran_as(tmp_path, monkeypatch) -> None:
    import copy

    import torch

    from benchmarks import budgets
    from benchmarks.utils import Context, Options
    from benchmarks.workloads import stack_workload

    ctx = Context("budgets", Options(quick=True, device="cpu", progress=False), str(tmp_path / "journal.jsonl"))
    workload = stack_workload("W4", cpu=True)
    master = workload.build_host()
    inputs = workload.make_inputs(ctx.device)
    resident = copy.deepcopy(master)
    with torch.inference_mode():
        reference = resident(*inputs[0]).detach().clone()
    block_bytes = [sum(p.numel() * p.element_size() for p in block.parameters()) for block in master.blocks]
    costs = BlockCosts([1.0] * len(block_bytes), block_bytes, 50.0)
    budget = 2 * max(block_bytes) + sum(block_bytes) // 2
    made = budgets._coded_plans

    def auto_picks_raw(*args):
        plans = made(*args)
        return {**plans, "auto": plans["raw"]}

    # The raw configuration's output differs; the coded one's does not.
    monkeypatch.setattr(budgets, "_coded_plans", auto_picks_raw)
    monkeypatch.setattr(budgets.Config, "bit_equal", lambda self, reference: self.group.plan.compressed)
    shared = {"peak_gbps": None, "block_bytes": block_bytes, "reference": reference,
              "resident_timer": lambda iters: (lambda: ctx.time_ms(lambda: resident(*inputs[0]), warmup=0,
                                                                   iters=iters))}
    try:
        row = budgets._compressed_row(ctx, master, workload, inputs, costs, budget, shared)
    finally:
        ctx.close()
    assert row["auto_config"] == "raw" and row["plan"].startswith("coded")
    assert row["bit_equal"] is False  # the pick ran as the raw configuration, whose output differs


def _scripted(values: list[float]):
    """A timer that returns the next of ``values`` (one sample a call, as a round's median)."""
    left = iter(values)
    return lambda: [next(left)]


def test_the_best_configuration_is_timed_against_the_plan_in_rounds_of_its_own() -> None:
    from benchmarks.budgets import _against_best
    from benchmarks.interleave import run_interleaved

    # In the choosing rounds one lucky round puts "spread/d2" ahead; timed again with the plan, it runs as the plan.
    timers = {"plan": _scripted([10.0, 10.0, 10.0, 10.0, 10.0, 10.0]),
              "spread/d2": _scripted([7.0, 10.4, 9.6, 10.0, 10.0, 10.0])}
    rounds = run_interleaved(timers, rounds=3)
    best = min(timers, key=rounds.median_ms)
    assert best == "spread/d2"
    figures = _against_best(rounds, best, timers, 3)
    assert figures["best_confirmed"] is True
    assert figures["x_best_selection"] == pytest.approx(10.0 / 9.6)
    assert figures["x_best"] == 1.0 and figures["x_best_range"] == [1.0, 1.0]
    assert figures["best_ms"] == 9.6


def test_a_plan_the_choosing_rounds_put_first_is_timed_again_against_the_fastest_other() -> None:
    from benchmarks.budgets import CONTROL, RESIDENT, _against_best
    from benchmarks.interleave import run_interleaved

    # One lucky round puts the plan first; timed again with the fastest other configuration, it is 4 % slower.
    timers = {"plan": _scripted([6.0, 9.8, 10.4, 10.4, 10.4, 10.4]),
              "spread/d2": _scripted([10.0, 10.0, 10.0, 10.0, 10.0, 10.0]),
              "first4/d1": _scripted([11.0, 11.0, 11.0]),
              RESIDENT: _scripted([9.0, 9.0, 9.0]), CONTROL: _scripted([9.0, 9.0, 9.0])}
    rounds = run_interleaved(timers, rounds=3)
    chosen = min(("plan", "spread/d2", "first4/d1"), key=rounds.median_ms)
    assert chosen == "plan"
    figures = _against_best(rounds, chosen, timers, 3)
    assert figures["best"] == "spread/d2" and figures["chosen"] == "plan" and figures["best_confirmed"] is True
    assert figures["x_best"] == pytest.approx(1.04) and figures["x_best"] > figures["x_best_selection"]


def test_a_plan_with_nothing_to_compare_with_is_its_own_best() -> None:
    from benchmarks.budgets import RESIDENT, _against_best
    from benchmarks.interleave import run_interleaved

    timers = {"plan": _scripted([9.0, 9.0]), RESIDENT: _scripted([8.0, 8.0])}
    rounds = run_interleaved(timers, rounds=2)
    figures = _against_best(rounds, "plan", timers, 2)
    assert figures["x_best"] == 1.0 and figures["best"] == "plan" and figures["best_confirmed"] is False
    assert "confirm_rounds" not in figures