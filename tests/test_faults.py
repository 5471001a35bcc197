"""Fault injection: whatever goes wrong mid-step, mid-enable or mid-mutation, nothing is lost.

Each test injects one fault into an offloaded model on the CPU (the real C++ engine with the host as
its device for "ext", FastVideo's algorithm for "python") and checks four things:

1. the fault surfaces as a clear exception (or the documented recovery happens);
2. the NEXT step is bit-exact against the resident model;
3. after ``disable_layerwise_offload`` no parameter is a placeholder and every value is the original
   (or the deliberately changed one);
4. nothing leaks: no engine slot is left "in_use" after a step, and the pool's in-use bytes return to
   0 after disable (ext); no state keeps host or device copies after disable (python).

Backend divergences found while writing these are asserted as they are today and marked
"DIVERGENCE" in the test's docstring; library bugs are ``xfail(strict=True)`` tests marked "BUG" that
state the expected behaviour (remove the marker once fixed).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext import _backend
from fastoffload_ext.engine import layerwise as layerwise_module
from fastoffload_ext.engine.offload_state import ExtLayerwiseOffloadState, LayerwiseOffloadState

from ._models import Stack, make_pair, offload_hook, params_equal, place_outside_blocks
from ._trees import has_hooks, mismatches, snapshot

BACKENDS = ["ext", "python"]
N_BLOCKS = 5
POSITIONS = {"first": 0, "middle": N_BLOCKS // 2, "last": N_BLOCKS - 1}
MiB = 1 << 20


class InjectedFault(RuntimeError):
    pass


def _setup(n_blocks: int = N_BLOCKS, seed: int = 0):
    model, reference = make_pair(n_blocks, seed=seed)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        want = reference(x)
    return model, reference, x, want


def _fails_then_recovers(model: Stack, group: fo.LayerwiseOffloadGroup, reference: Stack, x: torch.Tensor,
                         want: torch.Tensor, where: nn.Module, pre_hook: Any, fault: type[BaseException],
                         message: str) -> None:
    """A step whose ``pre_hook`` on ``where`` raises ``fault``: the engine is idle after it, the next
    step is exact, and disable gives every value back."""
    handle = where.register_forward_pre_hook(pre_hook)
    with torch.no_grad(), pytest.raises(fault, match=message):
        model(x)
    handle.remove()
    assert_idle(model, group)
    assert_step_exact(model, group, x, want)
    disable_and_check(model, group, reference)


def assert_idle(model: Stack, group: fo.LayerwiseOffloadGroup) -> None:
    """Between steps: every offloaded parameter is a placeholder, no slot is in use."""
    for state in group.states:
        assert all(p.numel() == 0 for p in state.module_ref.parameters())
    if group.engine is not None:
        engine = group.engine
        slots = [engine.slot_state(s) for s in range(engine.num_slots)]
        assert "in_use" not in slots, slots
        assert not any(engine.is_materialized(i) for i in range(len(group.states)))


def assert_step_exact(model: Stack, group: fo.LayerwiseOffloadGroup, x: torch.Tensor, want: torch.Tensor,
                      steps: int = 2) -> None:
    with torch.no_grad():
        for _ in range(steps):
            assert torch.equal(model(x), want)
            assert_idle(model, group)


def disable_and_check(model: Stack, group: fo.LayerwiseOffloadGroup, reference: nn.Module) -> None:
    """Disable, then: real tensors equal to the reference, no hook, no bytes or slots held."""
    pool = group.engine.pool if group.engine is not None else None
    fo.disable_layerwise_offload(model)
    assert fo.get_offload_group(model) is None
    assert not any(has_hooks(block) for block in model.blocks)
    assert all(p.numel() > 0 for p in model.parameters()), "a parameter was left a placeholder"
    assert params_equal(model, reference)
    if pool is not None:
        stats = pool.stats()
        assert (stats["in_use_bytes"], stats["allocation_count"], stats["reserved_bytes"]) == (0, 0, 0), stats
        assert group.engine.stats()["slot_bytes"] == 0
        assert all(group.engine.slot_state(s) == "empty" for s in range(group.engine.num_slots))
    else:
        assert all(not s.cpu_named_parameters and not s.gpu_named_parameters for s in group.states)


# ---- exceptions during a step -----------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("depth", [0, 1, 3])
def test_exception_inside_block_forward(backend: str, position: str, depth: int) -> None:
    model, reference, x, want = _setup()
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, prefetch_depth=depth)
    k = POSITIONS[position]
    with torch.no_grad():
        model(x)  # a full step first: the fault hits a warm engine (prefetched and cached slots)

    def explode(module, args):
        # Inside block k: its weights are loaded, and blocks after it are prefetched.
        assert all(p.numel() > 0 for p in model.blocks[k].parameters())
        raise InjectedFault(f"fault inside block {k}")

    _fails_then_recovers(model, group, reference, x, want, model.blocks[k].up, explode, InjectedFault,
                         f"fault inside block {k}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("position", POSITIONS)
def test_keyboard_interrupt_between_blocks(backend: str, position: str) -> None:
    """Ctrl-C after block k finished and before block k+1 (or the head, after the last block) started."""
    model, reference, x, want = _setup()
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, prefetch_depth=2)
    k = POSITIONS[position]
    after = model.blocks[k + 1] if k + 1 < N_BLOCKS else model.proj_out
    seen = {}

    def interrupt(module, args):
        seen["loaded"] = [i for i, b in enumerate(model.blocks) if any(p.numel() > 0 for p in b.parameters())]
        raise KeyboardInterrupt(f"interrupted after block {k}")

    _fails_then_recovers(model, group, reference, x, want, after, interrupt, KeyboardInterrupt,
                         f"interrupted after block {k}")
    assert seen["loaded"] == []  # block k gave its weights back before the interrupt


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("position", POSITIONS)
def test_keyboard_interrupt_while_a_block_exits(backend: str, position: str, monkeypatch) -> None:
    """Ctrl-C landing in the hook's exit, after block k's forward returned and before its release: the
    block still gives its slot back (else two of those hold every slot and no later step can load)."""
    from fastoffload_ext.engine.autograd import SavedTensorGuard

    model, reference, x, want = _setup()
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, prefetch_depth=1)
    k = POSITIONS[position]
    hook = offload_hook(model.blocks[k])
    real_leave = SavedTensorGuard.leave

    def leave(self):
        real_leave(self)
        if self is hook.saved_tensors:
            raise KeyboardInterrupt(f"interrupted while block {k} exits")

    monkeypatch.setattr(SavedTensorGuard, "leave", leave)
    for _ in range(2):
        with torch.no_grad(), pytest.raises(KeyboardInterrupt, match=f"while block {k} exits"):
            model(x)
        assert_idle(model, group)
    monkeypatch.setattr(SavedTensorGuard, "leave", real_leave)
    assert_step_exact(model, group, x, want)
    disable_and_check(model, group, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("position", POSITIONS)
def test_detach_from_inside_a_running_block(backend: str, position: str) -> None:
    """disable_layerwise_offload called from a pre-hook inside block k: the step in flight still
    computes the right output, and the model is an ordinary resident model afterwards."""
    model, reference, x, want = _setup()
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, prefetch_depth=1)
    pool = group.engine.pool if group.engine is not None else None
    k = POSITIONS[position]
    with torch.no_grad():
        model(x)

    def detach_now(module, args):
        fo.disable_layerwise_offload(model)

    handle = model.blocks[k].down.register_forward_pre_hook(detach_now)
    with torch.no_grad():
        out = model(x)
    handle.remove()
    assert torch.equal(out, want)
    assert fo.get_offload_group(model) is None
    assert not any(has_hooks(block) for block in model.blocks)
    assert all(p.numel() > 0 for p in model.parameters())
    assert params_equal(model, reference)
    with torch.no_grad():
        assert torch.equal(model(x), want)
    if pool is not None:
        assert pool.stats()["in_use_bytes"] == 0 and pool.stats()["reserved_bytes"] == 0
        assert all(group.engine.slot_state(s) == "empty" for s in range(group.engine.num_slots))
        assert all(group.engine.is_removed(i) for i in range(N_BLOCKS))
    # And offload can be enabled again on the same model.
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    assert_step_exact(model, group, x, want)
    disable_and_check(model, group, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_enabling_twice_is_refused_and_the_first_offload_keeps_working(backend: str) -> None:
    model, reference, x, want = _setup()
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    assert_step_exact(model, group, x, want, steps=1)
    in_use = group.engine.pool.stats()["in_use_bytes"] if group.engine is not None else None
    for again in ("ext", "python"):
        with pytest.raises(ValueError, match=r"layerwise offload is already enabled on this model \(<LayerwiseOffload"
                                             r"Group blocks: 5 of 5 blocks offloaded to cpu by backend '"
                                             f"{backend}'.*call disable_layerwise_offload\\(model\\) first, or pass "
                                             "is_replace=True"):
            fo.enable_layerwise_offload(model, device="cpu", backend=again, prefetch_depth=3)
    assert fo.get_offload_group(model) is group
    assert all(offload_hook(b).state is s for b, s in zip(model.blocks, group.states))
    if group.engine is not None:
        assert group.engine.pool.stats()["in_use_bytes"] == in_use  # no second copy of the weights
    assert_step_exact(model, group, x, want)
    disable_and_check(model, group, reference)


# ---- pinned memory refused ----------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_pinned_limit_does_not_apply_on_the_host_device(backend: str) -> None:
    """device='cpu' never pins (the pool is pageable), so a pinned_limit_bytes far below the model is
    not a refusal there: enable succeeds, pins nothing, and runs exactly. (The limit is exercised on
    the pool itself below, and on a GPU in tests/test_pinned_pool.py.)"""
    model, reference, x, want = _setup()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, pinned_limit_bytes=1024,
                                        pin_backing="host_alloc")
    assert weight_bytes > 1024
    stats = group.stats()
    assert stats["pinned_bytes"] == 0
    if backend == "ext":
        pool = group.engine.pool.stats()
        assert pool["backing"] == "pageable" and pool["pinned_bytes"] == 0 and pool["fallback_slabs"] == 0
        assert pool["in_use_bytes"] >= weight_bytes
    assert_step_exact(model, group, x, want)
    disable_and_check(model, group, reference)


@pytest.mark.parametrize("backing", ["host_alloc", "register"])
def test_pool_limit_refuses_pinning_and_keeps_its_accounting(backing: str) -> None:
    """The pinned-memory limit, on the pool itself. On a CUDA build the limit is checked before any CUDA
    call, so this runs without a GPU; a CPU-only build refuses a CUDA pool outright."""
    _C = _backend.require_ext()
    if not _C.build_info()["cuda"]:
        with pytest.raises(RuntimeError, match="this build has no CUDA support, so it cannot pin memory for cuda:0"):
            _C.PinnedPool(0, backing, MiB, False, 0)
        return
    pool = _C.PinnedPool(0, backing, MiB, False, 0)
    with pytest.raises(RuntimeError, match=rf"pinning 2\.0 MiB of host memory \({backing}\) failed: the pool's limit "
                                           r"of 1\.0 MiB would be exceeded\. This pool already holds 0\.0 MiB pinned\. "
                                           r".*allow_pageable_fallback=True"):
        pool.allocate(2 * MiB)
    stats = pool.stats()
    counts = (stats["reserved_bytes"], stats["in_use_bytes"], stats["slab_count"], stats["allocation_count"])
    assert counts == (0, 0, 0, 0)
    # The refusal changes nothing: a retry refuses the same way.
    with pytest.raises(RuntimeError, match="would be exceeded"):
        pool.allocate(2 * MiB)

    fallback = _C.PinnedPool(0, backing, MiB, True, 0)
    with pytest.warns(UserWarning, match=r"pinning 2\.0 MiB failed \(the pool's limit of 1\.0 MiB would be exceeded\); "
                                         "falling back to pageable memory"):
        memory = fallback.allocate(2 * MiB)
    stats = fallback.stats()
    assert (stats["fallback_slabs"], stats["pinned_bytes"], stats["in_use_bytes"]) == (1, 0, 2 * MiB)
    assert not memory.is_pinned()
    pattern = (torch.arange(2 * MiB) % 251).to(torch.uint8)
    memory.copy_(pattern)
    assert torch.equal(memory, pattern)
    del memory
    stats = fallback.stats()
    assert (stats["in_use_bytes"], stats["reserved_bytes"], stats["slab_count"]) == (0, 0, 0)


# ---- device memory refused -----------------------------------------------------------------------

@pytest.mark.parametrize("failing_call", [1, 2, 5, 9, 14])
def test_device_copy_refused_mid_block_python_backend(failing_call: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The python backend copies parameter by parameter (``Tensor.to``): a refusal half-way through a
    block's load or the next block's prefetch leaves no parameter bound and no copy held."""
    model, reference, x, want = _setup()
    group = fo.enable_layerwise_offload(model, device="cpu", backend="python")
    real_to = torch.Tensor.to
    calls = {"n": 0}

    def refusing_to(self: torch.Tensor, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == failing_call:
            raise torch.OutOfMemoryError("injected: out of device memory")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", refusing_to)
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError, match="injected"):
        model(x)
    monkeypatch.undo()
    assert all(not state.gpu_named_parameters for state in group.states)
    assert_idle(model, group)
    assert_step_exact(model, group, x, want)
    disable_and_check(model, group, reference)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_device_out_of_memory_for_the_first_block_then_recovers(backend: str) -> None:
    """CUDA out of memory when the first block needs device memory (ext: the slot ring, allocated on
    first use; python: the block's copies). The error says what to do, the weights stay intact, and once
    memory is free again the next step is exact."""
    model, reference = make_pair(N_BLOCKS, d=512)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    reference.cuda()
    place_outside_blocks(model, "cuda")
    x = torch.randn(2, 4, 512, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    with torch.no_grad():
        want = reference(x)
    reference.cpu()
    group = fo.enable_layerwise_offload(model, backend=backend)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # The caching allocator refuses anything beyond what it holds now plus 4 MiB (small activations fit;
    # a block of this model needs ~12.6 MB, its slots twice that).
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 4 * MiB) / total)
    expected = "could not allocate 2 device slots of 13 MiB" if backend == "ext" else "out of memory"
    try:
        with torch.no_grad(), pytest.raises(torch.OutOfMemoryError, match=expected) as raised:
            model(x)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    if backend == "ext":
        assert "Free device memory, lower prefetch_depth" in str(raised.value)
    assert_idle(model, group)
    assert_step_exact(model, group, x, want)
    disable_and_check(model, group, reference)


