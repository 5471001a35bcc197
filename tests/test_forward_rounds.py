"""The forward section's per-round arithmetic: ratios to the resident row and to the floor of each round."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from benchmarks.forward import Candidate, WorkloadRun, _finish, _round_ratios, _timer
from benchmarks.interleave import Interleaved
from benchmarks.utils import GB


def _run(cuda: bool, offloaded_bytes: int, peak_gbps: float | None) -> WorkloadRun:
    ctx = types.SimpleNamespace(cuda=cuda, quick=True)
    master = nn.Linear(4, 4)
    return WorkloadRun(ctx, workload=None, master=master, args=(), kwargs={}, block_bytes=[offloaded_bytes],
                       prefetch_depth=1, n_resident=0, peak_gbps=peak_gbps, build_s=0.0)


def test_ratios_are_taken_round_by_round_against_that_rounds_floor() -> None:
    run = _run(cuda=True, offloaded_bytes=int(1.5 * GB), peak_gbps=100.0)  # transfer: 15 ms
    assert run.transfer_ms == pytest.approx(15.0)
    timed = Interleaved({"resident": [10.0, 20.0, 30.0], "ext": [11.0, 21.0, 30.0], "accelerate": [100.0]})
    x_resident, x_floor = _round_ratios(run, timed, "ext")
    assert x_resident == pytest.approx([1.1, 1.05, 1.0])
    assert x_floor == pytest.approx([11 / 15, 21 / 20, 1.0])  # the floor is max(resident, transfer) per round
    # Timed on its own: against the resident median (20 ms), whose floor is max(20, 15).
    assert _round_ratios(run, timed, "accelerate") == (pytest.approx([5.0]), pytest.approx([5.0]))


def test_without_a_gpu_there_is_no_floor_ratio() -> None:
    run = _run(cuda=False, offloaded_bytes=1024, peak_gbps=None)
    timed = Interleaved({"resident": [2.0, 4.0], "python": [3.0, 4.0]})
    assert _round_ratios(run, timed, "python") == (pytest.approx([1.5, 1.0]), [])


def test_a_configuration_failing_mid_round_costs_only_its_own_row() -> None:
    ctx = types.SimpleNamespace(time_ms=lambda fn, warmup, iters: fn())

    def broken() -> list[float]:
        raise RuntimeError("fastoffload: slot lost")

    cand = Candidate("ext", forward=broken)
    measure = _timer(ctx, cand, iters=5)
    assert torch.isnan(torch.tensor(measure()))
    assert isinstance(cand.error, RuntimeError)
    assert torch.isnan(torch.tensor(measure()))  # later rounds do not run it again
    with pytest.raises(RuntimeError, match="fastoffload: slot lost"):
        _finish(_run(cuda=False, offloaded_bytes=1, peak_gbps=None), cand, Interleaved({"ext": [float("nan")]}))
