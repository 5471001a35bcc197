"""Importing FastVideo for a test without keeping what its import does to logging.

``fastvideo.logger`` configures the *root* logger when it is imported (level DEBUG, a stdout
handler). Left in place, every later test that reads log records at its default level sees messages
it never asked for; the root logger's level and handlers are put back after the import.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from types import ModuleType

import pytest

REASON = ("fastvideo is not importable (pip install --no-deps fastvideo==0.2.1 and the modules its loader imports: "
          "see scripts/setup_env.sh)")


@contextlib.contextmanager
def root_logging_kept() -> Iterator[None]:
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        yield
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers


def import_fastvideo(name: str) -> ModuleType:
    with root_logging_kept():
        return pytest.importorskip(name, reason=REASON)
