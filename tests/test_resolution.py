"""The resolution engine: ordering, isolation, schema checks, provenance and its explanation."""
from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import pytest

from fastoffload_ext.policy.resolution import (
    DEFAULT_SCHEMA,
    Decision,
    ExecutionMode,
    InvalidValueError,
    Resolution,
    ResolutionError,
    ResolutionView,
    SchemaField,
    StepResultError,
    UnknownPathError,
    resolve,
)

SCHEMA_PATHS = (
    "mode",
    "engine.use_fsdp_inference",
    "engine.offload.dit_layerwise",
    "engine.offload.dit",
    "engine.offload.text_encoder",
    "engine.offload.image_encoder",
    "engine.offload.vae",
    "engine.offload.lazy_module_load",
)


def turn_on_layerwise(view: ResolutionView) -> dict[str, Any]:
    return {"engine.offload.dit_layerwise": True}


def dit_follows_layerwise(view: ResolutionView) -> dict[str, Any]:
    return {"engine.offload.dit": not view.get("engine.offload.dit_layerwise")}


def decide_nothing(view: ResolutionView) -> dict[str, Any]:
    return {}


# ---- the view ------------------------------------------------------------------------------------

def test_view_get_contains_and_as_dict() -> None:
    config = {"engine": {"offload": {"vae": True, "dit": False, "lazy_module_load": None}}, "other": [1, 2]}
    view = ResolutionView(config)
    assert view.get("engine.offload.vae") is True
    assert view.get("engine.offload.dit") is False
    assert view.get("engine.offload.text_encoder") is None  # unset
    assert view.get("engine.offload.lazy_module_load") is None  # explicitly None reads as unset
    assert view.get("engine.offload.vae.deeper") is None  # through a leaf
    assert view.get("nothing.here") is None
    assert "engine.offload.vae" in view
    assert "engine.offload.dit" in view  # False is set
    assert "engine.offload.text_encoder" not in view
    assert "engine.offload.lazy_module_load" not in view
    assert 3 not in view
    snapshot = view.as_dict()
    assert snapshot == config
    snapshot["engine"]["offload"]["vae"] = False
    assert config["engine"]["offload"]["vae"] is True  # as_dict is a copy


def test_view_hands_out_copies_of_containers() -> None:
    config = {"engine": {"offload": {"vae": True}}, "other": [1, 2]}
    view = ResolutionView(config)
    view.get("engine.offload")["vae"] = False
    view.get("other").append(3)
    assert config == {"engine": {"offload": {"vae": True}}, "other": [1, 2]}


def test_step_cannot_mutate_through_the_view() -> None:
    def sneaky(view: ResolutionView) -> dict[str, Any]:
        view.get("engine.offload")["vae"] = True
        view.as_dict()["engine"]["offload"]["dit"] = True
        return {}

    result = resolve({"engine": {"offload": {"vae": False}}}, [sneaky])
    assert result.get("engine.offload.vae") is False
    assert result.get("engine.offload.dit") is False
    assert result.provenance == {}


# ---- ordering and isolation ----------------------------------------------------------------------

def test_steps_apply_in_order_and_see_earlier_results() -> None:
    result = resolve({}, [turn_on_layerwise, dit_follows_layerwise])
    assert result.get("engine.offload.dit_layerwise") is True
    assert result.get("engine.offload.dit") is False
    reversed_result = resolve({}, [dit_follows_layerwise, turn_on_layerwise])
    assert reversed_result.get("engine.offload.dit") is True  # it ran before layerwise was on


def test_later_step_wins_and_history_keeps_both() -> None:
    def off(view: ResolutionView) -> dict[str, Any]:
        return {"engine.offload.dit_layerwise": False}

    result = resolve({"engine": {"offload": {"dit_layerwise": False}}}, [turn_on_layerwise, off])
    assert result.get("engine.offload.dit_layerwise") is False
    assert result.decided_by("engine.offload.dit_layerwise") == "off"
    assert result.history == (
        Decision(step="turn_on_layerwise", path="engine.offload.dit_layerwise", before=False, value=True),
        Decision(step="off", path="engine.offload.dit_layerwise", before=True, value=False),
    )
    assert result.steps == ("turn_on_layerwise", "off")


