"""The other offloaders the models section measures, each set up the way its own project does it.

Every peer is the installed package's code, not a re-implementation: FastVideo's
``fastvideo.hooks.layerwise_offload``, SGLang's diffusion ``LayerwiseOffloadManager``, mmgp's
``offload.profile``, diffusers' ``apply_group_offloading`` (block and leaf level) and accelerate's
``cpu_offload``.

FastVideo and SGLang are imported *module only*: their top-level ``__init__`` pulls in a whole serving
runtime (FastVideo: video I/O, FSDP loaders; SGLang: the LLM server, its kernels), which the offload
module itself never calls and which the GPU machine cannot install offline. :func:`import_module_only`
loads the offload module with its package's ``__init__`` skipped; a few third-party modules that
SGLang's import chain names but its offload path never calls are replaced by stubs when absent, only
while the import runs (listed in ``SGLANG_STUBS``, and in the row's note). Packages are found where pip
installed them, or inside a wheel in ``.whl/`` at the repository root (pure-Python modules import from a
zip). Two dependencies are real, not stubbed: SGLang's import chain serializes a class with ``dill`` at
import time, and mmgp imports ``optimum.quanto`` (``optimum-quanto``) whether or not it quantizes; an
offline machine needs their wheels too, and takes them from ``.whl/`` the same way (``PEER_DEPENDENCIES``).

Each setup takes the model (on the host), the device and the names of the model's block lists, and
returns a teardown; a peer that cannot run raises :class:`PeerUnavailable` with the reason.

What a peer offloads is read from its hooks, not its documentation, and checked after its set-up
(:func:`offloaded_parts`): FastVideo hooks the blocks of the first direct-child ``ModuleList`` only
(``enable_layerwise_offload`` breaks out of its loop after it) and leaves the rest resident; SGLang
gets one ``LayerwiseOffloadManager`` per list, as its own Flux and Wan models declare in
``layer_names`` (both of Flux's lists); diffusers' block level groups every direct-child
``ModuleList`` and puts everything else into one more group that it onloads synchronously at the
top-level forward, so the whole model moves; leaf level, accelerate's ``cpu_offload`` and mmgp's
profile move every module's weights.
"""
from __future__ import annotations

import contextlib
import glob
import importlib
import importlib.machinery
import importlib.util
import inspect
import io
import os
import sys
import tempfile
import types
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

WHEEL_DIR = Path(__file__).resolve().parents[1] / ".whl"
SGLANG_STUBS = ("pybase64", "starlette", "starlette.routing", "tvm_ffi", "compressed_tensors",
                "compressed_tensors.config", "compressed_tensors.quantization", "gguf")
# Where SGLang keeps its offload manager: the newer layout first, then the older one (0.5.10).
SGLANG_OFFLOAD = ("sglang.multimodal_gen.runtime.managers.memory_managers.layerwise_offload",
                  "sglang.multimodal_gen.runtime.utils.layerwise_offload")
FASTVIDEO_OFFLOAD = "fastvideo.hooks.layerwise_offload"
# A peer's real dependencies: (the module it imports, the name its wheel starts with in .whl/).
PEER_DEPENDENCIES = {"sglang": (("dill", "dill"),), "mmgp": (("optimum", "optimum_quanto"),)}
# Imported, where installed, before a peer's module-only import: what SGLang's diffusion runtime is built on,
# so that their checks for optional modules run before any stub exists, and SciPy's statistics, whose
# docstring code, run once at its import, takes a ``sphinx`` in sys.modules for Sphinx (see
# _forget_side_effects). A model built with diffusers has imported them already; a plain stack has not.
REAL_FIRST = ("transformers", "diffusers", "diffusers.models", "scipy.stats")

Teardown = Callable[[], None]
MAX_STUBS = 60
# package -> the modules stubbed to import its offload module (for the rows' notes).
STUBBED: dict[str, list[str]] = {}


class PeerUnavailable(RuntimeError):
    """The peer cannot run here; the message says why (the row shows it)."""


# What a peer moves each forward (a part is a block list's name, or REST for everything outside the lists).
FIRST_LIST, EVERY_LIST, WHOLE_MODEL = "first list", "every list", "whole model"
REST = "rest"


@dataclass(frozen=True)
class Peer:
    name: str
    setup: Callable[[nn.Module, torch.device, list[str]], Teardown]
    # What the row's note says about how the peer was set up.
    how: str
    # What its hooks offload (FIRST_LIST, EVERY_LIST or WHOLE_MODEL): used where the check after set-up
    # cannot tell (on the host every tensor is "on the device").
    offloads: str = WHOLE_MODEL


