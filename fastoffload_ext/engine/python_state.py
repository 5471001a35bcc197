"""The ``"python"`` backend: FastVideo's per-parameter algorithm.

Every parameter is pinned on its own through torch, copied with its own ``.to(non_blocking=True)`` on a
side stream, and rebound with ``param.data =``. The class keeps the seed's constructor and attributes,
so code that builds states by hand keeps working, and it is the baseline every benchmark compares with.

Deliberate differences from the seed, each tested:
- A block that is prefetched while it is already loaded (a single-block list prefetches itself, and
  prefetch_depth >= the block count wraps onto loaded blocks) is left alone instead of failing the
  seed's assertion.
- Releasing a block that is not loaded is a no-op (after an error or a detach mid-step).
- A grad-recording forward through an offloaded block whose parameters require grad raises
  (``messages.GRAD_ERROR``): the device copy is dropped before backward could use it. Under
  ``torch.no_grad()``/``torch.inference_mode()`` the check costs one flag read.
- With ``device="cpu"`` the state runs with the host as its "device" (no streams, no pinning), so the
  algorithm is testable without a GPU.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from fastoffload_ext.engine.messages import GRAD_ERROR
from fastoffload_ext.engine.state import BlockOffloadState, real_copy, tensor_placeholder
from fastoffload_ext.errors import OffloadStateError

logger = logging.getLogger(__name__)

__all__ = ["LayerwiseOffloadState"]


class LayerwiseOffloadState:
    """Offload state of one block, FastVideo's pure-Python algorithm (backend ``"python"``)."""

    backend = "python"

    def __init__(self, async_copy_stream: torch.cuda.Stream | None, device: torch.device,
                 next_state: BlockOffloadState | None = None) -> None:
        self.async_copy_stream = async_copy_stream
        self.next_state = next_state
        self.prefetch_targets: list[BlockOffloadState] = [] if next_state is None else [next_state]
        self.gpu_named_parameters: dict[str, torch.Tensor] = {}
        self.cpu_named_parameters: dict[str, torch.Tensor] = {}
        self.module_ref: nn.Module = None  # type: ignore[assignment]
        self.device: torch.device = torch.device(device)

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        host = tensor.detach().to("cpu", copy=True) if tensor.device.type != "cpu" else tensor.detach().clone()
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host

    @torch.compiler.disable
    def on_init(self, module: nn.Module) -> None:
        # Copy everything first, then swap: a failure part-way (a meta or sparse parameter, host out of
        # memory) must leave every parameter as it was.
        named = list(module.named_parameters())
        for name, param in named:
            if param.layout != torch.strided:
                raise OffloadStateError(f"fastoffload: parameter '{name}' has layout {param.layout}; only dense "
                                        "(strided) tensors can be offloaded. Convert it with .to_dense() first")
        host = {name: self._host_copy(param.data) for name, param in named}
        self.module_ref = module
        self.cpu_named_parameters.update(host)
        for _, param in named:
            param.data = tensor_placeholder(param.data, self.device)

    def _check_grad(self) -> None:
        for name, param in self.module_ref.named_parameters():
            if param.requires_grad:
                raise OffloadStateError(GRAD_ERROR.format(where=f"block {type(self.module_ref).__name__}", name=name))

    def acquire(self) -> None:
        if torch.is_grad_enabled():
            self._check_grad()
        if self.async_copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.async_copy_stream)
        gpu = self.gpu_named_parameters
        try:
            for name, param in self.module_ref.named_parameters():
                loaded = gpu.get(name)
                if loaded is None:
                    # Nothing prefetched this block: load it now, on the current stream.
                    loaded = self.cpu_named_parameters[name].to(self.device, copy=True)
                    gpu[name] = loaded
                param.data = loaded
        except BaseException:
            self.release()  # out of device memory half-way: no parameter stays bound, no copy stays held
            raise

    def prefetch(self) -> None:
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

    def release(self) -> None:
        if self.module_ref is None:
            return
        for name, param in self.module_ref.named_parameters():
            if name in self.cpu_named_parameters:
                param.data = tensor_placeholder(param.data, self.device)
        self.gpu_named_parameters.clear()

    @torch.compiler.disable
    def wait_and_replace_params(self) -> None:
        self.acquire()

    @torch.compiler.disable
    def prefetch_params(self) -> None:
        self.prefetch()

    @torch.compiler.disable
    def release_gpu_params(self) -> None:
        self.release()

    def begin_mutation(self) -> None:
        with torch.no_grad():
            self.acquire()

    def end_mutation(self) -> None:
        self.cpu_named_parameters.clear()
        self.gpu_named_parameters.clear()
        self.on_init(self.module_ref)

    def restore(self, module: nn.Module, device: torch.device) -> None:
        for name, param in module.named_parameters():
            host = self.cpu_named_parameters.get(name)
            if host is None:
                logger.warning("Parameter %s not found in the offload state during detachment.", name)
                continue
            # A loaded block (running, or inside mutate_params_scope) holds its current values on the
            # device; an offloaded one holds a placeholder, whose shape differs from the host copy's.
            source = param.data if tuple(param.shape) == tuple(host.shape) else host
            param.data = real_copy(source, device)
        self.gpu_named_parameters.clear()
        self.cpu_named_parameters.clear()

    def host_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.cpu_named_parameters.values())

    def weight_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.cpu_named_parameters.values())
