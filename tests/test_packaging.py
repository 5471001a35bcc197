"""Packaging: one version, torch as the only dependency, and extras that match what the set-up script installs."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import fastoffload_ext

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[1]


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        return tomllib.load(handle)["project"]


def test_version_is_written_once() -> None:
    project = _project()
    assert project["dynamic"] == ["version"]
    hits = [path.relative_to(ROOT).as_posix() for path in [ROOT / "setup.py", ROOT / "pyproject.toml",
                                                            ROOT / "fastoffload_ext" / "__init__.py"]
            if fastoffload_ext.__version__ in path.read_text()]
    assert hits == ["fastoffload_ext/__init__.py"]


def test_torch_is_a_dependency_but_not_a_build_requirement() -> None:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        config = tomllib.load(handle)
    assert config["project"]["dependencies"] == ["torch"]
    assert not any(req.startswith("torch") for req in config["build-system"]["requires"])


def test_setup_env_installs_the_test_extra_and_make_bench_the_bench_extra() -> None:
    extras = _project()["optional-dependencies"]
    setup_env = (ROOT / "scripts" / "setup_env.sh").read_text()
    base = set(re.findall(r"\w+:(\w+)", setup_env.split("for pair in", 1)[1].split("; do", 1)[0]))
    makefile = (ROOT / "Makefile").read_text()
    bench_extra = set(re.findall(r"\w+:(\w+)", re.search(r'EXTRA_MODULES="([^"]*)"', makefile).group(1)))
    assert set(extras["test"]) <= base
    assert set(extras["bench"]) <= base | bench_extra
