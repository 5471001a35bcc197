"""The first pass learns the order the forward runs the offloaded blocks in, and the prefetches follow it."""
from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload
from fastoffload_ext.engine import run_order
from tests._models import Block, offload_hook, params_equal

BACKENDS = ["ext", "python"]


class Refiners(nn.Module):
    """Lumina2-shaped: registers ``noise_refiner`` before ``context_refiner`` and runs ``context_refiner`` first.
    ``skip_from`` > 0: every forward runs only the main blocks before that index (a cache that skips the rest)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.noise_refiner = nn.ModuleList(Block(d, 2) for _ in range(2))
        self.context_refiner = nn.ModuleList(Block(d, 2) for _ in range(2))
        self.layers = nn.ModuleList(Block(d, 2) for _ in range(4))
        self.skip_from = 0
        self.fail_at: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.context_refiner:
            x = block(x)
        for block in self.noise_refiner:
            x = block(x)
        for block in self.layers[:self.skip_from or None]:
            x = block(x)
        return x


def _pair() -> tuple[Refiners, Refiners]:
    torch.manual_seed(0)
    model = Refiners()
    torch.manual_seed(0)
    return model, Refiners()


def _targets(group) -> list[int]:
    """Each offloaded block's prefetch target, as its ring position."""
    position = {id(state): p for p, state in zip(group.offloaded_indices, group.states)}
    return [position[id(state.prefetch_targets[0])] for state in group.states]


def _watched(group) -> int:
    return sum(1 for state in group.states if "run_order_watch" in offload_hook(state.module_ref).__dict__)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lists_run_in_another_order_than_registered_are_rewired_after_the_first_pass(
        backend: str, caplog: pytest.LogCaptureFixture) -> None:
    model, reference = _pair()
    x = torch.randn(2, 16)
    group = enable_layerwise_offload(model, device="cpu", backend=backend, block_lists="all")
    # Ring positions: noise_refiner 0-1, context_refiner 2-3, layers 4-7.
    assert group.stats()["run_order"] == "watching" and _watched(group) == 8
    assert _targets(group) == [1, 2, 3, 4, 5, 6, 7, 0]
    with caplog.at_level(logging.INFO, logger="fastoffload_ext.engine.run_order"), torch.inference_mode():
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
    assert group.stats()["run_order"] == "rewired" and group.run_order.run_order == [2, 3, 0, 1, 4, 5, 6, 7]
    # context_refiner.0 -> .1 -> noise_refiner.0 -> .1 -> layers.0 ... -> layers.3 -> context_refiner.0
    assert _targets(group) == [1, 4, 3, 0, 5, 6, 7, 2]
    assert _watched(group) == 0  # the hooks stopped reporting
    assert [r.getMessage() for r in caplog.records] == [
        "fastoffload: the forward ran the offloaded blocks in another order (context_refiner.0-1, noise_refiner.0-1, "
        "layers.0-3) than the ring enable made (noise_refiner.0-1, context_refiner.0-1, layers.0-3); their prefetches "
        "now follow the order they ran in; block_lists=['context_refiner', 'noise_refiner', 'layers'] starts in that "
        "order"]
    if group.engine is not None:
        loads = group.stats()["sync_loads"]
        with torch.inference_mode():
            model(x)
        assert group.stats()["sync_loads"] == loads  # every block was prefetched by the one before it


@pytest.mark.parametrize("backend", BACKENDS)
def test_lists_named_in_the_order_they_run_keep_the_ring(backend: str) -> None:
    model, reference = _pair()
    x = torch.randn(2, 16)
    group = enable_layerwise_offload(model, device="cpu", backend=backend,
                                     block_lists=["context_refiner", "noise_refiner", "layers"])
    before = _targets(group)
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))
    assert group.stats()["run_order"] == "ring" and _targets(group) == before and _watched(group) == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cyclic", [True, False])
def test_a_run_that_starts_the_ring_elsewhere_is_the_same_cyclic_ring(backend: str, cyclic: bool) -> None:
    model, reference = _pair()
    x = torch.randn(2, 16)
    # Ring: noise_refiner 0-1, layers 2-5, context_refiner 6-7; the forward runs 6, 7, 0, ..., 5.
    group = enable_layerwise_offload(model, device="cpu", backend=backend, cyclic=cyclic,
                                     block_lists=["noise_refiner", "layers", "context_refiner"])
    with torch.inference_mode():
        for _ in range(2):
            assert torch.equal(model(x), reference(x))
    if cyclic:
        assert group.stats()["run_order"] == "ring" and _targets(group) == [1, 2, 3, 4, 5, 6, 7, 0]
    else:  # without the wrap-around, the block that runs first must be prefetched by the one that runs before it
        assert group.stats()["run_order"] == "rewired"
        targets = {i: [group.states.index(t) for t in state.prefetch_targets]
                   for i, state in enumerate(group.states)}
        assert targets == {6: [7], 7: [0], 0: [1], 1: [2], 2: [3], 3: [4], 4: [5], 5: []}


