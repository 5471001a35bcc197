"""torch.compile through an offloaded model: the hooks are graph boundaries, the block body one graph.

On the CPU the tests compile with a recording backend (FX graphs run eagerly, so outputs compare bit
for bit with the eager resident model); the ``cuda`` test compiles with inductor and compares with the
same compiled model resident.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

import fastoffload_ext as fo

from ._models import make_pair, offload_hook, params_equal, place_outside_blocks

BACKENDS = ["ext", "python"]


class RecordingBackend:
    """A dynamo backend that keeps every graph it is given and runs it as is."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def ops(self, gm: torch.fx.GraphModule) -> list[str]:
        return [str(node.target) for node in gm.graph.nodes if node.op in ("call_function", "call_module", "call_method")]


def _steps_without_recompiles(model: torch.nn.Module, reference: torch.nn.Module, x: torch.Tensor,
                              recorder: RecordingBackend) -> int:
    """Four steps bit-equal to ``reference``, the last three with recompiles made errors; the graphs the first made."""
    with torch.no_grad():
        want = reference(x)
        assert torch.equal(model(x), want)
        graphs_after_first_step = len(recorder.graphs)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(3):
                assert torch.equal(model(x), want)
    return graphs_after_first_step


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", BACKENDS)
def test_regional_compile_one_graph_per_block_no_recompiles(backend: str) -> None:
    model, reference = make_pair(4)
    x = torch.randn(2, 3, 16)
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    recorder = RecordingBackend()
    for block in model.blocks:
        block.compile(backend=recorder)
    replaced: list[int] = []
    hook = model.register_forward_hook(lambda *_: replaced.append(group.stats().get("slots_replaced", 0)))
    graphs_after_first_step = _steps_without_recompiles(model, reference, x, recorder)
    hook.remove()
    assert len(recorder.graphs) == graphs_after_first_step  # slots rotate, nothing recompiles
    # Tracing a block's first call holds its weights past the release once; from then on the slots keep their
    # buffers (and addresses, which a graph of the block bakes in).
    assert replaced[0] <= 1 and len(set(replaced)) == 1, replaced
    # The body of a block is a single graph holding all of its work: the hooks break the trace only
    # around it, never inside.
    bodies = [gm for gm in recorder.graphs if recorder.ops(gm)]
    assert len(bodies) == 1, [recorder.ops(gm) for gm in recorder.graphs]
    ops = " ".join(recorder.ops(bodies[0]))
    assert ops.count("linear") == 4 and ops.count("layer_norm") == 2 and "gelu" in ops
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", ["compile, then offload", "offload, then compile"])
def test_a_block_compiled_with_fullgraph_runs_its_hooks_outside_the_graph(backend: str, order: str) -> None:
    """``block.compile(fullgraph=True)`` (what diffusers' ``compile_repeated_blocks(fullgraph=True)`` does) before or
    after the offload: the hooks run around the compiled region, which holds the block's body as one graph and never
    recompiles as the slots rotate; disabling the offload gives the block its own compiled call back."""
    model, reference = make_pair(4)
    x = torch.randn(2, 3, 16)
    recorder = RecordingBackend()
    if order == "compile, then offload":
        for block in model.blocks:
            block.compile(backend=recorder, fullgraph=True)
    own = [block.__dict__.get("_compiled_call_impl") for block in model.blocks]
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    if order == "offload, then compile":
        for block in model.blocks:
            block.compile(backend=recorder, fullgraph=True)
        own = [fo.ModuleHookManager.get_from(block).compiled_call for block in model.blocks]
    graphs_after_first_step = _steps_without_recompiles(model, reference, x, recorder)
    assert len(recorder.graphs) == graphs_after_first_step == 1  # one body graph, shared by the four blocks
    ops = " ".join(recorder.ops(recorder.graphs[0]))
    assert ops.count("linear") == 4 and ops.count("layer_norm") == 2 and "gelu" in ops
    with torch.no_grad():
        want = reference(x)
        with pytest.raises(Exception):  # raised inside the compiled region: the block's release still runs
            model.blocks[1](torch.randn(2, 3, 15))
        assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
    for block, compiled in zip(model.blocks, own):
        assert "compile" not in block.__dict__ and fo.ModuleHookManager.get_from(block) is None
        assert compiled is not None and block.__dict__["_compiled_call_impl"] is compiled
    with torch.no_grad():
        assert torch.equal(model(x), want)  # the blocks' own compiled calls, after the offload


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_blocks_through_edits_loads_replacement_and_training(backend: str) -> None:
    """Blocks compiled with ``fullgraph=True`` (before the offload) through what users do while offloaded: an edit in
    ``mutate_params_scope()``, a partial ``load_state_dict``, an ``is_replace`` re-enable and a grad-mode forward
    with frozen blocks, each step bit-equal to the resident twin compiled the same way."""
    model, reference = make_pair(3)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    for m in (model, reference):
        for block in m.blocks:
            block.compile(backend="eager", fullgraph=True)
    x = torch.randn(2, 3, 16)

    def same() -> None:
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))

    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    same()
    with offload_hook(model.blocks[1]).mutate_params_scope():
        model.blocks[1].up.weight.mul_(0.5)
    reference.blocks[1].up.weight.data.mul_(0.5)
    same()
    update = {name: torch.randn_like(value) for name, value in reference.state_dict().items() if ".2." in name}
    for m in (model, reference):
        m.load_state_dict(update, strict=False)
    same()
    fo.enable_layerwise_offload(model, is_replace=True, device="cpu", backend=backend, prefetch_depth=2)
    same()
    grads = []
    for m in (model, reference):
        leaf = x.clone().requires_grad_(True)
        m(leaf).square().sum().backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
    same()


