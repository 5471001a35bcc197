"""The contract between the offload hook and a block's offload state, and helpers both backends use.

A state owns one block's weights while it is offloaded. The hook drives it through
:class:`BlockOffloadState`: ``acquire`` before the block runs, ``prefetch`` on the blocks that run next,
``release`` after it ran; ``begin_mutation``/``end_mutation`` around ``mutate_params_scope``; ``restore``
at detach. Two implementations, with bit-identical results: ``python_state.LayerwiseOffloadState``
(FastVideo's algorithm) and ``ext_state.ExtLayerwiseOffloadState`` (the compiled core).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from fastoffload_ext.engine.messages import REBUILD_FAILED_NOTE

__all__ = ["BackwardRuns", "BlockOffloadState", "SeedEntryPoints", "enter_mutation", "host_values_of",
           "leave_mutation", "parameter_names", "tensor_placeholder"]


@runtime_checkable
class BlockOffloadState(Protocol):
    """What the hook and the offload group need from one block's state."""

    backend: str
    device: torch.device
    module_ref: nn.Module
    next_state: BlockOffloadState | None
    # The states this block prefetches when it starts (next_state first); prefetch_depth long.
    prefetch_targets: list[BlockOffloadState]
    # The states this block prefetches when it releases (see layerwise._wire_prefetch_targets); mostly empty.
    release_targets: Sequence[BlockOffloadState]
    # The states this block prefetches when a backward pass runs it again (activation checkpointing).
    backward_targets: Sequence[BlockOffloadState]

    @property
    def cpu_named_parameters(self) -> dict[str, torch.Tensor]:
        """The host copy of each offloaded parameter, by name (the seed's attribute)."""

    def offloaded_parameters(self) -> dict[str, nn.Parameter]:
        """Each offloaded parameter object by its name when offloaded: the keys of ``cpu_named_parameters``. A
        submodule wrapped since (a LoRA layer around a Linear) renames a parameter but keeps the object."""

    def on_init(self, module: nn.Module) -> None:
        """Takes ``module``'s parameters into host memory; each becomes a placeholder."""

    def acquire(self) -> None:
        """The block is about to run: its parameters hold their values on the device."""

    def prefetch(self) -> None:
        """Starts copying the block to the device ahead of its acquire (a no-op when loaded)."""

    def release(self) -> None:
        """The block ran: its parameters become placeholders again (a no-op when not loaded)."""

    def begin_mutation(self) -> None:
        """``mutate_params_scope`` starts: the parameters become ordinary device tensors."""

    def end_mutation(self) -> None:
        """``mutate_params_scope`` ends: the host copy is rebuilt from the block's parameters now."""

    def restore(self, module: nn.Module, device: torch.device) -> None:
        """Every parameter back as a real tensor on ``device`` with its current values."""

    def host_bytes(self) -> int:
        """Host memory held for this block."""

    def weight_bytes(self) -> int:
        """Bytes of the block's offloaded parameters (0 once restored)."""

    # The seed's names for acquire, prefetch and release.
    def wait_and_replace_params(self) -> None: ...

    def prefetch_params(self) -> None: ...

    def release_gpu_params(self) -> None: ...


def host_values_of(state: BlockOffloadState) -> dict[str, torch.Tensor]:
    """The block's host values for the offload's own reads: ``cpu_named_parameters`` without recording them as handed
    out to the caller (``host_values``; a state built by hand may have ``cpu_named_parameters`` alone)."""
    read = getattr(state, "host_values", None)
    return read() if callable(read) else state.cpu_named_parameters


