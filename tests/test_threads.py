"""The threading contract: one offloaded model runs one forward at a time.

A second thread's forward is refused with a clear error while the first runs; a disable, re-plan or
is_replace from another thread waits for the running forward instead of changing the layout under it.
Whatever the interleaving: no crash, no placeholder left after disable, every value exact.
"""
from __future__ import annotations

import logging
import re
import sys
import threading
import time
import weakref
from typing import Any

import pytest
import torch

import fastoffload_ext as fo
from fastoffload_ext.engine.threads import ModelForwards
from fastoffload_ext.planning import BlockCosts, module_packed_bytes

from ._models import Block, make_pair, offload_hook, params_equal
from ._trees import has_hooks

BACKENDS = ["ext", "python"]
CONCURRENT = ("fastoffload: this offloaded model is running a forward in another thread; one offloaded model runs "
              "one forward at a time. Run its forwards from one thread (or one after another under a lock), or give "
              "each thread its own copy of the model.")
WAIT_S = 30.0  # a bound on waiting for the other thread, so a regression fails instead of hanging


class Paused:
    """Holds one thread inside block ``index``'s forward (its weights acquired) until told to go on."""

    def __init__(self, model: torch.nn.Module, index: int = 1) -> None:
        self.inside = threading.Event()
        self.proceed = threading.Event()
        self.armed = True
        self.handle = model.blocks[index].o.register_forward_pre_hook(self._pause)

    def _pause(self, module: Any, args: Any) -> None:
        if self.armed:
            self.armed = False
            self.inside.set()
            assert self.proceed.wait(WAIT_S)


def _run_in_thread(target: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def body() -> None:
        try:
            result["value"] = target()
        except BaseException as error:  # reported to the main thread, which asserts on it
            result["error"] = error

    thread = threading.Thread(target=body)
    thread.start()
    return thread, result


def _paused_offload(backend: str, seed: int) -> tuple[Any, Any, torch.Tensor, torch.Tensor, Paused, Any]:
    """A 3-block model offloaded, its reference output, and a forward that will pause inside block 1."""
    model, reference = make_pair(3)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = reference(x)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend, prefetch_depth=1)
    paused = Paused(model)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    return model, reference, x, want, paused, forward


