"""The build and the backend choice: what was compiled, whether it loads, and what happens when it does not.

The package must import everywhere (docs/DESIGN.md, "Build"): with the compiled core when it matches the
installed torch, and otherwise with the pure-Python backend and one warning that says why and how to
fix it. The fallback scenarios need a fresh interpreter (the backend is chosen once, at import), so
they run in subprocesses that sabotage the import of ``fastoffload_ext._C`` before importing the
package, and report what they saw as JSON for the assertions here.
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import fastoffload_ext
from fastoffload_ext import _backend

ROOT = Path(__file__).resolve().parent.parent
SUBPROCESS_TIMEOUT_S = 20

# Put in front of sys.meta_path, this finder makes ``import fastoffload_ext._C`` raise ImportError with a
# message of the test's choice, exactly as a missing or unloadable .so would.
BLOCK_C_PRELUDE = """
import sys
class _BlockCompiledCore:
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "fastoffload_ext._C":
            raise ImportError({message!r})
        return None
sys.meta_path.insert(0, _BlockCompiledCore())
"""

# Records every warning raised while the package is imported (torch is imported first, so its own
# import-time warnings, if any, are not counted).
IMPORT_RECORDING = """
import json, warnings
import torch
{before_import}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import fastoffload_ext
warning_records = [{{"category": w.category.__name__, "message": str(w.message)}} for w in caught]
"""


def _run_python(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    full_env.pop("PYTHONWARNINGS", None)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    full_env.update(env or {})
    command = [sys.executable, *(["-c", code] if code else []), *args]
    return subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)


def _run_json(code: str) -> dict[str, Any]:
    """Runs ``code`` (which prints one JSON line last) in a fresh interpreter; returns that JSON."""
    result = _run_python(code)
    assert result.returncode == 0, f"subprocess failed:\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def _compiled_core() -> Any:
    import fastoffload_ext._C as compiled
    return compiled


# (a) ------------------------------------------------------------------------------------------------

def test_compiled_core_loads_and_matches_installed_torch() -> None:
    compiled = _compiled_core()
    info = compiled.build_info()
    assert info["torch"] == torch.__version__
    assert info["alignment"] > 0 and info["alignment"] & (info["alignment"] - 1) == 0, info
    # And the package actually uses it: nothing about this install should have sent it to the fallback.
    assert _backend.ext_available(), fastoffload_ext.backend_reason
    assert fastoffload_ext.active_backend() == "ext"
    assert fastoffload_ext.backend_reason == "compiled core loaded"


# (b) ------------------------------------------------------------------------------------------------

def test_cuda_build_when_ci_expects_one() -> None:
    compiled_cuda = _compiled_core().build_info()["cuda"]
    if os.environ.get("FASTOFFLOAD_EXPECT_CUDA_BUILD") == "1":
        why = fastoffload_ext.build_info().get("why")
        assert compiled_cuda is True, ("FASTOFFLOAD_EXPECT_CUDA_BUILD=1 (a CUDA toolkit is present), but the "
                                       f"compiled core is CPU-only; setup.py recorded: {why}")
    # Without the CI flag, the flavour may be either, but every place that reports it must agree.
    assert isinstance(compiled_cuda, bool)
    assert _backend.ext_has_cuda() is compiled_cuda


def test_recorded_build_info_agrees_with_compiled_core() -> None:
    info = fastoffload_ext.build_info()
    compiled = _compiled_core().build_info()
    assert info, "fastoffload_ext/_build_info.json is missing: setup.py writes it on every build"
    assert info["compiled"] == dict(compiled)
    assert info["cuda_build"] is compiled["cuda"]
    assert info["torch"] == compiled["torch"] == torch.__version__
    assert info["version"] == fastoffload_ext.__version__
    assert ("-DFASTOFFLOAD_WITH_CUDA=1" in info["cxx_flags"]) is compiled["cuda"]
    assert f'-DFASTOFFLOAD_TORCH_VERSION="{torch.__version__}"' in info["cxx_flags"]
    if compiled["cuda"]:
        assert compiled["cuda_version"] == info["torch_cuda"] == torch.version.cuda
        assert info["cuda_home"] and Path(info["cuda_home"]).name.startswith("cuda")
    else:
        assert compiled["cuda_version"] is None
        assert info["cuda_home"] is None


# (c) ------------------------------------------------------------------------------------------------

FALLBACK_SCRIPT = (BLOCK_C_PRELUDE.format(message="simulated: no compiled core on this machine")
                   + IMPORT_RECORDING.format(before_import="") + textwrap.dedent("""
    from torch import nn
    from fastoffload_ext import ModuleHookManager, enable_layerwise_offload, get_offload_group

    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.linear = nn.Linear(width, width)
            self.norm = nn.LayerNorm(width)
        def forward(self, x):
            return x + self.linear(self.norm(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block(16) for _ in range(3))
        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    model = Model().eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        reference = model(x)
        group = enable_layerwise_offload(model, device="cpu", backend="auto")
        hooked = [ModuleHookManager.get_from(b) is not None
                  and ModuleHookManager.get_from(b).get_forward_hook("LayerwiseOffloadHook") is not None
                  for b in model.blocks]
        placeholders = [p.numel() == 0 for p in model.blocks.parameters()]
        outputs_equal = [torch.equal(model(x), reference) for _ in range(3)]
        placeholders_after = [p.numel() == 0 for p in model.blocks.parameters()]

    try:
        enable_layerwise_offload(Model(), device="cpu", backend="ext")
        ext_error = None
    except RuntimeError as error:
        ext_error = str(error)

    print(json.dumps({
        "warnings": warning_records,
        "active_backend": fastoffload_ext.active_backend(),
        "reason": fastoffload_ext.backend_reason,
        "ext_available": fastoffload_ext.ext_available(),
        "group_backend": group.backend,
        "state_types": sorted({type(s).__name__ for s in group.states}),
        "hooked": hooked,
        "placeholders": placeholders,
        "placeholders_after": placeholders_after,
        "outputs_equal": outputs_equal,
        "same_group": get_offload_group(model) is group,
        "ext_error": ext_error,
    }))
"""))


@pytest.fixture(scope="module")
def fallback_run() -> dict[str, Any]:
    return _run_json(FALLBACK_SCRIPT)


def test_fallback_import_warns_once_with_the_reason(fallback_run: dict[str, Any]) -> None:
    runtime_warnings = [w for w in fallback_run["warnings"] if w["category"] == "RuntimeWarning"]
    assert len(runtime_warnings) == 1, fallback_run["warnings"]
    message = runtime_warnings[0]["message"]
    assert message.startswith("fastoffload: ") and "pure-Python backend" in message
    assert "simulated: no compiled core on this machine" in message
    assert "pip install --no-build-isolation ." in message
    assert fallback_run["active_backend"] == "python"
    assert fallback_run["ext_available"] is False
    assert "simulated: no compiled core on this machine" in fallback_run["reason"]


def test_fallback_auto_offloads_bit_identically_through_python(fallback_run: dict[str, Any]) -> None:
    assert fallback_run["group_backend"] == "python"
    assert fallback_run["state_types"] == ["LayerwiseOffloadState"]
    assert fallback_run["same_group"] is True
    assert fallback_run["hooked"] == [True, True, True]
    # Offloaded: between forwards the blocks hold only placeholders.
    assert fallback_run["placeholders"] and all(fallback_run["placeholders"])
    assert all(fallback_run["placeholders_after"])
    assert fallback_run["outputs_equal"] == [True, True, True]


def test_fallback_backend_ext_refuses_and_suggests_python(fallback_run: dict[str, Any]) -> None:
    message = fallback_run["ext_error"]
    assert message is not None, "backend='ext' was accepted although the compiled core could not be imported"
    assert "backend='ext' needs the compiled core" in message
    assert "simulated: no compiled core on this machine" in message
    assert "backend='python'" in message


# (d) ------------------------------------------------------------------------------------------------

def test_core_built_for_another_torch_is_refused() -> None:
    code = IMPORT_RECORDING.format(before_import='torch.__version__ = "0.0.1+elsewhere"') + textwrap.dedent("""
        print(json.dumps({"warnings": warning_records, "active_backend": fastoffload_ext.active_backend(),
                          "reason": fastoffload_ext.backend_reason}))
    """)
    run = _run_json(code)
    runtime_warnings = [w for w in run["warnings"] if w["category"] == "RuntimeWarning"]
    assert len(runtime_warnings) == 1, run["warnings"]
    message = runtime_warnings[0]["message"]
    built_for = _compiled_core().build_info()["torch"]
    assert f"built for torch {built_for} but torch 0.0.1+elsewhere is installed" in message
    assert "rebuild with: pip install --no-build-isolation ." in message
    assert run["active_backend"] == "python"


def test_core_with_undefined_torch_symbol_is_explained_as_a_torch_mismatch() -> None:
    # What the dynamic loader says when the .so was linked against another libtorch.
    symbol_error = "/x/_C.so: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev"
    code = (BLOCK_C_PRELUDE.format(message=symbol_error) + IMPORT_RECORDING.format(before_import="")
            + 'print(json.dumps({"warnings": warning_records, "active_backend": fastoffload_ext.active_backend()}))')
    run = _run_json(code)
    runtime_warnings = [w for w in run["warnings"] if w["category"] == "RuntimeWarning"]
    assert len(runtime_warnings) == 1, run["warnings"]
    message = runtime_warnings[0]["message"]
    assert f"does not match the installed torch {torch.__version__}" in message
    assert "undefined symbol" in message
    assert "rebuild with: pip install --no-build-isolation ." in message
    assert run["active_backend"] == "python"


def test_cxx_errors_reach_python_as_exceptions() -> None:
    # Every input error of the core is a TORCH_CHECK whose message formats numbers (sizes, indices). If
    # _C carries its own static copy of libstdc++ (a toolchain whose link finds only libstdc++.a), that
    # formatting crashes the interpreter instead of raising; seen on a GPU machine whose CXX wrapper did
    # exactly this. In a subprocess, so a crash is a failure here, not the end of the test session.
    code = textwrap.dedent("""
        import torch
        from fastoffload_ext import _C
        pool = _C.PinnedPool(-1, "pageable", 0, False, 0)
        try:
            pool.allocate(1 << 60)
        except RuntimeError as error:
            print("pool:", str(error).splitlines()[0])
        engine = _C.OffloadEngine(torch.device("cpu"), 2, pool)
        try:
            engine.acquire(7)
        except RuntimeError as error:
            print("engine:", str(error).splitlines()[0])
    """)
    result = _run_python(code)
    if result.returncode != 0:
        diagnosis = ""
        readelf = shutil.which("readelf")
        if readelf is not None:
            needed = subprocess.run([readelf, "-d", _compiled_core().__file__], capture_output=True, text=True).stdout
            diagnosis = (" _C does not link libstdc++.so dynamically (static libstdc++?)"
                         if "libstdc++" not in needed else "")
        pytest.fail(f"the compiled core crashed (rc={result.returncode}) formatting an error instead of raising it."
                    f"{diagnosis}\n{result.stdout}\n{result.stderr[-2000:]}")
    lines = result.stdout.splitlines()
    assert any(line.startswith("pool: fastoffload: could not map") for line in lines), result.stdout
    assert any(line.startswith("engine: fastoffload: block handle 7 is out of range") for line in lines), result.stdout


# (e) ------------------------------------------------------------------------------------------------

def test_report_runs_and_names_backend_and_torch() -> None:
    result = _run_python("", "-m", "fastoffload_ext")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"fastoffload_ext {fastoffload_ext.__version__}" in out
    assert f"backend:          {fastoffload_ext.active_backend()} ({fastoffload_ext.backend_reason})" in out
    assert torch.__version__ in out
    flavour = "CUDA" if _backend.ext_has_cuda() else "CPU-only"
    assert f"extension:        {flavour} build for torch {torch.__version__}" in out
    assert "CUDA at runtime:" in out
    assert "\x1b[" not in out, "the report must be plain text"
    assert len(out.splitlines()) <= 12 + (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_report_without_compiled_core_names_python_backend_and_reason() -> None:
    code = (BLOCK_C_PRELUDE.format(message="simulated: report without _C")
            + "import runpy, warnings\nwarnings.simplefilter('ignore')\n"
              "runpy.run_module('fastoffload_ext', run_name='__main__')")
    result = _run_python(code)
    assert result.returncode == 0, result.stderr
    assert "backend:          python (" in result.stdout
    assert "simulated: report without _C" in result.stdout
    assert "extension:        not loaded" in result.stdout
    assert torch.__version__ in result.stdout


@pytest.mark.cuda
def test_report_lists_every_visible_gpu() -> None:
    from fastoffload_ext.policy import platform

    result = _run_python("", "-m", "fastoffload_ext")
    assert result.returncode == 0, result.stderr
    for index in range(torch.cuda.device_count()):
        memory = "unified memory" if platform.has_unified_memory(index) else "discrete memory"
        assert f"cuda:{index}  {platform.device_name(index)}, {memory}" in result.stdout


# (f) ------------------------------------------------------------------------------------------------

def test_setup_rejects_unknown_fastoffload_cuda_value() -> None:
    build_info_path = ROOT / "fastoffload_ext" / "_build_info.json"
    before = build_info_path.read_bytes() if build_info_path.exists() else None
    result = _run_python("", "setup.py", "--version", env={"FASTOFFLOAD_CUDA": "bogus"})
    assert result.returncode != 0
    assert "FASTOFFLOAD_CUDA must be auto, 1 or 0, got 'bogus'" in result.stderr
    # It refuses before it records anything about a build.
    assert (build_info_path.read_bytes() if build_info_path.exists() else None) == before


def test_setup_metadata_query_does_not_rewrite_the_build_record(tmp_path: Path) -> None:
    # _build_info.json describes the _C next to it. A command that builds nothing (pip's metadata queries,
    # `setup.py --version`) must not overwrite it with the flavour it *would* build, or the record and the
    # installed extension disagree (FASTOFFLOAD_CUDA=0 here would relabel a CUDA build as CPU-only).
    # Run on a copy of setup.py so the real record is never at risk.
    (tmp_path / "fastoffload_ext").mkdir()
    # setup.py and pyproject.toml both read the version from the package's __init__.py.
    for name in ("setup.py", "pyproject.toml", "README.md", "fastoffload_ext/__init__.py"):
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    env = dict(os.environ, FASTOFFLOAD_CUDA="0")
    result = subprocess.run([sys.executable, "setup.py", "--version"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == fastoffload_ext.__version__
    record = tmp_path / "fastoffload_ext" / "_build_info.json"
    assert not record.exists(), ("setup.py --version built nothing but wrote _build_info.json: "
                                 f"{json.loads(record.read_text())}")


def _load_setup_functions() -> dict[str, Any]:
    """setup.py's top level without its final ``main()`` call, so its helpers can be tested alone."""
    source = (ROOT / "setup.py").read_text()
    tree = ast.parse(source)
    tree.body = [node for node in tree.body
                 if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                         and isinstance(node.value.func, ast.Name) and node.value.func.id == "main")]
    namespace: dict[str, Any] = {"__name__": "fastoffload_setup_under_test", "__file__": str(ROOT / "setup.py")}
    exec(compile(tree, str(ROOT / "setup.py"), "exec"), namespace)
    return namespace


