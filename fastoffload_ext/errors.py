"""The package's exception types: one base class, so callers can catch everything this library raises.

Each concrete type also derives from the builtin that callers (and FastVideo's own code) already
catch, so ``except ValueError`` keeps working where it did. Every message starts with ``fastoffload:``
and says what to do.
"""
from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointReadError", "FastOffloadError", "OffloadConfigError", "OffloadStateError"]


class FastOffloadError(Exception):
    """Base class of every error this package raises on purpose."""


class OffloadConfigError(FastOffloadError, ValueError):
    """An argument or a model that offload cannot accept (raised before anything changes)."""


class OffloadStateError(FastOffloadError, RuntimeError):
    """An operation that the current offload state does not allow (raised with nothing lost)."""


class CheckpointError(OffloadConfigError):
    """A checkpoint that offload cannot build from: missing, truncated, or not matching the model."""


class CheckpointReadError(CheckpointError, OffloadStateError):
    """Reading a checkpoint's bytes failed: an I/O error, a short read, a file changed or gone after enable.

    At enable nothing is built (the model is as it was); mid-step nothing is lost (every parameter keeps
    its values, detach works) and the next step reads again. Raised by the compiled core's reader; it is
    both a :class:`CheckpointError` and an :class:`OffloadStateError` (so also a ``RuntimeError``).
    """