def _assert_clean_outcome(result: dict[str, Any], want: torch.Tensor) -> None:
    """A forward racing a disable either finished exactly or raised one of the package's own errors."""
    if "error" in result:
        assert str(result["error"]).startswith("fastoffload:"), repr(result["error"])
    else:
        assert torch.equal(result["value"], want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_second_forward_in_another_thread_is_refused(backend: str) -> None:
    model, reference, x, want, paused, forward = _paused_offload(backend, seed=1)
    first, first_result = _run_in_thread(forward)
    assert paused.inside.wait(WAIT_S)
    second, second_result = _run_in_thread(forward)
    second.join(WAIT_S)
    paused.proceed.set()
    first.join(WAIT_S)
    assert not first.is_alive() and not second.is_alive()
    assert isinstance(second_result.get("error"), RuntimeError)
    assert str(second_result["error"]) == CONCURRENT
    assert torch.equal(first_result["value"], want)
    with torch.no_grad():  # the refused forward left nothing behind
        assert torch.equal(model(x), want)
    paused.handle.remove()
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_forward_logs_no_error_for_the_block_the_other_thread_runs(backend: str,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    model, reference, x, want, paused, forward = _paused_offload(backend, seed=5)
    paused.handle.remove()
    paused = Paused(model, index=0)  # the refused forward's first block is the one running
    with caplog.at_level(logging.DEBUG, logger="fastoffload_ext"):
        first, first_result = _run_in_thread(forward)
        assert paused.inside.wait(WAIT_S)
        second, second_result = _run_in_thread(forward)
        second.join(WAIT_S)
        paused.proceed.set()
        first.join(WAIT_S)
    assert not first.is_alive() and not second.is_alive()
    assert str(second_result["error"]) == CONCURRENT
    assert torch.equal(first_result["value"], want)
    # The refused entry acquired nothing, so it has nothing to release: no "releasing a block ... failed".
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    paused.handle.remove()
    _runs_then_disables_exactly(model, reference, x, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_disable_from_another_thread_waits_for_the_running_block(backend: str) -> None:
    model, reference, x, want, paused, forward = _paused_offload(backend, seed=2)
    running, forward_result = _run_in_thread(forward)
    assert paused.inside.wait(WAIT_S)
    disabling, disable_result = _run_in_thread(lambda: fo.disable_layerwise_offload(model))
    time.sleep(0.05)  # let the disable reach the engine while block 1 still runs (no assertion on time)
    paused.proceed.set()
    running.join(WAIT_S)
    disabling.join(WAIT_S)
    assert not running.is_alive() and not disabling.is_alive()
    assert "error" not in disable_result, repr(disable_result.get("error"))
    _assert_clean_outcome(forward_result, want)
    paused.handle.remove()
    assert fo.get_offload_group(model) is None and not any(has_hooks(b) for b in model.blocks)
    assert params_equal(model, reference)
    with torch.no_grad():
        assert torch.equal(model(x), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mutation_from_another_thread_waits_for_the_running_block(backend: str) -> None:
    model, reference, x, want, paused, forward = _paused_offload(backend, seed=4)
    running, forward_result = _run_in_thread(forward)
    assert paused.inside.wait(WAIT_S)

    def mutate() -> None:
        with offload_hook(model.blocks[0]).mutate_params_scope(), torch.no_grad():
            model.blocks[0].o.weight.add_(1.0)

    mutating, mutate_result = _run_in_thread(mutate)
    mutating.join(0.2)  # it waits for block 1 to be released (it was refused at once before)
    assert mutating.is_alive() and not mutate_result
    paused.proceed.set()
    running.join(WAIT_S)
    mutating.join(WAIT_S)
    assert not running.is_alive() and not mutating.is_alive()
    assert "error" not in mutate_result, repr(mutate_result.get("error"))
    _assert_clean_outcome(forward_result, want)
    paused.handle.remove()
    with torch.no_grad():
        reference.blocks[0].o.weight.add_(1.0)
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_disable_racing_forwards_never_corrupts(backend: str) -> None:
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3))
    for trial in range(8):
        model, reference = make_pair(4, seed=trial)
        with torch.no_grad():
            want = reference(x)
        fo.enable_layerwise_offload(model, device="cpu", backend=backend, prefetch_depth=trial % 3)
        started = threading.Event()
        outcomes: list[dict[str, Any]] = []

        def forwards() -> None:
            for _ in range(30):
                result: dict[str, Any] = {}
                try:
                    with torch.no_grad():
                        result["value"] = model(x)
                except RuntimeError as error:
                    result["error"] = error
                outcomes.append(result)
                started.set()

        thread = threading.Thread(target=forwards)
        thread.start()
        assert started.wait(WAIT_S)
        time.sleep(0.001 * trial)  # a different point of the loop each trial (no assertion on time)
        fo.disable_layerwise_offload(model)
        thread.join(WAIT_S)
        assert not thread.is_alive()
        for result in outcomes:
            _assert_clean_outcome(result, want)
        assert all(p.numel() > 0 for p in model.parameters())
        assert params_equal(model, reference)


def test_error_text_is_the_same_on_both_backends() -> None:
    from fastoffload_ext.engine.threads import CONCURRENT_FORWARD_ERROR

    assert CONCURRENT_FORWARD_ERROR == CONCURRENT
    assert re.match(r"^fastoffload: ", CONCURRENT)


# ---- layout changes (re-plan, is_replace, disable) from another thread ---------------------------------
#
# A block's gate sees only an offloaded block while it runs. A layout change must also wait for a forward
# that is between blocks or inside a resident block: a re-plan that offloads that resident block would take
# its weights from under the running F.linear (a raw shape error on a 0-size placeholder). These tests hold
# a forward inside a block with an event, start the change in another thread, and let the forward go only
# once the change has said it waits (a log record, caught as an event: no sleeps).

N = 6
BLOCK_BYTES = module_packed_bytes(Block(16, 2))
# Under a budget of five blocks three stay resident: the first three as enable plans them from bytes alone (and a
# re-plan from a table of bytes alone), every other block once a calibrated table shows compute to hide copies behind.
SPREAD_COSTS = BlockCosts([0.1] * N, [BLOCK_BYTES] * N, 1e-3)
FIRST_COSTS = BlockCosts([0.0] * N, [BLOCK_BYTES] * N, 1e-3, calibrated=False)
HOLD_WAITS = "waiting for a forward running in another thread to finish before changing the offload layout"
FORWARD_WAITS = "a forward waits for another thread's layout change of this offloaded model"


class Logged(logging.Handler):
    """An event set when the threads module logs a message containing ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.text = text
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()

    def __enter__(self) -> Logged:
        self.logger = logging.getLogger("fastoffload_ext.engine.threads")
        self.level = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


def _runs_then_disables_exactly(model: Any, reference: Any, x: torch.Tensor, want: torch.Tensor) -> None:
    """The offload still runs bit-exact, and a disable leaves every parameter with its exact value."""
    with torch.no_grad():
        assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


def _planned(backend: str, spread: bool, seed: int) -> tuple[Any, Any, torch.Tensor, torch.Tensor, Any]:
    """A 6-block model under a budget of five blocks: resident (0, 1, 2), or (0, 2, 4) once re-planned."""
    model, reference = make_pair(N, seed=seed)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = reference(x)
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=5 * BLOCK_BYTES)
    if spread:
        group = group.replan(SPREAD_COSTS)
    assert group.resident == ((0, 2, 4) if spread else (0, 1, 2))
    return model, reference, x, want, group


def _forward_of(model: Any, x: torch.Tensor) -> Any:
    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model(x)
    return forward


def _check_waited_then_finished(paused: Paused, change: Any, forward: Any, waits_for: str = HOLD_WAITS
                                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs ``forward`` held in its paused block, then ``change`` in another thread; the change must say it
    waits before the forward is let go. Returns both results."""
    with Logged(waits_for) as logged:
        running, forward_result = _run_in_thread(forward)
        assert paused.inside.wait(WAIT_S)
        changing, change_result = _run_in_thread(change)
        assert logged.seen.wait(WAIT_S), "the layout change did not wait for the running forward"
        assert not change_result  # it is still waiting: nothing returned, nothing raised
        paused.proceed.set()
        running.join(WAIT_S)
        changing.join(WAIT_S)
    assert not running.is_alive() and not changing.is_alive()
    return forward_result, change_result


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index", [0, 2, 4])
def test_replan_waits_for_a_forward_inside_a_resident_block_it_offloads(backend: str, index: int) -> None:
    """Resident (0, 2, 4); the re-plan offloads 4 and keeps 1 resident instead (resident (0, 1, 2)). The forward
    is held in block ``index``: one the re-plan keeps resident, or one whose weights it takes into a host copy."""
    model, reference, x, want, group = _planned(backend, spread=True, seed=10 + index)
    paused = Paused(model, index)
    forward_result, replan_result = _check_waited_then_finished(
        paused, lambda: group.replan(FIRST_COSTS), _forward_of(model, x))
    assert "error" not in forward_result, repr(forward_result.get("error"))
    assert torch.equal(forward_result["value"], want)  # the forward ran on the layout it started with
    assert "error" not in replan_result, repr(replan_result.get("error"))
    fresh = replan_result["value"]
    assert fresh is fo.get_offload_group(model) and fresh.resident == (0, 1, 2)
    paused.handle.remove()
    with torch.no_grad():
        assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference) and ModelForwards.of(model) is None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index", [0, 4])
def test_replan_waits_for_a_forward_inside_an_offloaded_or_resident_block_it_makes_resident(backend: str,
                                                                                           index: int) -> None:
    """Resident (0, 1, 2); the re-plan makes 4 resident instead of 1 (resident (0, 2, 4)). Held in block 4 the
    forward owns the block's gate; held in block 0 it owns nothing, and the blocks after it change under it."""
    model, reference, x, want, group = _planned(backend, spread=False, seed=20 + index)
    paused = Paused(model, index)
    forward_result, replan_result = _check_waited_then_finished(
        paused, lambda: group.replan(SPREAD_COSTS), _forward_of(model, x))
    assert torch.equal(forward_result["value"], want)
    assert replan_result["value"].resident == (0, 2, 4)
    paused.handle.remove()
    _runs_then_disables_exactly(model, reference, x, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forward_that_starts_during_a_replan_waits_and_runs_on_the_new_layout(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference, x, want, group = _planned(backend, spread=True, seed=30)
    from fastoffload_ext.engine import layerwise

    attaching, attach_go = threading.Event(), threading.Event()
    attach = layerwise._attach_one

    def held_attach(*args: Any) -> Any:
        if not attaching.is_set():  # the re-plan's enable stops at its first block, model held
            attaching.set()
            assert attach_go.wait(WAIT_S)
        return attach(*args)

    monkeypatch.setattr(layerwise, "_attach_one", held_attach)
    with Logged(FORWARD_WAITS) as logged:
        replanning, replan_result = _run_in_thread(lambda: group.replan(FIRST_COSTS))
        assert attaching.wait(WAIT_S)
        running, forward_result = _run_in_thread(_forward_of(model, x))
        assert logged.seen.wait(WAIT_S), "the forward did not wait for the re-plan"
        assert not forward_result
        attach_go.set()
        replanning.join(WAIT_S)
        running.join(WAIT_S)
    assert not replanning.is_alive() and not running.is_alive()
    assert replan_result["value"].resident == (0, 1, 2), repr(replan_result.get("error"))
    assert torch.equal(forward_result["value"], want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_is_replace_from_another_thread_waits_for_the_running_forward(backend: str) -> None:
    model, reference, x, want, _ = _planned(backend, spread=False, seed=40)
    paused = Paused(model, 1)  # resident now; the replacement offloads every block

    def replace() -> Any:
        return fo.enable_layerwise_offload(model, is_replace=True, device="cpu", backend=backend, prefetch_depth=2)

    forward_result, replace_result = _check_waited_then_finished(paused, replace, _forward_of(model, x))
    assert torch.equal(forward_result["value"], want)
    assert replace_result["value"].resident == () and replace_result["value"].prefetch_depth == 2
    paused.handle.remove()
    _runs_then_disables_exactly(model, reference, x, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_disable_from_another_thread_waits_for_the_whole_forward(backend: str) -> None:
    """Held in block 1, which it owns, and then after the last block: a disable waits for the forward, not
    only for the block that runs, so the forward finishes on the weights it started with."""
    model, reference, x, want, paused, forward = _paused_offload(backend, seed=6)
    forward_result, disable_result = _check_waited_then_finished(
        paused, lambda: fo.disable_layerwise_offload(model), forward)
    assert "error" not in disable_result and torch.equal(forward_result["value"], want)
    paused.handle.remove()
    assert fo.get_offload_group(model) is None and not any(has_hooks(b) for b in model.blocks)
    assert ModelForwards.of(model) is None and not model._forward_pre_hooks and not model._forward_hooks
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forward_ended_by_keyboard_interrupt_does_not_hold_up_a_replan(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch runs no always-call hook for a forward that a KeyboardInterrupt ends: the forward's record
    stays behind, and its ended frame is what tells the re-plan that the forward is over. The record
    then lets go of that forward's input, and no thread's stack is read from another thread (reading one
    while its forward ran corrupted CPython 3.11's heap)."""
    model, reference, x, want, group = _planned(backend, spread=True, seed=50)

    def interrupt(module: Any, args: Any) -> None:
        raise KeyboardInterrupt

    def no_stack_reads() -> Any:
        raise AssertionError("sys._current_frames() was called")

    monkeypatch.setattr(sys, "_current_frames", no_stack_reads)
    handle = model.blocks[2].register_forward_pre_hook(interrupt)
    interrupted, still_alive = threading.Event(), threading.Event()
    its_input: list[weakref.ref[torch.Tensor]] = []

    def forward_then_linger() -> None:
        own = x.clone()
        its_input.append(weakref.ref(own))
        try:
            with torch.no_grad():
                model(own)
        except KeyboardInterrupt:
            interrupted.set()
        del own
        assert still_alive.wait(WAIT_S)  # the thread lives on, its forward long gone

    thread = threading.Thread(target=forward_then_linger)
    thread.start()
    assert interrupted.wait(WAIT_S)
    handle.remove()
    try:
        fresh = group.replan(FIRST_COSTS)  # would wait for good if the stale record counted
        assert its_input[0]() is None  # the ended forward's frame no longer keeps its input
    finally:
        still_alive.set()
        thread.join(WAIT_S)
    assert fresh.resident == (0, 1, 2)
    _runs_then_disables_exactly(model, reference, x, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replan_that_waited_for_another_threads_replan_refuses_the_stale_group(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads re-plan the same group: the second one waits for the first, and then finds its group no
    longer on the model (STALE_GROUP_ERROR) instead of re-planning the new group from the old one's plan."""
    from fastoffload_ext.engine import layerwise
    from fastoffload_ext.engine.messages import STALE_GROUP_ERROR

    model, reference, x, want, group = _planned(backend, spread=True, seed=60)
    detaching, detach_go = threading.Event(), threading.Event()
    detach = layerwise._detach_all

    def held_detach(*args: Any) -> Any:
        if not detaching.is_set():  # the first re-plan holds the model, its group still on it
            detaching.set()
            assert detach_go.wait(WAIT_S)
        return detach(*args)

    monkeypatch.setattr(layerwise, "_detach_all", held_detach)
    with Logged(HOLD_WAITS) as logged:
        first, first_result = _run_in_thread(lambda: group.replan(FIRST_COSTS))
        assert detaching.wait(WAIT_S)
        second, second_result = _run_in_thread(lambda: group.replan(FIRST_COSTS))
        assert logged.seen.wait(WAIT_S)
        detach_go.set()
        first.join(WAIT_S)
        second.join(WAIT_S)
    assert first_result["value"].resident == (0, 1, 2)
    assert str(second_result.get("error")) == STALE_GROUP_ERROR
    _runs_then_disables_exactly(model, reference, x, want)
