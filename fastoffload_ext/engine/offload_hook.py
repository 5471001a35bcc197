"""The forward hook that moves one block's weights: acquire before its forward, release after.

With grad mode on, the block's forward also runs under saved-tensor hooks (autograd.py), so what
autograd saves from the offloaded weights stays valid after they go back to placeholders; and the
block's state dict holds the host copy's values (state_dict.py).
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from fastoffload_ext.engine.autograd import SavedTensorGuard, functorch_active, refuse_differentiating_transforms
from fastoffload_ext.engine.hooks import ForwardHook, ModuleHookManager
from fastoffload_ext.engine.messages import EDITED_COPY_WARNING, warn_caller
from fastoffload_ext.engine.run_order import RunOrderWatch
from fastoffload_ext.engine.state import BlockOffloadState, enter_mutation, leave_mutation
from fastoffload_ext.engine.state_dict import StateDictHooks
from fastoffload_ext.errors import OffloadStateError

__all__ = ["LayerwiseOffloadHook", "offload_hook_of"]

logger = logging.getLogger(__name__)

DISABLE_CUT_SHORT_ERROR = ("fastoffload: a disable_layerwise_offload(model) was cut short (a Ctrl-C or an error) after "
                           "this block's weights came back and before every block was detached; call "
                           "disable_layerwise_offload(model) again to finish it (every parameter keeps its values), "
                           "then enable offload again to use it offloaded")

# Not -1 while autograd runs a backward pass on this thread (where checkpointed blocks run again).
_graph_task_id = torch._C._current_graph_task_id


class LayerwiseOffloadHook(ForwardHook):
    """Loads a block's weights before its forward and drops them after (FastVideo's hook)."""

    # Set on the hooks of a new offload until the first pass of its blocks has run (run_order.py).
    run_order_watch: RunOrderWatch | None = None

    def __init__(self, state: BlockOffloadState) -> None:
        self.state = state
        # Called as the outermost mutate_params_scope ends, before the rebuild (the budget check, set at enable).
        self.after_mutation: Callable[[], None] | None = None
        self.detach_device: torch.device | None = None  # where on_detach puts the parameters
        self.detaching = False  # set by disable_layerwise_offload as it detaches the block
        self.saved_tensors = SavedTensorGuard()
        self.state_dict_hooks = StateDictHooks(state)
        # The copies of the block's host values that its state_dict() handed out (the same list, changed in place):
        # empty, the forward's entry pays one test for them.
        self._copies = self.state_dict_hooks.copies
        # The ext state acquires and prefetches in one call into the compiled core where it can; any
        # other state (the python backend, one built by hand) through its acquire and prefetch.
        self._one_call_entry = getattr(state, "try_acquire_and_prefetch", None)
        cls = type(self)
        # A subclass that changes either entry point keeps the general path.
        self._eager = cls.pre_forward is LayerwiseOffloadHook.pre_forward and \
            cls.post_forward is LayerwiseOffloadHook.post_forward

    @property  # type: ignore[override]
    def eager_points(self) -> tuple[Callable[[], None], Callable[[], None]] | None:
        # Made on each call, not kept: bound methods stored on the hook would refer back to it, a cycle
        # that only the cycle collector frees (weak.py). A pair set on the hook replaces them.
        if "_eager_points" in self.__dict__:
            return self.__dict__["_eager_points"]
        return (self._enter, self._leave) if self._eager else None

    @eager_points.setter
    def eager_points(self, points: tuple[Callable[[], None], Callable[[], None]] | None) -> None:
        self.__dict__["_eager_points"] = points

    @classmethod
    def name(cls) -> str:
        return "LayerwiseOffloadHook"

    def on_attach(self, module: nn.Module) -> None:
        before = next((p.device for p in module.parameters()), self.state.device)
        self.state.on_init(module)
        try:
            self.state_dict_hooks.attach(module)
        except BaseException:
            # The state holds the block's weights now, and the hook manager drops a hook whose on_attach raised
            # without its on_detach: they go back before the error (a Ctrl-C too) propagates. A block read from a
            # checkpoint goes to the meta device, never to a copy whose reads may not have finished.
            self._put_back(module, torch.device("meta") if getattr(self.state, "restores_to_meta", False) else before)
            raise

    def on_detach(self, module: nn.Module) -> None:
        self._put_back(module, self.detach_device if self.detach_device is not None else self.state.device)

    def _put_back(self, module: nn.Module, device: torch.device) -> None:
        """The block's parameters real tensors again, on ``device``, and its state-dict hooks off."""
        lost_edit = getattr(self.state, "lost_edit", None)  # optional: a state built by hand may lack it
        lost = lost_edit() if lost_edit is not None else None
        # A copy that state_dict() handed out and the caller changed in place: it never reached the block.
        edited = self.state_dict_hooks.edited_copy(EDITED_COPY_WARNING) if self._copies else None
        # A parameter converted into a new object made from its placeholder (state_dict.StateDictHooks.rewrapped).
        rewrapped = list(self.state_dict_hooks.rewrapped().values())
        if device.type == "meta" and not getattr(self.state, "restores_to_meta", False):
            # A parameter cannot be rebound across device kinds (``param.data = meta`` raises), so the
            # block comes back on the host and then goes to meta as ``module.to("meta")`` takes it there.
            self.state.restore(module, torch.device("cpu"))
            _give_values(rewrapped)
            module.to(device)
        else:
            self.state.restore(module, device)
            _give_values(rewrapped)
        self.state_dict_hooks.detach()
        self.state_dict_hooks.forget_copies()  # the parameters are the model's own tensors from here on
        if lost is not None:
            warn_caller(lost)
        if edited is not None:
            warn_caller(edited)

    # The entry points are compiler boundaries: torch.compile must not trace into host-side weight
    # movement (stream waits, copies, rebinding). Without the boundary dynamo would break the graph
    # inside the hook once per block per step, fragmenting a compiled block and blocking CUDA-graph
    # capture; with it, the hook is one opaque eager call and the block body stays one region.
    @torch.compiler.disable
    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self._enter()
        return args, kwargs

    @torch.compiler.disable
    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self._leave()
        return output

    def _enter(self) -> None:
        if functorch_active():
            refuse_differentiating_transforms()  # before anything is bound inside a differentiating one
        if self._copies:
            # Before anything of the block changes: a copy of its values that state_dict() handed out was changed in
            # place, and would be lost silently.
            self.state_dict_hooks.refuse_edited_copies()
        state = self.state
        if _graph_task_id() != -1:
            # A backward pass runs the block again (activation checkpointing), last block first: the blocks
            # before it are the ones to copy ahead, and the order the forward runs in is not this one.
            runs = getattr(state, "backward_runs", None)
            if runs is not None:
                runs.ran_again()
            targets = getattr(state, "backward_targets", ())
        else:
            # Where the copies wrap into the next step: in a training forward the backward pass comes first.
            targets = getattr(state, "training_targets", None)
            if targets is not None or getattr(state, "release_wraps", False):
                state.in_training_step = training = state.backward_runs.training_forward(state)
                if not training:
                    targets = None
            watch = self.run_order_watch
            if watch is not None:
                watch.started(state)
        acquired = False
        try:
            if targets is not None:
                self._acquire_then_prefetch(targets)
            elif self._one_call_entry is None or not self._one_call_entry():
                self._acquire_then_prefetch(state.prefetch_targets)
            acquired = True
            self.saved_tensors.enter()
        except BaseException as error:
            # A Ctrl-C is raised at the first bytecode after the engine's acquire returns (an acquire that
            # waits for a disk read drops the GIL, so that is where it lands): the block is running then,
            # but the caller never learns that this entry completed and never releases it. Each such block
            # would hold its slot for good, and once every slot is held no block can load again. A state
            # without that check (the python backend) is released when the saved-tensor hooks were refused
            # after its acquire (under ``disable_saved_tensors_hooks``): kept, it held its device copy and the
            # model's gate for good, refusing every other thread's forward.
            release = getattr(self.state, "release_if_running", None)
            if release is None and acquired:
                release = state.release
            if release is not None:
                try:
                    release()
                except Exception:  # the original error is the one to raise
                    logger.exception("fastoffload: releasing a block after its entry raised failed")
            if self.detaching and isinstance(error, RuntimeError) and state.weight_bytes() == 0:
                # A disable cut short after this block's weights came back, before its hook came off.
                raise OffloadStateError(DISABLE_CUT_SHORT_ERROR) from error
            raise

    def _acquire_then_prefetch(self, targets: Sequence[BlockOffloadState]) -> None:
        state = self.state
        state.acquire()
        try:
            for target in targets:
                target.prefetch()
        except BaseException:
            state.release()  # the manager only cleans up hooks whose pre_forward completed
            raise

    def _leave(self) -> None:
        state = self.state
        try:
            self.saved_tensors.leave()
        finally:
            # A Ctrl-C landing inside the scope's exit must not keep the block holding its slot (see _enter).
            state.release()
        # Where other compute runs before the next offloaded block, its copies start in the slot just freed (in
        # the forward's order: not in a backward pass, which runs the blocks the other way, nor for the next step
        # at the end of a training forward, which a backward pass follows).
        targets = getattr(state, "release_targets", ())
        if targets and _graph_task_id() == -1 and not (
                getattr(state, "release_wraps", False) and state.in_training_step):
            # The blocks that run next may sit cached (a backward pass that ran blocks again left them) and older
            # than the slot just freed: prefetched again they are touched, so the copy takes that slot instead of
            # evicting them. Only once a backward pass has run blocks: inference pays nothing for it.
            runs = getattr(state, "backward_runs", None)
            if runs is not None and runs.count:
                for upcoming in state.prefetch_targets:
                    upcoming.prefetch()
            for target in targets:
                target.prefetch()

    def keep_running_changes(self) -> None:
        """Make what is written into the running block's weights from now until its release last.

        While a forward runs the block, its parameters are views of a device slot (ext) or device copies
        (python), which the release drops: an in-place change made there (peft unmerging a fused adapter in a
        forward with the adapters disabled) would be gone from the next step on, with the layer recording
        it as done. This makes the block's next release take the values its parameters hold at that moment
        and rebuild the host copy from them, as a ``mutate_params_scope()`` would have. The state's
        ``release`` is shadowed for that one call, so no forward pays for the check.
        """
        state = self.state
        if "release" in vars(state):
            return  # asked for already in this forward
        hook = weakref.ref(self)  # the state holds the shadow until the release: no cycle back through the hook

        def release_then_rebuild() -> None:
            del state.release  # type: ignore[misc]
            live = [(param, param.detach().clone()) for param in state.offloaded_parameters().values()]
            state.release()
            owner = hook()
            if owner is None:
                return
            with owner._mutation_scope(), torch.no_grad():
                for param, value in live:
                    param.copy_(value)

        state.release = release_then_rebuild  # type: ignore[method-assign]

    def mutate_params_scope(self) -> contextlib.AbstractContextManager[None]:
        """The block's weights are on the device, as ordinary tensors, for the whole scope.

        Change them in place (LoRA merge) or replace submodules (adapter conversion adds parameters):
        on exit, the host copy is rebuilt from whatever parameters the block has then, and offload
        resumes. The rebuild also runs when the scope exits with an exception. Scopes on one block nest
        (so does a ``load_state_dict()`` inside one): the outermost exit rebuilds.

        Refused, as the block's forward is, while a copy of its values that ``state_dict()`` handed out is
        changed in place and alive (state_dict.py): the scope would rebuild the block without that change.
        """
        if self._copies and getattr(self.state, "mutation_depth", 0) == 0:
            self.state_dict_hooks.refuse_edited_copies()
        return self._mutation_scope()

    @contextlib.contextmanager
    def _mutation_scope(self) -> Iterator[None]:
        """``mutate_params_scope`` without its check of the copies ``state_dict()`` handed out (the rebuild of
        ``keep_running_changes``, at the release of a forward that passed that check)."""
        self.state_dict_hooks.finish_interrupted_load()
        if getattr(self.state, "mutation_depth", 0) == 0:
            self.state_dict_hooks.settle_foreign()  # a parameter moved here from another block: that block's first
        enter_mutation(self.state)
        try:
            yield
        finally:
            try:
                if getattr(self.state, "mutation_depth", 0) == 1 and self.after_mutation is not None:
                    self.after_mutation()  # the outermost scope ends: its parameters are still real tensors
            finally:
                leave_mutation(self.state)
                if getattr(self.state, "mutation_depth", 0) == 0 and self.state_dict_hooks.attached():
                    # The scope may have added or replaced submodules, whose own state_dict() needs the hooks.
                    self.state_dict_hooks.attach(self.state.module_ref)


def _give_values(rewrapped: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Each restored parameter's value to the object the block holds in its place (state_dict.StateDictHooks.rewrapped),
    in that object's dtype, as the resident model's converted parameter holds it (a restore follows a cast alike)."""
    for param, now in rewrapped:
        now.data = param.data.to(now.dtype)


def offload_hook_of(module: nn.Module) -> LayerwiseOffloadHook | None:
    """The layerwise offload hook on ``module``; None without one (or with another class's under its name)."""
    manager = ModuleHookManager.get_from(module)
    hook = manager.get_forward_hook(LayerwiseOffloadHook.name()) if manager is not None else None
    return hook if isinstance(hook, LayerwiseOffloadHook) else None