def test_callers_config_is_never_mutated() -> None:
    config = {"mode": "finetuning", "engine": {"offload": {"dit": True}, "extra": {"keep": [1]}}}
    before = copy.deepcopy(config)
    result = resolve(config, [turn_on_layerwise, dit_follows_layerwise])
    assert config == before
    assert config["mode"] == "finetuning" and type(config["mode"]) is str  # not normalised in place
    result.config["engine"]["extra"]["keep"].append(2)
    assert config == before  # the result does not share containers with the input


def test_read_only_mapping_input_is_accepted() -> None:
    config = MappingProxyType({"engine": MappingProxyType({"offload": MappingProxyType({"vae": True})})})
    result = resolve(config, [turn_on_layerwise])
    assert result.get("engine.offload.vae") is True
    assert result.get("engine.offload.dit_layerwise") is True
    assert type(result.config["engine"]["offload"]) is dict


def test_keys_outside_the_schema_are_carried_through() -> None:
    config = {"model": "wan-14b", "engine": {"offload": {"vae": True, "custom": 3}, "threads": 8}}
    result = resolve(config, [])
    assert result.config["model"] == "wan-14b"
    assert result.config["engine"]["threads"] == 8
    assert result.config["engine"]["offload"]["custom"] == 3


def test_no_steps_fills_every_default() -> None:
    result = resolve({}, [])
    assert result.config == {
        "mode": ExecutionMode.INFERENCE,
        "engine": {
            "use_fsdp_inference": False,
            "offload": {"dit_layerwise": False, "dit": False, "text_encoder": False, "image_encoder": False,
                        "vae": False, "lazy_module_load": None},
        },
    }
    assert result.provenance == {}
    assert result.history == ()
    assert all(result.origins[path] == "default" for path in SCHEMA_PATHS)


def test_steps_see_unset_as_none_even_with_defaults() -> None:
    seen: dict[str, Any] = {}

    def probe(view: ResolutionView) -> dict[str, Any]:
        seen.update({path: view.get(path) for path in SCHEMA_PATHS})
        return {}

    resolve({}, [probe])
    assert seen == {path: None for path in SCHEMA_PATHS}


def test_step_setting_none_falls_back_to_the_default() -> None:
    def unset(view: ResolutionView) -> dict[str, Any]:
        return {"engine.offload.vae": None}

    result = resolve({"engine": {"offload": {"vae": True}}}, [unset])
    assert result.get("engine.offload.vae") is False
    assert result.decided_by("engine.offload.vae") == "unset"


def test_default_schema_names_exactly_the_offload_settings() -> None:
    assert tuple(DEFAULT_SCHEMA) == SCHEMA_PATHS
    assert DEFAULT_SCHEMA["engine.offload.lazy_module_load"].default is None
    assert DEFAULT_SCHEMA["mode"].default is ExecutionMode.INFERENCE
    with pytest.raises(TypeError):
        DEFAULT_SCHEMA["engine.offload.new"] = SchemaField()  # type: ignore[index]


def test_custom_schema() -> None:
    schema = {**DEFAULT_SCHEMA, "engine.offload.prefetch_depth": SchemaField(default=1)}

    def deeper(view: ResolutionView) -> dict[str, Any]:
        return {"engine.offload.prefetch_depth": 2}

    result = resolve({}, [deeper], schema=schema)
    assert result.get("engine.offload.prefetch_depth") == 2
    assert resolve({}, [], schema=schema).get("engine.offload.prefetch_depth") == 1
    with pytest.raises(UnknownPathError, match="engine.offload.prefetch_depth"):
        resolve({}, [deeper])


# ---- ExecutionMode and value checks --------------------------------------------------------------

