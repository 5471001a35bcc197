"""Per-block offload state, one class per backend.

``LayerwiseOffloadState`` is FastVideo's algorithm (the ``"python"`` backend): every parameter is
pinned on its own through torch, copied with its own ``.to(non_blocking=True)`` on a side stream, and
rebound with ``param.data =``. It keeps the seed's constructor and attributes, so code that builds
states by hand keeps working, and it is the baseline every benchmark compares with.

``ExtLayerwiseOffloadState`` has the same methods over the compiled core (the ``"ext"`` backend): a
block is one handle into an ``OffloadEngine``; acquire, prefetch and release are one call each.

Deliberate differences from the seed, each tested:
- A block that is prefetched while it is already loaded (a single-block list prefetches itself, and
  prefetch_depth >= the block count wraps onto loaded blocks) is left alone instead of failing the
  seed's assertion.
- Releasing a block that is not loaded is a no-op (after an error or a detach mid-step).
- A grad-recording forward through an offloaded block whose parameters require grad raises: the
  device copy is dropped (python) or overwritten by a later block (ext) before backward could use it.
  Under ``torch.no_grad()``/``torch.inference_mode()`` the check costs one flag read.
- Under ``share_host_copy`` (ext only, see sharing.py) ``mutate_params_scope`` is refused with
  ``SHARED_MUTATION_ERROR``: the host copy belongs to every rank of the host.
- With ``device="cpu"`` the state runs with the host as its "device" (no streams, no pinning), so the
  algorithm is testable without a GPU.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from fastoffload_ext.engine.sharing import SHARED_MUTATION_ERROR

logger = logging.getLogger(__name__)

GRAD_ERROR = ("fastoffload: {where} is offloaded, its parameter '{name}' requires grad, and grad mode is on. "
              "Offloaded weights live in device slots that later blocks overwrite, so a backward pass would read "
              "the wrong bytes. Run the forward under torch.no_grad() or torch.inference_mode(), or call "
              "model.requires_grad_(False); to train, keep the block resident.")


def _tensor_placeholder(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An empty tensor of the same rank and dtype on ``device`` (rank 0 becomes shape (0,))."""
    shape = (0,) * max(tensor.ndim, 1)
    return torch.empty(shape, device=device, dtype=tensor.dtype)


def _real_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``tensor`` on ``device`` that shares memory with nothing."""
    copy = torch.empty_like(tensor, device=device)
    copy.copy_(tensor)
    return copy


class LayerwiseOffloadState:
    """Offload state of one block, FastVideo's pure-Python algorithm (backend ``"python"``)."""

    backend = "python"

    def __init__(self, async_copy_stream: torch.cuda.Stream | None, device: torch.device,
                 next_state: LayerwiseOffloadState | None = None) -> None:
        self.async_copy_stream = async_copy_stream
        self.next_state = next_state
        # The states this block prefetches when it starts (next_state first); prefetch_depth long.
        self.prefetch_targets: list[LayerwiseOffloadState] = [] if next_state is None else [next_state]
        self.gpu_named_parameters: dict[str, torch.Tensor] = {}
        self.cpu_named_parameters: dict[str, torch.Tensor] = {}
        self.module_ref: nn.Module = None  # type: ignore[assignment]
        self.device: torch.device = torch.device(device)

    def _will_offload(self, name: str) -> bool:
        return True

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        host = tensor.detach().to("cpu", copy=True) if tensor.device.type != "cpu" else tensor.detach().clone()
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host

    @torch.compiler.disable
    def on_init(self, module: nn.Module) -> None:
        # Copy everything first, then swap: a failure part-way (a meta or sparse parameter, host out of
        # memory) must leave every parameter as it was.
        named = [(name, param) for name, param in module.named_parameters() if self._will_offload(name)]
        for name, param in named:
            if param.layout != torch.strided:
                raise RuntimeError(f"fastoffload: parameter '{name}' has layout {param.layout}; only dense (strided) "
                                   "tensors can be offloaded. Convert it with .to_dense() first")
        host = {name: self._host_copy(param.data) for name, param in named}
        self.module_ref = module
        self.cpu_named_parameters.update(host)
        for _, param in named:
            param.data = _tensor_placeholder(param.data, self.device)

    def _check_grad(self) -> None:
        for name, param in self.module_ref.named_parameters():
            if param.requires_grad and self._will_offload(name):
                raise RuntimeError(GRAD_ERROR.format(where=f"block {type(self.module_ref).__name__}", name=name))

    def _acquire(self) -> None:
        if torch.is_grad_enabled():
            self._check_grad()
        if self.async_copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.async_copy_stream)
        gpu = self.gpu_named_parameters
        try:
            for name, param in self.module_ref.named_parameters():
                if not self._will_offload(name):
                    continue
                loaded = gpu.get(name)
                if loaded is None:
                    # Nothing prefetched this block: load it now, on the current stream.
                    loaded = self.cpu_named_parameters[name].to(self.device, copy=True)
                    gpu[name] = loaded
                param.data = loaded
        except BaseException:
            self._release()  # out of device memory half-way: no parameter stays bound, no copy stays held
            raise

    def _prefetch(self) -> None:
        if self.gpu_named_parameters:
            return  # already loaded or prefetched
        try:
            if self.async_copy_stream is None:
                for name, host in self.cpu_named_parameters.items():
                    self.gpu_named_parameters[name] = host.to(self.device, copy=True)
                return
            compute_stream = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self.async_copy_stream):
                for name, host in self.cpu_named_parameters.items():
                    gpu_param = host.to(self.device, non_blocking=True)
                    gpu_param.record_stream(compute_stream)  # keep it alive until the compute stream used it
                    self.gpu_named_parameters[name] = gpu_param
        except BaseException:
            self.gpu_named_parameters.clear()  # a half prefetch is dropped; the block loads when it runs
            raise

    def _release(self) -> None:
        if self.module_ref is None:
            return
        for name, param in self.module_ref.named_parameters():
            if self._will_offload(name) and name in self.cpu_named_parameters:
                param.data = _tensor_placeholder(param.data, self.device)
        self.gpu_named_parameters.clear()

    @torch.compiler.disable
    def wait_and_replace_params(self) -> None:
        self._acquire()

    @torch.compiler.disable
    def prefetch_params(self) -> None:
        self._prefetch()

    @torch.compiler.disable
    def release_gpu_params(self) -> None:
        self._release()

    # Mutation (mutate_params_scope) and detach.
    def begin_mutation(self) -> None:
        with torch.no_grad():
            self._acquire()

    def end_mutation(self) -> None:
        self.cpu_named_parameters.clear()
        self.gpu_named_parameters.clear()
        self.on_init(self.module_ref)

    def restore(self, module: nn.Module, device: torch.device) -> None:
        """Every parameter back as a real tensor on ``device`` with its current values."""
        for name, param in module.named_parameters():
            host = self.cpu_named_parameters.get(name)
            if host is None:
                logger.warning("Parameter %s not found in the offload state during detachment.", name)
                continue
            # A loaded block (running, or inside mutate_params_scope) holds its current values on the
            # device; an offloaded one holds a placeholder, whose shape differs from the host copy's.
            source = param.data if tuple(param.shape) == tuple(host.shape) else host
            param.data = _real_copy(source, device)
        self.gpu_named_parameters.clear()
        self.cpu_named_parameters.clear()

    def host_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.cpu_named_parameters.values())


