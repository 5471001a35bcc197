"""``graph_forward(model)``: model(...) replayed from CUDA graphs, one per input signature.

On the CPU, the wrapper's logic runs on a real offloaded model with a stand-in for the captured graph (one that
replays the forward into a static output, as a CUDA graph does); on a GPU, the real thing.
"""
from __future__ import annotations

import collections
import dataclasses
import gc
import weakref
from typing import Any, ClassVar

import pytest
import torch

import fastoffload_ext as fo
from fastoffload_ext.engine import graph_forward as gf
from fastoffload_ext.engine.graph_forward import get_graph_forward, graph_forward, remove_graph_forward
from fastoffload_ext.errors import OffloadConfigError, OffloadStateError

from ._models import Stack, make_pair, offload_hook, params_equal, place_outside_blocks


def test_a_signature_holds_the_structure_shapes_dtypes_and_values() -> None:
    x = torch.zeros(2, 3)
    assert gf._key((x,), {"t": 1.0}) == gf._key((torch.ones(2, 3),), {"t": 1.0})
    others = [((torch.zeros(2, 4),), {"t": 1.0}), ((x.double(),), {"t": 1.0}), ((x,), {"t": 2.0}),
              ((x,), {"t": 1}), ((x,), {"t": True}), ((x,), {"s": 1.0}), (([x],), {"t": 1.0}), ((x, None), {"t": 1.0})]
    keys = {gf._key(*other) for other in others}
    assert len(keys) == len(others) and gf._key((x,), {"t": 1.0}) not in keys
    with pytest.raises(gf._Unkeyable, match=r"keyword argument 'mask'\[1\] is a object, not a tensor"):
        gf._key((x,), {"mask": [x, object()]})
    with pytest.raises(gf._Unkeyable, match="argument 0 is a dict with keys that are not strings"):
        gf._key(({1: x},), {})


@dataclasses.dataclass
class _Output:
    sample: torch.Tensor
    note: str = "kept"


def test_a_replay_s_output_is_copied_with_its_containers() -> None:
    pair = collections.namedtuple("pair", "a b")
    static = torch.arange(4.0)
    value = {"out": (static, [static]), "named": pair(static, 3), "data": _Output(static)}
    copied = gf._copy_output(value)
    static.zero_()  # the next replay overwrites the static output
    assert torch.equal(copied["out"][0], torch.arange(4.0)) and torch.equal(copied["out"][1][0], torch.arange(4.0))
    assert isinstance(copied["named"], pair) and copied["named"].b == 3 and torch.equal(copied["named"].a,
                                                                                         torch.arange(4.0))
    assert isinstance(copied["data"], _Output) and copied["data"].note == "kept"
    assert torch.equal(copied["data"].sample, torch.arange(4.0))