def declared_parts(peer: Peer, lists: list[str]) -> frozenset[str]:
    """The parts ``peer`` offloads by its hooks' rule."""
    if peer.offloads == FIRST_LIST:
        return frozenset(lists[:1])
    if peer.offloads == EVERY_LIST:
        return frozenset(lists)
    return frozenset([*lists, REST])


def _held(tensor: torch.Tensor, device: torch.device, shape: torch.Size) -> bool:
    """Whether ``tensor`` holds its full weight on ``device`` (not a placeholder, meta or host tensor)."""
    if tensor.is_meta or tensor.device != device or tensor.shape != shape:
        return False
    return tensor.untyped_storage().nbytes() >= tensor.numel() * tensor.element_size()


def offloaded_parts(model: nn.Module, device: torch.device, shapes: dict[str, torch.Size],
                    lists: list[str]) -> frozenset[str]:
    """The parts of ``model`` with a parameter not held on ``device`` after a peer's set-up.

    ``shapes`` are the parameters' shapes before the set-up (by name): FastVideo and SGLang swap a
    hooked weight for an empty placeholder on the device, diffusers leaves it on the host, accelerate
    makes it a meta tensor.
    """
    parts: set[str] = set()
    for name, param in model.named_parameters():
        if name in shapes and not _held(param, device, shapes[name]):
            head = name.split(".", 1)[0]
            parts.add(head if head in lists else REST)
    return frozenset(parts)


def _add_wheels(package: str, wheel: str | None = None) -> None:
    """Puts ``package`` (and the real dependencies :data:`PEER_DEPENDENCIES` names for it) on sys.path from
    ``.whl/`` when pip did not install it; ``wheel`` is the name its archive starts with, when not ``package``.

    The archive is unpacked next to it first: zipimport cannot import namespace packages (directories
    without ``__init__.py``), and SGLang's runtime tree is made of them, as is optimum-quanto's ``optimum``.
    """
    for dependency, dependency_wheel in PEER_DEPENDENCIES.get(package, ()):
        _add_wheels(dependency, dependency_wheel)
    if _importable(package):
        return
    stem = wheel or package
    archives = sorted(glob.glob(str(WHEEL_DIR / f"{stem}-*.whl")) + glob.glob(str(WHEEL_DIR / f"{stem}-*.zip")))
    for archive in archives:
        # Outside the repository: the checkout travels to the GPU machine, the unpacked tree need not.
        target = Path(tempfile.gettempdir()) / "fastoffload-peers" / Path(archive).stem
        if not (target / package).is_dir():
            with zipfile.ZipFile(archive) as opened:
                opened.extractall(target)
        if str(target) not in sys.path:
            sys.path.append(str(target))
        importlib.invalidate_caches()
        return


def import_module_only(package: str, module: str, stubs: tuple[str, ...] = (), *,
                       stub_missing: bool = False) -> types.ModuleType:
    """``module`` of ``package`` without running the ``__init__`` of ``package`` and of its first
    subpackage (deeper packages import normally).

    ``stubs`` are replaced by stub modules when absent; with ``stub_missing``, so is any other
    third-party module the import chain asks for and this machine lacks (the import is retried from
    scratch after each one). What was stubbed is in :data:`STUBBED`.
    """
    if module in sys.modules:
        return sys.modules[module]
    _add_wheels(package)
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PeerUnavailable(f"{package} is not installed and no {package}-*.whl is in {WHEEL_DIR}")
    root = list(spec.submodule_search_locations)[0]
    for library in REAL_FIRST:
        if _importable(library):
            with contextlib.suppress(Exception):  # a broken install: the peer's own import says so
                importlib.import_module(library)
    wanted = [stub for stub in stubs if not _importable(stub)]
    before = set(sys.modules)
    try:
        return _import_with_stubs(package, module, root, wanted, stub_missing)
    except PeerUnavailable:
        # A failed try leaves no half-imported package behind for the next layout's try to reuse.
        for name in [name for name in sys.modules if name == package or name.startswith(package + ".")]:
            del sys.modules[name]
        raise
    finally:
        _forget_side_effects(before)


