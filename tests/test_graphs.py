"""CUDA-graph capture of an offloaded forward: the fixed slot assignment (CPU) and replay (GPU)."""
from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Iterator

import pytest
import torch

import fastoffload_ext as fo
from fastoffload_ext.engine import graphs
from fastoffload_ext.engine.graphs import OffloadedCUDAGraph, cyclic_slot_assignment, slot_snapshot

from ._models import make_pair, offload_hook, params_equal, place_outside_blocks


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
@pytest.mark.parametrize("n_blocks", list(range(1, 20)) + [40, 41, 64])
def test_cyclic_assignment_never_shares_a_slot_within_a_window(n_blocks: int, depth: int) -> None:
    assignment, num_slots = cyclic_slot_assignment(n_blocks, depth)
    assert len(assignment) == n_blocks and set(assignment) <= set(range(num_slots))
    window = min(depth + 1, n_blocks)
    for i in range(n_blocks):
        slots = [assignment[(i + j) % n_blocks] for j in range(window)]
        assert len(set(slots)) == window, (i, slots)
    # The fewest slots a cyclic window colouring can use (chromatic number of the cycle's power).
    if n_blocks <= depth + 1:
        assert num_slots == n_blocks
    else:
        assert num_slots == -(-n_blocks // (n_blocks // (depth + 1)))
        assert num_slots <= depth + 2 or n_blocks < (depth + 1) * (depth + 2)


def test_cyclic_assignment_rejects_empty() -> None:
    with pytest.raises(ValueError, match="n_blocks must be >= 1, got 0"):
        cyclic_slot_assignment(0, 1)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("n_blocks", [1, 3, 5, 6])
def test_fixed_assignment_is_the_same_every_step(n_blocks: int, depth: int) -> None:
    model, reference = make_pair(n_blocks)
    x = torch.randn(2, 4, 16)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", prefetch_depth=depth)
    assignment, num_slots = cyclic_slot_assignment(n_blocks, depth)
    group.engine.set_slot_assignment(assignment, num_slots)
    seen: list[list[int]] = []
    for block, state in zip(model.blocks, group.states):
        # Inside the block's forward, after its hook acquired it.
        block.qkv.register_forward_pre_hook(lambda m, a, s=state: seen[-1].append(group.engine.slot_of(s.handle)))
    with torch.no_grad():
        for _ in range(3):
            seen.append([])
            assert torch.equal(model(x), reference(x))
    assert seen == [assignment] * 3
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_graph_refuses_what_it_cannot_capture() -> None:
    model, _ = make_pair(2)
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="needs a model with layerwise offload enabled"):
        OffloadedCUDAGraph(model, x)
    fo.enable_layerwise_offload(model, device="cpu", backend="python")
    with pytest.raises(ValueError, match="needs backend='ext' \\(static device slots\\)"):
        OffloadedCUDAGraph(model, x)
    fo.disable_layerwise_offload(model)
    fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    with pytest.raises(ValueError, match="needs a CUDA device, but offload runs on cpu"):
        OffloadedCUDAGraph(model, x)


def test_a_capture_that_raised_is_ended_in_the_allocator_and_gives_its_pool_use_back(monkeypatch) -> None:
    """torch's capture_end raises before ending the allocator's and the generator's capture: left so,
    empty_cache frees nothing and every random draw on the device raises."""
    calls: list[tuple] = []
    current = ["capture side"]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: (calls.append(("set_stream", stream)),
                                                                  current.__setitem__(0, stream)))
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda i, p: calls.append(("end", i, p)), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda i, p: calls.append(("release", i, p)), raising=False)
    monkeypatch.setattr(graphs, "_end_generator_capture", lambda i: calls.append(("generator", i)))
    error = RuntimeError("operation not permitted when stream is capturing")
    graphs._abandon_capture((0, 7), torch.device("cuda", 1), "caller's stream", error)
    assert calls == [("set_stream", "caller's stream"), ("end", 1, (0, 7)), ("release", 1, (0, 7)),
                     ("generator", 1)]

    # capture_end got as far as ending the allocator's capture: the pool's use is the graph's to give back,
    # not ours; it may still have raised before ending the generator's ("Invalid capture").
    def already_ended(index: int, pool: tuple[int, int]) -> None:
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    calls.clear()
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", already_ended)
    graphs._abandon_capture((0, 7), torch.device("cuda", 1), "caller's stream", error)
    assert calls == [("generator", 1)]
    assert not getattr(error, "__notes__", [])