class _StandInGraph:
    """What _ModelGraph does, without CUDA: warm-up forwards through the model at capture, and a replay that
    writes the forward of the given inputs into one static output."""

    made: ClassVar[list[_StandInGraph]] = []

    def __init__(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], warmup_steps: int,
                 pool: Any) -> None:
        self.model_ref, self.warmup_steps, self.stale = weakref.ref(model), warmup_steps, False
        self.recaptures = 0
        self.recapture()
        self.static = torch.empty(0)
        _StandInGraph.made.append(self)

    def recapture(self) -> None:
        self.recaptures += 1
        with torch.no_grad():
            self.model_ref()(torch.zeros(1, 4, 16))  # a warm-up goes through the model, and must run eagerly
        self.stale = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.stale:
            raise OffloadStateError("fastoffload: ... call recapture() before replaying")
        model = self.model_ref()
        out = type(model).forward(model, x)
        self.static.resize_(out.shape).copy_(out)
        return self.static


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> list[_StandInGraph]:
    monkeypatch.setattr(gf, "_ModelGraph", _StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    _StandInGraph.made = []
    return _StandInGraph.made


def _graphed(max_graphs: int = 4) -> tuple[Any, Any, gf.GraphedForward]:
    model, reference = make_pair(3)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    return model, reference, gf._install(model, gf.GraphedForward(model, group, max_graphs, 2))


def test_each_signature_is_captured_once_and_every_answer_is_its_own(stand_in: list[_StandInGraph]) -> None:
    model, reference, graphed = _graphed()
    assert get_graph_forward(model) is graphed
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for step in range(6):
            shape = (2, 4, 16) if step % 2 else (1, 8, 16)
            cond, uncond = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
            # Two calls a step, as under guidance: the first answer must survive the second replay.
            a, b = model(cond), model(uncond)
            assert torch.equal(a, reference(cond)) and torch.equal(b, reference(uncond)), step
    assert len(stand_in) == 2 and graphed.stats() == {"graphs": 2, "captures": 2, "replays": 12, "eager": 0}
    fo.disable_layerwise_offload(model)
    assert "forward" not in vars(model) and get_graph_forward(model) is None
    assert params_equal(model, reference)


def test_calls_a_graph_cannot_serve_run_eagerly_and_say_why_once(stand_in: list[_StandInGraph]) -> None:
    model, reference, graphed = _graphed(max_graphs=1)
    x, other = torch.randn(2, 4, 16), torch.randn(3, 4, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        with pytest.warns(RuntimeWarning, match=r"1 input signatures are captured already \(max_graphs=1\)"):
            assert torch.equal(model(other), reference(other))
        assert torch.equal(model(other), reference(other))  # warned once
    # Autograd records an eager forward (a graph records none): gradients to the input are exact.
    x.requires_grad_(True)
    model(x).sum().backward()
    expected = x.detach().clone().requires_grad_(True)
    reference(expected).sum().backward()
    assert torch.equal(x.grad, expected.grad)
    assert graphed.stats() == {"graphs": 1, "captures": 1, "replays": 1, "eager": 3}
    assert len(stand_in) == 1


def test_an_argument_a_signature_cannot_hold_runs_eagerly() -> None:
    class Scaled(Stack):
        def forward(self, x: torch.Tensor, scale: Any = None) -> torch.Tensor:
            return super().forward(x) * (1.0 if scale is None else scale.value)

    model = Scaled(3)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    graphed = gf._install(model, gf.GraphedForward(model, group, 4, 2))
    x = torch.randn(2, 4, 16)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="keyword argument 'scale' is a Scale, not a tensor"):
        model(x, scale=type("Scale", (), {"value": 2.0})())
    assert graphed.stats()["eager"] == 1 and graphed.stats()["graphs"] == 0


def test_a_stale_graph_is_captured_again_at_its_next_call(stand_in: list[_StandInGraph]) -> None:
    model, reference, graphed = _graphed()
    x = torch.randn(2, 4, 16)
    with torch.no_grad():
        model(x)
        stand_in[0].stale = True  # the weights changed, or an eager forward raised part-way
        for param in reference.blocks[1].parameters():
            param.add_(1)
        model.load_state_dict(reference.state_dict())
        assert torch.equal(model(x), reference(x))
    assert stand_in[0].recaptures == 2 and graphed.stats()["captures"] == 2


def test_a_forward_that_cannot_be_captured_says_why_and_keeps_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refusing(_StandInGraph):
        def recapture(self) -> None:
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(gf, "_ModelGraph", Refusing)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    model, reference, graphed = _graphed()
    x = torch.randn(2, 4, 16)
    with torch.no_grad():
        with pytest.raises(OffloadConfigError, match=r"forward cannot be captured in a CUDA graph \(operation not "
                                                     r"permitted.*remove_graph_forward\(model\)"):
            model(x)
        assert graphed.stats() == {"graphs": 0, "captures": 0, "replays": 0, "eager": 0}
        assert remove_graph_forward(model) and not remove_graph_forward(model)
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_the_graph_forward_holds_its_model_weakly(stand_in: list[_StandInGraph]) -> None:
    model, _, graphed = _graphed()
    with torch.no_grad():
        model(torch.randn(2, 4, 16))
    assert graphed.stats()["graphs"] == 1
    dropped, graphed_ref = weakref.ref(model), weakref.ref(graphed)
    del model, graphed
    gc.disable()
    try:
        stand_in.clear()
        assert dropped() is None and graphed_ref() is None  # freed with the last reference, no cycle
    finally:
        gc.enable()


@pytest.mark.parametrize("kwargs, message", [
    ({"max_graphs": 0}, r"max_graphs >= 1 \(an int\), got 0"),
    ({"max_graphs": True}, r"max_graphs >= 1 \(an int\), got True"),
    ({"warmup_steps": 1.5}, r"warmup_steps >= 1 \(an int\), got 1.5"),
])
def test_bad_options_are_refused(kwargs: dict[str, Any], message: str) -> None:
    model, _ = make_pair(3)
    with pytest.raises(OffloadConfigError, match=message):
        graph_forward(model, **kwargs)


@pytest.mark.parametrize("backend, message", [(None, "needs a model with layerwise offload enabled"),
                                              ("python", "needs backend='ext'"), ("ext", "needs a CUDA device")])
def test_a_model_a_graph_cannot_capture_is_refused(backend: str | None, message: str) -> None:
    model, _ = make_pair(3)
    if backend is not None:
        fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with pytest.raises(OffloadConfigError, match=message):
        graph_forward(model)
    assert "forward" not in vars(model)


# ----------------------------------------------------------------------------------------------- on a GPU


def _cuda_pair(n_blocks: int = 5, depth: int = 1, d: int = 256) -> tuple[Any, Any]:
    model, reference = make_pair(n_blocks, torch.bfloat16, d=d)
    reference.cuda()
    place_outside_blocks(model, "cuda")
    fo.enable_layerwise_offload(model, backend="ext", prefetch_depth=depth)
    return model, reference


@pytest.mark.cuda
@pytest.mark.parametrize("n_blocks, depth", [(5, 1), (4, 1), (7, 2)])
def test_graphs_of_several_signatures_and_eager_calls_interleave_bit_exact(n_blocks: int, depth: int) -> None:
    model, reference = _cuda_pair(n_blocks, depth)
    graphed = graph_forward(model)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(2, 64, 256), (3, 16, 256)]
    for step in range(24):
        x = torch.randn(*shapes[step % 2], device="cuda", generator=gen).bfloat16()
        with torch.inference_mode():
            # Every fifth call eager (the class's forward): the graphs replay after it without a new capture.
            out = type(model).forward(model, x) if step % 5 == 4 else model(x)
            assert torch.equal(out, reference(x)), step
    assert graphed.stats() == {"graphs": 2, "captures": 2, "replays": 20, "eager": 0}
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.cuda
def test_new_weights_and_an_interrupted_forward_are_captured_again() -> None:
    model, reference = _cuda_pair()
    graphed = graph_forward(model)
    x = torch.randn(2, 64, 256, device="cuda").bfloat16()
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        for param in reference.parameters():
            param.add_(torch.randn_like(param), alpha=0.1)
        model.load_state_dict(reference.state_dict())
        assert torch.equal(model(x), reference(x))
        assert graphed.stats()["captures"] == 2
        # An eager forward that raises after two blocks leaves the slots elsewhere than a capture began.
        calls = []

        def fail_once(module: Any, args: Any) -> None:
            if not calls:
                calls.append(1)
                raise KeyError("interrupted")

        handle = model.blocks[2].register_forward_pre_hook(fail_once)
        with pytest.raises(KeyError):
            type(model).forward(model, x)
        handle.remove()
        assert torch.equal(model(x), reference(x))
        assert graphed.stats()["captures"] == 3
        with offload_hook(model.blocks[0]).mutate_params_scope():
            model.blocks[0].qkv.weight.mul_(2)
        reference.blocks[0].qkv.weight.mul_(2)
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


