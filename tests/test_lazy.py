"""LazyModule: every promise of its docstrings (and the seed's) checked against real modules."""
from __future__ import annotations

import gc
import logging
import types
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from fastoffload_ext.pipeline import lazy as lazy_module_file
from fastoffload_ext.pipeline.lazy import LazyModule, is_lazy_module

LOGGER = "fastoffload_ext.pipeline.lazy"


class CountingLoader:
    """A loader that builds a fresh Linear each call and remembers every instance it built."""

    def __init__(self, features: int = 4) -> None:
        self.features = features
        self.built: list[weakref.ref[nn.Module]] = []

    @property
    def calls(self) -> int:
        return len(self.built)

    def __call__(self) -> nn.Linear:
        module = nn.Linear(self.features, self.features)
        self.built.append(weakref.ref(module))
        return module


class SelfReturning(nn.Module):
    """Stands in for .cuda() on a CPU machine: same contract as nn.Module.cuda (returns self)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))

    def cuda(self, device: Any = None) -> SelfReturning:  # type: ignore[override]
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def make(name: str = "vae", features: int = 4) -> tuple[LazyModule, CountingLoader]:
    loader = CountingLoader(features)
    return LazyModule(name, loader), loader


# ---- loading ---------------------------------------------------------------------------------

def test_construction_does_not_load() -> None:
    proxy, loader = make()
    assert loader.calls == 0
    assert proxy.is_materialized is False
    assert proxy.lazy_name == "vae"
    assert loader.calls == 0  # lazy_name and is_materialized do not load either


def test_attribute_access_loads_once() -> None:
    proxy, loader = make()
    weight = proxy.weight
    assert loader.calls == 1
    assert proxy.is_materialized is True
    assert weight is proxy.materialize().weight
    _ = proxy.bias, proxy.in_features
    assert loader.calls == 1
    assert proxy.in_features == 4


def test_call_loads_and_forwards_arguments() -> None:
    proxy, loader = make()
    x = torch.randn(3, 4)
    out = proxy(x)
    assert loader.calls == 1
    real = proxy.materialize()
    assert torch.equal(out, real(x))


def test_isinstance_forwards_and_loads() -> None:
    proxy, loader = make()
    assert isinstance(proxy, nn.Linear)
    assert loader.calls == 1
    assert isinstance(proxy, nn.Module)
    assert not isinstance(proxy, nn.Conv2d)
    assert proxy.__class__ is nn.Linear
    assert loader.calls == 1


def test_is_lazy_module_does_not_load() -> None:
    proxy, loader = make()
    assert is_lazy_module(proxy) is True
    assert loader.calls == 0
    assert is_lazy_module(nn.Linear(2, 2)) is False
    assert is_lazy_module(None) is False
    assert is_lazy_module(LazyModule) is False
    assert type(proxy) is LazyModule  # type() sees the proxy; isinstance sees the component


def test_repr_never_loads() -> None:
    proxy, loader = make("text_encoder")
    assert repr(proxy) == "<LazyModule text_encoder (deferred)>"
    assert f"{proxy!r} in a log line" == "<LazyModule text_encoder (deferred)> in a log line"
    assert loader.calls == 0
    proxy.materialize()
    assert repr(proxy) == "<LazyModule text_encoder (materialized)>"
    assert loader.calls == 1


def test_materialize_loads_once_and_returns_the_component() -> None:
    proxy, loader = make()
    first = proxy.materialize()
    second = proxy.materialize()
    assert first is second
    assert type(first) is nn.Linear
    assert loader.calls == 1


def test_loader_error_leaves_proxy_unloaded_and_retries() -> None:
    attempts = {"n": 0}

    def flaky() -> nn.Module:
        attempts["n"] += 1
        if attempts["n"] == 1:
            raise OSError("checkpoint not found")
        return nn.Linear(2, 2)

    proxy = LazyModule("dit", flaky)
    with pytest.raises(OSError, match="checkpoint not found"):
        proxy.materialize()
    assert proxy.is_materialized is False
    assert isinstance(proxy.materialize(), nn.Linear)
    assert attempts["n"] == 2


def test_loader_returning_none_raises() -> None:
    proxy = LazyModule("vae", lambda: None)
    with pytest.raises(ValueError, match=r"Deferred loader for module vae returned None; the loader must return"):
        proxy.materialize()
    with pytest.raises(ValueError, match=r"Deferred loader for module vae returned None"):
        _ = proxy.weight
    assert proxy.is_materialized is False


def test_loading_logs_without_cuda(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    proxy, _ = make("vae")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        proxy.materialize()
    assert [r.getMessage() for r in caplog.records] == ["Loading deferred module vae"]


# ---- attribute forwarding and identity -----------------------------------------------------------

def test_setattr_and_delattr_forward_to_the_component() -> None:
    proxy, loader = make()
    proxy.custom_flag = 7
    assert loader.calls == 1
    real = proxy.materialize()
    assert real.custom_flag == 7
    assert proxy.custom_flag == 7
    del proxy.custom_flag
    assert not hasattr(real, "custom_flag")


def test_plain_attributes_are_returned_as_is() -> None:
    proxy, _ = make()
    real = proxy.materialize()
    assert proxy.weight is real.weight
    assert proxy.training is True


@pytest.mark.parametrize("call", [
    lambda m: m.to("cpu"),
    lambda m: m.to(torch.float64),
    lambda m: m.eval(),
    lambda m: m.train(),
    lambda m: m.half(),
    lambda m: m.float(),
    lambda m: m.requires_grad_(False),
    lambda m: m.cuda(),
], ids=["to-device", "to-dtype", "eval", "train", "half", "float", "requires_grad_", "cuda"])
def test_self_returning_methods_hand_back_the_proxy(call: Callable[[Any], Any]) -> None:
    proxy = LazyModule("component", SelfReturning)
    result = call(proxy)
    assert result is proxy
    assert is_lazy_module(result)


def test_self_returning_method_effects_reach_the_component() -> None:
    proxy, _ = make()
    assert proxy.half() is proxy
    assert proxy.materialize().weight.dtype == torch.float16
    assert proxy.requires_grad_(False) is proxy
    assert proxy.materialize().weight.requires_grad is False
    assert proxy.eval() is proxy
    assert proxy.materialize().training is False


def test_methods_returning_other_objects_pass_them_through() -> None:
    proxy, _ = make()
    real = proxy.materialize()
    state = proxy.state_dict()
    assert set(state) == {"weight", "bias"}
    assert torch.equal(state["weight"], real.weight)
    assert list(proxy.parameters())[0] is real.weight


def test_builtin_self_returning_method_hands_back_the_proxy() -> None:
    # Tensor.add_ is a builtin method returning self: the isbuiltin branch.
    proxy = LazyModule("buffer", lambda: torch.zeros(3))
    assert proxy.add_(2) is proxy
    assert torch.equal(proxy.materialize(), torch.full((3,), 2.0))
    assert torch.equal(proxy.add(1), torch.full((3,), 3.0))  # a new tensor, passed through


def test_a_function_set_on_the_instance_that_returns_the_component_hands_back_the_proxy() -> None:
    """A wrapper on the instance (offload_transformer guards ``to`` that way) is a plain function, not a bound
    method: ``x = x.to(device)`` must still keep the proxy, or the pipeline could never free the component."""

    def guard(model: nn.Module) -> nn.Module:
        unbound = type(model).to
        object.__setattr__(model, "to", lambda *args, **kwargs: unbound(model, *args, **kwargs))
        return model

    proxy, loader = make()
    proxy.set_materialize_transform(guard)
    assert proxy.to("cpu") is proxy
    assert proxy.release() is True
    gc.collect()
    assert loader.built[0]() is None


def test_reassignment_pattern_keeps_the_proxy_releasable() -> None:
    """`self.vae = self.vae.to(device)` must keep the proxy, so the pipeline can still free the module."""

    class Stage:
        def __init__(self, vae: Any) -> None:
            self.vae = vae

    proxy, loader = make()
    stage = Stage(proxy)
    stage.vae = stage.vae.to("cpu").eval()
    assert stage.vae is proxy
    assert proxy.release() is True
    gc.collect()
    assert loader.built[0]() is None  # nothing kept the component alive


def test_uninitialised_proxy_fails_cleanly() -> None:
    # Built by copy/pickle machinery without __init__: an AttributeError, not a RecursionError.
    bare = LazyModule.__new__(LazyModule)
    with pytest.raises(AttributeError):
        _ = bare.weight


# ---- container components (len, indexing, iteration, in, bool) -----------------------------------

def _counted(build: Callable[[], nn.Module]) -> tuple[LazyModule, list[nn.Module]]:
    built: list[nn.Module] = []

    def load() -> nn.Module:
        built.append(build())
        return built[-1]

    return LazyModule("blocks", load), built


@pytest.mark.parametrize("build", [
    lambda: nn.ModuleList([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 3)]),
    lambda: nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 3)),
], ids=["ModuleList", "Sequential"])
def test_sequence_container_operations_load_and_answer_as_the_component(build: Callable[[], nn.Module]) -> None:
    proxy, built = _counted(build)
    assert repr(proxy) == "<LazyModule blocks (deferred)>" and is_lazy_module(proxy) and built == []
    assert len(proxy) == 3
    assert len(built) == 1
    real = built[0]
    assert proxy[0] is real[0] and proxy[-1] is real[-1]
    assert [type(m) for m in proxy[1:]] == [nn.ReLU, nn.Linear]
    assert [id(m) for m in proxy] == [id(m) for m in real]
    assert [id(m) for m in reversed(proxy)] == [id(m) for m in reversed(real)]
    assert real[1] in proxy and nn.ReLU() not in proxy
    assert bool(proxy) is True
    replacement = nn.Tanh()
    proxy[1] = replacement
    assert real[1] is replacement
    del proxy[1]
    assert len(real) == 2 and replacement not in real
    assert len(built) == 1  # every operation used the one loaded instance


def test_mapping_container_operations_load_and_answer_as_the_component() -> None:
    proxy, built = _counted(lambda: nn.ModuleDict({"attn": nn.Linear(2, 2), "ffn": nn.Linear(2, 2)}))
    assert "attn" in proxy and "mlp" not in proxy
    real = built[0]
    assert len(proxy) == 2
    assert proxy["ffn"] is real["ffn"]
    assert list(proxy) == ["attn", "ffn"]
    with pytest.raises(KeyError, match="mlp"):
        _ = proxy["mlp"]
    proxy["mlp"] = nn.ReLU()
    assert isinstance(real["mlp"], nn.ReLU)
    del proxy["attn"]
    assert list(real) == ["ffn", "mlp"] and len(built) == 1


def test_a_truth_test_loads_nothing_and_a_loaded_proxy_answers_as_its_component() -> None:
    empty, built = _counted(nn.ModuleList)
    assert bool(empty) is True and built == []  # ``if pipe.blocks:`` must not pull a component in
    assert len(empty) == 0 and len(built) == 1
    assert bool(empty) is False and not empty and list(empty) == []
    empty.release()
    assert bool(empty) is True and len(built) == 1
    module, loader = make()
    assert bool(module) is True and loader.calls == 0
    module.materialize()
    assert bool(module) is True and loader.calls == 1  # a module that is no container is always true


def test_container_operations_on_a_module_that_is_no_container_raise_its_own_error() -> None:
    proxy, _ = make()
    with pytest.raises(TypeError, match=r"^object of type 'Linear' has no len\(\)$"):
        len(proxy)
    with pytest.raises(TypeError, match=r"^'Linear' object is not subscriptable$"):
        _ = proxy[0]
    with pytest.raises(TypeError, match=r"^'Linear' object is not iterable$"):
        iter(proxy)
    with pytest.raises(TypeError, match=r"^argument of type 'Linear' is not iterable"):
        _ = 1 in proxy


# ---- release -------------------------------------------------------------------------------------

def test_release_when_nothing_loaded_returns_false() -> None:
    proxy, loader = make()
    callbacks: list[str] = []
    proxy.add_release_callback(lambda: callbacks.append("ran"))
    assert proxy.release() is False
    assert callbacks == []
    assert loader.calls == 0


def test_release_drops_and_frees_the_component() -> None:
    proxy, loader = make()
    proxy.materialize()
    assert proxy.release() is True
    assert proxy.is_materialized is False
    assert loader.built[0]() is None  # gc ran and no reference survived
    assert proxy.release() is False  # second release: nothing to drop


def test_use_after_release_reloads_a_fresh_instance() -> None:
    proxy, loader = make()
    x = torch.randn(2, 4)
    proxy(x)
    proxy.release()
    proxy(x)
    assert loader.calls == 2
    assert proxy.is_materialized is True


def test_release_callbacks_run_each_release_in_order_after_the_drop() -> None:
    proxy, _ = make()
    seen: list[tuple[str, bool]] = []
    proxy.add_release_callback(lambda: seen.append(("first", proxy.is_materialized)))
    proxy.add_release_callback(lambda: seen.append(("second", proxy.is_materialized)))
    proxy.materialize()
    proxy.release()
    proxy.materialize()
    proxy.release()
    assert seen == [("first", False), ("second", False)] * 2


def test_release_without_cuda_skips_empty_cache_and_logs(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    def forbidden() -> None:
        raise AssertionError("empty_cache called without CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", forbidden)
    collected: list[int] = []
    real_collect = gc.collect
    monkeypatch.setattr(lazy_module_file.gc, "collect", lambda *a: collected.append(1) or real_collect(*a))
    proxy, _ = make("vae")
    proxy.materialize()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert proxy.release() is True
    assert collected == [1]
    assert [r.getMessage() for r in caplog.records] == ["Released deferred module vae"]


class FakeCudaMemory:
    """torch.cuda as a release sees it: allocated bytes, and empty_cache calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, allocated_gib: list[float]) -> None:
        self.readings = list(allocated_gib)
        self.empty_cache_calls = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "memory_allocated", self.memory_allocated)
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)

    def memory_allocated(self, device: Any = None) -> int:
        return int(self.readings.pop(0) * 1024**3)

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1


