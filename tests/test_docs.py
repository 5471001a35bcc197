"""The docs the code cites exist: every docs/DESIGN.md citation names one of its sections, nothing points
outside the repository, and the README stays a page a newcomer reads."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = re.compile(r"\.(py|sh|cpp|h|cu|toml)$|(^|/)Makefile$")
# docs/DESIGN.md followed closely by a quoted section name: `docs/DESIGN.md, "Build"`, `DESIGN.md ("Build")`.
CITATION = re.compile(r'DESIGN\.md[^"\n]{0,14}"([^"]+?)\\?"')


def _tracked() -> list[str]:
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    this_file = Path(__file__).resolve().relative_to(ROOT).as_posix()  # it spells out the patterns it looks for
    return [name for name in listed.stdout.splitlines() if (ROOT / name).is_file() and name != this_file]


def _sections() -> set[str]:
    return {line.lstrip("#").strip() for line in (ROOT / "docs" / "DESIGN.md").read_text().splitlines()
            if line.startswith("#")}


def test_every_design_citation_names_a_section() -> None:
    sections = _sections()
    unknown, bare = [], []
    for name in _tracked():
        if name == "docs/DESIGN.md":
            continue
        text = (ROOT / name).read_text(errors="ignore")
        for match in re.finditer(r"DESIGN\.md", text):
            cited = CITATION.match(text, match.start())
            if cited is None:
                if CODE.search(name):
                    bare.append(f"{name}: {text[match.start():match.start() + 50]!r}")
                continue
            section = " ".join(cited.group(1).split())
            if section not in sections:
                unknown.append(f"{name}: {section!r}")
    assert not unknown, f"citations of sections docs/DESIGN.md does not have: {unknown}"
    assert not bare, f"citations in code that name no section of docs/DESIGN.md: {bare}"


def test_nothing_points_outside_the_repository() -> None:
    outside = re.compile(r"\.\./shared|/work/|STYLE\.md|\bissues? [0-9]+", re.IGNORECASE)
    hits = [f"{name}: {match.group(0)}" for name in _tracked()
            for match in outside.finditer((ROOT / name).read_text(errors="ignore"))]
    assert not hits


def test_readme_fits_a_newcomer() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 180
    headings = [line for line in lines if line.startswith("## ")]
    assert headings == ["## Install", "## The two commands", "## Usage", "## Results", "## Layout", "## Known issues"]