def tensor_placeholder(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An empty tensor of the same rank and dtype on ``device`` (rank 0 becomes shape (0,))."""
    shape = (0,) * max(tensor.ndim, 1)
    return torch.empty(shape, device=device, dtype=tensor.dtype)


def parameter_names(module: nn.Module, prefix: str = "") -> dict[int, list[str]]:
    """Every name of each parameter of ``module`` (``prefix`` before each), by the parameter's id, in
    ``named_parameters`` order: a weight tied inside the module (``b.weight = a.weight``) is one
    parameter that ``named_parameters()`` lists once but the module holds, saves and loads under each name."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(prefix + name)
    return names


def enter_mutation(state: BlockOffloadState) -> None:
    """``begin_mutation`` of ``state``, unless its block is already inside one.

    Mutations nest (a ``mutate_params_scope()`` inside another on the same block, a ``load_state_dict()``
    inside a scope): only the outermost one materializes the block and, in :func:`leave_mutation`, rebuilds
    the host copy. An inner one that rebuilt it would turn the parameters back into placeholders under
    the outer scope, whose own rebuild would then take those placeholders for the block's values.
    """
    depth = getattr(state, "mutation_depth", 0)
    if depth == 0:
        state.begin_mutation()
    state.mutation_depth = depth + 1  # type: ignore[attr-defined]
    state.mutating = True  # type: ignore[attr-defined]


def leave_mutation(state: BlockOffloadState) -> None:
    """Ends what :func:`enter_mutation` started; the outermost end rebuilds the host copy."""
    depth = max(getattr(state, "mutation_depth", 1) - 1, 0)
    state.mutation_depth = depth  # type: ignore[attr-defined]
    if depth == 0:
        state.mutating = False  # type: ignore[attr-defined]
        try:
            state.end_mutation()
        except Exception as error:
            if hasattr(error, "add_note"):  # Python 3.11 and newer
                error.add_note(REBUILD_FAILED_NOTE)
            raise
        # The rebuilt host copy may now hold adapter weights that peft added since enable, perhaps with a peft
        # imported only since: its merges must go through the block's scope from here on.
        from fastoffload_ext.integrations.peft import patch_peft

        patch_peft()


class BackwardRuns:
    """Shared by the states of one ring: whether backward passes run their blocks again (activation
    checkpointing), which tells a training step's forward, followed by such a pass, from one that is not.

    A forward with grad mode on is a training step's once any backward pass has run the blocks. A forward
    without it is one too when a backward pass ran them since the block last ran forward, and that forward
    was without grad mode as well: a reentrant checkpoint runs its forward under ``no_grad``. Inference after
    such training takes its first forward for a training step's and wraps around again from the second on;
    inference after training with grad-mode forwards wraps from the first.
    """

    __slots__ = ("seen", "count")

    def __init__(self) -> None:
        self.seen = False
        self.count = 0  # blocks run by backward passes

    def ran_again(self) -> None:
        """A backward pass runs one of the blocks again."""
        self.seen = True
        self.count += 1

    def training_forward(self, state: Any) -> bool:
        """Whether the forward now running ``state``'s block is a training step's (a backward pass follows)."""
        grad = torch.is_grad_enabled()
        if grad:
            training = self.seen
        else:
            training = self.count != state.backward_count_seen and not state.last_forward_grad
        state.backward_count_seen, state.last_forward_grad = self.count, grad
        return training


class SeedEntryPoints:
    """FastVideo's three method names, over a state's ``acquire``/``prefetch``/``release``.

    Compiler boundaries, as the hook's entry points are: dynamo must not trace host-side weight movement.
    """

    # True inside the block's mutate_params_scope() (set by the hook): a re-plan is refused meanwhile.
    mutating: bool = False
    # How many mutations (scopes, loads) the block is inside now: they nest (enter_mutation).
    mutation_depth: int = 0
    # Whether the block's release may start the next copies (wired by enable_layerwise_offload): only where an
    # acquire waits for its own copy alone, so an early copy delays no block before it.
    prefetches_on_release: bool = False
    release_targets: Sequence[BlockOffloadState] = ()
    backward_targets: Sequence[BlockOffloadState] = ()
    # A training forward's targets, where ``prefetch_targets`` wrap into the next step (else None): a backward pass
    # follows it and runs the last blocks again first, so copying the first ones would only evict those. Used in
    # the forwards that ``backward_runs`` takes for a training step's.
    training_targets: Sequence[BlockOffloadState] | None = None
    release_wraps: bool = False  # the release target, if any, is the next step's: a training forward skips it
    backward_runs: BackwardRuns | None = None
    backward_count_seen: int = 0  # backward_runs.count when this block last ran forward
    last_forward_grad: bool = False  # whether grad mode was on then
    in_training_step: bool = False  # whether its running forward was taken for a training step's (for the release)

    def unlink(self) -> None:
        """Drops this state's references to the other states (the prefetch ring, a cycle among them): its
        model was collected while offloaded, and the states go with it (group.py)."""
        self.next_state = None
        self.prefetch_targets = []
        self.release_targets = ()
        self.backward_targets = ()
        self.training_targets = None

    @torch.compiler.disable
    def wait_and_replace_params(self) -> None:
        self.acquire()  # type: ignore[attr-defined]

    @torch.compiler.disable
    def prefetch_params(self) -> None:
        self.prefetch()  # type: ignore[attr-defined]

    @torch.compiler.disable
    def release_gpu_params(self) -> None:
        self.release()  # type: ignore[attr-defined]