def test_load_with_cuda_logs_allocated(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    FakeCudaMemory(monkeypatch, [1.5])
    proxy, _ = make("dit")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        proxy.materialize()
    assert [r.getMessage() for r in caplog.records] == [
        "Loading deferred module dit", "Loaded deferred module dit, cuda allocated now 1.50 GiB"]


def test_release_with_cuda_empties_cache_and_logs_freed(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    proxy, _ = make("dit")
    proxy.materialize()
    cuda = FakeCudaMemory(monkeypatch, [3.0, 1.25])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert proxy.release() is True
    assert cuda.empty_cache_calls == 1
    assert [r.getMessage() for r in caplog.records] == [
        "Released deferred module dit, cuda allocated 3.00 -> 1.25 GiB, freed 1.75 GiB"]


# ---- materialize transforms ----------------------------------------------------------------------

def tag(label: str, log: list[str]) -> Callable[[Any], Any]:
    def transform(module: Any) -> Any:
        log.append(label)
        module.tags = [*getattr(module, "tags", []), label]
        return module
    transform.__name__ = f"tag_{label}"
    return transform


def test_transform_registration_does_not_load_and_applies_at_load() -> None:
    proxy, loader = make()
    applied: list[str] = []
    proxy.set_materialize_transform(tag("compile", applied))
    assert loader.calls == 0
    assert applied == []
    assert proxy.tags == ["compile"]
    assert applied == ["compile"]


def test_transforms_chain_outer_over_inner_for_future_loads() -> None:
    proxy, _ = make()
    applied: list[str] = []
    proxy.set_materialize_transform(tag("inner", applied))
    proxy.set_materialize_transform(tag("outer", applied))
    assert proxy.tags == ["inner", "outer"]
    proxy.release()
    assert proxy.tags == ["inner", "outer"]  # the reloaded instance gets the same chain
    assert applied == ["inner", "outer", "inner", "outer"]


def test_new_transform_applies_only_itself_to_a_loaded_instance() -> None:
    proxy, loader = make()
    applied: list[str] = []
    proxy.set_materialize_transform(tag("inner", applied))
    proxy.materialize()
    assert applied == ["inner"]
    proxy.set_materialize_transform(tag("outer", applied))
    assert applied == ["inner", "outer"]  # inner not re-applied to the resident instance
    assert proxy.tags == ["inner", "outer"]
    assert loader.calls == 1


def test_transform_on_loaded_instance_without_previous_transform() -> None:
    proxy, _ = make()
    proxy.materialize()
    applied: list[str] = []
    proxy.set_materialize_transform(tag("only", applied))
    assert applied == ["only"]
    assert proxy.tags == ["only"]


def test_transform_may_return_a_wrapper() -> None:
    class Doubling(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * 2

    proxy, _ = make()
    proxy.set_materialize_transform(Doubling)
    x = torch.randn(2, 4)
    wrapper = proxy.materialize()
    assert type(wrapper) is Doubling
    assert isinstance(proxy, Doubling)
    assert torch.equal(proxy(x), wrapper.inner(x) * 2)
    # a wrapper added to an already-loaded instance replaces it, too
    proxy.set_materialize_transform(Doubling)
    assert type(proxy.materialize()) is Doubling and proxy.materialize().inner is wrapper


def test_transform_returning_none_at_load_raises() -> None:
    proxy, _ = make("vae")
    proxy.set_materialize_transform(lambda module: None)
    with pytest.raises(ValueError, match=r"Materialize transform for module vae returned None; a transform must"):
        proxy.materialize()
    assert proxy.is_materialized is False


def test_transform_returning_none_on_loaded_instance_raises_and_changes_nothing() -> None:
    proxy, loader = make("vae")
    applied: list[str] = []
    proxy.set_materialize_transform(tag("kept", applied))
    resident = proxy.materialize()
    with pytest.raises(ValueError, match=r"Materialize transform for module vae returned None"):
        proxy.set_materialize_transform(lambda module: None)
    assert proxy.materialize() is resident
    del resident  # held, the released instance would come back instead of a reload
    proxy.release()
    assert proxy.tags == ["kept"]  # the rejected transform was not stored
    assert loader.calls == 2


def test_a_keyed_transform_registered_again_replaces_itself_in_its_place() -> None:
    proxy, loader = make()
    applied: list[str] = []
    proxy.set_materialize_transform(tag("first-offload", applied), key="offload")
    proxy.set_materialize_transform(tag("compile", applied))
    assert proxy.has_materialize_transform("offload") and not proxy.has_materialize_transform("other")
    assert loader.calls == 0  # neither registering nor asking loads
    proxy.set_materialize_transform(tag("second-offload", applied), key="offload")
    assert loader.calls == 0 and applied == []
    assert proxy.tags == ["second-offload", "compile"]  # the old one gone, the new one where it ran
    assert applied == ["second-offload", "compile"]


def test_a_keyed_transform_registered_again_on_a_loaded_instance_applies_only_the_new_one() -> None:
    proxy, loader = make()
    applied: list[str] = []
    proxy.set_materialize_transform(tag("first", applied), key="offload")
    loaded = proxy.materialize()
    proxy.set_materialize_transform(tag("second", applied), key="offload")
    assert proxy.materialize() is loaded and loaded.tags == ["first", "second"] and loader.calls == 1
    del loaded  # held, the released instance would come back instead of a reload
    proxy.release()
    assert proxy.tags == ["second"]  # a new load runs the chain with the replacement only


def test_a_keyed_transform_that_fails_on_the_loaded_instance_changes_nothing() -> None:
    proxy, _ = make()
    applied: list[str] = []
    proxy.set_materialize_transform(tag("kept", applied), key="offload")
    loaded = proxy.materialize()

    def refuse(module: Any) -> Any:
        raise ValueError("fastoffload: test: refused")

    with pytest.raises(ValueError, match="refused"):
        proxy.set_materialize_transform(refuse, key="offload")
    assert proxy.materialize() is loaded
    proxy.release()
    assert proxy.tags == ["kept"]


def test_copies_and_pickles_keep_the_transform_keys() -> None:
    import copy
    import functools
    import pickle

    proxy = LazyModule("vae", functools.partial(nn.Linear, 2, 5))
    proxy.set_materialize_transform(functools.partial(nn.Module.requires_grad_, requires_grad=False), key="frozen")
    for clone in (copy.copy(proxy), copy.deepcopy(proxy), pickle.loads(pickle.dumps(proxy))):
        assert clone.has_materialize_transform("frozen") and not clone.is_materialized
        assert not clone.weight.requires_grad


def test_a_pickle_from_before_transform_keys_still_loads() -> None:
    """Such a pickle holds one composed transform (or None) where the chain of keyed ones now is."""
    applied: list[str] = []
    old = lazy_module_file._rebuild("vae", CountingLoader(4), tag("composed", applied))
    assert old.tags == ["composed"] and not old.has_materialize_transform("composed")
    assert not lazy_module_file._rebuild("vae", CountingLoader(4), None).has_materialize_transform("x")


@pytest.mark.cuda
def test_release_frees_cuda_memory_and_the_cache(caplog: pytest.LogCaptureFixture) -> None:
    # release() collects garbage: what earlier tests left unreachable must be gone before the baseline,
    # or its collection would show up as memory this release freed.
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    reserved_before = torch.cuda.memory_reserved()
    # Earlier tests may leave cached free space inside segments that still hold live blocks; a weight
    # larger than all of it gets a segment of its own, which empty_cache can hand back. Whole 2 MiB
    # units, the allocator's segment granule, so the block is exactly the weight.
    units = max(32, -(-(reserved_before - baseline) // 2**21) + 1)
    rows = units * 2**21 // (4096 * 4)
    weight_bytes = rows * 4096 * 4
    proxy = LazyModule("dit", lambda: nn.Linear(4096, rows, bias=False, device="cuda"))
    proxy.materialize()
    assert torch.cuda.memory_allocated() - baseline == weight_bytes
    reserved_loaded = torch.cuda.memory_reserved()
    assert reserved_loaded >= reserved_before + weight_bytes
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert proxy.release() is True
    assert torch.cuda.memory_allocated() == baseline
    assert torch.cuda.memory_reserved() <= reserved_loaded - weight_bytes  # empty_cache handed the block back
    message = caplog.records[-1].getMessage()
    assert message.startswith("Released deferred module dit, cuda allocated ")
    assert message.endswith(f"GiB, freed {weight_bytes / 2**30:.2f} GiB")


# ---- threads and copies ---------------------------------------------------------------------------

def test_four_threads_on_first_use_run_the_loader_once() -> None:
    import threading
    import time

    threads_in = threading.Barrier(4)

    class SlowLoader(CountingLoader):
        def __call__(self) -> nn.Linear:
            time.sleep(0.05)  # widens the window in which the other threads arrive; no timing is asserted
            return super().__call__()

    loader = SlowLoader()
    proxy = LazyModule("dit", loader)
    seen: list[Any] = []

    def first_use() -> None:
        threads_in.wait()
        seen.append(proxy.materialize())
        seen.append(proxy.weight)

    workers = [threading.Thread(target=first_use) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert loader.calls == 1
    components = seen[0::2]
    assert len(components) == 4 and all(c is components[0] for c in components)
    assert all(w is components[0].weight for w in seen[1::2])


def test_release_waits_for_a_load_in_progress_and_a_later_use_reloads() -> None:
    import threading

    loading, may_finish = threading.Event(), threading.Event()

    class GatedLoader(CountingLoader):
        def __call__(self) -> nn.Linear:
            loading.set()
            may_finish.wait(30)
            return super().__call__()

    loader = GatedLoader()
    proxy = LazyModule("vae", loader)
    loader_thread = threading.Thread(target=proxy.materialize)
    loader_thread.start()
    assert loading.wait(30)
    released: list[bool] = []
    releaser = threading.Thread(target=lambda: released.append(proxy.release()))
    releaser.start()
    may_finish.set()
    loader_thread.join(30)
    releaser.join(30)
    # The release ran after the load finished (never in the middle of it) and dropped that instance.
    assert released == [True] and not proxy.is_materialized and loader.calls == 1
    proxy.materialize()
    assert loader.calls == 2


@pytest.mark.parametrize("loaded", [False, True])
def test_copy_gives_an_unloaded_proxy_with_the_same_recipe(loaded: bool) -> None:
    import copy

    proxy, loader = make("vae")
    proxy.set_materialize_transform(lambda m: m.requires_grad_(False))
    callbacks: list[str] = []
    proxy.add_release_callback(lambda: callbacks.append("original"))
    if loaded:
        original = proxy.materialize()
    clone = copy.copy(proxy)
    assert is_lazy_module(clone) and not clone.is_materialized and clone.lazy_name == "vae"
    assert loader.calls == int(loaded) and proxy.is_materialized == loaded
    component = clone.materialize()
    assert loader.calls == 1 + int(loaded)
    assert not component.weight.requires_grad  # the transform came along
    if loaded:
        assert component is not original and proxy.materialize() is original
    clone.release()
    assert callbacks == []  # release callbacks belong to whoever manages the original


def test_deepcopy_copies_the_loader_and_never_loads() -> None:
    import copy

    proxy, loader = make("text_encoder", features=3)
    proxy.materialize()
    clone = copy.deepcopy(proxy)
    assert is_lazy_module(clone) and not clone.is_materialized and loader.calls == 1
    assert clone.in_features == 3
    assert loader.calls == 1  # the clone ran its own (deep-copied) loader
    holder = copy.deepcopy({"a": proxy, "b": proxy})
    assert holder["a"] is holder["b"] and is_lazy_module(holder["a"])  # the memo keeps shared references shared


def test_pickle_round_trips_the_unloaded_proxy_and_names_an_unpicklable_loader() -> None:
    import functools
    import pickle

    proxy = LazyModule("vae", functools.partial(nn.Linear, 2, 5))
    proxy.materialize()
    restored = pickle.loads(pickle.dumps(proxy))
    assert is_lazy_module(restored) and not restored.is_materialized and restored.lazy_name == "vae"
    assert restored.out_features == 5 and proxy.is_materialized
    unpicklable = LazyModule("vae", lambda: nn.Linear(2, 2))
    with pytest.raises((pickle.PicklingError, AttributeError), match="lambda"):
        pickle.dumps(unpicklable)
    assert not unpicklable.is_materialized


def test_the_lazy_benchmark_counts_eager_building_its_components_in_its_wall_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks.lazy as section

    clock = [0.0]
    monkeypatch.setattr(section, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def run_stage(stage: str, components: dict, inputs: dict, state: Any) -> torch.Tensor:
        clock[0] += 1.0  # each stage's compute, in stand-in seconds
        return torch.zeros(2)

    monkeypatch.setattr(section, "_run_stage", run_stage)

    def eager() -> tuple[dict, Callable[[str], list[str]]]:
        clock[0] += 5.0  # building every component before the first stage
        return {name: nn.Linear(2, 2) for name in ("text_encoder", "transformer", "vae")}, lambda stage: []

    class _HostCtx:
        cuda = False

    row = section._variant_row(_HostCtx(), "eager", eager, {}, {}, {})
    assert row["wall_s"] == 8.0
