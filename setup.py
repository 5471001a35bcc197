"""Build script for fastoffload_ext.

torch is both a build and a runtime dependency that the user already has, so it is not listed in
``build-system.requires``: building against a private copy of torch in an isolated environment would
produce an extension for the wrong ABI. Install with ``pip install --no-build-isolation .``.

``FASTOFFLOAD_CUDA`` chooses the flavour of ``fastoffload_ext._C``:
  auto (default)  CUDA build when torch is a CUDA build and a CUDA toolkit is found; CPU-only otherwise.
                  No GPU is needed to build.
  1               CUDA build; fail with a message naming what is missing.
  0               CPU-only build (the engine then runs with the host as its "device").
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
PACKAGE = "fastoffload_ext"


def read_version() -> str:
    """The package version, written once in fastoffload_ext/__init__.py (pyproject.toml reads it too)."""
    text = (ROOT / PACKAGE / "__init__.py").read_text()
    found = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    if found is None:
        sys.exit(f"fastoffload_ext: no __version__ = \"...\" line in {PACKAGE}/__init__.py")
    return found.group(1)


VERSION = read_version()

try:
    import torch
except ImportError:
    sys.exit(
        "fastoffload_ext: torch is not installed in this environment. Install torch first "
        "(pip install torch), then build with: pip install --no-build-isolation ."
    )


def _toolkit_ok(home: Path) -> bool:
    nvcc = home / "bin" / "nvcc"
    libs = [home / "lib64" / "libcudart.so", home / "lib" / "libcudart.so",
            home / "targets" / "x86_64-linux" / "lib" / "libcudart.so"]
    return nvcc.exists() and any(lib.exists() for lib in libs)


def find_cuda_home() -> Path | None:
    """The CUDA toolkit root, or None.

    torch's own guess takes the parent of the folder that holds ``nvcc``. Where ``nvcc`` is a wrapper
    script in /usr/local/bin, that guess is /usr/local, which has no cudart to link against. So each
    candidate must actually hold both ``bin/nvcc`` and ``libcudart``.
    """
    candidates: list[Path] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]))
    candidates.append(Path("/usr/local/cuda"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(os.path.realpath(nvcc)).parent.parent)
    for home in candidates:
        if _toolkit_ok(home):
            return home.resolve()
    return None


def choose_flavour() -> tuple[bool, str]:
    mode = os.environ.get("FASTOFFLOAD_CUDA", "auto").strip().lower()
    if mode not in ("auto", "1", "0"):
        sys.exit(f"fastoffload_ext: FASTOFFLOAD_CUDA must be auto, 1 or 0, got {mode!r}")
    if mode == "0":
        return False, "FASTOFFLOAD_CUDA=0 asked for a CPU-only build"
    home = find_cuda_home()
    missing = []
    if torch.version.cuda is None:
        missing.append(f"torch {torch.__version__} is not a CUDA build")
    if home is None:
        missing.append("no CUDA toolkit found (looked at $CUDA_HOME, /usr/local/cuda and the folder of nvcc "
                       "on PATH for bin/nvcc and libcudart)")
    if missing:
        if mode == "1":
            sys.exit("fastoffload_ext: FASTOFFLOAD_CUDA=1 asked for a CUDA build, but " + "; ".join(missing) +
                     ". Install the CUDA toolkit and set CUDA_HOME, or build with FASTOFFLOAD_CUDA=0.")
        return False, "; ".join(missing)
    # torch.utils.cpp_extension reads CUDA_HOME once, when it is imported: set it before that.
    os.environ["CUDA_HOME"] = str(home)
    return True, f"CUDA toolkit at {home}"


# Name the shared libstdc++ before the compiler driver adds its own: should a wrapper still add
# -static-libstdc++, the archive is then never pulled in, and C++ exceptions stay shared with torch.
# -lrt: shm_open/shm_unlink (shared host copies, csrc/shared_segment.cpp) live in librt before glibc 2.34;
# from 2.34 on they are in libc and librt is an empty stub, so naming it is harmless.
LINK_ARGS = ["-Wl,--no-as-needed", "-lstdc++", "-lrt"]


# The decode kernel is plain integer work: one real architecture (Hopper) plus its PTX, which newer GPUs
# compile at load time, keeps the build short. Naming -gencode here stops torch from adding one per
# architecture of TORCH_CUDA_ARCH_LIST.
NVCC_FLAGS = ["-O3", "-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90"]


def _has_shared_libstdcxx(compiler: str) -> bool:
    """Whether ``compiler`` can link libstdc++ as a shared library.

    An extension that carries its own static copy of libstdc++ shares no locale or exception state with
    torch: seen on a GPU image whose default CXX had only the static library, every error message that
    formats a number crashed the process instead of raising. ``-print-file-name`` answers the bare name
    when the compiler has no such file.
    """
    try:
        found = subprocess.run([compiler, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return True  # cannot tell: leave the user's choice alone
    return os.path.isabs(found) and os.path.exists(found)


def choose_compiler() -> None:
    cxx = os.environ.get("CXX", "c++")  # torch.utils.cpp_extension's default is c++ on PATH
    if _has_shared_libstdcxx(cxx):
        return
    if Path("/usr/bin/g++").exists() and _has_shared_libstdcxx("/usr/bin/g++"):
        print(f"fastoffload_ext: CXX={cxx} has no shared libstdc++ (a static copy breaks C++ errors across torch); "
              "building with /usr/bin/g++ instead", file=sys.stderr)
        os.environ["CXX"] = "/usr/bin/g++"
        if Path("/usr/bin/gcc").exists():
            os.environ["CC"] = "/usr/bin/gcc"
    else:
        print(f"fastoffload_ext: warning: CXX={cxx} has no shared libstdc++; errors raised by the extension may crash "
              "the process. Set CXX to a compiler that links libstdc++ dynamically.", file=sys.stderr)


def main() -> None:
    choose_compiler()
    with_cuda, why = choose_flavour()
    from torch.utils import cpp_extension

    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))
    if with_cuda:
        # Kernels (.cu) only in the CUDA build: the CPU-only build must not need nvcc.
        sources += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cu"))
    cxx_flags = ["-O3", f"-DFASTOFFLOAD_TORCH_VERSION=\"{torch.__version__}\""]
    if with_cuda:
        cxx_flags.append("-DFASTOFFLOAD_WITH_CUDA=1")
        cxx_flags.append(f"-DFASTOFFLOAD_CUDA_VERSION=\"{torch.version.cuda}\"")
        extension = cpp_extension.CUDAExtension(f"{PACKAGE}._C", sources,
                                                 extra_compile_args={"cxx": cxx_flags, "nvcc": NVCC_FLAGS},
                                                 extra_link_args=LINK_ARGS)
    else:
        extension = cpp_extension.CppExtension(f"{PACKAGE}._C", sources, extra_compile_args={"cxx": cxx_flags},
                                               extra_link_args=LINK_ARGS)

    build_info = {
        "version": VERSION,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_build": with_cuda,
        "cuda_home": os.environ.get("CUDA_HOME") if with_cuda else None,
        "why": why,
        "cxx_flags": cxx_flags,
        "python": sys.version.split()[0],
    }
    base = cpp_extension.BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)

    class BuildWithRecord(base):  # type: ignore[misc, valid-type]
        """Writes what _C is built against next to it, only when it is really built (not on metadata queries)."""

        def run(self) -> None:
            print(f"fastoffload_ext: {'CUDA' if with_cuda else 'CPU-only'} build ({why})", file=sys.stderr)
            (ROOT / PACKAGE / "_build_info.json").write_text(json.dumps(build_info, indent=2) + "\n")
            super().run()

    # name, version, dependencies and python_requires come from pyproject.toml's [project] table.
    setup(
        packages=find_packages(include=[PACKAGE, f"{PACKAGE}.*"]),
        package_data={PACKAGE: ["py.typed", "_build_info.json", "_C.pyi"]},
        ext_modules=[extension],
        cmdclass={"build_ext": BuildWithRecord},
        zip_safe=False,
    )


main()