@pytest.mark.parametrize("backend", BACKENDS)
def test_passes_that_skip_blocks_teach_nothing_and_leave_the_ring(backend: str) -> None:
    model, reference = _pair()
    model.skip_from = reference.skip_from = 2  # layers 2 and 3 never run
    x = torch.randn(2, 16)
    group = enable_layerwise_offload(model, device="cpu", backend=backend, block_lists="all")
    before = _targets(group)
    with torch.inference_mode():
        for _ in range(run_order.MAX_PASSES):
            assert group.stats()["run_order"] == "watching"
            assert torch.equal(model(x), reference(x))
        assert torch.equal(model(x), reference(x))
    assert group.stats()["run_order"] == "not learned" and _targets(group) == before and _watched(group) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forward_that_raises_in_the_first_pass_is_learned_from_the_next(backend: str) -> None:
    model, reference = _pair()
    x = torch.randn(2, 16)
    group = enable_layerwise_offload(model, device="cpu", backend=backend, block_lists="all")
    with torch.inference_mode():
        with pytest.raises(RuntimeError):
            model(torch.randn(2, 5))  # the first block's matmul refuses the width
        assert group.stats()["run_order"] == "watching"
        for _ in range(2):
            assert torch.equal(model(x), reference(x))
    assert group.stats()["run_order"] == "rewired" and _targets(group) == [1, 4, 3, 0, 5, 6, 7, 2]
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_resident_blocks_stay_and_the_offloaded_ones_are_rewired_around_them(backend: str) -> None:
    model, reference = _pair()
    x = torch.randn(2, 16)
    group = enable_layerwise_offload(model, device="cpu", backend=backend, block_lists="all", resident_blocks=[0, 3, 5])
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
    assert group.offloaded_indices == (1, 2, 4, 6, 7) and group.stats()["run_order"] == "rewired"
    # Ran: context_refiner.0 (2), noise_refiner.1 (1), layers.0 (4), layers.2 (6), layers.3 (7).
    assert _targets(group) == [4, 1, 6, 7, 2]
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_model_dropped_while_the_watch_waits_is_freed_without_the_cycle_collector(backend: str) -> None:
    model, _ = _pair()
    enable_layerwise_offload(model, device="cpu", backend=backend, block_lists="all")
    ref = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert ref() is None
    finally:
        gc.enable()


def test_names_are_described_as_runs_and_as_lists_where_each_ran_whole() -> None:
    names = ["a.0", "a.1", "a.2", "b.0", "a.3", "b.2", "b.1", "b.10"]
    assert run_order._describe(names) == "a.0-2, b.0, a.3, b.2, b.1, b.10"
    assert run_order._lists_in_order(names) is None
    assert run_order._lists_in_order(["b.0", "b.2", "a.1", "a.3", "c.0"]) == ["b", "a", "c"]  # resident ones left out
    assert run_order._lists_in_order(["a.1", "a.0"]) is None


@pytest.mark.cuda
@pytest.mark.parametrize("learned_first", [True, False], ids=["eager step first", "graph first"])
def test_a_cuda_graph_of_a_model_run_out_of_ring_order_replays_exactly(learned_first: bool) -> None:
    from fastoffload_ext.engine.graphs import OffloadedCUDAGraph

    model, reference = _pair()
    # Five offloaded blocks at depth 1 take three fixed slots, so a learned order meets the ring's assignment.
    model.layers, reference.layers = model.layers[:1], reference.layers[:1]
    reference.cuda()
    x = torch.randn(2, 16, device="cuda")
    group = enable_layerwise_offload(model, device="cuda", backend="ext", block_lists="all")
    with torch.inference_mode():
        expected = reference(x)
        if learned_first:
            assert torch.equal(model(x), expected)
            assert group.stats()["run_order"] == "rewired"
    graph = OffloadedCUDAGraph(model, x.clone())
    assert group.stats()["run_order"] == "rewired"  # the warm-up steps learned it otherwise
    for _ in range(3):
        assert torch.equal(graph(x), expected)
    with torch.inference_mode():
        assert torch.equal(model(x), expected)  # an eager step after the replays
    assert torch.equal(graph(x), expected)


class Shuffled(nn.Module):
    """Runs its blocks in a fixed order of its own."""

    def __init__(self, n: int, order: list[int], d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, 2) for _ in range(n))
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = self.blocks[i](x)
        return x


