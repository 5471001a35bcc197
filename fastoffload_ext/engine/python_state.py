"""The ``"python"`` backend: FastVideo's per-parameter algorithm.

Every parameter is pinned on its own through torch, copied with its own ``.to(non_blocking=True)`` on a
side stream, and rebound with ``param.data =``. The class keeps the seed's constructor and attributes,
so code that builds states by hand keeps working, and it is the baseline every benchmark compares with.

Deliberate differences from the seed, each tested:
- A block that is prefetched while it is already loaded (a single-block list prefetches itself, and
  prefetch_depth >= the block count wraps onto loaded blocks) is left alone instead of failing the
  seed's assertion.
- Releasing a block that is not loaded is a no-op (after an error or a detach mid-step).
- Acquires nest: a block that calls itself, or a forward inside the block's ``mutate_params_scope()``,
  runs on the values already bound, and only the outermost release drops them (the seed's inner
  release left the outer call, or the scope's rebuild, with placeholders).
- A grad-recording forward through an offloaded block whose parameters require grad raises
  (``messages.GRAD_ERROR``): the device copy is dropped before backward could use it. Under
  ``torch.no_grad()``/``torch.inference_mode()`` the check costs one flag read.
- With ``device="cpu"`` the state runs with the host as its "device" (no streams, no pinning), so the
  algorithm is testable without a GPU.
- One forward at a time (threads.py): the states of one model share a :class:`ForwardGate`; another
  thread's acquire raises ``CONCURRENT_FORWARD_ERROR``, another thread's restore or mutation waits.
- An offloaded parameter changed in place (its version counter moved) or cast (``model.half()``)
  since the block last ran raises at the next acquire instead of running on stale values; restore
  follows a cast, so ``.half()`` then disable gives float16, as on the resident model.
- A restored (detached) block refuses acquire with the core's "detached" message.
- A value the caller gave an offloaded parameter (``param.data = value`` between steps) raises at the
  next acquire, as on the ext backend, instead of being silently replaced by the host copy (the seed
  runs the old weights and loses the new value); disable keeps it.
- A parameter the caller replaced with a new ``nn.Parameter`` object while its block was offloaded is
  no longer this state's: it runs and is restored as the caller left it, as on the ext backend (the
  seed would refuse it as "changed in place" and then bind its placeholder, losing the new value).
- A parameter that is a view without dense strides (an expanded row, a slice) keeps its sizes and strides in the
  host copy, the device copies and the restore, as on the compiled core: made contiguous, reductions over it
  added in another order and the outputs differed from the resident model's.
- The device copies and placeholders are ordinary tensors even when made inside ``inference_mode()``:
  a parameter rebound to an inference tensor stops counting versions, so an in-place write to it in
  an inference_mode forward would be silently lost (the resident model keeps it; here it raises).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from fastoffload_ext.engine.messages import (CAST_ERROR, DETACHED_ERROR, GRAD_ERROR, IN_PLACE_ERROR, LOST_EDIT_WARNING,
                                            REPLACED_ERROR, scalar_type_name)
from fastoffload_ext.engine.state import BlockOffloadState, SeedEntryPoints, tensor_placeholder
from fastoffload_ext.engine.threads import ForwardGate
from fastoffload_ext.engine.weak import WeakModule
from fastoffload_ext.errors import OffloadStateError

logger = logging.getLogger(__name__)

__all__ = ["LayerwiseOffloadState"]


def _ordinary(make: Callable[[], None]) -> None:
    """Runs ``make`` so that the tensors it makes are ordinary ones, inside ``inference_mode()`` too (see the
    module docstring). Outside inference mode it is a plain call: a context manager costs ~0.5 us a block."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            make()
    else:
        make()