def test_a_generator_that_cannot_be_reset_is_named_on_the_capture_error(monkeypatch) -> None:
    """The capture's own error goes on to the caller, with a note of what is left stuck."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "caller's stream")
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda i, p: None, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda i, p: None, raising=False)

    def device_lost(index: int) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(graphs, "_end_generator_capture", device_lost)
    error = RuntimeError("operation not permitted when stream is capturing")
    graphs._abandon_capture((0, 7), 0, "caller's stream", error)
    assert len(error.__notes__) == 1
    assert "cuda:0's default random generator could not be reset (CUDA error: an illegal memory access" in \
        error.__notes__[0]
    assert "until a CUDA graph is captured on that device" in error.__notes__[0]


def test_capture_graph_abandons_the_capture_it_began_when_it_raises(monkeypatch) -> None:
    """The pool it names is the one it ends and releases; an error in the captured work propagates."""
    events: list[tuple] = []

    @contextlib.contextmanager
    def failing_graph(graph: object, pool: tuple[int, int]) -> Iterator[None]:
        events.append(("capture", pool))
        yield

    monkeypatch.setattr(torch.cuda, "graph", failing_graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 42))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "caller's stream")
    monkeypatch.setattr(graphs, "_abandon_capture", lambda pool, device, stream, error: events.append(
        ("abandon", pool, device, stream, str(error))))
    with pytest.raises(RuntimeError, match="host sync"):
        with graphs.capture_graph(object(), "cuda:0"):
            raise RuntimeError("host sync while capturing")
    assert events == [("capture", (0, 42)), ("abandon", (0, 42), "cuda:0", "caller's stream",
                                              "host sync while capturing")]
    events.clear()
    with graphs.capture_graph(object(), 0, pool=(0, 5)):
        pass
    assert events == [("capture", (0, 5))]  # a capture that ended is the graph's to clean up


def test_begin_capture_outside_a_capture_is_refused() -> None:
    if not torch.cuda.is_available():
        # On the host device there is nothing to capture: the call is a no-op by design.
        model, _ = make_pair(1)
        group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
        group.engine.begin_capture()
        assert group.engine.capturing is False
        group.engine.end_capture()
        return
    model, _ = make_pair(1)
    group = fo.enable_layerwise_offload(model, device="cuda", backend="ext")
    with pytest.raises(RuntimeError, match="must be called while the current stream is capturing a CUDA graph"):
        group.engine.begin_capture()


def _capture_and_replay(model, reference, steps: int = 20):
    """Captures ``model`` on an example input, then replays fresh inputs against ``reference`` bit for bit;
    returns the graph and the example."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    example = torch.randn(2, 8, 64, device="cuda", generator=gen).bfloat16()
    graph = OffloadedCUDAGraph(model, example)
    with torch.no_grad():
        for step in range(steps):
            x = torch.randn(2, 8, 64, device="cuda", generator=gen).bfloat16()
            assert torch.equal(graph(x), reference(x)), step
    return graph, example