@pytest.mark.parametrize(("given", "expected"), [
    ("inference", ExecutionMode.INFERENCE),
    ("preprocess", ExecutionMode.PREPROCESS),
    ("FINETUNING", ExecutionMode.FINETUNING),
    (" distillation ", ExecutionMode.DISTILLATION),
    (ExecutionMode.DISTILLATION, ExecutionMode.DISTILLATION),
])
def test_mode_accepts_strings_and_enums(given: Any, expected: ExecutionMode) -> None:
    seen: list[Any] = []

    def probe(view: ResolutionView) -> dict[str, Any]:
        seen.append(view.get("mode"))
        return {}

    result = resolve({"mode": given}, [probe])
    assert result.get("mode") is expected
    assert seen == [expected]
    assert result.origins["mode"] == "input"


def test_execution_mode_values() -> None:
    assert [mode.value for mode in ExecutionMode] == ["inference", "preprocess", "finetuning", "distillation"]
    assert ExecutionMode.FINETUNING == "finetuning"
    assert str(ExecutionMode.PREPROCESS) == "preprocess"


def test_invalid_mode_in_input() -> None:
    with pytest.raises(InvalidValueError,
                       match=r"fastoffload: invalid value for mode from the input config: expected one of 'inference', "
                             r"'preprocess', 'finetuning', 'distillation' \(or an ExecutionMode\), got 'training'"):
        resolve({"mode": "training"}, [])


def test_invalid_mode_from_a_step_names_the_step() -> None:
    def bad_mode(view: ResolutionView) -> dict[str, Any]:
        return {"mode": 3}

    with pytest.raises(InvalidValueError, match=r"fastoffload: invalid value for mode from resolution step bad_mode: "
                                                r".*got 3"):
        resolve({}, [bad_mode])


@pytest.mark.parametrize("value", ["false", 0, 1, "yes"])
def test_flags_must_be_booleans(value: Any) -> None:
    with pytest.raises(InvalidValueError,
                       match=r"fastoffload: invalid value for engine.offload.vae from the input config: expected true "
                             r"or false \(or None to leave it unset\), got"):
        resolve({"engine": {"offload": {"vae": value}}}, [])


def test_flag_from_step_must_be_boolean() -> None:
    def stringly(view: ResolutionView) -> dict[str, Any]:
        return {"engine.offload.dit": "off"}

    with pytest.raises(InvalidValueError,
                       match=r"fastoffload: invalid value for engine.offload.dit from resolution step stringly: "
                             r".*got 'off' \(str\)"):
        resolve({}, [stringly])


def test_setting_through_a_non_mapping_is_rejected() -> None:
    def never_runs(view: ResolutionView) -> dict[str, Any]:
        raise AssertionError("a malformed config must be rejected before any step runs")

    with pytest.raises(InvalidValueError, match=r"fastoffload: cannot set engine.offload.dit_layerwise: engine.offload "
                                                r"holds True, not a mapping; make engine.offload a mapping of "
                                                r"settings"):
        resolve({"engine": {"offload": True}}, [never_runs])


def test_overlapping_schema_paths_are_rejected() -> None:
    schema = {"engine": SchemaField(), "engine.offload.vae": SchemaField(default=False)}
    with pytest.raises(ResolutionError, match=r"fastoffload: schema paths 'engine' and 'engine.offload.vae' overlap: a "
                                              r"setting cannot also hold settings; rename 'engine' \(e.g. "
                                              r"engine.enabled\)"):
        resolve({}, [], schema=schema)


def test_explicit_none_parent_is_treated_as_unset() -> None:
    result = resolve({"engine": None}, [turn_on_layerwise])
    assert result.get("engine.offload.dit_layerwise") is True
    assert result.get("engine.offload.vae") is False


# ---- errors from steps ---------------------------------------------------------------------------

def test_unknown_path_names_path_and_step() -> None:
    def typo(view: ResolutionView) -> dict[str, Any]:
        return {"engine.offload.dit_layerwse": False}

    with pytest.raises(UnknownPathError, match=r"fastoffload: resolution step typo set 'engine.offload.dit_layerwse', "
                                               r"which is not a known setting; fix the path in typo \(known settings: "
                                               r""):
        resolve({}, [typo])
    assert issubclass(UnknownPathError, ValueError)
    assert issubclass(UnknownPathError, ResolutionError)


