"""LazyModule and the release schedule against the plain module: state a release lost, a load that built other
weights, a loader that used its own proxy, and one component under two names.

Each test compares with the component used without the proxy, bit for bit, and was wrong before its fix.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fastoffload_ext.errors import OffloadStateError
from fastoffload_ext.pipeline.lazy import LazyModule
from fastoffload_ext.pipeline.schedule import ReleaseSchedule, run_pipeline


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 4)


def _merged() -> nn.Linear:
    """A loader that computes a weight: a LoRA merged into it when it loads."""
    torch.manual_seed(0)
    linear = nn.Linear(8, 8)
    down, up = torch.randn(2, 8), torch.randn(8, 2)
    with torch.no_grad():
        linear.weight.add_(up @ down)
    return linear


def test_a_component_frozen_through_the_proxy_is_kept_at_release() -> None:
    """A release dropped requires_grad_(False): the reload was trainable again, its outputs required grad."""
    proxy, plain = LazyModule("text_encoder", _linear), _linear()
    proxy.requires_grad_(False)
    plain.requires_grad_(False)
    with pytest.warns(RuntimeWarning, match=r"^fastoffload: deferred module text_encoder was not released: it changed "
                                            r"after it loaded \(its parameter 'weight' was frozen "
                                            r"\(requires_grad_\(False\)\)\)"):
        assert proxy.release() is False
    x = torch.randn(2, 4)
    out, reference = proxy(x), plain(x)
    assert torch.equal(out, reference)
    assert [p.requires_grad for p in proxy.parameters()] == [p.requires_grad for p in plain.parameters()] == [False] * 2
    assert out.requires_grad is reference.requires_grad is False
    assert proxy.release(discard_changes=True) is True
    assert all(p.requires_grad for p in proxy.parameters())  # dropped on request: as the loader builds it


@pytest.mark.parametrize("where", ["component", "submodule"])
def test_a_forward_hook_registered_through_the_proxy_is_kept_at_release(where: str) -> None:
    """A release dropped the hook: the reloaded component's output was silently another."""

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _linear()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    def double(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        return output * 2

    proxy, plain = LazyModule("vae", Outer), Outer()
    for module in (proxy, plain):
        (module if where == "component" else module.inner).register_forward_hook(double)
    target = "the component" if where == "component" else "its submodule 'inner'"
    with pytest.warns(RuntimeWarning, match=r"^fastoffload: deferred module vae was not released: it changed after it "
                                            r"loaded \(a forward or backward hook was registered on, or removed from, "
                                            + target):
        assert proxy.release() is False
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(proxy(x), plain(x))


def test_a_hook_registered_and_removed_again_lets_the_component_go() -> None:
    proxy = LazyModule("vae", _linear)
    handle = proxy.register_forward_pre_hook(lambda module, args: None)
    handle.remove()
    assert proxy.release() is True


def test_a_first_use_inside_autocast_loads_the_weights_a_load_outside_it_does() -> None:
    """The loader ran under the caller's autocast: the weight it computed was rounded to bfloat16."""
    plain = _merged()
    proxy = LazyModule("text_encoder", _merged)
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, reference = proxy(x), plain(x)
        assert torch.is_autocast_enabled("cpu")  # the caller's autocast is back after the load
    assert torch.equal(proxy.weight, plain.weight) and torch.equal(proxy.bias, plain.bias)
    assert out.dtype == reference.dtype == torch.bfloat16 and torch.equal(out, reference)


def test_a_loader_that_uses_its_own_proxy_is_refused_clearly() -> None:
    """It recursed until Python's limit, with a note per level."""
    proxy: LazyModule

    def loader() -> nn.Linear:
        return nn.Linear(proxy.in_features, 4)  # the proxy's component is what is being built

    proxy = LazyModule("vae", loader)
    with pytest.raises(OffloadStateError, match=r"^fastoffload: deferred module vae was used by its own loader or "
                                                r"materialize transform while it loaded"):
        proxy.materialize()
    assert not proxy.is_materialized

    def transform(module: nn.Module) -> nn.Module:
        proxy.eval()  # the transform's argument is the component; the proxy has none yet
        return module

    proxy = LazyModule("vae", _linear)
    proxy.set_materialize_transform(transform)
    with pytest.raises(OffloadStateError, match=r"used by its own loader or materialize transform"):
        proxy.materialize()
    assert not proxy.is_materialized


def test_one_component_under_two_names_is_released_after_the_last_use_of_either() -> None:
    """It was released after the first name's last stage and loaded again for the second name's."""
    loads: list[int] = []

    def load() -> nn.Linear:
        component = _linear()
        loads.append(id(component))  # not the component: held, a release would hand the same one back
        return component

    proxy, plain = LazyModule("text_encoder", load), _linear()
    components = {"text_encoder": proxy, "text_encoder_2": proxy}
    stages = [("encode", ["text_encoder"], lambda x, c: c["text_encoder"](x)),
              ("encode_2", ["text_encoder_2"], lambda x, c: c["text_encoder_2"](x))]
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(run_pipeline(stages, components, x), plain(plain(x)))
    assert len(loads) == 1 and not proxy.is_materialized  # loaded once, released after encode_2

    # Kept under either name: kept.
    with torch.no_grad():
        run_pipeline(stages, components, x, keep=("text_encoder",))
    assert len(loads) == 2 and proxy.is_materialized
    schedule = ReleaseSchedule.from_stages(stages, keep=("text_encoder",))
    assert schedule.release_after("encode_2", components) == []
    assert proxy.is_materialized