@pytest.mark.parametrize("seed", range(24))
def test_random_run_orders_depths_and_resident_sets_are_exact_and_prefetched(seed: int) -> None:
    rng = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 10, (1,), generator=rng))
    order = torch.randperm(n, generator=rng).tolist()
    depth = int(torch.randint(1, 4, (1,), generator=rng))
    resident = [i for i in range(n) if torch.rand(1, generator=rng) < 0.3][:n - 1]
    backend = BACKENDS[seed % 2]
    torch.manual_seed(seed)
    model = Shuffled(n, order)
    torch.manual_seed(seed)
    reference = Shuffled(n, order)
    x = torch.randn(2, 8)
    group = enable_layerwise_offload(model, device="cpu", backend=backend, prefetch_depth=depth,
                                     resident_blocks=resident)
    loads = []
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
            if group.engine is not None:
                loads.append(group.stats()["sync_loads"])
    ran = [i for i in order if i not in resident]
    if len(ran) > 1:
        state_at = dict(zip(group.offloaded_indices, group.states))
        firsts = [state_at[ran[(k + 1) % len(ran)]] for k in range(len(ran))]
        assert [state_at[i].prefetch_targets[0] for i in ran] == firsts
    if loads:
        assert loads[2] == loads[1]
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_a_graph_s_fixed_slots_follow_the_learned_order() -> None:
    from fastoffload_ext.engine.graphs import cyclic_slot_assignment, run_order_slot_assignment

    torch.manual_seed(0)
    model = Shuffled(4, [0, 2, 1, 3])
    torch.manual_seed(0)
    reference = Shuffled(4, [0, 2, 1, 3])
    x = torch.randn(2, 8)
    group = enable_layerwise_offload(model, device="cpu", backend="ext")
    # Along the ring, blocks 0 and 2 share a slot, and 2 runs right after 0.
    assert run_order_slot_assignment(group) == cyclic_slot_assignment(4, 1) == ([0, 1, 0, 1], 2)
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))
    assignment, slots = run_order_slot_assignment(group)
    assert slots == 2 and assignment == [0, 0, 1, 1]
    assert [assignment[i] for i in [0, 2, 1, 3]] == [0, 1, 0, 1]  # any two in a row (wrapping) differ


@pytest.mark.cuda
def test_a_cuda_graph_set_up_before_a_single_list_s_order_was_learned_replays_exactly() -> None:
    from fastoffload_ext.engine.graphs import OffloadedCUDAGraph

    # One list, run 0, 2, 1, 3: its fixed slots are fixed along the ring before the warm-up learns the order, so
    # block 2's prefetch meets block 0 still running in its slot, and block 2 is loaded by its own acquire.
    torch.manual_seed(0)
    model = Shuffled(4, [0, 2, 1, 3], d=32)
    torch.manual_seed(0)
    reference = Shuffled(4, [0, 2, 1, 3], d=32).cuda()
    x = torch.randn(2, 32, device="cuda")
    group = enable_layerwise_offload(model, device="cuda", backend="ext")
    with torch.inference_mode():
        expected = reference(x)
    graph = OffloadedCUDAGraph(model, x.clone())
    assert group.stats()["run_order"] == "rewired"
    for _ in range(3):
        assert torch.equal(graph(x), expected)
    with torch.inference_mode():
        assert torch.equal(model(x), expected)
    assert torch.equal(graph(x), expected)


def test_calibration_measures_the_order_blocks_ran_in_and_the_gaps_along_it() -> None:
    from fastoffload_ext.planning.calibration import measure_blocks

    # The gap before a block runs from the end of the block that ran before it, whatever their list positions.
    for order, measured_order in (([0, 1, 2, 3], None), ([0, 2, 1, 3], (0, 2, 1, 3)), ([3, 1, 0, 2], (3, 1, 0, 2)),
                                  ([0, 1, 1, 2, 3], None)):
        torch.manual_seed(0)
        model = Shuffled(4, order)
        x = torch.randn(2, 8)
        enable_layerwise_offload(model, device="cpu", backend="ext")
        with torch.inference_mode():
            measured = measure_blocks(list(model.blocks), lambda: model(x), torch.device("cpu"), repeats=2)
        once = len(order) == 4  # a block that ran twice: its gap belongs to no single block
        assert measured.run_order == measured_order
        assert (measured.gap_ms is not None) == once and (measured.host_gap_ms is not None) == once
        if once:
            assert measured.gap_ms[order[0]] == 0.0 and all(ms >= 0 for ms in measured.gap_ms)
        assert all(ms > 0 for ms in measured.block_ms)


def test_a_calibrated_group_keeps_the_run_order_for_its_plans() -> None:
    torch.manual_seed(0)
    model = Shuffled(6, [3, 4, 5, 0, 1, 2], d=16)
    x = torch.randn(2, 16)
    group = enable_layerwise_offload(model, device="cpu", backend="ext")
    with torch.inference_mode():
        costs = group.calibrate(lambda: model(x), repeats=2)
    assert costs.run_order == (3, 4, 5, 0, 1, 2)