def test_non_string_path_is_unknown() -> None:
    def numeric(view: ResolutionView) -> dict[Any, Any]:
        return {3: True}

    with pytest.raises(UnknownPathError, match=r"fastoffload: resolution step numeric set 3, which is not a known "
                                               r"setting"):
        resolve({}, [numeric])  # type: ignore[list-item]


def test_unknown_path_aborts_without_touching_the_input() -> None:
    config = {"engine": {"offload": {"vae": True}}}

    def typo(view: ResolutionView) -> dict[str, Any]:
        return {"engine.offload.vae": False, "vea": False}

    with pytest.raises(UnknownPathError, match="'vea'"):
        resolve(config, [typo])
    assert config == {"engine": {"offload": {"vae": True}}}


def test_step_returning_none_is_rejected() -> None:
    def forgot_return(view: ResolutionView) -> None:
        pass

    with pytest.raises(StepResultError, match=r"fastoffload: resolution step forgot_return returned NoneType; a step "
                                              r"must return a mapping of \{dotted.path: value\} \(return \{\} to "
                                              r"decide nothing\)"):
        resolve({}, [forgot_return])  # type: ignore[list-item]


def test_exception_in_step_propagates_with_a_note() -> None:
    def broken(view: ResolutionView) -> dict[str, Any]:
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing") as caught:
        resolve({}, [broken])
    assert "(raised by resolution step broken)" in caught.value.__notes__


def test_non_mapping_config_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"fastoffload: resolve\(\) needs the config as a mapping of settings, got "
                                        r"list"):
        resolve([("engine.offload.vae", True)], [])  # type: ignore[arg-type]


def test_step_without_name_is_named_by_repr() -> None:
    def setter(view: ResolutionView, *, value: bool) -> dict[str, Any]:
        return {"engine.offload.vae": value}

    step = functools.partial(setter, value=True)
    result = resolve({}, [step])
    assert result.decided_by("engine.offload.vae") == repr(step)


def test_step_may_return_any_mapping() -> None:
    def proxy_result(view: ResolutionView) -> Mapping[str, Any]:
        return MappingProxyType({"engine.offload.vae": True})

    assert resolve({}, [proxy_result]).get("engine.offload.vae") is True


# ---- provenance and explain ----------------------------------------------------------------------

def test_provenance_covers_exactly_the_paths_steps_set() -> None:
    result = resolve({"engine": {"offload": {"vae": True}}}, [decide_nothing, turn_on_layerwise,
                                                              dit_follows_layerwise])
    assert result.provenance == {"engine.offload.dit_layerwise": "turn_on_layerwise",
                                 "engine.offload.dit": "dit_follows_layerwise"}
    assert result.decided_by("engine.offload.dit") == "dit_follows_layerwise"
    assert result.decided_by("engine.offload.vae") is None  # from the input
    assert result.decided_by("engine.offload.text_encoder") is None  # default
    assert result.origins["engine.offload.vae"] == "input"
    assert result.origins["engine.offload.text_encoder"] == "default"
    assert result.input_values == {"engine.offload.vae": True}


def test_resolve_logs_each_decision_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="fastoffload_ext.policy.resolution"):
        resolve({}, [turn_on_layerwise])
    assert [r.getMessage() for r in caplog.records] == [
        "Resolution step turn_on_layerwise set engine.offload.dit_layerwise = True"]


def test_explain_says_why_each_setting_has_its_value() -> None:
    def layerwise_conflict(view: ResolutionView) -> dict[str, Any]:
        return {"engine.offload.dit": False}

    result = resolve({"engine": {"offload": {"dit_layerwise": True, "dit": True}}},
                     [layerwise_conflict, turn_on_layerwise])
    text = result.explain()
    lines = text.splitlines()
    assert lines[0] == "Offload settings after 2 resolution step(s) (layerwise_conflict, turn_on_layerwise):"
    assert len(lines) == 1 + len(SCHEMA_PATHS)
    by_path = {line.split()[0]: line for line in lines[1:]}
    assert set(by_path) == set(SCHEMA_PATHS)
    assert by_path["engine.offload.dit"].split("=", 1)[1].split() == [
        "False", "decided", "by", "layerwise_conflict", "(input:", "True)"]
    assert by_path["engine.offload.vae"].endswith("default (not set)")
    assert "False" in by_path["engine.offload.vae"]
    assert "decided by turn_on_layerwise (input: True)" in by_path["engine.offload.dit_layerwise"]
    assert str(result) == text


