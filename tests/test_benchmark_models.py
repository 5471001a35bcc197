"""The models benchmark section on the host: tiny configs of the real diffusers classes, resident and
ext bit-equal, every GPU-only peer row saying why it did not run; and its summary lines."""
from __future__ import annotations

import copy
import importlib
import json
import os
import re
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("diffusers", reason="diffusers is not installed (scripts/setup_env.sh installs it)")

from benchmarks import graph_rows, model_rows, models, peer_diff, peers  # noqa: E402
from benchmarks.interleave import Interleaved  # noqa: E402
from benchmarks.phases import PhaseLog  # noqa: E402
from benchmarks.utils import GB, Context, MiB, Options, read_journal  # noqa: E402
from tests._fastvideo import import_fastvideo, root_logging_kept  # noqa: E402


def test_the_section_runs_on_the_host_bit_equal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(models.ENV_MODELS, "wan-1.3b,flux")
    journal = tmp_path / "journal.jsonl"
    ctx = Context("models", Options(device="cpu", progress=False), str(journal))
    try:
        models.run(ctx)
    finally:
        ctx.close()
    rows = [record["row"] for record in read_journal(str(journal)) if record["type"] == "row"]
    ext = [row for row in rows if row["backend"] == "ext"]
    every_list = [row for row in rows if row["backend"] == "ext all lists"]
    # Wan at three token counts (the "mid" one too), Flux at two, each Flux count with both selections.
    assert [row["tokens"] for row in ext] == ["16 (small)", "32 (mid)", "64 (large)", "16 (small)", "64 (large)"]
    assert len(every_list) == 2 and all(row["bit_equal"] is True for row in ext + every_list), json.dumps(rows)[:2000]
    flux = next(row for row in ext if row["model"] == "flux")
    assert flux["note"].startswith("1 list(s) offloaded: transformer_blocks (default settings)")
    assert every_list[0]["note"].startswith("2 list(s) offloaded: transformer_blocks, single_transformer_blocks "
                                            "(block_lists='all')")
    skipped = [row for row in rows if row["backend"] in {peer.name for peer in peers.PEERS}]
    assert len(skipped) == 5 * len(peers.PEERS) and all(row["skipped"] == "needs a CUDA device" for row in skipped)
    assert all(row.get("ms", 0) > 0 for row in rows if row["backend"] in ("resident", "ext", "ext all lists"))


def _summary_rows() -> list[dict[str, Any]]:
    tokens = "9216 (balanced)"
    return [
        {"model": "flux", "tokens": tokens, "backend": "resident", "ms": 400.0},
        {"model": "flux", "tokens": tokens, "backend": "ext", "ms": 440.0, "x_floor": 1.023,
         "range": "[1.010, 1.040]", "bit_equal": True},
        {"model": "flux", "tokens": tokens, "backend": "ext all lists", "ms": 497.0, "x_floor": 1.165,
         "range": "[1.160, 1.168]", "bit_equal": True, "bound_ms": 497.0, "x_bound": 1.0},
        {"model": "flux", "tokens": tokens, "backend": "fastvideo", "ms": 430.0, "x_ext": 0.98, "x_ext_max": 0.99,
         "x_ext_range": "[0.97, 0.99]", "bit_equal": True, "vs_ext": "ext"},
        {"model": "flux", "tokens": tokens, "backend": "sglang", "ms": 519.0, "x_ext": 1.04, "x_ext_max": 1.05,
         "x_ext_range": "[1.04, 1.05]", "bit_equal": True, "vs_ext": "ext all lists"},
        {"model": "flux", "tokens": tokens, "backend": "mmgp", "ms": 900.0, "x_ext": 1.81, "x_ext_max": 1.9,
         "x_ext_range": "[1.8, 1.9]", "bit_equal": False, "vs_ext": "ext all lists"},
        {"model": "flux", "tokens": tokens, "backend": "accelerate", "skipped": "why"},
    ]