def _fake_toolkit(home: Path, lib_dir: str = "lib64") -> Path:
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (home / "bin" / "nvcc").chmod(0o755)
    (home / lib_dir).mkdir(parents=True)
    (home / lib_dir / "libcudart.so").write_bytes(b"")
    return home


@pytest.fixture
def setup_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], Path]:
    """setup.py's functions with the hard-coded /usr/local/cuda candidate redirected to ``tmp/usr_local_cuda``.

    That one redirection (done through the ``Path`` name the functions look up) makes the toolkit search
    deterministic on any machine; everything else runs unchanged.
    """
    namespace = _load_setup_functions()
    real_path = namespace["Path"]
    sandbox_cuda = tmp_path / "usr_local_cuda"

    def sandbox_path(*parts: Any) -> Path:
        path = real_path(*parts)
        return sandbox_cuda if str(path) == "/usr/local/cuda" else path

    namespace["Path"] = sandbox_path
    empty_bin = tmp_path / "empty_bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.delenv("FASTOFFLOAD_CUDA", raising=False)
    return namespace, tmp_path


def test_setup_finds_no_toolkit_in_an_empty_cuda_home(setup_sandbox: tuple[dict[str, Any], Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    namespace, tmp_path = setup_sandbox
    empty_home = tmp_path / "empty_cuda_home"
    empty_home.mkdir()
    monkeypatch.setenv("CUDA_HOME", str(empty_home))
    assert namespace["find_cuda_home"]() is None

    monkeypatch.setenv("FASTOFFLOAD_CUDA", "1")
    with pytest.raises(SystemExit) as exit_info:
        namespace["choose_flavour"]()
    message = str(exit_info.value.code)
    assert "FASTOFFLOAD_CUDA=1 asked for a CUDA build" in message
    assert "no CUDA toolkit found" in message
    assert "FASTOFFLOAD_CUDA=0" in message

    monkeypatch.setenv("FASTOFFLOAD_CUDA", "auto")
    with_cuda, why = namespace["choose_flavour"]()
    assert with_cuda is False
    assert "no CUDA toolkit found" in why
    assert os.environ["CUDA_HOME"] == str(empty_home), "a CPU-only choice must leave CUDA_HOME alone"


def test_setup_skips_nvcc_wrapper_without_cudart(setup_sandbox: tuple[dict[str, Any], Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # docs/DESIGN.md, "Build": nvcc is a wrapper in /usr/local/bin, torch then guesses /usr/local, which has no cudart.
    namespace, tmp_path = setup_sandbox
    wrapper_root = tmp_path / "usr_local"
    (wrapper_root / "bin").mkdir(parents=True)
    (wrapper_root / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (wrapper_root / "bin" / "nvcc").chmod(0o755)
    monkeypatch.setenv("PATH", str(wrapper_root / "bin"))
    assert namespace["find_cuda_home"]() is None

    toolkit = _fake_toolkit(tmp_path / "usr_local_cuda")
    assert namespace["find_cuda_home"]() == toolkit.resolve()

    monkeypatch.setenv("FASTOFFLOAD_CUDA", "1")
    if torch.version.cuda is None:
        with pytest.raises(SystemExit, match="is not a CUDA build"):
            namespace["choose_flavour"]()
        return
    with_cuda, why = namespace["choose_flavour"]()
    assert with_cuda is True
    assert why == f"CUDA toolkit at {toolkit.resolve()}"
    # Set before torch.utils.cpp_extension is imported, which reads it once.
    assert os.environ["CUDA_HOME"] == str(toolkit.resolve())


def test_setup_prefers_cuda_home_and_accepts_targets_layout(setup_sandbox: tuple[dict[str, Any], Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    namespace, tmp_path = setup_sandbox
    _fake_toolkit(tmp_path / "usr_local_cuda")
    chosen = _fake_toolkit(tmp_path / "cuda-12.9", lib_dir="targets/x86_64-linux/lib")
    monkeypatch.setenv("CUDA_HOME", str(chosen))
    assert namespace["find_cuda_home"]() == chosen.resolve()


@pytest.mark.parametrize("value", ["0", " 0 "])
def test_setup_fastoffload_cuda_0_forces_cpu_only(setup_sandbox: tuple[dict[str, Any], Path],
                                                  monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    namespace, tmp_path = setup_sandbox
    _fake_toolkit(tmp_path / "usr_local_cuda")
    monkeypatch.setenv("FASTOFFLOAD_CUDA", value)
    assert namespace["choose_flavour"]() == (False, "FASTOFFLOAD_CUDA=0 asked for a CPU-only build")
    assert "CUDA_HOME" not in os.environ


def test_compiler_without_shared_libstdcxx_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A compiler that can only link libstdc++ statically gives an extension whose error paths crash
    # (seen on a GPU image); setup.py must build with the system g++ instead, and say so.
    fake = tmp_path / "static-only-g++"
    fake.write_text("#!/bin/sh\necho libstdc++.so\n")
    fake.chmod(0o755)
    setup_functions = _load_setup_functions()
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.delenv("CC", raising=False)
    assert setup_functions["_has_shared_libstdcxx"](str(fake)) is False
    if not Path("/usr/bin/g++").exists() or not setup_functions["_has_shared_libstdcxx"]("/usr/bin/g++"):
        pytest.skip("no system g++ with a shared libstdc++ to switch to on this machine")
    setup_functions["choose_compiler"]()
    assert os.environ["CXX"] == "/usr/bin/g++"