def _span(tensor: torch.Tensor) -> int:
    """How many elements of its storage ``tensor`` reaches, from its offset on."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


def _layout_copy(tensor: torch.Tensor, device: torch.device, non_blocking: bool = False,
                 pin: bool = False) -> torch.Tensor:
    """A copy of ``tensor`` on ``device`` that shares memory with nothing, with its sizes and strides.

    A plain copy makes a view that is not dense (an expanded row, a slice) contiguous, and reductions over it
    then add in another order than on the resident model. Such a tensor's storage span is copied as it is, as
    the compiled core packs it; a contiguous one (nearly every parameter) takes the plain copy.
    """
    if tensor.is_contiguous():
        copy = tensor.to(device, copy=True, non_blocking=non_blocking)
        return copy.pin_memory() if pin else copy
    flat = tensor.as_strided((_span(tensor),), (1,)).to(device, copy=True, non_blocking=non_blocking)
    if pin:
        flat = flat.pin_memory()
    return flat.as_strided(tensor.shape, tensor.stride(), 0)


class LayerwiseOffloadState(SeedEntryPoints):
    """Offload state of one block, FastVideo's pure-Python algorithm (backend ``"python"``)."""

    backend = "python"
    module_ref = WeakModule()  # the block, held weakly: it holds this state through its hook

    def __init__(self, async_copy_stream: torch.cuda.Stream | None, device: torch.device,
                 next_state: BlockOffloadState | None = None) -> None:
        self.async_copy_stream = async_copy_stream
        self.next_state = next_state
        self.prefetch_targets: list[BlockOffloadState] = [] if next_state is None else [next_state]
        self.gpu_named_parameters: dict[str, torch.Tensor] = {}
        self.cpu_named_parameters: dict[str, torch.Tensor] = {}
        self.device: torch.device = torch.device(device)
        # enable_layerwise_offload gives every state of a model the same gate and its index in the list.
        self.gate = ForwardGate()
        self.block_index: int | None = None
        self._versions: dict[str, int] = {}  # param name -> version counter as of the last bind
        # The host tensors the last prefetch copied, with their version counters then: a write into
        # cpu_named_parameters after it (the seed's way to change a weight) makes the acquire load again.
        self._prefetched_from: list[tuple[str, torch.Tensor, int]] = []
        self._offloaded: dict[str, nn.Parameter] = {}  # the parameter objects on_init offloaded
        # param name -> the placeholder release bound and its storage's identity (held, so that the identity is
        # never reused)
        self._placeholders: dict[str, tuple[torch.Tensor, int]] = {}
        self._depth = 0  # acquires not yet released: they nest (a re-entrant block, a forward inside a mutation)
        self._kept = False  # materialized by a rebuild that failed: the parameters hold the block's values
        self._detached = False

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return _layout_copy(tensor.detach(), torch.device("cpu"), pin=self.device.type == "cuda")

    @torch.compiler.disable
    def on_init(self, module: nn.Module) -> None:
        # Copy everything first, then swap: a failure part-way (a meta or sparse parameter, host out of
        # memory) must leave every parameter as it was.
        named = list(module.named_parameters())
        for name, param in named:
            if param.is_meta:  # the compiled core's text
                raise OffloadStateError(f"fastoffload: parameter '{name}' is on the meta device and has no values to "
                                        "offload; materialize the model first (e.g. model.to_empty(device=...) followed "
                                        "by load_state_dict)")
            if param.layout != torch.strided:
                raise OffloadStateError(f"fastoffload: parameter '{name}' has layout {param.layout}; only dense "
                                        "(strided) tensors can be offloaded. Convert it with .to_dense() first")
        with torch.inference_mode(False):  # ordinary host copies and placeholders (see the module docstring)
            host = {name: self._host_copy(param.data) for name, param in named}
            self.module_ref = module
            self.cpu_named_parameters.update(host)
            self._placeholders.clear()
            for name, param in named:
                self._bind_placeholder(name, param)
        self._versions = {name: param._version for name, param in named}
        self._offloaded = dict(named)
        self._detached = False

    def _own_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameter objects on_init offloaded that the block still holds, by their names then (a state built
        by hand without on_init: all the module's). By object, not by name: a submodule wrapped since (a LoRA layer
        around a Linear) renames them, and a parameter the caller replaced is no longer this state's."""
        module = self.module_ref
        own = self._offloaded
        if not own:
            return list(module.named_parameters())
        held = {id(param) for param in module.parameters()}
        return [(name, param) for name, param in own.items() if id(param) in held]

    def _every_offloaded(self, module: nn.Module | None = None) -> list[tuple[str, nn.Parameter]]:
        """Every parameter object this state offloads, by its name then, held by the block or moved out of it since
        (an edit to a moved one is refused and warned about as for one in the block, as on the compiled core); a
        state built by hand without on_init: the parameters of ``module`` (default: the block)."""
        if self._offloaded:
            return list(self._offloaded.items())
        return list((self.module_ref if module is None else module).named_parameters())

    def is_live(self) -> bool:
        """Whether the parameters the block holds have its current values now: running, inside
        mutate_params_scope(), or kept materialized by a rebuild that failed."""
        return self._depth > 0 and not self._detached

    def is_running(self) -> bool:
        """Whether a forward holds the block's device copies now, which its release drops (not a scope's or a kept
        materialization's tensors)."""
        return self._depth > 0 and not self._detached and not getattr(self, "mutating", False) and not self._kept

    def offloaded_parameters(self) -> dict[str, nn.Parameter]:
        """Each offloaded parameter object by its name when offloaded (empty once restored; a state built by hand
        without on_init: the module's parameters)."""
        if self._detached or self.module_ref is None:
            return {}
        return dict(self._every_offloaded())

    def _where(self) -> str:
        return str(self.block_index) if self.block_index is not None else type(self.module_ref).__name__

    def _check_binding(self, name: str, param: nn.Parameter, host: torch.Tensor) -> None:
        """Raises when ``param`` was written in place or cast since it was last bound."""
        if param.dtype != host.dtype or param.device != self.device:
            raise OffloadStateError(CAST_ERROR.format(name=name, index=self._where(), now=scalar_type_name(param.dtype),
                                                      now_device=param.device, was=scalar_type_name(host.dtype),
                                                      device=self.device))
        if self._replaced(name, param, host):  # not the empty placeholder release bound
            # ``param.data = value`` between steps, or a cast and a cast back (whose rounding the host copy never
            # got): binding the host copy would silently drop that value.
            raise OffloadStateError(REPLACED_ERROR.format(name=name, index=self._where()))
        if param._version != self._versions.get(name, param._version):
            raise OffloadStateError(IN_PLACE_ERROR.format(name=name, index=self._where()))

    def _check_bindings(self, named: list[tuple[str, nn.Parameter]]) -> None:
        for name, param in named:
            self._check_binding(name, param, self.cpu_named_parameters[name])

    def _check_grad(self) -> None:
        # The offloaded parameters only (those the host copy holds), as on the compiled core: one the block took
        # since (an adapter added after enable) is an ordinary tensor until a rebuild, and trains as one.
        for name, param in self._every_offloaded():
            if param.requires_grad:
                raise OffloadStateError(GRAD_ERROR.format(where=f"block {type(self.module_ref).__name__}", name=name))

    def acquire(self) -> None:
        if torch.is_grad_enabled():
            self._check_grad()
        self.gate.begin(id(self))
        if self._depth > 0 and not self._detached:
            # Already bound (a block that calls itself, or a forward inside mutate_params_scope): the
            # parameters hold the live values, which a rebind would replace and the release would drop.
            self._depth += 1
            return
        try:
            # Checked inside the gate: a restore from another thread may have finished while this
            # thread waited to enter.
            if self._detached:
                raise OffloadStateError(DETACHED_ERROR.format(index=self._where()))
            named = self._own_parameters()
            self._check_bindings(self._every_offloaded())
        except BaseException:
            # Refused before anything was bound: a release would bind placeholders over the caller's values.
            self.gate.end(id(self))
            raise
        try:
            if self.async_copy_stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self.async_copy_stream)
            self._bind_loaded(named)
        except BaseException:
            self.release()  # out of device memory half-way: no parameter stays bound, no copy stays held
            raise
        self._depth = 1

    def _bind_loaded(self, named: list[tuple[str, nn.Parameter]]) -> None:
        gpu = self.gpu_named_parameters
        if gpu and self._prefetch_stale():
            gpu.clear()  # cpu_named_parameters was written (or an entry replaced) after the prefetch copied it
        if any(name not in gpu for name, _ in named):  # a prefetch loads all of a block or none of it
            # Nothing prefetched this block: load it now, on the current stream.
            _ordinary(lambda: gpu.update({name: _layout_copy(self.cpu_named_parameters[name], self.device)
                                          for name, _ in named if name not in gpu}))
        for name, param in named:
            param.data = gpu[name]
            self._versions[name] = param._version

    def prefetch(self) -> None:
        if self.gpu_named_parameters or self._detached:
            return  # already loaded or prefetched, or detached
        self.gate.check()
        try:
            _ordinary(self._copy_to_device)
        except BaseException:
            self.gpu_named_parameters.clear()  # a half prefetch is dropped; the block loads when it runs
            raise

    def _prefetch_stale(self) -> bool:
        host = self.cpu_named_parameters
        return any(host.get(name) is not tensor or tensor._version != version
                   for name, tensor, version in self._prefetched_from)

    def _copy_to_device(self) -> None:
        self._prefetched_from = [(name, host, host._version) for name, host in self.cpu_named_parameters.items()]
        if self.async_copy_stream is None:
            for name, host in self.cpu_named_parameters.items():
                self.gpu_named_parameters[name] = _layout_copy(host, self.device)
            return
        compute_stream = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.async_copy_stream):
            for name, host in self.cpu_named_parameters.items():
                gpu_param = _layout_copy(host, self.device, non_blocking=True)
                gpu_param.record_stream(compute_stream)  # keep it alive until the compute stream used it
                self.gpu_named_parameters[name] = gpu_param

    def release(self) -> None:
        if self.module_ref is None:
            return
        if self._depth > 1:  # an inner acquire of a block still bound: the outer one releases
            self._depth -= 1
            self.gate.end(id(self))
            return
        self._depth = 0
        self._kept = False
        _ordinary(self._bind_placeholders)
        self.gpu_named_parameters.clear()
        self.gate.end(id(self))

    def _bind_placeholders(self) -> None:
        for name, param in self._own_parameters():
            if name in self.cpu_named_parameters:
                self._bind_placeholder(name, param)

    def _bind_placeholder(self, name: str, param: nn.Parameter) -> None:
        placeholder = tensor_placeholder(param.data, self.device)
        param.data = placeholder
        self._placeholders[name] = (placeholder, placeholder.untyped_storage()._cdata)

    def _replaced(self, name: str, param: nn.Parameter, host: torch.Tensor) -> bool:
        """Whether ``param`` holds something other than the placeholder release bound: a value given by
        ``param.data = t``, or another empty tensor, which a cast and a cast back (``half().float()``) leave."""
        if param.numel() != 0 and host.numel() != 0:
            return True
        placeholder = self._placeholders.get(name)
        return placeholder is not None and param.untyped_storage()._cdata != placeholder[1]

    def begin_mutation(self) -> None:
        # Another thread's running forward finishes first, as for restore: its acquire would refuse at once.
        with self.gate.exclusive(), torch.no_grad():
            self.acquire()

    def end_mutation(self) -> None:
        # Ordinary tensors, inside inference_mode() too (a load_state_dict() there): an inference tensor bound to a
        # parameter would refuse requires_grad_() and count no versions from then on, as on the compiled core.
        with self.gate.exclusive(), torch.inference_mode(False):
            if self._detached:
                # Disabled inside the scope: the parameters are ordinary tensors holding the scope's values,
                # and a rebuild would turn them into placeholders on a model with no offload left.
                return
            host, loaded = dict(self.cpu_named_parameters), dict(self.gpu_named_parameters)
            held = {id(param) for param in self.module_ref.parameters()}
            moved = [(name, param) for name, param in self._offloaded.items() if id(param) not in held]
            self.cpu_named_parameters.clear()
            self.gpu_named_parameters.clear()
            try:
                self.on_init(self.module_ref)
            except BaseException:
                # on_init changed nothing (a sparse or meta parameter added in the scope): the block stays
                # materialized, its parameters the scope's live values, until a scope on it ends cleanly.
                # Its acquire nests from here on, so the gate is not held in between.
                self.cpu_named_parameters.update(host)
                self.gpu_named_parameters.update(loaded)
                self._kept = True
                self.gate.end(id(self))
                raise
            # A parameter moved out of the block since enable (``model.extra = block.up``) is no longer this block's
            # to offload: it becomes an ordinary tensor on the device with its value, as on the compiled core.
            for name, param in moved:
                param.data = self._current_value(param, host[name], self.device)
            self._depth = 0
            self._kept = False
            self.gate.end(id(self))

    def binding_refusal(self) -> Exception | None:
        """What the next acquire or materialize would raise for an edit, cast or rebind made while the block was
        offloaded (None: nothing, or the block is loaded); checks without changing anything."""
        if self._depth > 0 or self._detached or self.module_ref is None or getattr(self, "mutating", False):
            return None
        try:
            self._check_bindings(self._every_offloaded())
        except OffloadStateError as error:
            return error
        return None

    def mutation_refusal(self) -> Exception | None:
        """What ``begin_mutation`` would raise now for an edit, cast or rebind made while the block was offloaded
        (None: it materializes); checks without changing anything."""
        return self.binding_refusal()

    def lost_edit(self, template: str = LOST_EDIT_WARNING) -> str | None:
        """What a restore now would lose: an in-place write to an offloaded parameter, or a cast and a cast back
        (``template``: LOST_EDIT_WARNING, or STALE_SAVE_WARNING for a state_dict())."""
        if self._depth > 0 or self._detached or self.module_ref is None:
            return None  # a loaded block holds its current values, which restore keeps
        for name, param in self._every_offloaded():
            host = self.cpu_named_parameters.get(name)
            if host is None or tuple(param.shape) == tuple(host.shape):
                continue  # a full value given by the caller: restore keeps it
            # Written in place, cast and cast back, or rebound to a value of another shape (another tensor of the
            # host's dtype than the placeholder; a cast to another dtype is followed by restore).
            cast_back = param.dtype == host.dtype and self._replaced(name, param, host)
            if param._version != self._versions.get(name, param._version) or cast_back:
                return template.format(name=name, index=self._where())
        return None

    def restore(self, module: nn.Module, device: torch.device) -> None:
        with self.gate.exclusive():  # another thread's running block finishes first
            # Every object offloaded gets its value back, wherever it is now: moved out of the block
            # (``model.extra = block.up``) it is still the caller's parameter. One the caller replaced is
            # referenced by nothing, and restoring it costs a copy.
            named = self._every_offloaded(module)
            # A live block's parameters hold its current values, whatever their shape or dtype (a scope whose
            # rebuild failed may have changed either); one moved out of it holds its placeholder still.
            live = {id(param) for param in module.parameters()} if self._depth > 0 else set()
            for name, param in named:
                host = self.cpu_named_parameters.get(name)
                if host is None:
                    logger.warning("Parameter %s not found in the offload state during detachment.", name)
                    continue
                param.data = _layout_copy(param.data, device) if id(param) in live else \
                    self._current_value(param, host, device)
            self.gpu_named_parameters.clear()
            self.cpu_named_parameters.clear()
            self._prefetched_from = []
            self._offloaded = {}
            self._placeholders.clear()
            self._depth = 0
            self._kept = False
            self._detached = True
            self.gate.forget(id(self))

    @staticmethod
    def _current_value(param: nn.Parameter, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        # A loaded block (running, or inside mutate_params_scope) holds its current values on the
        # device; an offloaded one holds a placeholder, whose shape differs from the host copy's.
        if tuple(param.shape) == tuple(host.shape):
            return _layout_copy(param.data, device)
        value = _layout_copy(host, device)
        # A cast after enable (model.half()) left a placeholder of the new dtype: follow it, as the
        # resident model would have, instead of silently handing back the old dtype.
        return value if param.dtype == host.dtype else value.to(param.dtype)

    def host_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.cpu_named_parameters.values())

    def weight_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.cpu_named_parameters.values())
