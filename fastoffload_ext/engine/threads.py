"""The threading contract of one offloaded model, for the python backend (the ext backend enforces the same
contract in C++, csrc/thread_gate.h, with the same message), and the model-wide hold that a change of
layout takes.

One offloaded model runs one forward at a time. The thread whose acquire finds the model idle owns it
until every block it acquired is released again (the forward ended, or its error cleanup ran):

- an acquire or prefetch from another thread meanwhile raises :data:`CONCURRENT_FORWARD_ERROR` at
  once, instead of interleaving two forwards' bindings (which gave random shape errors);
- restore, mutation and teardown from another thread wait until the owner has released its blocks,
  so a restore never rebinds a parameter that a running block is reading.

A block's gate sees only the offloaded blocks, and only while one runs: between two blocks, or inside a
resident block, a forward owns nothing. That is enough for a restore, but not for a call that changes
the layout (``disable_layerwise_offload``, ``group.replan``, ``enable_layerwise_offload(is_replace=True)``):
it would move a resident block's weights into a host copy while another thread's forward computes
with them (a raw shape error from F.linear on a placeholder), or take the rest of that forward's blocks
away under it. So every offloaded model also carries :class:`ModelForwards`, a pair of torch hooks on
the model itself that know which threads are inside its forward; a layout change takes its
:meth:`~ModelForwards.hold`, which waits until no other thread is inside a forward and keeps new
forwards from other threads waiting at their entry until the change is done. The running forward
completes on the layout it started with, and the next one runs on the new one.

Between forwards any thread may drive the model, one after another.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fastoffload_ext.engine.messages import COPY_ERROR
from fastoffload_ext.errors import OffloadStateError

logger = logging.getLogger(__name__)

CONCURRENT_FORWARD_ERROR = (
    "fastoffload: this offloaded model is running a forward in another thread; one offloaded model runs one forward "
    "at a time. Run its forwards from one thread (or one after another under a lock), or give each thread its own "
    "copy of the model.")


class ForwardGate:
    """Who owns an offloaded model now: the thread with blocks running, or nobody."""

    def __init__(self) -> None:
        # Re-entrant: a detach from inside the owner's own forward takes the gate again.
        self._condition = threading.Condition(threading.RLock())
        self._owner: int | None = None
        self._running: dict[int, int] = {}  # id(state) -> nesting depth

    def _owned_by_other(self) -> bool:
        return self._owner is not None and self._owner != threading.get_ident()

    def check(self) -> None:
        """Raises when another thread's forward owns the model."""
        with self._condition:
            if self._owned_by_other():
                raise OffloadStateError(CONCURRENT_FORWARD_ERROR)

    def begin(self, key: int) -> None:
        """Block ``key`` starts running in this thread (raises when another thread owns the model)."""
        with self._condition:
            if self._owned_by_other():
                raise OffloadStateError(CONCURRENT_FORWARD_ERROR)
            self._owner = threading.get_ident()
            self._running[key] = self._running.get(key, 0) + 1

    def end(self, key: int) -> None:
        """Block ``key`` stopped running (a no-op when it was not running)."""
        with self._condition:
            depth = self._running.get(key)
            if depth is None:
                return
            if depth > 1:
                self._running[key] = depth - 1
                return
            del self._running[key]
            if not self._running:
                self._owner = None
                self._condition.notify_all()

    def forget(self, key: int) -> None:
        """Block ``key`` is no longer running at any depth (it was detached or rebuilt)."""
        with self._condition:
            while key in self._running:
                self.end(key)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Waits until no other thread owns the model, and keeps step calls out while the body runs."""
        with self._condition:
            if self._owned_by_other():
                logger.debug("waiting for another thread's forward to release its blocks")
            self._condition.wait_for(lambda: not self._owned_by_other())
            yield


# How often a hold that waits looks again at the forwards it waits for: a forward ended by a
# KeyboardInterrupt skips torch's always-call hooks, and only its frame then says it has ended.
RECHECK_SECONDS = 0.5


def _frame_ended(frame: Any) -> bool:
    """Whether ``frame`` has returned or unwound. ``frame.clear()`` refuses a frame that is executing
    (documented) and otherwise drops the locals it holds, which an ended forward no longer needs.

    A frame is only ever asked through the reference its own thread recorded: the threads' stacks are
    never read across threads (``sys._current_frames()`` while another thread's forward ran corrupted
    CPython 3.11's heap, a rare segfault in a later allocation)."""
    try:
        frame.clear()
    except RuntimeError:
        return False
    return True


class ModelForwards:
    """Which threads are inside one offloaded model's forward now, and a hold that keeps them out.

    A forward pre-hook (run first) and an always-call forward hook on the model count the forwards
    of each thread; a forward is recorded by the frame that ran the hooks (torch's ``_call_impl``),
    which executes for exactly as long as the forward runs, so a forward that a KeyboardInterrupt
    ended (torch skips the always-call hooks for it) is recognised as gone by its frame having ended,
    instead of being waited for forever. Inside a compiled region the
    hooks do nothing (dynamo would trace them): a whole-model ``torch.compile`` forward is not seen;
    regional compile (``block.compile()``) is.

    One per model, stored on it as :data:`ATTRIBUTE` by ``enable_layerwise_offload`` and removed by
    ``disable_layerwise_offload`` (after the hold that a re-plan keeps across its disable and enable).
    """

    ATTRIBUTE = "_fastoffload_forwards"

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._entries: dict[int, list[Any]] = {}  # thread id -> the frames that entered a forward
        self._holder: int | None = None
        self._hold_depth = 0
        self._handles: tuple[Any, ...] = ()
        self._detach_pending: nn.Module | None = None  # the model to take the tracker off when the hold ends

    def __reduce_ex__(self, protocol: object) -> Any:
        raise OffloadStateError(COPY_ERROR)  # reached first when an offloaded model is copied or pickled

    @classmethod
    def of(cls, model: nn.Module) -> ModelForwards | None:
        """The tracker on ``model``, or None."""
        return model.__dict__.get(cls.ATTRIBUTE)

    @classmethod
    def attach(cls, model: nn.Module) -> ModelForwards:
        """The tracker on ``model``, put there (hooks and all) when it has none."""
        forwards = cls.of(model)
        if forwards is None:
            forwards = cls()
            model.__dict__[cls.ATTRIBUTE] = forwards
        with forwards._condition:
            forwards._detach_pending = None
            if not forwards._handles:
                forwards._handles = (model.register_forward_pre_hook(forwards._enter, prepend=True),
                                     model.register_forward_hook(forwards._leave, always_call=True))
        return forwards

    def detach(self, model: nn.Module) -> None:
        """Takes the hooks and the tracker off ``model``; while a hold is kept (a re-plan between its
        disable and its enable), when that hold ends, unless an enable attached it again meanwhile."""
        with self._condition:
            if self._hold_depth > 0:
                self._detach_pending = model
                return
            self._remove(model)

    def _remove(self, model: nn.Module) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = ()
        # The record of a forward a KeyboardInterrupt ended holds its frame, whose locals hold the model, which
        # held this tracker: left here, that cycle would keep the disabled model until the cycle collector ran.
        for entries in self._entries.values():
            for frame in entries:
                _frame_ended(frame)  # clears the locals of an ended one
        self._entries.clear()
        if model.__dict__.get(self.ATTRIBUTE) is self:
            del model.__dict__[self.ATTRIBUTE]
        self._detach_pending = None

    def _enter(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        frame = sys._getframe(1)  # torch's frame around this forward: executing until the forward ends
        me = threading.get_ident()
        with self._condition:
            mine = self._entries.get(me)
            if mine:
                mine[:] = [entry for entry in mine if not _frame_ended(entry)]  # ended by a KeyboardInterrupt
            if not mine:
                # Not nested in a forward of this thread: a layout change in another thread goes first.
                if self._holder not in (None, me):
                    logger.debug("a forward waits for another thread's layout change of this offloaded model")
                self._condition.wait_for(lambda: self._holder in (None, me))
            self._entries.setdefault(me, []).append(frame)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        me = threading.get_ident()
        with self._condition:
            mine = self._entries.get(me)
            if mine:
                mine.pop()
            if not mine:
                self._entries.pop(me, None)
                self._condition.notify_all()

    def _others_running(self) -> bool:
        """Whether a thread other than this one is inside a forward; drops the records of forwards that
        ended without the leave hook (their frame has ended)."""
        me = threading.get_ident()
        for ident in [ident for ident in self._entries if ident != me]:
            entries = [entry for entry in self._entries[ident] if not _frame_ended(entry)]
            if entries:
                self._entries[ident] = entries
                return True
            del self._entries[ident]
        return False

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Waits until no other thread is inside a forward of the model and no other thread holds it,
        then keeps other threads' new forwards waiting at their entry until the body is done.
        Re-entrant; a forward of the holding thread itself passes."""
        me = threading.get_ident()
        with self._condition:
            if self._holder != me:
                waited = False
                while self._holder is not None or self._others_running():
                    if not waited:
                        logger.info("fastoffload: waiting for a forward running in another thread to finish before "
                                    "changing the offload layout")
                        waited = True
                    self._condition.wait(RECHECK_SECONDS)
                self._holder = me
            self._hold_depth += 1
        try:
            yield
        finally:
            with self._condition:
                self._hold_depth -= 1
                if self._hold_depth == 0:
                    self._holder = None
                    if self._detach_pending is not None:
                        self._remove(self._detach_pending)
                    self._condition.notify_all()


@contextlib.contextmanager
def layout_change(model: nn.Module) -> Iterator[None]:
    """The hold of ``model``'s :class:`ModelForwards` (nothing to hold on a model that has none)."""
    forwards = ModelForwards.of(model)
    if forwards is None:
        yield
        return
    with forwards.hold():
        yield


__all__ = ["CONCURRENT_FORWARD_ERROR", "RECHECK_SECONDS", "ForwardGate", "ModelForwards", "layout_change"]
