"""scripts/offline_wheels.sh fetches what the code looks for in .whl/: the peers, their real dependencies and
the integration tests' packages."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from benchmarks import peers

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "offline_wheels.sh"


def _specs() -> set[str]:
    text = SCRIPT.read_text()
    block = re.search(r"specs=\((.*?)\n\)", text, re.S)
    assert block, "offline_wheels.sh lists its packages in specs=( ... )"
    names = set()
    for line in block.group(1).splitlines():
        for token in line.split("#")[0].split():
            names.add(re.split(r"[=<>!]", token.strip('"'))[0].replace("-", "_").lower())
    return names


def test_the_script_fetches_every_wheel_the_peers_and_the_setup_look_for() -> None:
    specs = _specs()
    for peer, dependencies in peers.PEER_DEPENDENCIES.items():
        assert peer in specs
        assert {wheel.lower() for _, wheel in dependencies} <= specs
    # What scripts/setup_env.sh installs from .whl/ and the GPU image lacks.
    assert {"diffusers", "importlib_metadata", "fastvideo", "remote_pdb", "wcwidth", "ftfy"} <= specs


def test_an_unknown_option_is_refused_with_the_one_it_takes() -> None:
    done = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "unknown option --bogus (use --python X.Y)" in done.stderr