def _forget_side_effects(before: set[str]) -> None:
    """Drops what a peer's import left in ``sys.modules`` that would change later imports elsewhere.

    - The stubs: they stand in while the chain imports, and no longer. A library imported later
      (transformers, and what it checks for) would take a stub for the real module.
    - A namespace package found only by a failed probe, with nothing imported beneath it. FastVideo and
      SGLang probe ``from sphinx.ext.autodoc.mock import _MockModule``; where a ``sphinx`` directory
      without ``__init__.py`` is on the path, the probe fails but leaves ``sphinx`` in ``sys.modules``,
      and SciPy's docstring code (imported by transformers) then takes Sphinx for loaded and fails.

    The peer's own modules keep the references they took.
    """
    added = set(sys.modules) - before
    for name in added:
        module = sys.modules.get(name)
        if isinstance(module, _StubModule) or (_bare_namespace(module)
                                               and not any(other.startswith(name + ".") for other in sys.modules)):
            del sys.modules[name]


def _bare_namespace(module: types.ModuleType | None) -> bool:
    spec = getattr(module, "__spec__", None)
    return (module is not None and getattr(module, "__file__", None) is None and spec is not None
            and spec.origin in (None, "namespace") and spec.submodule_search_locations is not None
            and type(spec.loader).__name__ == "NamespaceLoader")


def _import_with_stubs(package: str, module: str, root: str, wanted: list[str],
                       stub_missing: bool) -> types.ModuleType:
    for _ in range(MAX_STUBS):
        _bare_parents(package, module, root)
        for stub in wanted:
            sys.modules.setdefault(stub, _stub_module(stub))
        try:
            loaded = importlib.import_module(module)
        except ModuleNotFoundError as error:
            missing = error.name or ""
            if not stub_missing or not missing or missing.split(".")[0] == package or missing in wanted:
                raise PeerUnavailable(f"importing {module} failed: {why(error)}"[:400]) from error
            wanted.append(missing)
            for name in [name for name in sys.modules if name == package or name.startswith(package + ".")]:
                del sys.modules[name]  # a half-imported chain would be reused as it is
            continue
        except Exception as error:
            raise PeerUnavailable(f"importing {module} failed: {why(error)}"[:400]) from error
        STUBBED[package] = list(wanted)
        return loaded
    raise PeerUnavailable(f"importing {module} needs more than {MAX_STUBS} modules this machine lacks")


def _bare_parents(package: str, module: str, root: str) -> None:
    parts = module.split(".")
    for depth in (1, 2):
        name = ".".join(parts[:depth])
        if name not in sys.modules and depth < len(parts):
            bare = types.ModuleType(name)
            bare.__path__ = [os.path.join(root, *parts[1:depth])]  # type: ignore[attr-defined]
            # With a spec, so that importlib.util.find_spec (the next layout's try, or the peer's own code)
            # can look beneath it.
            bare.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            bare.__spec__.submodule_search_locations = list(bare.__path__)
            sys.modules[name] = bare


def why(error: BaseException) -> str:
    """``Type: message`` of ``error``, and of the error it came from where there is one (a lazy import's
    "could not import X" says little without the reason underneath)."""
    root, seen = error, {id(error)}
    while root.__cause__ is not None and id(root.__cause__) not in seen:
        root = root.__cause__
        seen.add(id(root))
    text = f"{type(error).__name__}: {error}"
    return text if root is error else f"{text} (from {type(root).__name__}: {root})"


class _StubMeta(type):
    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})


class _Stub(metaclass=_StubMeta):
    """Anything a stubbed module is asked for at import time: a class that can be subclassed,
    instantiated, called as a decorator (it hands back what it decorates) and asked for attributes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if len(args) == 1 and not kwargs else _Stub()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        # A stub named in a pydantic model's field (SGLang's request protocol) validates anything.
        from pydantic_core import core_schema
        return core_schema.any_schema()


class _StubModule(types.ModuleType):
    """A module this machine lacks, stood in for while a peer's offload module imports."""


def _stub_module(name: str) -> types.ModuleType:
    stub = _StubModule(name)
    stub.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    stub.__path__ = []  # type: ignore[attr-defined]  # a package, so "stub.sub" resolves too

    def attribute(name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})

    stub.__getattr__ = attribute  # type: ignore[method-assign]
    return stub


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _rest_to(model: nn.Module, device: torch.device, offloaded: list[str]) -> None:
    """Everything outside the offloaded lists to the device (the caller's job for FastVideo-style hooks)."""
    from benchmarks.workloads import move_all_but
    move_all_but(model, device, [getattr(model, name) for name in offloaded])


def fastvideo(model: nn.Module, device: torch.device, lists: list[str]) -> Teardown:
    module = import_module_only("fastvideo", FASTVIDEO_OFFLOAD)
    # FastVideo's rule: the first direct-child ModuleList only; the rest of the model is resident.
    _rest_to(model, device, lists[:1])
    with torch.cuda.device(device):
        module.enable_layerwise_offload(model)
    return lambda: None