@pytest.mark.parametrize("backend", BACKENDS)
def test_whole_model_compile_breaks_only_at_hooks(backend: str) -> None:
    """Compiling the whole model: the hooks are the only breaks, and the block bodies still compile.

    The breaks sit inside the model's loop over blocks, and dynamo runs a frame with a break inside a
    loop eagerly; what it compiles then is each block's body, as one graph, exactly as regional compile
    does. That is why regional compile (``block.compile()``) is the recommended way.
    """
    from torch._dynamo.utils import counters

    model, reference = make_pair(3)
    x = torch.randn(2, 3, 16)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    recorder = RecordingBackend()
    compiled = torch.compile(model, backend=recorder)
    counters.clear()
    with torch.no_grad():
        want = reference(x)
        for _ in range(3):
            assert torch.equal(compiled(x), want)
    reasons = [reason for reason in counters["unimplemented"] if counters["unimplemented"][reason]]
    assert reasons and all(("LayerwiseOffloadHook.pre_forward" in r or "LayerwiseOffloadHook.post_forward" in r)
                           for r in reasons), reasons
    assert any("LayerwiseOffloadHook.pre_forward" in r for r in reasons), reasons
    assert any("LayerwiseOffloadHook.post_forward" in r for r in reasons), reasons
    assert all("torch.compiler.disable" in r for r in reasons), reasons
    bodies = [gm for gm in recorder.graphs if recorder.ops(gm)]
    assert len(bodies) == 1 and counters["stats"]["unique_graphs"] == 1
    ops = " ".join(recorder.ops(bodies[0]))
    assert ops.count("linear") == 4 and ops.count("layer_norm") == 2


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_inductor_regional_compile_matches_compiled_resident(backend: str) -> None:
    model, reference = make_pair(4, torch.bfloat16, d=64)
    reference.cuda()
    place_outside_blocks(model, "cuda")
    x = torch.randn(2, 8, 64, device="cuda").bfloat16()
    for block in reference.blocks:
        block.compile()
    with torch.no_grad():
        want = reference(x)
    fo.enable_layerwise_offload(model, backend=backend)
    for block in model.blocks:
        block.compile()
    with torch.no_grad():
        assert torch.equal(model(x), want)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(3):
                assert torch.equal(model(x), want)


def _fresh_inputs(steps: int, d: int) -> list[torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(7)
    return [torch.randn(2, 8, d, device="cuda", generator=generator).bfloat16() for _ in range(steps)]


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_blocks", [3, 4])
@pytest.mark.parametrize("mark_step", [False, True])
def test_reduce_overhead_whole_model_matches_compiled_resident(backend: str, n_blocks: int, mark_step: bool) -> None:
    """``torch.compile(model, mode="reduce-overhead")`` with offload on: bit-exact, step after step.

    Dynamo compiles each block body (the hooks break around it) and inductor replays it as a CUDA
    graph whose weight pointers are the slot the block was given; a block that lands in another slot
    is recorded once more (cudagraph trees check static input addresses), so the replay never reads
    another block's weights. The reference is the resident model with the same per-block compile.
    """
    model, reference = make_pair(n_blocks, torch.bfloat16, d=64)
    reference.cuda()
    place_outside_blocks(model, "cuda")
    for block in reference.blocks:
        block.compile()
    fo.enable_layerwise_offload(model, backend=backend)
    compiled = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for x in _fresh_inputs(8, 64):
            want = reference(x)
            if mark_step:
                torch.compiler.cudagraph_mark_step_begin()
            assert torch.equal(compiled(x), want)
    fo.disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_overhead_regional_matches_resident(backend: str) -> None:
    """Every block compiled with ``mode="reduce-overhead"``: the offloaded model gives exactly what the
    resident model compiled the same way gives. Both need ``cudagraph_mark_step_begin()`` once per step
    (torch's rule for graphs called several times per step), offload adds no other requirement."""
    model, reference = make_pair(5, torch.bfloat16, d=64)
    reference.cuda()
    place_outside_blocks(model, "cuda")
    fo.enable_layerwise_offload(model, backend=backend)
    for m in (reference, model):
        for block in m.blocks:
            block.compile(mode="reduce-overhead")
    with torch.no_grad():
        for x in _fresh_inputs(8, 64):
            torch.compiler.cudagraph_mark_step_begin()
            want = reference(x).clone()
            torch.compiler.cudagraph_mark_step_begin()
            assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)