@pytest.mark.cuda
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("n_blocks", [1, 3, 4, 7])
def test_replay_is_bit_exact_with_fresh_inputs(n_blocks: int, depth: int) -> None:
    model, reference = make_pair(n_blocks, torch.bfloat16, d=64)
    reference.cuda()
    place_outside_blocks(model, "cuda")
    fo.enable_layerwise_offload(model, backend="ext", prefetch_depth=depth)
    graph, example = _capture_and_replay(model, reference)
    # A complete eager forward leaves the fixed slots as the capture found them: the graph replays after it.
    with torch.no_grad():
        assert torch.equal(model(example), reference(example))
        assert torch.equal(graph(example), reference(example))
    graph.recapture()
    with torch.no_grad():
        assert torch.equal(graph(example), reference(example))
    with pytest.raises(ValueError, match=r"input\[0\] must match the captured input"):
        graph(torch.zeros(3, 8, 64, device="cuda").bfloat16())
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.cuda
@pytest.mark.parametrize("n_blocks, depth", [(5, 1), (4, 1), (7, 2)])
def test_two_graphs_of_one_model_and_eager_forwards_interleave_bit_exact(n_blocks: int, depth: int) -> None:
    # Both graphs use the same fixed slots; each starts where the other (or an eager forward) leaves them.
    model, reference = make_pair(n_blocks, torch.bfloat16, d=512)
    reference.cuda()
    place_outside_blocks(model, "cuda")
    group = fo.enable_layerwise_offload(model, backend="ext", prefetch_depth=depth)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"a": (2, 64, 512), "b": (3, 16, 512)}
    graphs = {key: OffloadedCUDAGraph(model, torch.zeros(*shape, device="cuda").bfloat16())
              for key, shape in shapes.items()}
    layout = group.engine.layout_generation
    with torch.no_grad():
        for step, op in enumerate("abaeabbeeaab" * 3):
            key = op if op != "e" else "ab"[step % 2]
            x = torch.randn(*shapes[key], device="cuda", generator=gen).bfloat16()
            out = model(x) if op == "e" else graphs[key](x).clone()
            assert torch.equal(out, reference(x)), (step, op)
    assert group.engine.layout_generation == layout
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.cuda
@pytest.mark.parametrize("depth", [1, 2])
def test_replay_with_resident_blocks_between_offloaded_ones_is_bit_exact(depth: int) -> None:
    # Block 1 releases before resident block 2 runs: its release prefetches the block after next into the slot
    # it frees, inside the capture; the last block's does the same for the next replay.
    model, reference = make_pair(8, torch.bfloat16, d=64)
    reference.cuda()
    place_outside_blocks(model, "cuda")
    group = fo.enable_layerwise_offload(model, backend="ext", prefetch_depth=depth, resident_blocks=[2, 5])
    assert group is not None and any(state.release_targets for state in group.states[:2])
    _capture_and_replay(model, reference)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("static, fresh, message", [
    ((torch.zeros(2),), (torch.zeros(3),), r"input\[0\] must match the captured input, a tensor \(2,\) "
     r"torch.float32, got a tensor \(3,\) torch.float32"),
    ((torch.zeros(2),), (), r"input must match the captured input, a tuple of 1, got a tuple of 0"),
    ({"x": torch.zeros(2)}, {"x": torch.zeros(2), "mask": torch.ones(2)},
     r"keyword input must match the captured input, a dict with keys \['x'\], got a dict with keys \['mask', 'x'\]"),
    ({"x": torch.zeros(2)}, {}, r"a dict with keys \['x'\], got a dict with keys \[\]"),
    ({"scale": None}, {"scale": torch.ones(2)}, r"input\['scale'\] must match the captured input, None, got a tensor"),
    ({"scale": 2.0}, {"scale": 3.0}, r"input\['scale'\] must match the captured input, 2.0, got 3.0"),
])
def test_a_replay_refuses_inputs_the_graph_would_not_see(static, fresh, message) -> None:
    """An extra keyword would be dropped and a missing one replayed with the captured value: both would
    give another model's answer without a word, so a replay refuses them, as it refuses another shape."""
    from fastoffload_ext.engine.graphs import _copy_inputs

    where = "keyword input" if isinstance(static, dict) else "input"
    with pytest.raises(ValueError, match=message):
        _copy_inputs(static, fresh, where)


def test_a_replay_copies_matching_inputs_into_the_captured_ones() -> None:
    from fastoffload_ext.engine.graphs import _copy_inputs

    static = (torch.zeros(2), [torch.zeros(1)], {"k": torch.zeros(3), "flag": True})
    _copy_inputs(static, (torch.ones(2), [torch.full((1,), 2.0)], {"flag": True, "k": torch.full((3,), 3.0)}))
    assert torch.equal(static[0], torch.ones(2)) and torch.equal(static[1][0], torch.full((1,), 2.0))
    assert torch.equal(static[2]["k"], torch.full((3,), 3.0))


def test_every_change_to_a_block_s_host_copy_or_slots_moves_the_generation() -> None:
    # A captured graph copies from each block's host copy into fixed slots: it may replay only while the
    # engine's generation is the one it was captured at, so anything that frees or rebuilds those must move it.
    model, reference = make_pair(3)
    x = torch.randn(2, 4, 16)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    engine = group.engine
    with torch.no_grad():
        model(x)
    seen = [engine.generation]
    model.load_state_dict({name: value + 1 for name, value in reference.state_dict().items()})
    seen.append(engine.generation)
    with offload_hook(model.blocks[1]).mutate_params_scope():
        pass
    seen.append(engine.generation)
    with offload_hook(model.blocks[2]).mutate_params_scope(), torch.no_grad():
        model.blocks[2].qkv.weight.add_(1)
    seen.append(engine.generation)
    fo.disable_layerwise_offload(model)
    seen.append(engine.generation)
    assert all(later > earlier for earlier, later in itertools.pairwise(seen)), seen


def test_the_layout_generation_moves_with_host_copies_and_slots_and_not_with_a_forward() -> None:
    # A graph replays after an eager forward (its slots end where the capture began) but never after a change
    # to what it copies from or into.
    model, reference = make_pair(5)
    x = torch.randn(2, 4, 16)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    engine = group.engine
    assignment, num_slots = cyclic_slot_assignment(5, 1)
    engine.set_slot_assignment(assignment, num_slots)
    with torch.no_grad():
        model(x)
    layout, slots = engine.layout_generation, slot_snapshot(engine)
    with torch.no_grad():
        model(x)
    engine.set_slot_assignment(assignment, num_slots)  # the same again (a second graph): nothing changes
    assert (engine.layout_generation, slot_snapshot(engine)) == (layout, slots)
    seen = [layout]
    model.load_state_dict(reference.state_dict())
    seen.append(engine.layout_generation)
    with offload_hook(model.blocks[1]).mutate_params_scope():
        pass
    seen.append(engine.layout_generation)
    engine.set_slot_assignment([0, 1, 0, 1, 2], 3)
    seen.append(engine.layout_generation)
    fo.disable_layerwise_offload(model)
    seen.append(engine.layout_generation)
    assert all(later > earlier for earlier, later in itertools.pairwise(seen)), seen


