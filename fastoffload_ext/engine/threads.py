"""The threading contract of one offloaded model, for the python backend (the ext backend enforces the same
contract in C++, csrc/thread_gate.h, with the same message).

One offloaded model runs one forward at a time. The thread whose acquire finds the model idle owns it
until every block it acquired is released again (the forward ended, or its error cleanup ran):

- an acquire or prefetch from another thread meanwhile raises :data:`CONCURRENT_FORWARD_ERROR` at
  once, instead of interleaving two forwards' bindings (which gave random shape errors);
- restore (disable), mutation and teardown from another thread wait until the owner has released
  its blocks, so a disable never rebinds a parameter that a running block is reading. A disable that
  lands between two blocks of a forward wins: the rest of that forward then runs on the restored
  weights, or its next acquire raises because its block was detached.

Between forwards any thread may drive the model, one after another.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

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


__all__ = ["CONCURRENT_FORWARD_ERROR", "ForwardGate"]