def test_the_forward_workloads_run_here_when_named_with_the_forward_sections_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.workloads import CPU_WORKLOADS, build_stack

    ctx = Context("models", Options(device="cpu", progress=False), str(tmp_path / "journal.jsonl"))
    try:
        monkeypatch.delenv(models.ENV_MODELS, raising=False)
        assert all(spec.name in models.MODELS for spec in models.selected_models(ctx))  # not run unless named
        monkeypatch.setenv(models.ENV_MODELS, "W3,W1")
        assert [spec.name for spec in models.selected_models(ctx)] == ["W3", "W1"]
        monkeypatch.setenv(models.ENV_MODELS, "W3")  # the smallest on the host
        models.run(ctx)
    finally:
        ctx.close()
    rows = [record["row"] for record in read_journal(str(tmp_path / "journal.jsonl")) if record["type"] == "row"]
    ext = [row for row in rows if row["backend"] == "ext"]
    assert [(row["model"], row["tokens"]) for row in ext] == [("W3", "32 (many-small-params)")]
    assert all(row["bit_equal"] is True and row["note"].startswith("1 list(s) offloaded: blocks") for row in ext)
    # The same weights as the forward section's W3 (seed 1), called by keyword with a tuple out.
    master = models.build_master(models.STACK_MODELS["W3"], ctx)
    reference = build_stack(CPU_WORKLOADS["W3"], "cpu", seed=1)
    assert all(torch.equal(a, b) for a, b in zip(master.state_dict().values(), reference.state_dict().values()))
    x = torch.randn(1, 4, CPU_WORKLOADS["W3"].d, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(master(hidden_states=x, return_dict=False)[0], reference(x))


def test_summary_compares_each_peer_with_the_ext_that_offloads_the_same_lists() -> None:
    assert models.summarize(_summary_rows()) == [
        "flux 9216 (balanced): ext 440.00 ms = 1.023x floor [1.010, 1.040] (meets <=1.05x)",
        "flux 9216 (balanced): fastest peer vs ext: fastvideo 430.00 ms, 0.980x ext [0.97, 0.99]; ext faster than "
        "every peer offloading the same lists: NO",
        "flux 9216 (balanced): ext all lists 497.00 ms = 1.165x floor [1.160, 1.168] (MISSES <=1.05x), 1.000x "
        "schedule bound 497.0 ms (the bound is above the floor target)",
        "flux 9216 (balanced): fastest peer vs ext all lists: sglang 519.00 ms, 1.040x ext all lists [1.04, 1.05]; "
        "ext all lists faster than every peer offloading the same lists: yes",
    ]


def test_a_peer_within_the_rounds_noise_is_tied_and_one_faster_in_every_round_is_faster() -> None:
    tokens = "6240 (balanced)"

    def rows(x_ext: float, x_ext_max: float, range_text: str) -> list[dict[str, Any]]:
        return [
            {"model": "wan-1.3b", "tokens": tokens, "backend": "ext", "ms": 72.74, "x_floor": 1.037,
             "range": "[1.032, 1.040]", "bit_equal": True},
            # A budgeted ext row names its configuration too; it is not a peer, and it is faster.
            {"model": "wan-1.3b", "tokens": tokens, "backend": "ext, budget 1.0 GB", "ms": 60.0, "x_ext": 0.82,
             "x_ext_max": 0.85, "vs_ext": "ext", "bit_equal": True},
            {"model": "wan-1.3b", "tokens": tokens, "backend": "fastvideo", "ms": 72.19, "x_ext": 1.002,
             "x_ext_max": 1.317, "x_ext_range": "[0.995, 1.317]", "bit_equal": True, "vs_ext": "ext"},
            {"model": "wan-1.3b", "tokens": tokens, "backend": "sglang", "ms": 72.69, "x_ext": x_ext,
             "x_ext_max": x_ext_max, "x_ext_range": range_text, "bit_equal": False, "vs_ext": "ext"},
        ]

    head = "wan-1.3b 6240 (balanced): fastest peer vs ext: sglang 72.69 ms, not bit-equal, "
    assert models.summarize(rows(0.9992, 1.536, "[0.960, 1.536]"))[1] == (
        head + "0.999x ext [0.960, 1.536]; ext faster than every peer offloading the same lists: tied with sglang "
        "(within 2%, and ext as fast in some rounds)")
    # Faster in every round, or by more than the band: a loss, whatever the other rounds say.
    assert models.summarize(rows(0.995, 0.998, "[0.990, 0.998]"))[1].endswith("the same lists: NO")
    assert models.summarize(rows(0.97, 1.2, "[0.90, 1.20]"))[1].endswith("the same lists: NO")
    assert models.summarize(rows(1.01, 1.2, "[0.99, 1.20]"))[1] == (
        "wan-1.3b 6240 (balanced): fastest peer vs ext: fastvideo 72.19 ms, 1.002x ext [0.995, 1.317]; ext faster "
        "than every peer offloading the same lists: yes")
    assert [model_rows.peer_verdict(*pair) for pair in ((1.001, 1.1), (0.99, 1.0), (0.99, 0.999), (0.979, 1.5))] == [
        "slower", "tied", "faster", "faster"]



def _wan_first_session(tmp_path: Path) -> tuple[Context, models.ModelRun, Any, str]:
    """The Wan model's first session on the host, and its first token count's label."""
    ctx, run = _host_run(tmp_path, models.MODELS["wan-1.3b"])
    try:
        result = models._first_session(ctx, run)
    finally:
        ctx.close()
    return ctx, run, result, next(iter(run.inputs))


def test_ext_rows_are_set_against_the_resident_model_with_copies_streaming_too(tmp_path: Path) -> None:
    ctx, run, result, label = _wan_first_session(tmp_path)
    # What the copy interference would read on a GPU: the resident forward 1.25x slower in every round.
    result.rounds[f"{models.LOADED}|{label}"] = [1.25 * ms for ms in result.rounds[f"resident|{label}"]]
    rows = models._own_rows(ctx, run, result, peak_gbps=1e6)  # a fast link: the resident model sets the floor
    by_backend = {labels["backend"]: values for labels, values, _, _ in rows if labels["tokens"].startswith(
        str(run.token_counts[label]))}
    assert list(by_backend)[:3] == ["resident", "resident, copies streaming", "floor"]
    assert by_backend["resident, copies streaming"]["x_resident"] == pytest.approx(1.25)
    ext = by_backend["ext"]
    assert ext["x_loaded_floor"] == pytest.approx(ext["x_floor"] / 1.25, rel=1e-6)
    line = models.summarize([{"model": "wan-1.3b", "tokens": "1560", "backend": "ext", **ext}])[0]
    assert f"{ext['x_loaded_floor']:.3f}x the floor with copies streaming" in line
    assert "x_link_floor" not in ext  # no link probe on the host


def test_ext_rows_are_set_against_the_floor_at_each_round_s_link(tmp_path: Path) -> None:
    from benchmarks.link_probe import LinkProbe
    ctx, run, result, label = _wan_first_session(tmp_path)
    config = run.configs[0]
    resident, ext = result.rounds[f"resident|{label}"], result.rounds[f"{config.name}|{label}"]
    # A link that moves the configuration's bytes in 3x the resident forward's time, in every round.
    run.link = LinkProbe(torch.device("cpu"), nbytes=MiB)
    result.rounds[models.LINK] = [3 * r * MiB / config.offloaded_bytes for r in resident]
    rows = models._own_rows(ctx, run, result, peak_gbps=1e6)
    values = next(values for labels, values, _, _ in rows if labels["backend"] == "ext" and
                  labels["tokens"].startswith(str(run.token_counts[label])))
    assert values["x_link_floor"] == pytest.approx(statistics.median(e / (3 * r) for e, r in zip(ext, resident)))
    line = models.summarize([{"model": "wan-1.3b", "tokens": "1560", "backend": "ext", **values}])[0]
    assert f"{values['x_link_floor']:.3f}x the floor at each round's link" in line
    # Rounds of the probe that do not match the forward's are refused, not paired off.
    result.rounds[models.LINK] = result.rounds[models.LINK][:-1]
    with pytest.raises(ValueError, match="one probe per round"):
        models._own_rows(ctx, run, result, peak_gbps=1e6)


def test_ext_rows_give_the_step_after_a_readback_against_the_resident_one(tmp_path: Path) -> None:
    import dataclasses
    ctx, run, result, label = _wan_first_session(tmp_path)
    assert result.leads == {}  # no lead forward on the host
    config = run.configs[0]
    # The lead forwards of a GPU run: resident 10 ms, ext 12, 11 and 13 ms, on a link that sets no floor.
    result = dataclasses.replace(result, leads={f"resident|{label}": [10.0, 10.0, 10.0],
                                                f"{config.name}|{label}": [12.0, 11.0, 13.0]})
    rows = models._own_rows(ctx, run, result, peak_gbps=1e6)
    values = next(values for labels, values, _, _ in rows if labels["backend"] == "ext" and
                  labels["tokens"].startswith(str(run.token_counts[label])))
    assert values["x_floor_readback"] == pytest.approx(1.2)
    line = models.summarize([{"model": "wan-1.3b", "tokens": "1560", "backend": "ext", **values}])[0]
    assert "1.200x the floor after a readback" in line


def test_a_peer_row_gives_its_step_after_a_readback_too() -> None:
    from benchmarks.interleave import Interleaved
    from benchmarks.model_rows import peer_values
    config = models.ExtConfig("ext", ["blocks"], {}, offloaded_bytes=int(10 * GB))
    # 10 GB at 250 GB/s: 40 ms of copies, above the resident forward in every round.
    rounds = {"resident|mid": [30.0, 30.0, 30.0], "ext|mid": [40.0, 40.0, 40.0], "peer|mid": [60.0, 64.0, 62.0]}
    steady = peer_values(Interleaved(rounds), "peer|mid", "mid", config, int(10 * GB), peak_gbps=250.0)
    assert steady["x_floor"] == pytest.approx(1.55) and steady["x_ext"] == pytest.approx(1.55)
    assert "x_floor_readback" not in steady  # timed without leads (on the host)
    leads = {"resident|mid": [50.0, 30.0, 30.0], "peer|mid": [80.0, 44.0, 48.0]}
    values = peer_values(Interleaved(rounds, leads), "peer|mid", "mid", config, int(10 * GB), peak_gbps=250.0)
    assert values["x_floor_readback"] == pytest.approx(1.2)  # 80/50, 44/40, 48/40


def test_a_peer_row_gives_each_ratio_the_range_of_its_own_rounds() -> None:
    from benchmarks.interleave import Interleaved
    from benchmarks.model_rows import peer_values
    config = models.ExtConfig("ext", ["blocks"], {}, offloaded_bytes=int(10 * GB))
    # The floor is the resident forward here (40 ms of copies at 250 GB/s, below it), which drifts.
    rounds = {"resident|mid": [50.0, 60.0, 50.0], "ext|mid": [55.0, 66.0, 60.0], "peer|mid": [75.0, 99.0, 90.0]}
    values = peer_values(Interleaved(rounds), "peer|mid", "mid", config, int(10 * GB), peak_gbps=250.0)
    # x floor: 75/50, 99/60, 90/50; x ext: 75/55, 99/66, 90/60.
    assert values["x_floor"] == pytest.approx(1.65) and values["range"] == "[1.500, 1.800]"
    assert values["x_ext"] == pytest.approx(1.5) and values["x_ext_range"] == "[1.364, 1.500]"


def test_rows_give_each_steady_reserve_and_an_offloader_s_against_the_resident_model_s(tmp_path: Path) -> None:
    from benchmarks.model_rows import reserve_values
    block = 100 * MiB
    reserves = {"resident|mid": 50 * MiB, "ext|mid": 50 * MiB, "fastvideo|mid": 350 * MiB}
    assert reserve_values(reserves, "resident", "mid", block) == ({"reserve_mib": 50.0}, None)
    values, note = reserve_values(reserves, "fastvideo", "mid", block)
    assert values == {"reserve_mib": 350.0}
    assert note == "steady reserve 350 MiB, +300 MiB against the resident model's (+3.0 blocks of 100 MiB)"
    assert reserve_values(reserves, "ext", "mid", block)[1].endswith("+0 MiB against the resident model's "
                                                                      "(+0.0 blocks of 100 MiB)")
    assert reserve_values(reserves, "sglang", "mid", block) == ({}, None)  # not measured (on the host)
    # In the section's rows: the resident row and each ext row carry theirs.
    ctx, run, result, label = _wan_first_session(tmp_path)
    assert run.reserves == {}  # nothing measured on the host
    config = run.configs[0]
    run.reserves = {f"resident|{label}": 2 * MiB, f"{config.name}|{label}": 3 * MiB}
    rows = {labels["backend"]: values for labels, values, _, _ in models._own_rows(ctx, run, result, peak_gbps=1e6)
            if labels["tokens"].startswith(str(run.token_counts[label]))}
    assert rows["resident"]["reserve_mib"] == 2.0 and rows["ext"]["reserve_mib"] == 3.0
    assert "steady reserve 3 MiB, +1 MiB against the resident model's" in rows["ext"]["note"]


@pytest.mark.cuda
def test_the_copy_load_outlasts_the_forward_it_is_timed_with() -> None:
    from benchmarks.copy_load import CHUNK_BYTES, CopyLoad
    load = CopyLoad(torch.device("cuda"))
    x = torch.randn(2048, 2048, device="cuda")

    def forward() -> None:
        for _ in range(20):
            x @ x
    alone_ms = load.time(forward, 0)[0]
    copies = load.copies_for(alone_ms)
    assert copies * CHUNK_BYTES / 55e9 * 1e3 > alone_ms  # more bytes than the peak moves in that time
    times = load.timer(forward, 3)()
    assert len(times) == 3 and all(ms > 0 for ms in times)

def test_graph_rows_are_set_against_the_resident_graph_and_say_the_eager_floor_too() -> None:
    from benchmarks import graph_rows
    from benchmarks.interleave import Interleaved
    config = models.ExtConfig("ext", ["blocks"], {}, offloaded_bytes=int(10 * GB))
    label = "mid"
    # Eager resident 60 ms (host-bound), its graph 40 ms; 10 GB at 250 GB/s is 40 ms of copies.
    result = Interleaved({"resident|mid": [60.0, 62.0, 58.0], f"{graph_rows.RESIDENT}|mid": [40.0, 40.0, 40.0],
                          f"{graph_rows.EXT}|mid": [40.4, 40.8, 40.0]})
    rows = dict(graph_rows.rows_for(result, label, config, True, 3, peak_gbps=250.0, target=1.02))
    assert list(rows) == [graph_rows.RESIDENT, graph_rows.FLOOR, graph_rows.EXT]
    assert rows[graph_rows.RESIDENT]["x_resident"] == pytest.approx(40 / 60)
    assert rows[graph_rows.FLOOR]["ms"] == pytest.approx(40.0) and rows[graph_rows.FLOOR]["compute_over_copy"] == 1.0
    ext = rows[graph_rows.EXT]
    assert ext["x_floor"] == pytest.approx(1.01) and ext["x_resident"] == pytest.approx(1.01)
    assert ext["pass"] is True and ext["target"] == 1.02 and ext["bit_equal"] is True
    assert "3 fixed slots" in ext["note"] and f"{40.4 / 60:.3f}x the eager floor" in ext["note"]
    slow = Interleaved({**result.rounds, f"{graph_rows.EXT}|mid": [41.2, 41.6, 40.8]})
    assert dict(graph_rows.rows_for(slow, label, config, True, 3, 250.0, target=1.02))[graph_rows.EXT]["pass"] is False
    line = models.summarize([{"model": "wan-1.3b", "tokens": "4096 (mid)", "backend": graph_rows.EXT, **ext}])
    expected = f"wan-1.3b 4096 (mid): ext, CUDA graph {ext['ms']:.2f} ms = 1.010x floor {ext['range']} (meets <=1.02x)"
    assert line == [expected]
    # The forward a pipeline calls, through graph_forward: against the same floor, and against the bare replay.
    wrapped = Interleaved({**result.rounds, f"{graph_rows.EXT_FORWARD}|mid": [40.8, 41.6, 40.4]})
    rows = dict(graph_rows.rows_for(wrapped, label, config, True, 3, 250.0, target=1.02))
    assert list(rows)[-1] == graph_rows.EXT_FORWARD
    forward = rows[graph_rows.EXT_FORWARD]
    assert forward["x_floor"] == pytest.approx(1.02) and forward["pass"] is True and forward["range"] == "[1.010, 1.040]"
    assert "1.010x [1.010, 1.020] the bare replay" in forward["note"]
    assert "x_link_floor" not in forward
    # With the link probed in each round: a link at 4/5 of the peak in the last round sets that round's floor.
    probe_bytes = int(GB)  # 4 ms at 250 GB/s
    rows = dict(graph_rows.rows_for(wrapped, label, config, True, 3, 250.0, target=1.02,
                                    link=(probe_bytes, [4.0, 4.0, 5.0])))
    assert rows[graph_rows.EXT]["x_link_floor"] == pytest.approx(statistics.median([40.4 / 40, 40.8 / 40, 40.0 / 50]))
    assert rows[graph_rows.EXT_FORWARD]["x_link_floor"] == pytest.approx(1.02)
    assert rows[graph_rows.EXT]["x_floor"] == ext["x_floor"]  # the floor the target is set on stays the section's


@pytest.mark.cuda
def test_the_graph_rows_run_on_a_small_model_bit_equal(tmp_path: Path) -> None:
    import dataclasses

    from benchmarks import graph_rows
    wan = models.MODELS["wan-1.3b"]
    spec = dataclasses.replace(wan, config=wan.cpu_config, tokens=wan.cpu_tokens)
    ctx = Context("models", Options(device="cuda", progress=False), str(tmp_path / "journal.jsonl"))
    try:
        run = models._prepare(ctx, spec, models.enable_layerwise_offload, PhaseLog("models", echo=False))
        assert run.graph_error is None and run.graphs is not None
        assert all(run.graphs.equal.values()) and set(run.graphs.equal) == set(run.inputs)
        result = models._first_session(ctx, run)
        rows = models._own_rows(ctx, run, result, peak_gbps=55.0)
    finally:
        ctx.close()
    for label in run.inputs:
        got = {labels["backend"]: values for labels, values, _, error in rows
               if labels["tokens"].startswith(str(run.token_counts[label])) and error is None}
        assert {graph_rows.RESIDENT, graph_rows.FLOOR, graph_rows.EXT, graph_rows.EXT_FORWARD} <= set(got)
        assert got[graph_rows.EXT]["bit_equal"] is True and got[graph_rows.EXT]["ms"] > 0
        assert got[graph_rows.EXT_FORWARD]["bit_equal"] is True and got[graph_rows.EXT_FORWARD]["x_floor"] > 0
        assert got[graph_rows.EXT]["x_floor"] > 0 and got[graph_rows.RESIDENT]["ms"] > 0


def test_summary_flags_a_row_that_is_not_bit_equal_and_holds_the_host_bound_rows_to_their_target() -> None:
    rows = [{"model": "wan-1.3b", "tokens": "1560 (transfer-bound)", "backend": "ext", "ms": 50.0, "x_floor": 1.08,
             "range": "[1.06, 1.10]", "bit_equal": False},
            {"model": "wan-1.3b", "tokens": "4096 (mid)", "backend": "ext", "ms": 60.0, "x_floor": 1.03,
             "range": "[1.02, 1.04]", "bit_equal": True, "target": 1.02}]
    assert models.summarize(rows) == [
        "wan-1.3b 1560 (transfer-bound): ext 50.00 ms = 1.080x floor [1.06, 1.10] (MISSES <=1.05x), NOT bit-equal",
        "wan-1.3b 4096 (mid): ext 60.00 ms = 1.030x floor [1.02, 1.04] (MISSES <=1.02x)"]
    assert models.MODELS["wan-1.3b"].tight == ("mid",) and models.MODELS["flux"].tight == ("transfer-bound",)


def test_rows_are_shown_per_token_count_in_a_fixed_order() -> None:
    rows = _summary_rows()
    measured = [rows[4], rows[1], rows[0], rows[6], rows[3], rows[2], rows[5]]  # as a run might journal them
    measured.insert(2, {"model": "flux", "tokens": "1024 (transfer-bound)", "backend": "ext", "ms": 1.0})
    arranged = models.arrange_rows(measured)
    assert [(row["tokens"][:4], row["backend"]) for row in arranged] == [
        ("9216", "resident"), ("9216", "ext"), ("9216", "ext all lists"), ("9216", "fastvideo"), ("9216", "sglang"),
        ("9216", "mmgp"), ("9216", "accelerate"), ("1024", "ext")]


def test_fastvideo_offload_module_imports_without_its_runtime() -> None:
    import_fastvideo("fastvideo.hooks.layerwise_offload")
    with root_logging_kept():
        module = peers.import_module_only("fastvideo", peers.FASTVIDEO_OFFLOAD)
    assert module.__name__ == peers.FASTVIDEO_OFFLOAD and callable(module.enable_layerwise_offload)


def test_a_missing_peer_package_says_where_it_looked() -> None:
    with pytest.raises(peers.PeerUnavailable, match=r"no_such_peer is not installed and no no_such_peer-\*\.whl is in"):
        peers.import_module_only("no_such_peer", "no_such_peer.offload")


def test_stub_modules_can_be_subclassed_called_and_used_as_decorators() -> None:
    stub = peers._stub_module("absent_runtime")
    base = stub.Object

    @stub.register_object("key")
    class Derived(base):  # type: ignore[misc, valid-type]
        pass

    assert issubclass(Derived, base) and Derived().anything is not None
    with pytest.raises(AttributeError):
        stub.__file__  # noqa: B018


def test_a_failed_layout_leaves_nothing_behind_for_the_next_try(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang moved its offload module between releases: the first layout's failed try must not leave a
    spec-less half-import of the package that the next try's find_spec trips on."""
    root = tmp_path / "moved_peer"
    (root / "runtime" / "utils").mkdir(parents=True)
    (root / "__init__.py").write_text("raise ImportError('the whole runtime')\n")
    (root / "runtime" / "__init__.py").write_text("raise ImportError('the whole runtime')\n")
    (root / "runtime" / "utils" / "__init__.py").write_text("")
    (root / "runtime" / "utils" / "offload.py").write_text("import importlib.util\n"
                                                           "FOUND = importlib.util.find_spec('moved_peer.runtime')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(peers.PeerUnavailable, match="moved_peer.runtime.managers"):
            peers.import_module_only("moved_peer", "moved_peer.runtime.managers.offload")
        assert not [name for name in sys.modules if name.startswith("moved_peer")]
        module = peers.import_module_only("moved_peer", "moved_peer.runtime.utils.offload")
        assert module.FOUND is not None and module.FOUND.submodule_search_locations == [str(root / "runtime")]
    finally:
        for name in [name for name in sys.modules if name.startswith("moved_peer")]:
            del sys.modules[name]


def test_a_stub_in_a_pydantic_field_validates_anything() -> None:
    pydantic = pytest.importorskip("pydantic")
    stub = peers._stub_module("absent_protocol")

    class Request(pydantic.BaseModel):
        tool: stub.Tool  # type: ignore[name-defined]

    assert Request(tool=3).tool == 3


def _tiny_wan() -> torch.nn.Module:
    ctx = Context("models", Options(device="cpu", progress=False), os.devnull)
    try:
        return models.build_master(models.MODELS["wan-1.3b"], ctx)
    finally:
        ctx.close()


def test_a_host_copy_moves_only_the_listed_block_lists_and_keeps_every_value() -> None:
    master = _tiny_wan()
    copied = models.host_copy(master, ["blocks"])
    assert copied is not master
    mine, theirs = dict(copied.state_dict(keep_vars=True)), master.state_dict(keep_vars=True)
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]) and tensor.data_ptr() != theirs[name].data_ptr(), name
    assert all(param.device.type == "cpu" for param in copied.blocks.parameters())


def _run_for(spec: models.ModelSpec, elapsed_s: float) -> models.ModelRun:
    log = PhaseLog("models", echo=False)
    log.started -= elapsed_s
    return models.ModelRun(spec, torch.nn.Module(), ["blocks"], {}, log, models.ext_configs(["blocks"], None))


def _cuda_ctx() -> Context:
    ctx = Context("models", Options(device="cpu", progress=False), os.devnull)
    ctx.cuda = True  # the reasons are decided before anything touches a device
    return ctx


def test_a_large_model_runs_only_the_strongest_peers_unless_told_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(models.ENV_PEERS, raising=False)
    run = _run_for(models.MODELS["wan-14b"], 0.0)
    by_name = {peer.name: peer for peer in peers.PEERS}
    ctx = _cuda_ctx()
    try:
        assert models._peer_skip_reason(ctx, run, by_name["sglang"], 480.0) is None
        reason = models._peer_skip_reason(ctx, run, by_name["accelerate"], 480.0)
        assert reason is not None and reason.startswith("not run on wan-14b so that the section fits one GPU command")
        assert "BENCHMARK_MODEL_PEERS=all runs it" in reason
        monkeypatch.setenv(models.ENV_PEERS, "all")
        assert models._peer_skip_reason(ctx, run, by_name["accelerate"], 480.0) is None
    finally:
        ctx.close()


def test_graph_rows_left_out_on_request_leave_one_row_that_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _cuda_ctx()
    try:
        monkeypatch.delenv(models.ENV_GRAPHS, raising=False)
        assert models.graphs_skipped(ctx) is None
        monkeypatch.setenv(models.ENV_GRAPHS, "0")
        run = _run_for(models.MODELS["flux"], 0.0)
        run.graph_skip = models.graphs_skipped(ctx)
        rows = models._graph_rows(run, Interleaved({}), "1024 (transfer-bound)", {"model": "flux"}, 55.0)
        assert rows == [({"model": "flux", "backend": graph_rows.EXT}, None,
                         "BENCHMARK_MODELS_GRAPHS=0: the CUDA-graph rows were not built (the peers' rounds get their "
                         "time)", None)]
    finally:
        ctx.close()


def test_named_peers_run_on_every_model_and_only_they(monkeypatch: pytest.MonkeyPatch) -> None:
    by_name = {peer.name: peer for peer in peers.PEERS}
    ctx = _cuda_ctx()
    try:
        monkeypatch.setenv(models.ENV_PEERS, " accelerate, diffusers leaf ")
        assert models.named_peers() == ("accelerate", "diffusers leaf")
        run = _run_for(models.MODELS["wan-14b"], 0.0)  # its own choice leaves accelerate out
        assert models._peer_skip_reason(ctx, run, by_name["accelerate"], 480.0) is None
        assert models._peer_skip_reason(ctx, run, by_name["diffusers leaf"], 480.0) is None
        reason = models._peer_skip_reason(ctx, run, by_name["fastvideo"], 480.0)
        assert reason == "not run: BENCHMARK_MODEL_PEERS names only accelerate, diffusers leaf"
        monkeypatch.setenv(models.ENV_PEERS, "accelerate,sglng")
        with pytest.raises(ValueError, match="unknown peer.*sglng.*known: all, fastvideo, sglang"):
            models.run(ctx)
    finally:
        ctx.close()


def test_a_spent_time_budget_skips_the_remaining_peers_with_a_reason() -> None:
    run = _run_for(models.MODELS["flux"], 500.0)
    ctx = _cuda_ctx()
    try:
        reason = models._peer_skip_reason(ctx, run, peers.PEERS[0], 480.0)
    finally:
        ctx.close()
    assert reason == ("not run: flux's share of the section's time budget (BENCHMARK_MODELS_BUDGET_S) ended at "
                      "480 s and it was 500 s; the stronger peers ran first")


def test_a_peer_the_host_memory_cannot_hold_is_not_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer's set-up pins its own copy of the model: with too little host memory left the kernel killed the
    whole section (SIGKILL on Flux, after SGLang's copy), losing the rows still to come."""
    from fastoffload_ext.planning import memory

    run = _run_for(models.MODELS["flux"], 0.0)
    run.model_bytes = 24 * 10**9
    ctx = _cuda_ctx()
    try:
        monkeypatch.setattr(models, "probe_host", lambda: memory.HostMemory(
            mem_available=60 * 10**9, cgroup_headroom=None, cgroup_path=None, margin=0))
        assert models._peer_skip_reason(ctx, run, peers.PEERS[0], 480.0) is None
        monkeypatch.setattr(models, "probe_host", lambda: memory.HostMemory(
            mem_available=30 * 10**9, cgroup_headroom=None, cgroup_path=None, margin=0))
        reason = models._peer_skip_reason(ctx, run, peers.PEERS[0], 480.0)
    finally:
        ctx.close()
    assert reason == ("not run: its set-up may take 48 GB of host memory (2x the model's 24.0 GB) and 30 GB is "
                      "available; the kernel would kill the section for it")


def test_a_peer_that_would_outlast_the_budget_is_not_started() -> None:
    run = _run_for(models.MODELS["flux"], 400.0)
    run.peer_seconds = [30.0, 55.0]
    ctx = _cuda_ctx()
    try:
        assert models._peer_skip_reason(ctx, run, peers.PEERS[0], 460.0) is None
        reason = models._peer_skip_reason(ctx, run, peers.PEERS[0], 450.0)
    finally:
        ctx.close()
    assert reason == ("not run: flux's share of the section's time budget (BENCHMARK_MODELS_BUDGET_S) ends at 450 s; "
                      "at 400 s the slowest peer so far (55 s) would not finish before it; the stronger peers ran "
                      "first")


def test_peers_are_set_up_strongest_first() -> None:
    assert [peer.name for peer in models._peers_in_run_order()] == list(models.RUN_ORDER)
    assert set(models.RUN_ORDER) == {peer.name for peer in peers.PEERS}
    assert models.BUDGET_ROW_AFTER in models.RUN_ORDER[:3]  # the planned-budget row comes before the weakest peers


def test_phase_lines_carry_time_rss_and_text(capsys: pytest.CaptureFixture[str]) -> None:
    log = PhaseLog("models")
    line = log.mark("wan-14b: master built")
    assert re.fullmatch(r"\[models \d\d:\d\d:\d\d \+\d+s\] rss \d+\.\d GB \(high-water \d+\.\d GB\)"
                        r"( gpu \d+\.\d GB)?: wan-14b: master built", line), line
    assert capsys.readouterr().err.strip() == line
    assert log.summary().startswith("models: host RSS peak ") and log.summary().endswith("wan-14b: master built")


def _fake_peers() -> tuple[peers.Peer, ...]:
    """Four peers on the host: one exact, one that nudges a weight (in the host copy it is given), one that
    cannot run, one exact again (given a fresh host copy)."""
    def exact(model: torch.nn.Module, device: torch.device, lists: list[str]) -> peers.Teardown:
        return lambda: None

    def nudged(model: torch.nn.Module, device: torch.device, lists: list[str]) -> peers.Teardown:
        with torch.no_grad():
            linear = next(m for m in getattr(model, lists[0])[1].modules() if isinstance(m, torch.nn.Linear))
            linear.weight.add_(1.0)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # a set-up that changes numerics
        return lambda: None

    def absent(model: torch.nn.Module, device: torch.device, lists: list[str]) -> peers.Teardown:
        raise peers.PeerUnavailable("absent: not installed")

    return (peers.Peer("fastvideo", exact, "exact"), peers.Peer("sglang", nudged, "nudged"),
            peers.Peer("mmgp", absent, "absent"), peers.Peer("diffusers", exact, "exact after"))


def _run_peer_sessions(tmp_path: Path, spec: models.ModelSpec, log: PhaseLog) -> list[dict[str, Any]]:
    """The section's rows for ``spec`` with ``peers.PEERS``, the GPU-only peer path taken on the host."""
    journal = tmp_path / "journal.jsonl"
    ctx = Context("models", Options(device="cpu", progress=False), str(journal))
    before = peer_diff.numerics_settings()
    try:
        run = models._prepare(ctx, spec, models.enable_layerwise_offload, log)
        ctx.cuda = True  # the peers' path from here on; the device stays the host
        pending = [row for peer in peers.PEERS for row in models._peer_rows(ctx, run, peer, 1e9)]
        ctx.cuda = False
        models._write(ctx, pending)
        del run
        assert peer_diff.numerics_settings() == before  # the section put back what a peer's set-up changed
    finally:
        ctx.close()
        peer_diff.restore_settings(before)
    return [record["row"] for record in read_journal(str(journal)) if record["type"] == "row"]


def test_the_peer_sessions_release_each_copy_and_explain_a_difference(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU-only peer path, run on the host: the device timers and memory counters are swapped for
    host ones, everything else is what runs on the H200."""
    monkeypatch.setattr(peers, "PEERS", _fake_peers())
    monkeypatch.setattr(models, "_peers_in_run_order", lambda: list(peers.PEERS))
    def host_timer(ctx: Context, fn: Any, iters: int) -> Any:
        def measure() -> list[float]:
            times = []
            for _ in range(iters):
                started = time.perf_counter()
                fn()
                times.append((time.perf_counter() - started) * 1e3)
            return times
        return measure

    monkeypatch.setattr(models, "_timer", host_timer)  # CUDA events would need a device
    monkeypatch.setattr(models, "steady_reserve", lambda forward, count: 5 * MiB)  # so would the allocator's reserve
    copies: list[weakref.ref[torch.nn.Module]] = []
    real_copy = models.host_copy

    def tracked_copy(master: torch.nn.Module, lists: list[str] | None = None,
                     source: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
        model = real_copy(master, lists, source)
        if lists is None:  # a peer's copy, not ext's
            copies.append(weakref.ref(model))
        return model

    monkeypatch.setattr(models, "host_copy", tracked_copy)
    log = PhaseLog("models", echo=False)
    rows = _run_peer_sessions(tmp_path, models.MODELS["wan-1.3b"], log)
    by_backend = {(row["backend"], row.get("tokens")): row for row in rows}
    assert ("all", None) not in by_backend, by_backend
    exact, nudged = by_backend[("fastvideo", "16 (small)")], by_backend[("sglang", "16 (small)")]
    assert exact["bit_equal"] is True and exact["note"] == "exact; offloads blocks, rest"
    assert exact["vs_ext"] == "ext" and isinstance(exact["pass"], bool) and exact["reserve_mib"] == 5.0
    assert nudged["bit_equal"] is False
    assert "its set-up changed torch's numerics (matmul.allow_bf16_reduced_precision_reduction True -> False); " \
           "put back for its rows" in nudged["note"]
    assert "not bit-equal: op " in nudged["note"]
    assert "a weight holds other values than the resident's" in nudged["note"]
    assert by_backend[("mmgp", "64 (large)")]["skipped"] == "absent: not installed"
    assert "it wrote into the host copy of the weights it was given; the next peer gets a fresh one" in nudged["note"]
    assert by_backend[("diffusers", "16 (small)")]["bit_equal"] is True  # not the nudged copy
    assert len(copies) == 4 and all(ref() is None for ref in copies)  # every peer's model was freed
    assert any("fastvideo: released" in line for line in log.lines)


class _TwoLists(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(4, 4)
        self.doubles = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.singles = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))


def test_a_peer_session_runs_on_a_forward_workload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "PEERS", _fake_peers()[:1])  # the exact one (a difference's trace is tested above)
    monkeypatch.setattr(models, "_peers_in_run_order", lambda: list(peers.PEERS))

    def host_timer(ctx: Context, fn: Any, iters: int) -> Any:
        return lambda: [0.0 if fn() is None else 1.0 for _ in range(iters)]

    monkeypatch.setattr(models, "_timer", host_timer)  # CUDA events would need a device
    monkeypatch.setattr(models, "steady_reserve", lambda forward, count: 0)  # so would the allocator's reserve
    rows = {row["backend"]: row for row in _run_peer_sessions(tmp_path, models.STACK_MODELS["W3"],
                                                              PhaseLog("models", echo=False))}
    assert rows["fastvideo"]["bit_equal"] is True and rows["fastvideo"]["vs_ext"] == "ext"
    assert rows["fastvideo"]["tokens"] == "32 (many-small-params)" and "x_ext_max" in rows["fastvideo"]


def test_what_a_peer_offloads_is_read_from_where_its_weights_are_after_set_up() -> None:
    model = _TwoLists()
    shapes = {name: param.shape for name, param in model.named_parameters()}
    lists = ["doubles", "singles"]
    cpu = torch.device("cpu")
    assert peers.offloaded_parts(model, cpu, shapes, lists) == frozenset()
    model.doubles[1].weight.data = torch.empty(0)  # FastVideo's and SGLang's placeholder
    assert peers.offloaded_parts(model, cpu, shapes, lists) == frozenset({"doubles"})
    model.singles[0].weight = torch.nn.Parameter(torch.empty(4, 4, device="meta"))  # accelerate's meta weight
    model.head.bias.data = torch.zeros(1).expand(4)  # the right shape, but no storage behind it
    assert peers.offloaded_parts(model, cpu, shapes, lists) == frozenset({"doubles", "singles", peers.REST})
    by_name = {peer.name: peer for peer in peers.PEERS}
    assert peers.declared_parts(by_name["fastvideo"], lists) == frozenset({"doubles"})
    assert peers.declared_parts(by_name["sglang"], lists) == frozenset(lists)
    assert peers.declared_parts(by_name["diffusers"], lists) == frozenset([*lists, peers.REST])


def test_each_peer_is_matched_with_the_ext_that_offloads_the_same_lists() -> None:
    configs = models.ext_configs(["doubles", "singles"], "all")
    assert [config.name for config in configs] == ["ext", "ext all lists"]
    match = model_rows.matching_config
    assert match(configs, frozenset({"doubles"})).name == "ext"
    assert match(configs, frozenset({"doubles", "singles"})).name == "ext all lists"
    assert match(configs, frozenset({"doubles", "singles", peers.REST})).name == "ext all lists"
    assert match(configs, frozenset({"singles"})).name == "ext all lists"  # a tie goes to the wider
    assert [config.name for config in models.ext_configs(["blocks"], None)] == ["ext"]


def _host_run(tmp_path: Path, spec: models.ModelSpec) -> tuple[Context, models.ModelRun]:
    ctx = Context("models", Options(device="cpu", progress=False), str(tmp_path / "journal.jsonl"))
    return ctx, models._prepare(ctx, spec, models.enable_layerwise_offload, PhaseLog("models", echo=False))


def test_ext_rows_carry_their_own_floor_and_the_schedule_bound(tmp_path: Path) -> None:
    ctx, run = _host_run(tmp_path, models.MODELS["flux"])
    try:
        result = models._first_session(ctx, run)
        # A slow imaginary link, so that the copies (not the host's compute) set the floors.
        rows = models._own_rows(ctx, run, result, peak_gbps=1e-5)
    finally:
        ctx.close()
    by_backend = {labels["backend"]: values for labels, values, _, _ in rows if labels["tokens"] == "16 (small)"}
    assert list(by_backend) == ["resident", "floor", "floor all lists", "ext", "ext all lists"]
    first, every = run.configs
    assert every.offloaded_bytes > first.offloaded_bytes > 0
    assert by_backend["floor all lists"]["ms"] == pytest.approx(every.offloaded_bytes / (1e-5 * GB) * 1e3)
    # Each floor row says how compute-bound its own configuration is: resident time / its copy time.
    assert by_backend["floor"]["compute_over_copy"] > by_backend["floor all lists"]["compute_over_copy"] > 0
    for name in ("ext", "ext all lists"):
        values = by_backend[name]
        assert values["bit_equal"] is True and values["bound_ms"] > 0 and values["x_bound"] > 0
        assert values["pass"] is (values["x_floor"] <= model_rows.EXT_TARGET)
    # All copies at one depth-1 ring cost at least what the copies alone take.
    assert by_backend["ext all lists"]["bound_ms"] >= by_backend["floor all lists"]["ms"] * 0.999


def test_a_model_that_cannot_be_captured_costs_its_graph_rows_only(tmp_path: Path) -> None:
    from benchmarks import graph_rows
    ctx, run = _host_run(tmp_path, models.MODELS["wan-1.3b"])
    offloaded: list[weakref.ref] = []

    def enable(model: torch.nn.Module, **kwargs: Any) -> Any:
        offloaded.append(weakref.ref(model))
        return models.enable_layerwise_offload(model, **kwargs)
    try:
        models._build_graphs(ctx, run, enable)  # on the host: OffloadedCUDAGraph refuses a CPU offload
        result = models._first_session(ctx, run)
        rows = models._own_rows(ctx, run, result, peak_gbps=55.0)
    finally:
        ctx.close()
    assert run.graphs is None and "needs a CUDA device" in str(run.graph_error)
    assert len(offloaded) == 1 and offloaded[0]() is None  # the graph rows' offloaded copy was freed
    errors = [(labels["backend"], error) for labels, _, _, error in rows if error is not None]
    assert [name for name, _ in errors] == [graph_rows.EXT] * len(run.inputs)
    measured = [labels["backend"] for labels, values, _, _ in rows if values is not None]
    assert measured.count("ext") == len(run.inputs) and graph_rows.RESIDENT not in measured


def test_rows_measured_before_an_interruption_are_in_the_journal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run cut short (SIGTERM ends the child) keeps ext's rows and every finished peer's."""
    def interrupted(model: torch.nn.Module, device: torch.device, lists: list[str]) -> peers.Teardown:
        raise KeyboardInterrupt

    fake = (_fake_peers()[0], peers.Peer("sglang", interrupted, "interrupted"))
    monkeypatch.setattr(models, "_peers_in_run_order", lambda: list(fake))
    monkeypatch.setattr(models, "_peer_skip_reason", lambda *args: None)
    journal = tmp_path / "journal.jsonl"
    ctx = Context("models", Options(device="cpu", progress=False), str(journal))
    try:
        with pytest.raises(KeyboardInterrupt):
            models._run_model(ctx, models.MODELS["wan-1.3b"], PhaseLog("models", echo=False), None, 1e9)
    finally:
        ctx.close()
    rows = [record["row"] for record in read_journal(str(journal)) if record["type"] == "row"]
    backends = [(row["backend"], row["tokens"].split()[0]) for row in rows]
    assert backends == [(backend, tokens) for tokens in ("16", "32", "64") for backend in ("resident", "ext")] + [
        ("fastvideo", tokens) for tokens in ("16", "32", "64")]


def test_the_planned_budget_row_is_bit_equal_and_says_what_the_planner_chose(tmp_path: Path) -> None:
    from benchmarks.model_budget import block_costs, least_budget_plan

    ctx, run = _host_run(tmp_path, models.MODELS["flux"])
    try:
        run.first = models._first_session(ctx, run)
        clock = run.clocks["small"]
        compute = clock.block_medians()
        costs = block_costs(run.blocks(), compute, 0.0, 0.001, 0)
        plan = least_budget_plan(costs, 1e9)
        assert plan is not None
        values = models._budget_session(ctx, run, "small", plan, floor_ms=10.0, peak_gbps=0.001)
    finally:
        ctx.close()
    assert values["bit_equal"] is True and values["vs_ext"] == "ext all lists" and values["ms"] > 0
    assert values["note"].startswith("plan_offload on this run's per-block compute: the least device_budget")
    assert f"depth {plan.prefetch_depth}" in values["note"]
    # Where ext reaches its floor target (on the host it does: no copy is timed), no budget row is made.
    assert models._budget_plan(ctx, run, "small", None) is None


def test_the_peers_models_share_one_host_copy_and_a_write_into_it_shows() -> None:
    from benchmarks.host_source import bind, fingerprint, host_source

    master = _tiny_wan()
    source = host_source(master)
    first, second = models.host_copy(master, source=source), models.host_copy(master, source=source)
    pairs = zip(first.state_dict(keep_vars=True).items(), second.state_dict(keep_vars=True).values())
    for (name, mine), theirs in pairs:
        assert mine.data_ptr() == theirs.data_ptr() == source[name].data_ptr(), name
        assert torch.equal(mine, master.state_dict()[name]) and mine.data_ptr() != master.state_dict()[name].data_ptr()
    printed = fingerprint(source)
    with torch.no_grad():
        first.blocks[0].ffn.net[0].proj.weight.mul_(2.0)
    assert fingerprint(source) != printed
    tied = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    tied_source = host_source(tied)
    bound = copy.deepcopy(tied)
    bind(bound, tied_source)
    assert bound[0].weight is bound[1].weight and bound[0].weight.data_ptr() == tied_source["0.weight"].data_ptr()


def _peer_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offload_source: str) -> None:
    root = tmp_path / "stubbed_peer"
    (root / "runtime").mkdir(parents=True)
    (root / "__init__.py").write_text("raise ImportError('the whole runtime')\n")
    (root / "runtime" / "__init__.py").write_text("raise ImportError('the whole runtime')\n")
    (root / "runtime" / "offload.py").write_text(offload_source)
    monkeypatch.syspath_prepend(str(tmp_path))


def _forget(prefix: str) -> None:
    for name in [name for name in sys.modules if name.startswith(prefix)]:
        del sys.modules[name]


def test_a_stub_stands_in_only_while_the_peer_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A library imported after the peer (transformers checking for an optional module) must find the
    machine's truth, not the stub the peer's chain was given."""
    _peer_package(tmp_path, monkeypatch, "import absent_dependency_of_a_peer as dep\nHANDLE = dep.Handle\n")
    try:
        module = peers.import_module_only("stubbed_peer", "stubbed_peer.runtime.offload", stub_missing=True)
        assert peers.STUBBED["stubbed_peer"] == ["absent_dependency_of_a_peer"]
        assert isinstance(module.HANDLE, type)
        assert "absent_dependency_of_a_peer" not in sys.modules
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("absent_dependency_of_a_peer")
    finally:
        _forget("stubbed_peer")
        peers.STUBBED.pop("stubbed_peer", None)


def test_a_failed_peer_import_leaves_no_stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _peer_package(tmp_path, monkeypatch, "import absent_dependency_of_a_peer\nimport stubbed_peer.runtime.gone\n")
    try:
        with pytest.raises(peers.PeerUnavailable, match="stubbed_peer.runtime.gone"):
            peers.import_module_only("stubbed_peer", "stubbed_peer.runtime.offload", stub_missing=True)
        assert "absent_dependency_of_a_peer" not in sys.modules
        assert not [name for name in sys.modules if name.startswith("stubbed_peer")]
    finally:
        _forget("stubbed_peer")


def test_the_layout_a_release_lacks_is_named_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _peer_package(tmp_path, monkeypatch, "import stubbed_peer.runtime.gone\n")
    try:
        with pytest.raises(peers.PeerUnavailable) as raised:
            peers.first_layout("stubbed_peer", ("stubbed_peer.runtime.managers.offload", "stubbed_peer.runtime.offload"), ())
        first, second = str(raised.value).split("; ")
        assert first == "stubbed_peer.runtime.managers.offload: not in this release"
        assert second.startswith("importing stubbed_peer.runtime.offload failed") and "stubbed_peer.runtime.gone" in second
    finally:
        _forget("stubbed_peer")


def test_a_peer_that_cannot_import_says_the_reason_underneath() -> None:
    try:
        try:
            raise ModuleNotFoundError("No module named 'torchvision'", name="torchvision")
        except ModuleNotFoundError as inner:
            raise ModuleNotFoundError("Could not import module 'AutoModel'") from inner
    except ModuleNotFoundError as outer:
        assert peers.why(outer) == ("ModuleNotFoundError: Could not import module 'AutoModel' "
                                    "(from ModuleNotFoundError: No module named 'torchvision')")
    assert peers.why(ValueError("plain")) == "ValueError: plain"


def test_a_namespace_package_a_failed_probe_found_is_forgotten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FastVideo probes for Sphinx; a ``sphinx`` directory without ``__init__.py`` on the path made the probe
    leave ``sphinx`` in sys.modules, and SciPy (under transformers) then failed on ``sphinx.ext``."""
    (tmp_path / "probed_namespace" / "templates").mkdir(parents=True)
    _peer_package(tmp_path, monkeypatch, "try:\n    from probed_namespace.ext.mock import Mock\n"
                                         "except ModuleNotFoundError:\n    Mock = None\n")
    try:
        module = peers.import_module_only("stubbed_peer", "stubbed_peer.runtime.offload")
        assert module.Mock is None
        assert "probed_namespace" not in sys.modules
    finally:
        _forget("stubbed_peer")
        _forget("probed_namespace")