def _stand_in_graph(model, group) -> tuple[OffloadedCUDAGraph, list[int]]:
    """An OffloadedCUDAGraph whose captured graph is a stand-in (CPU): what a capture records, and replays counted."""
    graph = object.__new__(OffloadedCUDAGraph)
    graph.model, graph.group, graph.engine = model, group, group.engine
    graph.handles = [state.handle for state in group.states]
    graph.generation, graph.static_output = group.engine.generation, "output"
    graph.layout_generation, graph.slots = group.engine.layout_generation, slot_snapshot(group.engine)
    graph.resumable, graph.watch = True, graphs._ModelWatch(model)
    replays: list[int] = []
    graph.graph = types.SimpleNamespace(replay=lambda: replays.append(1))
    return graph, replays


def test_a_replay_follows_a_complete_forward_and_refuses_an_interrupted_one_or_new_weights() -> None:
    model, reference = make_pair(5)
    x = torch.randn(2, 4, 16)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    group.engine.set_slot_assignment(*cyclic_slot_assignment(5, 1))
    with torch.no_grad():
        model(x)
    graph, replays = _stand_in_graph(model, group)
    with torch.no_grad():
        model(x)
    assert graph.replay() == "output" and replays == [1]
    assert graph.generation == group.engine.generation  # resumed: the next replay checks nothing again

    def fail_once(module, args):
        hook.remove()
        raise KeyError("interrupted")

    hook = model.blocks[2].register_forward_pre_hook(fail_once)
    with torch.no_grad(), pytest.raises(KeyError):
        model(x)
    with pytest.raises(RuntimeError, match="did not end with the blocks where the capture began"):
        graph.replay()
    with torch.no_grad():
        model(x)  # a complete forward puts the blocks back where the capture found them
    assert graph.replay() == "output" and replays == [1, 1]
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():
        model(x)
    with pytest.raises(RuntimeError, match="weights were loaded or edited .* or the slots were reallocated"):
        graph.replay()
    assert replays == [1, 1]
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


EDITS = {
    "cast": (lambda model: model.half(), "was cast or moved to Half"),
    "rebind": (lambda model: setattr(model.blocks[1].qkv.weight, "data", torch.zeros(48, 16)), "was replaced while"),
    "write": (lambda model: model.blocks[1].qkv.weight.add_(1), "was changed in place while"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_replay_refuses_a_cast_rebind_or_write_made_since_the_capture(edit: str) -> None:
    # The replay's guards on a real engine (CPU), with a stand-in for the captured CUDA graph.
    model, _ = make_pair(3)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    with torch.no_grad():
        model(torch.randn(2, 4, 16))
    graph, replays = _stand_in_graph(model, group)
    assert graph.replay() == "output" and replays == [1]
    change, message = EDITS[edit]
    with torch.no_grad():
        change(model)
    with pytest.raises(RuntimeError, match=message):
        graph.replay()
    assert replays == [1]


@pytest.mark.cuda
def test_a_replay_after_a_load_or_a_disable_is_refused_and_a_recapture_uses_the_new_weights() -> None:
    model, reference = make_pair(3, torch.bfloat16, d=64)
    reference.cuda()
    place_outside_blocks(model, "cuda")
    fo.enable_layerwise_offload(model, backend="ext")
    graph, example = _capture_and_replay(model, reference, steps=2)
    # New weights for every block: the host copies are rebuilt, and the graph would copy the old ones.
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(torch.randn_like(param), alpha=0.1)
    model.load_state_dict(reference.state_dict())
    with pytest.raises(RuntimeError, match="weights were loaded or edited"):
        graph(example)
    graph.recapture()
    with torch.no_grad():
        assert torch.equal(graph(example), reference(example))
        with offload_hook(model.blocks[0]).mutate_params_scope():
            model.blocks[0].qkv.weight.mul_(2)
        reference.blocks[0].qkv.weight.mul_(2)
    with pytest.raises(RuntimeError, match="call recapture\\(\\) before replaying"):
        graph(example)
    graph.recapture()
    with torch.no_grad():
        assert torch.equal(graph(example), reference(example))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
    with pytest.raises(RuntimeError, match="was disabled \\(or enabled again\\)"):
        graph(example)
    with pytest.raises(RuntimeError, match="capture a new OffloadedCUDAGraph"):
        graph.recapture()
