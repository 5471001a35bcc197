"""Where the models section finds a peer that pip did not install: its wheel in .whl/, and its real dependencies'."""
from __future__ import annotations

import importlib
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from benchmarks import peers


def _wheel(directory: Path, stem: str, files: dict[str, str]) -> None:
    with zipfile.ZipFile(directory / f"{stem}-1.0-py3-none-any.whl", "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)


def test_a_peer_and_its_dependency_wheel_are_put_on_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A peer whose module imports a dependency from a namespace package shipped under another wheel name,
    # as mmgp imports optimum.quanto from optimum_quanto-*.whl.
    _wheel(tmp_path, "fo_peer", {"fo_peer/__init__.py": "from fo_ns.inner import VALUE\n"})
    _wheel(tmp_path, "fo_ns_wheel", {"fo_ns/inner/__init__.py": "VALUE = 42\n"})
    monkeypatch.setattr(peers, "WHEEL_DIR", tmp_path)
    monkeypatch.setitem(peers.PEER_DEPENDENCIES, "fo_peer", (("fo_ns", "fo_ns_wheel"),))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "unpacked"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("fo_peer", "fo_ns", "fo_ns.inner"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    peers._add_wheels("fo_peer")
    try:
        assert importlib.import_module("fo_peer").VALUE == 42
        assert [Path(entry).name for entry in sys.path[-2:]] == ["fo_ns_wheel-1.0-py3-none-any",
                                                                 "fo_peer-1.0-py3-none-any"]
    finally:
        for name in ("fo_peer", "fo_ns", "fo_ns.inner"):
            sys.modules.pop(name, None)


def test_the_peers_name_the_dependencies_their_imports_need() -> None:
    assert peers.PEER_DEPENDENCIES["sglang"] == (("dill", "dill"),)
    assert peers.PEER_DEPENDENCIES["mmgp"] == (("optimum", "optimum_quanto"),)