def _sglang_module() -> types.ModuleType:
    return first_layout("sglang", SGLANG_OFFLOAD, SGLANG_STUBS)


def first_layout(package: str, layouts: tuple[str, ...], stubs: tuple[str, ...]) -> types.ModuleType:
    """The first of ``layouts`` (where releases of ``package`` keep one module) that imports; the error
    names a layout this release lacks as such, so the reason a layout that exists failed stays readable."""
    errors = []
    for name in layouts:
        try:
            return import_module_only(package, name, stubs, stub_missing=True)
        except PeerUnavailable as error:
            cause = error.__cause__
            absent = isinstance(cause, ModuleNotFoundError) and cause.name and name.startswith(cause.name)
            errors.append(f"{name}: not in this release" if absent else str(error))
    raise PeerUnavailable("; ".join(errors)[:400])


def sglang(model: nn.Module, device: torch.device, lists: list[str]) -> Teardown:
    module = _sglang_module()
    # What SGLang's OffloadableDiTMixin.configure_layerwise_offload does, with its defaults
    # (prefetch 1, no resident layers, pinned host memory): one manager per block list.
    manager_type = module.LayerwiseOffloadManager
    deferred = "initialize" in inspect.signature(manager_type.__init__).parameters
    with torch.cuda.device(device):
        if deferred:
            # Every list replaced before the rest of the model moves to the device.
            managers = [manager_type(model, layers_attr_str=name, num_layers=len(getattr(model, name)), enabled=True,
                                     pin_cpu_memory=True, prefetch_size=1, initialize=False) for name in lists]
            for manager in managers:
                manager._initialize_layer_weights()
            model.to(device)
            for manager in managers:
                manager._finalize_initialization()
                manager.register_forward_hooks()
        else:
            # The older manager offloads and hooks in its constructor, from a model already on the device.
            model.to(device)
            managers = [manager_type(model, layers_attr_str=name, num_layers=len(getattr(model, name)), enabled=True,
                                     pin_cpu_memory=True, prefetch_size=1) for name in lists]

    def teardown() -> None:
        for manager in managers:
            manager.remove_forward_hooks()
            manager.release_all()
        # Its pinned host copies (the whole model's) go with the managers, not with release_all; the
        # section empties torch's host cache next, and the next peer needs that memory on a large model.
        managers.clear()

    return teardown


def mmgp(model: nn.Module, device: torch.device, lists: list[str]) -> Teardown:
    _add_wheels("mmgp")
    try:
        from mmgp import offload, profile_type
    except Exception as error:
        raise PeerUnavailable(f"mmgp: {why(error)}"[:400]) from error
    # Its pinned-RAM, low-VRAM profile; no quantization, no dtype change: the same weights as the others.
    with contextlib.redirect_stdout(io.StringIO()):
        handle = offload.profile({"transformer": model}, profile_type.HighRAM_LowVRAM, quantizeTransformer=False,
                                 convertWeightsFloatTo=None)
    return handle.release


def _diffusers_group(offload_type: str) -> Callable[[nn.Module, torch.device, list[str]], Teardown]:
    def setup(model: nn.Module, device: torch.device, lists: list[str]) -> Teardown:
        try:
            from diffusers.hooks import apply_group_offloading
        except Exception as error:
            raise PeerUnavailable(f"diffusers: {why(error)}"[:400]) from error
        grouping = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
        apply_group_offloading(model, onload_device=device, offload_type=offload_type, use_stream=True, **grouping)
        return lambda: None

    return setup


def accelerate(model: nn.Module, device: torch.device, lists: list[str]) -> Teardown:
    try:
        from accelerate import cpu_offload
    except Exception as error:
        raise PeerUnavailable(f"accelerate: {why(error)}"[:400]) from error
    cpu_offload(model, execution_device=device)
    return lambda: None


PEERS = (
    Peer("fastvideo", fastvideo, "fastvideo.hooks.layerwise_offload.enable_layerwise_offload (first list only)",
         FIRST_LIST),
    Peer("sglang", sglang, "SGLang LayerwiseOffloadManager per list, prefetch 1, pinned", EVERY_LIST),
    Peer("mmgp", mmgp, "mmgp offload.profile HighRAM_LowVRAM, no quantization"),
    Peer("diffusers", _diffusers_group("block_level"), "apply_group_offloading block_level, 1 block/group, stream"),
    Peer("diffusers leaf", _diffusers_group("leaf_level"), "apply_group_offloading leaf_level, stream"),
    Peer("accelerate", accelerate, "accelerate cpu_offload"),
)
