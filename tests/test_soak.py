"""scripts/soak.py on the CPU: a short soak on both backends passes, and a wrong reference fails it."""
from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"
MEMORY_KEYS = {"pinned_bytes", "host_reserved_bytes", "gpu_allocated_bytes", "rss_bytes"}


@pytest.fixture(scope="module")
def soak() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("soak_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is executed
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_short_soak_is_bit_equal_and_restores_parameters(soak: ModuleType, backend: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code = soak.main(["--device", "cpu", "--steps", "60", "--check-every", "20", "--backend", backend,
                      "--out", str(tmp_path)])
    result = json.loads((tmp_path / "soak.json").read_text())
    assert code == 0
    assert [s["step"] for s in result["samples"]] == [0, 20, 40, 59]  # every check_every, and the last step
    assert result["checks"] == 4
    assert all(s["bit_equal"] == {"A": True, "B": True} for s in result["samples"])
    assert result["all_bit_equal"] and result["params_restored"]
    assert result["bytes_compared"] > 0 and result["background_iterations"] > 0
    assert result["drift"].keys() == MEMORY_KEYS and result["span"].keys() == MEMORY_KEYS
    assert result["backend"] == backend and result["device"] == "cpu"
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary.startswith("soak: 60 steps, 4 checks, all bit-equal: yes,")
    assert "drift pinned" in summary and "gpu allocated" in summary and "rss" in summary


def test_a_reference_that_differs_fails_the_soak(soak: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    build = soak.build

    def build_with_wrong_reference(*args: object) -> object:
        run = build(*args)
        if run.spec.name == "B":
            with torch.no_grad():
                run.reference.proj_out.bias.add_(1)
        return run

    monkeypatch.setattr(soak, "build", build_with_wrong_reference)
    code = soak.main(["--device", "cpu", "--steps", "3", "--check-every", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "soak.json").read_text())
    assert code == 1
    assert not result["all_bit_equal"] and result["params_restored"]
    assert [s["bit_equal"] for s in result["samples"]] == [{"A": True, "B": False}] * 2