def _empty_cache_hands_back_a_new_segment() -> bool:
    """Whether ``torch.cuda.empty_cache()`` frees a segment just freed; it does not while a capture is underway."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cached_free = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    size = (cached_free // 2**21 + 32) * 2**21  # more than any cached block: a segment of its own
    block = torch.empty(size, dtype=torch.uint8, device="cuda")
    loaded = torch.cuda.memory_reserved()
    del block
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved() <= loaded - size


@pytest.mark.cuda
def test_a_forward_that_synchronizes_cannot_be_captured_and_the_model_runs_on() -> None:
    model, reference = _cuda_pair()
    graph_forward(model, warmup_steps=1)
    # A host read after the last block: not allowed while a stream captures.
    def host_read(module: Any, args: Any, out: torch.Tensor) -> None:
        out.sum().item()

    model.proj_out.register_forward_hook(host_read)
    x = torch.randn(2, 64, 256, device="cuda").bfloat16()
    assert _empty_cache_hands_back_a_new_segment()
    generator_state = torch.cuda.get_rng_state()
    with torch.no_grad():
        with pytest.raises(OffloadConfigError, match="cannot be captured in a CUDA graph"):
            model(x)
        assert torch.equal(torch.cuda.get_rng_state(), generator_state)  # the reset draws nothing
        # The failed capture left torch as it was: the stream it ran on, an allocator that frees and a
        # random generator that draws outside a capture.
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        assert _empty_cache_hands_back_a_new_segment()
        torch.manual_seed(3)
        drawn = torch.randn(64, device="cuda")
        torch.manual_seed(3)
        assert torch.equal(torch.randn(64, device="cuda"), drawn)
        assert remove_graph_forward(model)
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
