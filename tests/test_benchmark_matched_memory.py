"""ext given the device memory a faster peer took (``benchmarks/matched_memory.py``): the arithmetic, the row's
figures and summary, and the models section's path that builds and times it, run on the host."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import matched_memory, model_rows
from benchmarks.interleave import Interleaved
from benchmarks.phases import PhaseLog
from benchmarks.steady import SteadyTimer
from benchmarks.utils import GB, Context, Options
from fastoffload_ext.planning import plan_offload


def test_the_budget_is_the_peers_footprint_less_what_both_keep_resident() -> None:
    assert matched_memory.budget_from(persistent=11 * GB, reserve=5 * GB, kept_bytes=10 * GB) == 6 * GB
    # ext with default settings: k+1 slots of the largest block and the activations.
    assert matched_memory.least_ext_bytes(1, 2 * GB, GB) == 5 * GB
    assert matched_memory.least_ext_bytes(2, 2 * GB, 0) == 6 * GB


def test_the_cost_table_takes_the_offloaded_lists_blocks_and_counts_the_rest_as_other() -> None:
    blocks = [torch.nn.Linear(8, 8, bias=False) for _ in range(2)]  # 256 bytes each
    # Two lists: "doubles" (2 blocks, offloaded) then "singles" (3 blocks, resident); a 20 ms step.
    costs = matched_memory.costs_for([3.0, 4.0, 1.0, 1.0, 1.0], 20.0, ["doubles", "singles"],
                                     {"doubles": 2, "singles": 3}, ["doubles"], blocks, 50.0, 1000)
    assert costs.compute_ms == (3.0, 4.0) and costs.other_ms == pytest.approx(13.0)
    assert costs.block_bytes == (256, 256) and costs.activation_bytes == 1000 and costs.h2d_gbps == 50.0
    # The second list alone: its three blocks.
    three = [torch.nn.Linear(8, 8, bias=False) for _ in range(3)]
    costs = matched_memory.costs_for([3.0, 4.0, 1.0, 1.0, 1.0], 20.0, ["doubles", "singles"],
                                     {"doubles": 2, "singles": 3}, ["singles"], three, 50.0, 0)
    assert costs.compute_ms == (1.0, 1.0, 1.0) and costs.other_ms == pytest.approx(17.0)
    with pytest.raises(ValueError, match="2 block times for 3 offloaded blocks"):
        matched_memory.costs_for([3.0, 4.0, 1.0, 1.0, 1.0], 20.0, ["doubles", "singles"],
                                 {"doubles": 2, "singles": 3}, ["doubles"], three, 50.0, 0)


def test_a_peer_is_matched_only_where_it_was_faster_in_every_round_or_beyond_the_tie_band() -> None:
    faster = Interleaved({"fastvideo|a": [9.0, 9.1, 8.9], "ext|a": [10.0, 10.0, 10.0]})
    assert matched_memory.peer_was_faster(faster, "fastvideo|a", "ext|a")
    tied = Interleaved({"fastvideo|a": [9.9, 10.1, 9.9], "ext|a": [10.0, 10.0, 10.0]})
    assert not matched_memory.peer_was_faster(tied, "fastvideo|a", "ext|a")
    slower = Interleaved({"fastvideo|a": [11.0, 12.0, 11.0], "ext|a": [10.0, 10.0, 10.0]})
    assert not matched_memory.peer_was_faster(slower, "fastvideo|a", "ext|a")


def _figures(footprint: int) -> dict[str, Any]:
    blocks = [torch.nn.Linear(8, 8, bias=False) for _ in range(4)]
    costs = matched_memory.costs_for([1.0] * 4, 6.0, ["blocks"], {"blocks": 4}, ["blocks"], blocks, 1e-6, 0)
    plan = plan_offload(costs, 3 * 256)  # two slots and one resident block
    return {"budget": 3 * 256, "kept": 100, "peer_footprint": 1000, "footprint": footprint, "plan": plan,
            "bit_equal": True}


def test_the_row_reads_ext_under_the_peers_memory_against_the_peer_round_by_round() -> None:
    name = "ext, fastvideo's memory|a"
    result = Interleaved({"resident|a": [10.0, 10.0, 20.0], "ext|a": [30.0, 30.0, 60.0],
                          "fastvideo|a": [25.0, 26.0, 50.0], name: [24.0, 26.0, 51.0]})
    values = matched_memory.row_values(result, name, "fastvideo", "a", "ext", 22.0, _figures(900))
    assert values["x_peer"] == pytest.approx(1.0) and values["x_peer_range"] == "[0.960, 1.020]"
    assert values["x_ext"] == pytest.approx(0.85) and values["vs_ext"] == "ext"
    assert values["x_resident"] == pytest.approx(2.55) and values["x_floor"] == pytest.approx(26.0 / 22.0)
    assert values["pass"] is True and values["mem_ok"] is True and values["bit_equal"] is True
    assert values["note"].startswith("device_budget 0.00 GB: what fastvideo held on the device")
    assert "keeps 1 block(s) resident" in values["note"] and "ran 1.000x fastvideo [0.960, 1.020]" in values["note"]
    # A peer still faster in every round fails the row; a footprint above the peer's fails its memory column.
    slower = Interleaved({**result.rounds, name: [27.0, 28.0, 55.0]})
    values = matched_memory.row_values(slower, name, "fastvideo", "a", "ext", None, _figures(1001))
    assert values["pass"] is False and values["mem_ok"] is False and "x_floor" not in values


def test_the_summary_gives_ext_under_the_faster_peers_memory_beside_the_peer() -> None:
    rows = [
        {"model": "flux", "tokens": "9216", "backend": "ext", "ms": 500.0, "x_floor": 1.16},
        {"model": "flux", "tokens": "9216", "backend": "fastvideo", "ms": 434.0, "vs_ext": "ext", "x_ext": 0.867,
         "x_ext_max": 0.87, "range": "[0.867, 0.870]"},
        {"model": "flux", "tokens": "9216", "backend": "ext, fastvideo's memory", "ms": 430.0, "vs_ext": "ext",
         "peer": "fastvideo", "x_peer": 0.99, "x_peer_range": "[0.98, 1.00]", "x_floor": 1.0},
    ]
    lines = model_rows.summarize(rows)
    peer_line = next(line for line in lines if "fastest peer vs ext:" in line)
    assert "faster than every peer offloading the same lists: NO" in peer_line
    assert peer_line.endswith("; given fastvideo's device memory, ext ran 0.990x fastvideo [0.98, 1.00]")
    assert any(line.startswith("flux 9216: ext, fastvideo's memory 430.00 ms") for line in lines)


def _host_run(tmp_path: Path, spec_name: str) -> tuple[Context, Any, Any]:
    pytest.importorskip("diffusers", reason="diffusers is not installed (scripts/setup_env.sh installs it)")
    from benchmarks import models

    ctx = Context("models", Options(device="cpu", progress=False), str(tmp_path / "journal.jsonl"))
    run = models._prepare(ctx, models.MODELS[spec_name], models.enable_layerwise_offload,
                          PhaseLog("models", echo=False))
    run.first = models._first_session(ctx, run)  # the block clocks the plan is made from
    return ctx, run, models


def test_the_section_times_ext_under_the_peers_memory_bit_equal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU-only path on the host: the peer is a second resident-fed forward, the device's counters are faked."""
    ctx, run, models = _host_run(tmp_path, "flux")
    try:
        # Every list (five blocks): with two slots the first list's two blocks would need no copy at all.
        config = run.configs[-1]
        ctx.cuda = True  # the peers' path; the device stays the host
        # CUDA events would need a device: the host path of the same timer.
        monkeypatch.setattr(models, "_timer", lambda ctx, fn, iters: SteadyTimer(fn, iters, False))
        monkeypatch.setattr(models, "steady_reserve", lambda forward, count: 0)
        rest = run.model_bytes - run.part_bytes(frozenset(config.lists))
        largest = config.largest_block
        holder = {"config": config, "parts": frozenset(config.lists), "persistent": rest + 3 * largest}
        labels, values, skipped, error = models._matched_row(ctx, run, "fastvideo", holder,
                                                             run.forwards["ext all lists|small"], "small", 1e9, 1e-6)
        assert skipped is None and error is None, (skipped, error)
        assert labels["backend"] == "ext, fastvideo's memory" and values["bit_equal"] is True
        assert values["peer"] == "fastvideo" and values["vs_ext"] == "ext all lists"
        assert isinstance(values["pass"], bool) and values["mem_ok"] is True  # host timings decide the first
        # Copies at 1e-6 GB/s: the plan keeps what the budget holds resident.
        assert re.search(r"keeps [1-3] block\(s\) resident", values["note"]), values["note"]
        # A peer that held no more than ext's two slots: nothing to match, and the row says so.
        holder["persistent"] = rest + largest
        _, values, skipped, _ = models._matched_row(ctx, run, "fastvideo", holder, run.forwards["ext all lists|small"],
                                                    "small", 1e9, 1e-6)
        assert values is None and skipped.startswith("fastvideo held 0.00 GB beyond the modules it keeps resident")
        # Past the model's share of the time budget it does not start.
        holder["persistent"] = rest + 3 * largest
        _, _, skipped, _ = models._matched_row(ctx, run, "fastvideo", holder, run.forwards["ext all lists|small"], "small",
                                               -1.0, 1e-6)
        assert skipped.startswith("not run: at ")
    finally:
        ctx.cuda = False
        ctx.close()