def test_explain_shows_every_decision_of_a_contested_setting() -> None:
    def off(view: ResolutionView) -> dict[str, Any]:
        return {"engine.offload.vae": False}

    def on(view: ResolutionView) -> dict[str, Any]:
        return {"engine.offload.vae": True}

    result = resolve({}, [off, on])
    line = next(line for line in result.explain().splitlines() if "engine.offload.vae" in line)
    assert line.endswith("decided by on (input: unset; off: False; on: True)")


def test_resolution_is_a_value_object() -> None:
    result = resolve({}, [])
    assert isinstance(result, Resolution)
    with pytest.raises(AttributeError):
        result.config = {}  # type: ignore[misc]
    assert result.get("not.a.path") is None


def test_objects_outside_the_schema_are_carried_not_copied() -> None:
    import threading

    from torch import nn

    lock, module = threading.Lock(), nn.Linear(2, 2)
    config = {"runtime": {"lock": lock, "modules": [module]}, "engine": {"offload": {"vae": True}, "lock": lock}}
    seen: dict[str, Any] = {}

    def reads_everything(view: ResolutionView) -> dict[str, Any]:
        seen["runtime"] = view.get("runtime")
        seen["whole"] = view.as_dict()
        return {"engine.offload.dit_layerwise": True}

    result = resolve(config, [reads_everything])
    assert result.config["runtime"]["lock"] is lock and result.config["engine"]["lock"] is lock
    assert result.config["runtime"]["modules"][0] is module
    assert seen["runtime"]["lock"] is lock and seen["whole"]["engine"]["lock"] is lock
    # Containers are still the result's own: changing them leaves the caller's config alone.
    result.config["runtime"]["modules"].append(None)
    assert config["runtime"]["modules"] == [module]
    assert result.get("engine.offload.dit_layerwise") is True and result.get("engine.offload.vae") is True


def test_self_referencing_containers_outside_the_schema_are_copied_once() -> None:
    loop: list[Any] = []
    loop.append(loop)
    result = resolve({"extra": {"loop": loop}}, [])
    copied = result.config["extra"]["loop"]
    assert copied is not loop and copied[0] is copied


@pytest.mark.parametrize("config", [
    {"engine.offload.dit_layerwise": True},
    {"engine": {"offload.dit_layerwise": True}},
    {"engine.offload": {"dit_layerwise": True}},
])
def test_dotted_key_for_a_setting_is_rejected_not_dropped(config: dict[str, Any]) -> None:
    """A setting written as a dotted key would be carried through unread while the real setting takes its
    default, so a requested offload would end up off without a word; it must be refused instead."""
    with pytest.raises(InvalidValueError, match=r"fastoffload: the config key '[a-z_.]+' holds .*engine.offload."
                                                r"dit_layerwise.* nest it: \{'engine': \{'offload': "
                                                r"\{'dit_layerwise': \.\.\.\}\}\}"):
        resolve(config, [])


def test_dotted_keys_outside_the_schema_are_still_carried_through() -> None:
    result = resolve({"model.name": "wan", "engine": {"compile.mode": "max"}}, [])
    assert result.config["model.name"] == "wan"
    assert result.config["engine"]["compile.mode"] == "max"


def test_numpy_bool_is_refused_with_its_real_type() -> None:
    """numpy's bool prints its type name as plain 'bool'; the message must not claim a bool was refused."""
    np = pytest.importorskip("numpy")
    with pytest.raises(InvalidValueError, match=r"got np\.True_ \(numpy\.bool_?, not a Python bool; pass "
                                                r"bool\(value\)\)"):
        resolve({"engine": {"offload": {"vae": np.True_}}}, [])