class ExtLayerwiseOffloadState(LayerwiseOffloadState):
    """Offload state of one block over the compiled core (backend ``"ext"``)."""

    backend = "ext"

    def __init__(self, engine: Any, device: torch.device, next_state: LayerwiseOffloadState | None = None) -> None:
        super().__init__(None, device, next_state)
        self.engine = engine
        self.handle: int | None = None
        self.param_names: list[str] = []
        # Set by enable_layerwise_offload when the ranks of this host share one host copy (sharing.py):
        # the segment of this block, whether this process owns (packs) it, how many ranks map it.
        self.shared_segment: str | None = None
        self.shared_owner = False
        self.shared_by = 0

    @torch.compiler.disable
    def on_init(self, module: nn.Module) -> None:
        self.module_ref = module
        named = list(module.named_parameters())
        self.param_names = [name for name, _ in named]
        params = [p for _, p in named]
        if self.shared_segment is not None:
            self.handle = self.engine.add_block_shared(self.param_names, params, self.shared_segment, self.shared_owner)
        else:
            self.handle = self.engine.add_block(self.param_names, params)

    # The seed exposes these dicts; here they are computed on demand (never on the hot path). A shared
    # block's are copies: its pages are other ranks' weights too, and read-only on a non-owner.
    @property  # type: ignore[override]
    def cpu_named_parameters(self) -> dict[str, torch.Tensor]:
        if self.handle is None or self.engine.is_removed(self.handle):
            return {}
        return {name: self.engine.host_view(self.handle, j) for j, name in enumerate(self.param_names)}

    @cpu_named_parameters.setter
    def cpu_named_parameters(self, value: dict[str, torch.Tensor]) -> None:
        pass  # the base constructor assigns an empty dict; the engine owns the host copies

    @property  # type: ignore[override]
    def gpu_named_parameters(self) -> dict[str, torch.Tensor]:
        if self.handle is None or self.engine.is_removed(self.handle) or self.engine.slot_of(self.handle) < 0:
            return {}
        params = dict(self.module_ref.named_parameters())
        return {name: params[name].data for name in self.param_names if name in params}

    @gpu_named_parameters.setter
    def gpu_named_parameters(self, value: dict[str, torch.Tensor]) -> None:
        pass

    def _acquire(self) -> None:
        self.engine.acquire(self.handle)

    def _prefetch(self) -> None:
        self.engine.prefetch(self.handle)

    def _release(self) -> None:
        if self.handle is not None:
            self.engine.release(self.handle)

    def begin_mutation(self) -> None:
        if self.shared_segment is not None:
            # One rank's LoRA merge would change every rank's weights under them (or, repacked
            # privately, silently diverge from them): refused, see sharing.py.
            raise RuntimeError(SHARED_MUTATION_ERROR.format(n=self.shared_by))
        self.engine.materialize(self.handle)

    def end_mutation(self) -> None:
        named = list(self.module_ref.named_parameters())
        self.param_names = [name for name, _ in named]
        self.engine.repack(self.handle, self.param_names, [p for _, p in named])

    def restore(self, module: nn.Module, device: torch.device) -> None:
        if self.handle is None or self.engine.is_removed(self.handle):
            return
        self.engine.restore(self.handle, device)

    def host_bytes(self) -> int:
        if self.handle is None or self.engine.is_removed(self.handle):
            return 0
        return int(self.engine.block_bytes(self.handle))


__all__ = ["ExtLayerwiseOffloadState", "LayerwiseOffloadState"]