# ---- failures while enabling ----------------------------------------------------------------------

class _RecordingCore:
    """Stands in for fastoffload_ext._C inside enable_layerwise_offload, keeping every pool it creates."""

    def __init__(self) -> None:
        self.core = _backend.require_ext()
        self.pools: list = []
        self.OffloadEngine = self.core.OffloadEngine

    def PinnedPool(self, *args):  # noqa: N802 - mirrors the class it creates
        pool = self.core.PinnedPool(*args)
        self.pools.append(pool)
        return pool


@pytest.fixture
def recording_core(monkeypatch) -> _RecordingCore:
    recorder = _RecordingCore()
    monkeypatch.setattr(layerwise_module._backend, "require_ext", lambda: recorder)
    return recorder


def _assert_untouched(model: Stack, original: dict, blocks: range) -> None:
    assert fo.get_offload_group(model) is None
    for i in blocks:
        block = model.blocks[i]
        assert not has_hooks(block), f"block {i} kept a hook"
        assert all(p.numel() > 0 and p.device.type == "cpu" for p in block.parameters()), f"block {i}"
        assert mismatches(block, {k.split(".", 2)[2]: v for k, v in original.items() if k.startswith(f"blocks.{i}.")}) \
            == [], f"block {i}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_meta_parameter_in_a_later_block_refuses_before_touching_anything(backend: str) -> None:
    """Blocks on different devices (cpu, and meta from index 3): refused naming the parameter."""
    model, reference, x, want = _setup()
    original = snapshot(model)
    with torch.device("meta"):
        model.blocks[3] = Stack(1).blocks[0]
    with pytest.raises(ValueError, match=r"^fastoffload: parameter 3\.qkv\.weight is on the meta device and has no "
                                         r"values to offload; materialize the model first \(e\.g\. "
                                         r"to_empty\(device=\.\.\.\) then load_state_dict\)$"):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    _assert_untouched(model, original, range(3))
    assert not has_hooks(model.blocks[3]) and model.blocks[3].qkv.weight.is_meta
    model.blocks[3] = reference.blocks[3]
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    assert_step_exact(model, group, x, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_failure_while_attaching_block_3_rolls_back_blocks_0_to_2(backend: str, recording_core) -> None:
    """A sparse parameter in block 3 passes the up-front checks and fails when block 3 is packed, after
    blocks 0-2 were offloaded: those are rolled back to real tensors with their values and no hooks.

    Both backends name the parameter and say what to do (the layout prints as torch prints it in C++
    and in Python).
    """
    model, reference, x, want = _setup()
    model.blocks[3].o.weight = nn.Parameter(reference.blocks[3].o.weight.detach().to_sparse(), requires_grad=False)
    original = snapshot(model.blocks[:3])
    original = {f"blocks.{k}": v for k, v in original.items()}
    message = (r"fastoffload: parameter 'o\.weight' has layout (Sparse|torch\.sparse_coo); only dense \(strided\) "
               r"tensors can be offloaded\. Convert it with \.to_dense\(\) first")
    with pytest.raises(RuntimeError, match=message):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    _assert_untouched(model, original, range(3))
    if backend == "ext":
        (pool,) = recording_core.pools
        assert pool.stats()["in_use_bytes"] == 0 and pool.stats()["reserved_bytes"] == 0
    # Fixing the block is enough to enable again.
    model.blocks[3] = reference.blocks[3]
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    assert_step_exact(model, group, x, want)
    disable_and_check(model, group, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_failure_while_attaching_block_3_leaves_block_3_untouched(backend: str) -> None:
    """Attaching is all-or-nothing per block, and the rollback covers the block whose attach failed:
    no empty hook manager or wrapped ``forward`` is left on it, and (python backend) no parameter
    before the failing one was turned into a placeholder."""
    model, reference, x, want = _setup()
    model.blocks[3].o.weight = nn.Parameter(reference.blocks[3].o.weight.detach().to_sparse(), requires_grad=False)
    with pytest.raises(RuntimeError):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    lost = [name for name, p in model.blocks[3].named_parameters() if p.numel() == 0]
    assert lost == [], f"block 3 lost the values of {lost}"
    assert not has_hooks(model.blocks[3]), "block 3 kept a hook manager / wrapped forward"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fault", [InjectedFault, KeyboardInterrupt])
def test_fault_injected_into_the_fourth_attach_rolls_back(backend: str, fault: type[BaseException], monkeypatch,
                                                          recording_core) -> None:
    """An error (or Ctrl-C) raised when block 3's state is initialised, before it touches the block."""
    model, reference, x, want = _setup()
    original = snapshot(model)
    cls = ExtLayerwiseOffloadState if backend == "ext" else LayerwiseOffloadState
    real_on_init = cls.on_init
    calls = {"n": 0}

    def on_init(self, module):
        calls["n"] += 1
        if calls["n"] == 4:
            raise fault("injected while attaching block 3")
        return real_on_init(self, module)

    monkeypatch.setattr(cls, "on_init", on_init)
    with pytest.raises(fault, match="injected while attaching block 3"):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    monkeypatch.setattr(cls, "on_init", real_on_init)
    _assert_untouched(model, original, range(3))
    for i in range(3, N_BLOCKS):
        assert all(p.numel() > 0 for p in model.blocks[i].parameters())
    assert mismatches(model, original) == []
    if backend == "ext":
        (pool,) = recording_core.pools
        assert pool.stats()["in_use_bytes"] == 0
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    assert_step_exact(model, group, x, want)
    disable_and_check(model, group, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fault", [InjectedFault, KeyboardInterrupt])
def test_a_fault_moving_a_resident_block_rolls_back(backend: str, fault: type[BaseException], monkeypatch,
                                                    recording_core) -> None:
    """The resident blocks move to the device last, after every offloaded block is attached: an error
    there (out of memory, Ctrl-C) undoes the whole enable too."""
    model, reference, x, want = _setup()
    original = snapshot(model)
    real_to = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        if self is model.blocks[1]:
            raise fault("injected while moving resident block 1")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "to", to)
    with pytest.raises(fault, match="injected while moving resident block 1"):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend, resident_blocks=[0, 1])
    monkeypatch.setattr(nn.Module, "to", real_to)
    _rolled_back_then_works(model, reference, x, want, original, backend, recording_core, [0, 1])


def _rolled_back_then_works(model: nn.Module, reference: nn.Module, x: torch.Tensor, want: torch.Tensor,
                            original: Any, backend: str, recording_core: Any, resident: list[int]) -> None:
    """After a failed enable: no group, every block as it was, no pinned bytes held; enabled again, exact."""
    assert fo.get_offload_group(model) is None
    _assert_untouched(model, original, range(N_BLOCKS))
    assert mismatches(model, original) == []
    if backend == "ext":
        (pool,) = recording_core.pools
        assert pool.stats()["in_use_bytes"] == 0
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, resident_blocks=resident)
    assert_step_exact(model, group, x, want)
    disable_and_check(model, group, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fault", [InjectedFault, KeyboardInterrupt])
@pytest.mark.parametrize("step", ["_wire_prefetch_targets", "_watch_run_order", "_model_hooks"])
def test_a_fault_after_the_blocks_are_attached_rolls_back(backend: str, fault: type[BaseException], step: str,
                                                          monkeypatch, recording_core) -> None:
    """Between attaching the blocks and putting the group on the model (the prefetch wiring, the run-order
    watch, the state-dict hooks), a Ctrl-C left every block hooked and empty with no group to disable."""
    from fastoffload_ext.engine import layerwise

    model, reference, x, want = _setup()
    original = snapshot(model)

    def failing(*args: Any, **kwargs: Any) -> None:
        raise fault(f"injected in {step}")

    monkeypatch.setattr(layerwise, step, failing)
    with pytest.raises(fault, match=f"injected in {step}"):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend, resident_blocks=[1])
    monkeypatch.undo()
    _rolled_back_then_works(model, reference, x, want, original, backend, recording_core, [1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_meta_parameter_in_a_resident_block_is_refused_before_anything_changes(backend: str) -> None:
    """Resident blocks are moved to the device only at the end of enable, so they are checked with the
    offloaded ones first: a resident block on the meta device gets the same ValueError as an offloaded
    one, before anything changes."""
    model, reference, x, want = _setup()
    with torch.device("meta"):
        model.blocks[0] = Stack(1).blocks[0]
    try:
        fo.enable_layerwise_offload(model, device="cpu", backend=backend, resident_blocks=1)
        raised: BaseException | None = None
    except BaseException as error:  # noqa: BLE001 - the type is what is asserted
        raised = error
    assert isinstance(raised, ValueError) and "0.qkv.weight is on the meta device" in str(raised), repr(raised)
    assert not any(has_hooks(block) for block in model.blocks)
    assert all(p.numel() > 0 for block in model.blocks[1:] for p in block.parameters())


# ---- parameters changed behind the offload's back -----------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("same_shape", [False, True], ids=["different_shape", "same_shape"])
def test_parameter_replaced_outside_mutate_scope_is_refused(backend: str, same_shape: bool) -> None:
    """FastVideo's algorithm binds the host copy over a value given while the block was offloaded: the step
    ran on the OLD values and the new one was gone. Both backends refuse it instead."""
    model, reference, x, want = _setup()
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.no_grad():
        model(x)
        model.blocks[2].o.weight.data = torch.full((16, 16) if same_shape else (5, 16), 3.0)
        for _ in range(2):  # refused on every step until fixed, and nothing is left in use
            with pytest.raises(RuntimeError, match=r"^fastoffload: parameter 'o\.weight' of block 2 was replaced "
                                                   r"while it was offloaded, so its new value would be silently "
                                                   r"overwritten\. Change a block's parameters inside "
                                                   r"mutate_params_scope\(\), which rebuilds the host copy, or "
                                                   r"disable offload first\."):
                model(x)
            if backend == "ext":
                slots = [group.engine.slot_state(s) for s in range(group.engine.num_slots)]
                assert "in_use" not in slots
            else:
                assert all(state._depth == 0 for state in group.states)
    # Recovery: disable. A replacement of the parameter's shape is its current value and is kept; one of
    # another shape cannot be the parameter's value, and the host copy is restored.
    if same_shape:
        with torch.no_grad():
            reference.blocks[2].o.weight.data = torch.full((16, 16), 3.0)
        disable_and_check(model, group, reference)
        return
    with pytest.warns(RuntimeWarning, match=r"^fastoffload: parameter 'o\.weight' of block 2 was changed while it was "
                                            r"offloaded \(.*rebound to a value of another shape\).* disabled with its "
                                            r"value from before that change"):
        disable_and_check(model, group, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_shape_replacement_then_disable(backend: str) -> None:
    """A parameter replaced (same shape) while offloaded, then offload disabled with no step in between: both
    backends keep the replacement, the parameter's current value."""
    model, reference, x, want = _setup()
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.no_grad():
        model(x)
    replacement = torch.full((16, 16), 3.0)
    model.blocks[2].o.weight.data = replacement
    fo.disable_layerwise_offload(model)
    assert torch.equal(model.blocks[2].o.weight, replacement)
    assert all(p.numel() > 0 for p in model.parameters())


def _lora_convert(block: nn.Module) -> None:
    """An adapter conversion: replaces a Linear by a module with more parameters, merges a scale."""

    class LoRA(nn.Module):
        def __init__(self, base: nn.Linear) -> None:
            super().__init__()
            self.base = base
            gen = torch.Generator().manual_seed(3)
            self.a = nn.Parameter(torch.randn(2, base.in_features, generator=gen) * 0.1, requires_grad=False)
            self.b = nn.Parameter(torch.randn(base.out_features, 2, generator=gen) * 0.1, requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + (x @ self.a.t()) @ self.b.t()

    block.up = LoRA(block.up)
    with torch.no_grad():
        block.o.weight.mul_(0.5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fault", [InjectedFault, KeyboardInterrupt])
@pytest.mark.parametrize("when", ["after_change", "before_change"])
def test_mutate_params_scope_raising_rebuilds_the_host_copy(backend: str, fault: type[BaseException],
                                                            when: str) -> None:
    model, reference, x, want = _setup()
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.no_grad():
        model(x)
    block = model.blocks[1]
    with pytest.raises(fault, match="conversion failed"):
        with offload_hook(block).mutate_params_scope():
            assert all(p.numel() > 0 for p in block.parameters())
            if when == "after_change":
                _lora_convert(block)
            raise fault("conversion failed")
    if when == "after_change":
        _lora_convert(reference.blocks[1])
        with torch.no_grad():
            want = reference(x)
    assert_idle(model, group)
    if group.engine is not None:
        engine = group.engine
        # The old region was freed: the pool holds exactly the current blocks.
        assert engine.pool.stats()["in_use_bytes"] == sum(engine.block_bytes(i) for i in range(N_BLOCKS))
        names = {n for n, _ in block.named_parameters()}
        assert ("up.a" in names) == (when == "after_change")
        assert set(group.states[1].param_names) == names
    assert_step_exact(model, group, x, want)
    disable_and_check(model, group, reference)
