"""Blocks whose parameters are strided views (expanded, sliced, transposed), and blocks whose forward returns a
generator, on both backends: bit-exact against the resident model, or a clear refusal with every value intact."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext.engine.hooks import GENERATOR_OUTPUT_ERROR

BACKENDS = ["ext", "python"]


class StridedBlock(nn.Module):
    """Parameters that are views with strides of their own: an expanded row, a slice, a transpose."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.expanded = nn.Parameter(torch.randn(1, d).expand(d, d), requires_grad=False)
        self.sliced = nn.Parameter(torch.randn(d, 2 * d)[:, :d], requires_grad=False)
        self.transposed = nn.Parameter(torch.randn(d, d).t(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Reductions over a parameter follow its strides: a contiguous copy sums in another order.
        return x + self.expanded.sum() + self.sliced.sum(0) + self.transposed.sum(1) + self.expanded.mean(0)


class StridedStack(nn.Module):
    def __init__(self, n_blocks: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(StridedBlock() for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _layouts(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    return {name: (tuple(p.shape), p.stride()) for name, p in model.named_parameters()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_strided_view_parameters_run_bit_exact_and_keep_their_strides(backend: str, mode: str) -> None:
    reference, model = StridedStack(), StridedStack()
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with context():
        expected = reference(x)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    for _ in range(2):
        with context():
            assert torch.equal(model(x), expected)
    fo.disable_layerwise_offload(model)
    assert _layouts(model) == _layouts(reference)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(param, ref), name
    with torch.no_grad():
        assert torch.equal(model(x), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_view_parameters_survive_is_replace_to_the_other_backend(backend: str) -> None:
    reference, model = StridedStack(), StridedStack()
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference(x)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    other = "python" if backend == "ext" else "ext"
    fo.enable_layerwise_offload(model, True, device="cpu", backend=other, prefetch_depth=2)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    fo.disable_layerwise_offload(model)
    assert _layouts(model) == _layouts(reference)


class LazyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):  # noqa: ANN201 - a generator, on purpose
        # Runs when the caller iterates: on the offloaded model, after the block's weights were released.
        return (self.lin.weight.sum() * t for t in (x, x + 1))


class YieldingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):  # noqa: ANN201 - a generator function, on purpose
        yield self.lin(x)
        yield self.lin.weight.sum() + x


class LazyStack(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outputs: list[torch.Tensor] = []
        for block in self.blocks:
            outputs.extend(block(x))
        return outputs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block", [LazyBlock, YieldingBlock])
@pytest.mark.parametrize("extra_hook", [False, True])
def test_block_returning_a_generator_is_refused_not_run_on_placeholders(backend: str, block: type[nn.Module],
                                                                        extra_hook: bool) -> None:
    reference, model = LazyStack(block), LazyStack(block)
    x = torch.randn(2, 8)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    if extra_hook:  # the general path: a second hook on the block's manager
        manager = fo.ModuleHookManager.get_from(model.blocks[0])
        assert manager is not None
        manager.append_forward_hook(fo.ForwardHook())
    with torch.no_grad(), pytest.raises(fo.OffloadStateError, match="generator") as raised:
        model(x)
    assert str(raised.value) == GENERATOR_OUTPUT_ERROR.format(block=type(model.blocks[0]).__name__)
    fo.disable_layerwise_offload(model)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(param, ref), name
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model(x), reference(x)))
