"""Release schedules: computed from names without loading, releasing exactly after the last use."""
from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

from fastoffload_ext.pipeline.lazy import LazyModule
from fastoffload_ext.pipeline.schedule import ReleaseSchedule, Stage, run_pipeline

T2V_STAGES = [
    ("encode_prompt", ["text_encoder"]),
    ("encode_image", ["image_encoder", "vae"]),
    ("denoise", ["transformer"]),
    ("decode", ["vae"]),
]


class LiveBytes:
    """Counts the bytes of component weights that are alive, and the peak seen at stage boundaries.

    Each loader registers a finalizer on its weight tensor, so the count drops when the tensor is
    really freed, not when someone merely forgets a name.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.loads: list[str] = []

    def loader(self, name: str, elements: int) -> Any:
        def load() -> nn.Module:
            module = nn.Linear(elements, 1, bias=False)
            size = module.weight.numel() * module.weight.element_size()
            self.live += size
            self.loads.append(name)
            weakref.finalize(module.weight, self._freed, size)
            return module
        return load

    def _freed(self, size: int) -> None:
        self.live -= size

    def sample(self) -> None:
        self.peak = max(self.peak, self.live)


def lazy_components(counter: LiveBytes, sizes: Mapping[str, int]) -> dict[str, LazyModule]:
    return {name: LazyModule(name, counter.loader(name, elements)) for name, elements in sizes.items()}


def unloaded_lazy(name: str) -> tuple[LazyModule, list[str]]:
    loads: list[str] = []

    def load() -> nn.Module:
        loads.append(name)
        return nn.Linear(2, 2)

    return LazyModule(name, load), loads


# ---- computing the schedule ----------------------------------------------------------------------

def test_each_component_is_released_after_its_last_use() -> None:
    schedule = ReleaseSchedule.from_stages(T2V_STAGES)
    assert schedule.releases_after("encode_prompt") == ["text_encoder"]
    assert schedule.releases_after("encode_image") == ["image_encoder"]  # vae is used again by decode
    assert schedule.releases_after("denoise") == ["transformer"]
    assert schedule.releases_after("decode") == ["vae"]
    assert dict(schedule.last_use) == {"text_encoder": "encode_prompt", "image_encoder": "encode_image",
                                       "transformer": "denoise", "vae": "decode"}
    assert [stage.name for stage in schedule.stages] == ["encode_prompt", "encode_image", "denoise", "decode"]


def test_releases_keep_declaration_order_and_return_fresh_lists() -> None:
    schedule = ReleaseSchedule.from_stages([("a", ["x", "y"]), ("b", ["z", "y", "w"])])
    assert schedule.releases_after("a") == ["x"]
    assert schedule.releases_after("b") == ["z", "y", "w"]
    schedule.releases_after("b").append("mutated")
    assert schedule.releases_after("b") == ["z", "y", "w"]


def test_stage_using_nothing_releases_nothing() -> None:
    schedule = ReleaseSchedule.from_stages([("prepare", []), ("denoise", ["transformer"])])
    assert schedule.releases_after("prepare") == []
    assert "prepare: -" in repr(schedule)
    assert "denoise: transformer" in repr(schedule)


def test_keep_excludes_components_from_release() -> None:
    schedule = ReleaseSchedule.from_stages(T2V_STAGES, keep=["transformer"])
    assert schedule.releases_after("denoise") == []
    assert schedule.kept == frozenset({"transformer"})
    assert schedule.last_use["transformer"] == "denoise"


def test_keep_and_stages_given_as_generators_are_read_once() -> None:
    # Each was read more than once: an exhausted generator kept nothing (the transformer was released
    # after every run) and a generator of stages gave a schedule that released nothing.
    schedule = ReleaseSchedule.from_stages(T2V_STAGES, keep=(name for name in ["transformer"]))
    assert schedule.releases_after("denoise") == []
    assert schedule.kept == frozenset({"transformer"})
    schedule = ReleaseSchedule((Stage(name, uses) for name, uses in T2V_STAGES), keep=iter(["transformer"]))
    assert [stage.name for stage in schedule.stages] == [name for name, _ in T2V_STAGES]
    assert schedule.releases_after("denoise") == [] and schedule.kept == frozenset({"transformer"})
    assert schedule.last_use == ReleaseSchedule.from_stages(T2V_STAGES).last_use
    assert [schedule.releases_after(name) for name, _ in T2V_STAGES] == \
        [ReleaseSchedule.from_stages(T2V_STAGES, keep=["transformer"]).releases_after(name) for name, _ in T2V_STAGES]


def test_stage_objects_and_tuples_mix() -> None:
    schedule = ReleaseSchedule.from_stages([Stage("encode", ["te"]), ("decode", ("vae",), lambda s, c: s)])
    assert schedule.stages[1].uses == ("vae",)
    assert schedule.releases_after("decode") == ["vae"]


def test_computing_and_applying_the_schedule_loads_nothing() -> None:
    te, te_loads = unloaded_lazy("text_encoder")
    vae, vae_loads = unloaded_lazy("vae")
    schedule = ReleaseSchedule.from_stages([("encode", ["text_encoder"]), ("decode", ["vae"])])
    components = {"text_encoder": te, "vae": vae}
    assert schedule.release_after("encode", components) == []  # not loaded: nothing to drop
    assert schedule.release_after("decode", components) == []
    assert te_loads == [] and vae_loads == []
    assert not te.is_materialized and not vae.is_materialized


def test_release_after_releases_only_loaded_lazy_components() -> None:
    te, _ = unloaded_lazy("text_encoder")
    image_encoder, _ = unloaded_lazy("image_encoder")
    plain = nn.Linear(2, 2)
    te.materialize()
    schedule = ReleaseSchedule.from_stages([("encode", ["text_encoder", "image_encoder", "plain"])])
    released = schedule.release_after("encode", {"text_encoder": te, "image_encoder": image_encoder, "plain": plain})
    assert released == ["text_encoder"]
    assert not te.is_materialized
    assert plain.weight.shape == (2, 2)  # a plain module is left alone


def test_release_after_does_not_release_components_used_later() -> None:
    vae, _ = unloaded_lazy("vae")
    vae.materialize()
    schedule = ReleaseSchedule.from_stages(T2V_STAGES)
    assert schedule.release_after("encode_image", {"image_encoder": nn.Identity(), "vae": vae}) == []
    assert vae.is_materialized


# ---- errors ----------------------------------------------------------------------------------------

def test_duplicate_stage_name() -> None:
    with pytest.raises(ValueError, match=r"fastoffload: stage name 'decode' appears twice; give every stage a unique "
                                         r"name"):
        ReleaseSchedule.from_stages([("decode", ["vae"]), ("decode", ["vae"])])


def test_components_given_as_a_string() -> None:
    with pytest.raises(TypeError, match=r"fastoffload: stage 'decode' lists its components as the string 'vae'; pass a "
                                        r"sequence of names, e.g. \('vae',\)"):
        ReleaseSchedule.from_stages([("decode", "vae")])


def test_component_that_is_not_a_name() -> None:
    with pytest.raises(TypeError, match=r"fastoffload: stage 'decode' lists component 3 \(int\); components are named "
                                        r"by strings"):
        ReleaseSchedule.from_stages([("decode", [3])])  # type: ignore[list-item]


def test_component_given_as_a_lazy_module_is_rejected_without_loading() -> None:
    vae, loads = unloaded_lazy("vae")
    with pytest.raises(TypeError, match=r"fastoffload: stage 'decode' lists component <LazyModule vae \(deferred\)> "
                                        r"\(LazyModule\); components are named by strings"):
        ReleaseSchedule.from_stages([("decode", [vae])])  # type: ignore[list-item]
    assert loads == []


@pytest.mark.parametrize("spec", [("decode",), ("decode", ["vae"], None, "extra"), ["decode", ["vae"]], "decode"])
def test_unreadable_stage(spec: Any) -> None:
    with pytest.raises(TypeError, match=r"fastoffload: cannot read stage .*; give a Stage, a \(name, components\) pair "
                                        r"or a \(name, components, run\) triple"):
        ReleaseSchedule.from_stages([spec])


def test_lazy_module_as_stage_is_rejected_without_loading() -> None:
    vae, loads = unloaded_lazy("vae")
    with pytest.raises(TypeError, match=r"fastoffload: cannot read stage <LazyModule vae \(deferred\)>"):
        ReleaseSchedule.from_stages([vae])  # type: ignore[list-item]
    assert loads == []


def test_keep_naming_an_unused_component() -> None:
    with pytest.raises(ValueError, match=r"fastoffload: keep names 'tranformer', which no stage uses; keep only "
                                         r"components that appear in a stage \(used: text_encoder, "):
        ReleaseSchedule.from_stages(T2V_STAGES, keep=["tranformer"])


def test_keep_given_as_a_string() -> None:
    with pytest.raises(TypeError, match=r"fastoffload: keep must be a collection of component names, got the string "
                                        r"'transformer'; write keep=\('transformer',\)"):
        ReleaseSchedule.from_stages(T2V_STAGES, keep="transformer")


def test_unknown_stage() -> None:
    schedule = ReleaseSchedule.from_stages(T2V_STAGES)
    with pytest.raises(ValueError, match=r"fastoffload: unknown stage 'denoising'; this schedule's stages are "
                                         r"'encode_prompt', 'encode_image', 'denoise', 'decode'"):
        schedule.releases_after("denoising")
    with pytest.raises(ValueError, match=r"fastoffload: unknown stage 'denoising'"):
        schedule.release_after("denoising", {})


def test_release_after_with_a_missing_component() -> None:
    schedule = ReleaseSchedule.from_stages(T2V_STAGES)
    with pytest.raises(ValueError, match=r"fastoffload: components 'vae' are due for release after stage 'decode' but "
                                         r"missing from the components mapping; pass the same mapping the stages "
                                         r"use"):
        schedule.release_after("decode", {"transformer": nn.Identity()})


def test_run_pipeline_stage_without_function() -> None:
    te, loads = unloaded_lazy("text_encoder")
    with pytest.raises(ValueError, match=r"fastoffload: stage 'decode' has no function to run; give it as "
                                         r"Stage\(name, components, run\)"):
        run_pipeline([Stage("encode", ["text_encoder"], lambda s, c: c["text_encoder"]), ("decode", ["vae"])],
                     {"text_encoder": te, "vae": nn.Identity()})
    assert loads == []  # checked before the first stage ran


def test_run_pipeline_missing_component() -> None:
    te, loads = unloaded_lazy("text_encoder")
    with pytest.raises(ValueError, match=r"fastoffload: stage 'decode' uses 'vae', missing from the components mapping "
                                         r"\(it has 'text_encoder'\)"):
        run_pipeline([("encode", ["text_encoder"], lambda s, c: c["text_encoder"]),
                      ("decode", ["vae"], lambda s, c: s)], {"text_encoder": te})
    assert loads == []


# ---- running a pipeline ------------------------------------------------------------------------------

def test_run_pipeline_threads_state_and_shows_only_declared_components() -> None:
    seen: list[tuple[str, list[str]]] = []

    def stage(name: str) -> Any:
        def run(state: list[str], components: Mapping[str, Any]) -> list[str]:
            seen.append((name, sorted(components)))
            return [*state, name]
        return run

    components = {"text_encoder": nn.Identity(), "transformer": nn.Identity(), "vae": nn.Identity()}
    out = run_pipeline([("encode", ["text_encoder"], stage("encode")),
                        ("denoise", ["transformer"], stage("denoise")),
                        ("decode", ["vae"], stage("decode"))], components, state=["start"])
    assert out == ["start", "encode", "denoise", "decode"]
    assert seen == [("encode", ["text_encoder"]), ("denoise", ["transformer"]), ("decode", ["vae"])]


def test_undeclared_use_fails_instead_of_reloading() -> None:
    te, _ = unloaded_lazy("text_encoder")

    def sneaky(state: Any, components: Mapping[str, Any]) -> Any:
        return components["text_encoder"]

    with pytest.raises(KeyError, match="text_encoder"):
        run_pipeline([("encode", ["text_encoder"], lambda s, c: c["text_encoder"](torch.ones(2))),
                      ("decode", ["vae"], sneaky)], {"text_encoder": te, "vae": nn.Identity()})


def test_stage_components_are_read_only() -> None:
    def replace(state: Any, components: Any) -> Any:
        components["vae"] = None
        return state

    with pytest.raises(TypeError):
        run_pipeline([("decode", ["vae"], replace)], {"vae": nn.Identity()})


def test_failing_stage_releases_nothing_more() -> None:
    counter = LiveBytes()
    components = lazy_components(counter, {"text_encoder": 8, "transformer": 16})

    def explode(state: Any, c: Mapping[str, Any]) -> Any:
        c["transformer"](torch.ones(16))
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        run_pipeline([("encode", ["text_encoder"], lambda s, c: c["text_encoder"](torch.ones(8))),
                      ("denoise", ["transformer"], explode)], components)
    assert not components["text_encoder"].is_materialized  # released after its stage finished
    assert components["transformer"].is_materialized  # kept for a retry


def test_keep_stays_loaded_across_runs() -> None:
    counter = LiveBytes()
    components = lazy_components(counter, {"text_encoder": 8, "transformer": 16})
    stages = [("encode", ["text_encoder"], lambda s, c: c["text_encoder"](torch.ones(8))),
              ("denoise", ["transformer"], lambda s, c: c["transformer"](torch.ones(16)))]
    for _ in range(3):
        run_pipeline(stages, components, keep=["transformer"])
    assert counter.loads == ["text_encoder", "transformer", "text_encoder", "text_encoder"]
    assert components["transformer"].is_materialized


PEAK_SIZES = {"text_encoder": 3 * 2**16, "transformer": 5 * 2**16, "vae": 2 * 2**16}  # float32 elements


def three_stage_pipeline(counter: LiveBytes) -> list[tuple[str, list[str], Any]]:
    def use(name: str) -> Any:
        def run(state: Any, components: Mapping[str, Any]) -> Any:
            with torch.no_grad():
                out = components[name](torch.ones(PEAK_SIZES[name]))
            counter.sample()
            return out
        return run

    return [("encode", ["text_encoder"], use("text_encoder")), ("denoise", ["transformer"], use("transformer")),
            ("decode", ["vae"], use("vae"))]


def test_peak_memory_falls_from_sum_to_largest() -> None:
    """The point of the schedule: three components in sequence peak at the largest, not the sum."""
    bytes_of = {name: elements * 4 for name, elements in PEAK_SIZES.items()}

    # Without releases (components kept, as a pipeline that loads everything does): peak is the sum.
    eager = LiveBytes()
    kept = lazy_components(eager, PEAK_SIZES)
    run_pipeline(three_stage_pipeline(eager), kept, keep=list(PEAK_SIZES))
    assert eager.peak == sum(bytes_of.values())

    # With the schedule: each component is gone before the next loads.
    scheduled = LiveBytes()
    components = lazy_components(scheduled, PEAK_SIZES)
    run_pipeline(three_stage_pipeline(scheduled), components)
    assert scheduled.peak == max(bytes_of.values())
    assert scheduled.live == 0
    assert scheduled.loads == ["text_encoder", "transformer", "vae"]
    assert not any(component.is_materialized for component in components.values())


@pytest.mark.cuda
def test_peak_cuda_memory_falls_from_sum_to_largest() -> None:
    """The same on a GPU, measured by the caching allocator's own peak counter."""
    mib = 2**20
    in_features = 1024  # inputs stay tiny (4 KiB), so the peak is the weights
    sizes = {"text_encoder": 96 * mib, "transformer": 160 * mib, "vae": 64 * mib}  # weight bytes

    def loader(nbytes: int) -> Any:
        return lambda: nn.Linear(in_features, nbytes // 4 // in_features, bias=False, device="cuda")

    def use(name: str) -> Any:
        def run(state: Any, components: Mapping[str, Any]) -> Any:
            with torch.no_grad():
                return components[name](torch.ones(in_features, device="cuda"))
        return run

    stages = [("encode", ["text_encoder"], use("text_encoder")), ("denoise", ["transformer"], use("transformer")),
              ("decode", ["vae"], use("vae"))]

    # Warm up cuBLAS so its workspace is allocated before the baseline is taken.
    with torch.no_grad():
        nn.Linear(in_features, 8, device="cuda")(torch.ones(in_features, device="cuda"))

    def peak(keep: list[str]) -> int:
        components = {name: LazyModule(name, loader(nbytes)) for name, nbytes in sizes.items()}
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run_pipeline(stages, components, keep=keep)
        torch.cuda.synchronize()
        result = torch.cuda.max_memory_allocated() - base
        for component in components.values():
            component.release()
        assert torch.cuda.memory_allocated() - base < mib
        return result

    total, largest = sum(sizes.values()), max(sizes.values())
    unscheduled = peak(keep=list(sizes))
    scheduled = peak(keep=[])
    assert total <= unscheduled <= total + 8 * mib
    assert largest <= scheduled <= largest + 8 * mib
