"""The training benchmark section on the host: its rows hold what a checkpointed training step through
offloaded blocks does (gradients bit-equal to the resident model's; in backward each block copied once, and
only the first loaded on demand), against the hooks' earlier forward-order targets."""
from __future__ import annotations

from pathlib import Path

from benchmarks import training
from benchmarks.utils import MiB, Context, Options, read_journal
from benchmarks.workloads import StackSpec


def _rows(tmp_path: Path, spec: StackSpec) -> dict[str, dict]:
    """The section's rows for ``spec`` on the host, by configuration."""
    journal = tmp_path / "journal.jsonl"
    ctx = Context("training", Options(quick=True, device="cpu", progress=False), str(journal))
    try:
        training._workload(ctx, spec, None)
    finally:
        ctx.close()
    return {record["row"]["config"]: record["row"] for record in read_journal(str(journal))
            if record.get("type") == "row"}


def test_the_training_rows_count_the_copies_and_loads_a_backward_makes(tmp_path: Path) -> None:
    spec = StackSpec("tiny", d=32, blocks=6, tokens=8, n_norms=2, character="")
    rows = _rows(tmp_path, spec)
    assert set(rows) == {training.RESIDENT, training.EXT, training.EXT_BEFORE, training.EXT_REENTRANT, "floor"}
    for name in (training.RESIDENT, training.EXT, training.EXT_BEFORE, training.EXT_REENTRANT):
        assert "error" not in rows[name], rows[name].get("error")
        assert rows[name]["bit_equal"] is True
        # The floor's bytes: the blocks' weights, counted before enable left placeholders in them.
        assert rows[name]["offloaded_mib"] * MiB == spec.weight_bytes()
    # Per step: each of the 6 blocks copied once forward and once in backward, but for the 2 still in the slots
    # where the direction turns; none loads on demand.
    assert (rows[training.EXT]["copies"], rows[training.EXT]["sync_loads"]) == (8.0, 0.0)
    # The same under a reentrant checkpoint, whose forward runs under no_grad.
    assert (rows[training.EXT_REENTRANT]["copies"], rows[training.EXT_REENTRANT]["sync_loads"]) == (8.0, 0.0)
    # Forward-order targets in backward: every block loads on demand there, and its prefetches are wasted.
    assert rows[training.EXT_BEFORE]["sync_loads"] == 6.0 and rows[training.EXT_BEFORE]["copies"] > 12.0
    assert rows["floor"]["skipped"] == "needs a CUDA device and the peak H2D"


def test_the_training_rows_compare_a_step_after_the_timed_ones_too(tmp_path: Path, monkeypatch) -> None:
    spec = StackSpec("tiny", d=32, blocks=4, tokens=8, n_norms=2, character="")
    timed = {"done": False}
    real_step, real_rounds = training._step, training.run_interleaved

    def step(model, x):
        inner = real_step(model, x)
        # After the timed rounds every step's gradient is off by one: only a check made then sees it.
        return lambda: inner() + (1.0 if timed["done"] else 0.0)

    def rounds(timers, count):
        result = real_rounds(timers, count)
        timed["done"] = True
        return result

    monkeypatch.setattr(training, "_step", step)
    monkeypatch.setattr(training, "run_interleaved", rounds)
    rows = _rows(tmp_path, spec)
    assert all(rows[name]["bit_equal"] is False for name in (training.EXT, training.EXT_BEFORE, training.EXT_REENTRANT))
