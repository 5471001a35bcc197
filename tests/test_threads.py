"""The threading contract: one offloaded model runs one forward at a time.

A second thread's forward is refused with a clear error while the first runs; a disable from another
thread waits for the running block instead of freeing the bytes it reads. Whatever the interleaving:
no crash, no placeholder left after disable, every value exact.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

import pytest
import torch

import fastoffload_ext as fo

from ._models import make_pair, offload_hook, params_equal
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
    with torch.no_grad():
        assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


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