class CheckpointedRotation(nn.Module):
    """Wan VACE-shaped: registers ``blocks`` before ``vace_blocks`` and runs every VACE block first, each under
    ``torch.utils.checkpoint`` (a training step's forward, followed by a backward pass that runs them again)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.proj_in = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d, 2) for _ in range(3))
        self.vace_blocks = nn.ModuleList(Block(d, 2) for _ in range(3))
        self.blocks.requires_grad_(False)
        self.vace_blocks.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.proj_in(x)
        for block in [*self.vace_blocks, *self.blocks]:
            x = checkpoint(block, x, use_reentrant=False)
        return x


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rotated_cyclic_ring_wraps_where_the_step_ends_in_training(backend: str) -> None:
    # Ring: blocks 0-2, vace_blocks 0-2; the forward runs vace_blocks first, a rotation of the cyclic ring: its
    # prefetch targets stay, but a training forward must leave out the copy that wraps into the next step where the
    # step ends (after blocks.2), not where the ring ends (after vace_blocks.2, mid-step). Wired at the ring's end,
    # a training step loaded blocks.0 on demand in the forward and two blocks in backward, every step.
    torch.manual_seed(0)
    model = CheckpointedRotation()
    torch.manual_seed(0)
    reference = CheckpointedRotation()
    group = enable_layerwise_offload(model, device="cpu", backend=backend, block_lists="all")
    x = torch.randn(2, 4, 16)
    targets = _targets(group)
    counts = _training_steps(model, reference, group, x, 4)
    assert torch.equal(model.proj_in.weight.grad, reference.proj_in.weight.grad)
    if group.engine is not None:
        # Each direction copies the blocks the two slots do not hold: 2 x (6 - 2), none on demand.
        assert counts[2:] == [(8, 0), (8, 0)]
    assert group.stats()["run_order"] == "ring" and _targets(group) == targets == [1, 2, 3, 4, 5, 0]
    # The training forward's targets: nothing past the step's last block, the next block everywhere else.
    last = group.states[2]  # blocks.2
    assert last.training_targets == [] and group.states[5].training_targets is None
    disable_layerwise_offload(model)
    assert params_equal(model, reference)


def _training_steps(model: nn.Module, reference: nn.Module, group: Any, x: torch.Tensor,
                    steps: int) -> list[tuple[int, int]]:
    """``steps`` training steps of ``model`` and ``reference`` on ``x``, outputs and input gradients checked bit for
    bit; each step's (copies, loads on demand) from the group's counters."""
    counts = []
    for _ in range(steps):
        latents = x.clone().requires_grad_(True)
        before = group.stats()
        out = model(latents)
        out.square().sum().backward()
        after = group.stats()
        want = x.clone().requires_grad_(True)
        expected = reference(want)
        expected.square().sum().backward()
        assert torch.equal(out, expected) and torch.equal(latents.grad, want.grad)
        counts.append((after.get("copies", 0) - before.get("copies", 0),
                       after.get("sync_loads", 0) - before.get("sync_loads", 0)))
    return counts


class CheckpointedOrder(nn.Module):
    """Runs its blocks in ``order``, each under ``torch.utils.checkpoint``, with resident compute around them."""

    def __init__(self, order: list[int], d: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d, 2) for _ in range(len(order)))
        self.blocks.requires_grad_(False)
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.proj(x)
        for i in self.order:
            x = checkpoint(self.blocks[i], x, use_reentrant=False)
        return self.proj(x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", [[5, 4, 3, 2, 1, 0], [0, 3, 1, 4, 2, 5]], ids=["reversed", "interleaved"])
def test_a_release_prefetch_in_a_training_forward_keeps_the_blocks_backward_left_cached(backend: str,
                                                                                       order: list[int]) -> None:
    # Rewired along an order whose list positions jump, every block prefetches one more as it releases. After a
    # backward pass the next block sits cached in its slot, touched before the one just released: that copy evicted
    # it, and the next block was loaded on demand in every training step.
    torch.manual_seed(0)
    model = CheckpointedOrder(order)
    torch.manual_seed(0)
    reference = CheckpointedOrder(order)
    group = enable_layerwise_offload(model, device="cpu", backend=backend)
    x = torch.randn(2, 4, 16)
    counts = _training_steps(model, reference, group, x, 4)
    if group.engine is not None:
        assert [loads for _, loads in counts[2:]] == [0, 0]
    assert group.stats()["run_order"] == "rewired"
    disable_layerwise_offload(model)
    assert params_equal(model, reference)
