"""The device policy, checked over its whole input space against rules written independently here.

The expected outcome below is stated as what each setting *ends up as* (declarative), not as the
four steps the policy runs, so a mistake in step order or in a step's condition shows up as a
mismatch rather than being copied into the expectation.
"""
from __future__ import annotations

import itertools
import logging
from typing import Any

import pytest

import fastoffload_ext.policy.platform
from fastoffload_ext import policy
from fastoffload_ext.policy import (
    DEVICE_POLICY_STEPS,
    UNIFIED_MEMORY_OFFLOAD_PATHS,
    apply_layerwise_offload_conflicts,
    apply_mps_offload_policy,
    apply_unified_memory_offload_policy,
    fill_lazy_module_load,
    has_unified_memory,
)
from fastoffload_ext.policy.resolution import ExecutionMode, ResolutionView, resolve

DEVICE = "Test iGPU"
UNIFIED_STEP = "apply_unified_memory_offload_policy"
LAZY_STEP = "fill_lazy_module_load"
MPS_STEP = "apply_mps_offload_policy"
CONFLICT_STEP = "apply_layerwise_offload_conflicts"

# mode as the user may write it: unset, strings, the enum
MODES: list[Any] = [None, "inference", "preprocess", ExecutionMode.FINETUNING, "distillation"]
TRAINING = {"finetuning", "distillation"}


def unified_message(flag: str, device: str = DEVICE) -> str:
    return (f"Disabling {flag}: {device} has unified memory, so moving weights to the host duplicates them rather "
            "than freeing device memory.")


def lazy_message(device: str = DEVICE) -> str:
    return (f"Enabling lazy_module_load: {device} has unified memory, so encoder, DiT, and VAEs cannot stay resident "
            "together. Set engine.offload.lazy_module_load to false to keep every component loaded.")


def mps_message(flag: str) -> str:
    return f"Disabling {flag}: MPS runs neither FSDP inference nor layerwise offload."


FSDP_WARNING = "dit_layerwise_offload is enabled, automatically disabling use_fsdp_inference."
DIT_WARNING = "dit_layerwise_offload is enabled, automatically disabling dit_cpu_offload."


def expected_outcome(inputs: dict[str, Any], *, unified: bool, mps: bool, apply: bool
                     ) -> tuple[dict[str, Any], dict[str, str], list[tuple[int, str]]]:
    """(final values, which rule decided each changed path, expected log records) from the policy's rules."""
    final = dict(inputs)
    if not apply:
        return final, {}, []

    mode = inputs["mode"]
    training = mode is not None and str(mode) in TRAINING
    decided: dict[str, str] = {}
    logs: list[tuple[int, str]] = []

    # Unified memory: every host offload that was asked for is a loss, so it ends off.
    offload_flags = {"layerwise": "dit_layerwise_offload", "dit": "dit_cpu_offload",
                     "text_encoder": "text_encoder_cpu_offload", "image_encoder": "image_encoder_cpu_offload",
                     "vae": "vae_cpu_offload"}
    if unified:
        for key, flag in offload_flags.items():
            if inputs[key]:
                final[key] = False
                decided[key] = UNIFIED_STEP
                logs.append((logging.INFO, unified_message(flag)))

    # lazy_module_load: the user's explicit choice stands; unset means "on exactly for non-training on unified".
    if inputs["lazy"] is None:
        final["lazy"] = unified and not training
        decided["lazy"] = LAZY_STEP
        if final["lazy"]:
            logs.append((logging.INFO, lazy_message()))

    # MPS: never FSDP inference, never layerwise, whatever was asked; a warning for each that was on.
    if mps:
        for key, flag in (("fsdp", "use_fsdp_inference"), ("layerwise", "dit_layerwise_offload")):
            if final[key]:
                logs.append((logging.WARNING, mps_message(flag)))
        final["fsdp"] = False
        final["layerwise"] = False
        decided["fsdp"] = MPS_STEP
        decided["layerwise"] = MPS_STEP

    # Layerwise offload that survived the device rules excludes FSDP inference and whole-DiT offload.
    if final["layerwise"]:
        if final["fsdp"]:
            final["fsdp"] = False
            decided["fsdp"] = CONFLICT_STEP
            logs.append((logging.WARNING, FSDP_WARNING))
        if final["dit"]:
            final["dit"] = False
            decided["dit"] = CONFLICT_STEP
            logs.append((logging.WARNING, DIT_WARNING))
    return final, decided, logs


PATHS = {
    "fsdp": "engine.use_fsdp_inference",
    "layerwise": "engine.offload.dit_layerwise",
    "dit": "engine.offload.dit",
    "text_encoder": "engine.offload.text_encoder",
    "image_encoder": "engine.offload.image_encoder",
    "vae": "engine.offload.vae",
    "lazy": "engine.offload.lazy_module_load",
}


def build_config(inputs: dict[str, Any]) -> dict[str, Any]:
    offload = {path.rsplit(".", 1)[1]: inputs[key] for key, path in PATHS.items()
               if path.startswith("engine.offload.") and inputs[key] is not None}
    config: dict[str, Any] = {"engine": {"use_fsdp_inference": inputs["fsdp"], "offload": offload}}
    if inputs["mode"] is not None:
        config["mode"] = inputs["mode"]
    return config


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Substitutes the platform answers; counts the queries so 'policy off' can prove it asked nothing."""
    state: dict[str, Any] = {"unified": False, "mps": False, "queries": 0, "asked_ids": []}

    def has_unified(device_id: int = 0) -> bool:
        state["queries"] += 1
        state["asked_ids"].append(device_id)
        return state["unified"]

    def is_mps() -> bool:
        state["queries"] += 1
        return state["mps"]

    def device_name(device_id: int = 0) -> str:
        return DEVICE

    monkeypatch.setattr(fastoffload_ext.policy.platform, "has_unified_memory", has_unified)
    monkeypatch.setattr(fastoffload_ext.policy.platform, "is_mps", is_mps)
    monkeypatch.setattr(fastoffload_ext.policy.platform, "device_name", device_name)
    return state


FLAG_COMBINATIONS = list(itertools.product(
    [False, True],  # fsdp
    [False, True],  # dit
    [False, True],  # text_encoder
    [False, True],  # image_encoder
    [False, True],  # vae
    [None, False, True],  # lazy_module_load
))


@pytest.mark.parametrize("apply", [True, False], ids=["policy-on", "policy-off"])
@pytest.mark.parametrize("mps", [False, True], ids=["discrete", "mps"])
@pytest.mark.parametrize("unified", [False, True], ids=["dedicated-mem", "unified-mem"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["layerwise-off", "layerwise-on"])
@pytest.mark.parametrize("mode", MODES, ids=lambda mode: f"mode-{mode}")
def test_policy_matrix(device: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                       apply: bool, mps: bool, unified: bool, layerwise: bool, mode: Any) -> None:
    """Every offload flag combination (96 per case) × mode × unified × MPS × layerwise × policy switch."""
    device["unified"] = unified
    device["mps"] = mps
    monkeypatch.setattr(policy, "APPLY_DEVICE_POLICY", apply)
    caplog.set_level(logging.DEBUG, logger="fastoffload_ext")

    for fsdp, dit, text_encoder, image_encoder, vae, lazy in FLAG_COMBINATIONS:
        inputs = {"mode": mode, "fsdp": fsdp, "layerwise": layerwise, "dit": dit, "text_encoder": text_encoder,
                  "image_encoder": image_encoder, "vae": vae, "lazy": lazy}
        config = build_config(inputs)
        caplog.clear()
        device["queries"] = 0

        result = resolve(config, DEVICE_POLICY_STEPS)

        final, decided, logs = expected_outcome(inputs, unified=unified, mps=mps, apply=apply)
        context = f"inputs={inputs} unified={unified} mps={mps} apply={apply}"
        actual = {key: result.get(path) for key, path in PATHS.items()}
        expected = {key: final[key] for key in PATHS}
        assert actual == expected, context
        assert result.provenance == {PATHS[key]: step for key, step in decided.items()}, context
        assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "fastoffload_ext.policy"] == logs, \
            context
        expected_mode = ExecutionMode(str(mode)) if mode is not None else ExecutionMode.INFERENCE
        assert result.get("mode") is expected_mode, context
        if not apply:
            assert device["queries"] == 0, "with the policy off the platform must not even be asked"


# ---- individual promises ---------------------------------------------------------------------------

def test_steps_run_in_the_seed_order() -> None:
    assert DEVICE_POLICY_STEPS == (apply_unified_memory_offload_policy, fill_lazy_module_load,
                                   apply_mps_offload_policy, apply_layerwise_offload_conflicts)
    assert [step.__name__ for step in DEVICE_POLICY_STEPS] == [UNIFIED_STEP, LAZY_STEP, MPS_STEP, CONFLICT_STEP]


def test_unified_memory_offload_paths() -> None:
    assert UNIFIED_MEMORY_OFFLOAD_PATHS == {
        "dit_layerwise_offload": "engine.offload.dit_layerwise",
        "dit_cpu_offload": "engine.offload.dit",
        "text_encoder_cpu_offload": "engine.offload.text_encoder",
        "image_encoder_cpu_offload": "engine.offload.image_encoder",
        "vae_cpu_offload": "engine.offload.vae",
    }


def test_policy_defaults() -> None:
    assert policy.APPLY_DEVICE_POLICY is True
    assert policy.LOCAL_DEVICE_ID == 0


def test_unified_policy_keeps_layerwise_conflicts_quiet(device: dict[str, Any],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Unified runs first, so the conflict step sees layerwise already off and warns about nothing."""
    device["unified"] = True
    config = {"engine": {"use_fsdp_inference": True, "offload": {"dit_layerwise": True, "dit": True}}}
    with caplog.at_level(logging.INFO, logger="fastoffload_ext.policy"):
        result = resolve(config, DEVICE_POLICY_STEPS)
    assert result.get("engine.use_fsdp_inference") is True
    assert result.get("engine.offload.dit") is False
    assert result.decided_by("engine.offload.dit") == UNIFIED_STEP
    assert FSDP_WARNING not in caplog.text and DIT_WARNING not in caplog.text
    assert f"decided by {UNIFIED_STEP} (input: True)" in result.explain()


def test_steps_ask_about_local_device_id_at_call_time(device: dict[str, Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy, "LOCAL_DEVICE_ID", 3)
    resolve({"engine": {"offload": {"vae": True}}}, DEVICE_POLICY_STEPS)
    assert device["asked_ids"] and set(device["asked_ids"]) == {3}


def test_apply_device_policy_is_read_at_call_time(device: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    device["unified"] = True
    config = {"engine": {"offload": {"vae": True}}}
    assert resolve(config, DEVICE_POLICY_STEPS).get("engine.offload.vae") is False
    monkeypatch.setattr(policy, "APPLY_DEVICE_POLICY", False)
    assert resolve(config, DEVICE_POLICY_STEPS).get("engine.offload.vae") is True


def test_has_unified_memory_delegates_to_platform_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fastoffload_ext.policy.platform, "has_unified_memory", lambda device_id=0: device_id == 5)
    assert has_unified_memory(5) is True
    assert has_unified_memory(0) is False
    assert has_unified_memory() is False


def test_has_unified_memory_failure_means_discrete(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    def broken(device_id: int = 0) -> bool:
        raise RuntimeError("NVML not found")

    monkeypatch.setattr(fastoffload_ext.policy.platform, "has_unified_memory", broken)
    with caplog.at_level(logging.DEBUG, logger="fastoffload_ext.policy"):
        assert has_unified_memory(0) is False
        result = resolve({"engine": {"offload": {"vae": True}}}, DEVICE_POLICY_STEPS)
    assert result.get("engine.offload.vae") is True
    assert result.get("engine.offload.lazy_module_load") is False
    assert "Treating device 0 as discrete: the unified-memory query failed (NVML not found)" in caplog.text


def test_real_platform_on_this_cpu_machine_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    config = {"engine": {"offload": {"vae": True, "text_encoder": True}}}
    with caplog.at_level(logging.INFO, logger="fastoffload_ext.policy"):
        result = resolve(config, DEVICE_POLICY_STEPS)
    assert result.get("engine.offload.vae") is True
    assert result.get("engine.offload.text_encoder") is True
    assert result.get("engine.offload.lazy_module_load") is False
    assert caplog.records == []


def test_unnameable_device_uses_platform_name_in_messages(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    # Messages name the device as the platform names it; a platform that cannot name it falls back to "cpu".
    monkeypatch.setattr(fastoffload_ext.policy.platform, "has_unified_memory", lambda device_id=0: True)
    monkeypatch.setattr(fastoffload_ext.policy.platform, "device_name", lambda device_id=0: "Grace Hopper")
    with caplog.at_level(logging.INFO, logger="fastoffload_ext.policy"):
        resolve({"engine": {"offload": {"vae": True}}}, DEVICE_POLICY_STEPS)
    assert [r.getMessage() for r in caplog.records] == [unified_message("vae_cpu_offload", "Grace Hopper"),
                                                         lazy_message("Grace Hopper")]

    def unnameable(device_id: int = 0) -> str:
        raise RuntimeError("MIG selector")

    monkeypatch.setattr(fastoffload_ext.policy.platform, "device_name", unnameable)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastoffload_ext.policy"):
        resolve({"engine": {"offload": {"dit": True}}}, DEVICE_POLICY_STEPS)
    assert caplog.records[0].getMessage() == unified_message("dit_cpu_offload", fastoffload_ext.policy.platform.platform_name())


def test_mps_step_decides_even_unset_settings(device: dict[str, Any]) -> None:
    device["mps"] = True
    view = ResolutionView({})
    assert apply_mps_offload_policy(view) == {"engine.use_fsdp_inference": False,
                                              "engine.offload.dit_layerwise": False}


def test_lazy_module_load_explicit_value_is_kept(device: dict[str, Any]) -> None:
    device["unified"] = True
    assert fill_lazy_module_load(ResolutionView({"engine": {"offload": {"lazy_module_load": False}}})) == {}
    assert fill_lazy_module_load(ResolutionView({})) == {"engine.offload.lazy_module_load": True}
    assert fill_lazy_module_load(ResolutionView({"mode": "finetuning"})) == {"engine.offload.lazy_module_load": False}


def test_steps_decide_nothing_when_switched_off(device: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    device["unified"] = True
    device["mps"] = True
    monkeypatch.setattr(policy, "APPLY_DEVICE_POLICY", False)
    view = ResolutionView({"engine": {"use_fsdp_inference": True, "offload": {"dit_layerwise": True, "dit": True}}})
    assert [step(view) for step in DEVICE_POLICY_STEPS] == [{}, {}, {}, {}]
    assert device["queries"] == 0


def test_mps_says_when_it_turns_off_what_was_asked(device: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """A real Mac: MPS is unified memory, so layerwise goes with the unified policy and FSDP with the MPS step.
    FSDP inference the user asked for must not disappear without a line at the default log level."""
    device["mps"] = True
    device["unified"] = True
    config = {"engine": {"use_fsdp_inference": True, "offload": {"dit_layerwise": True}}}
    with caplog.at_level(logging.INFO, logger="fastoffload_ext.policy"):
        result = resolve(config, DEVICE_POLICY_STEPS)
    assert result.get("engine.use_fsdp_inference") is False
    assert result.decided_by("engine.use_fsdp_inference") == MPS_STEP
    assert (logging.WARNING, mps_message("use_fsdp_inference")) in [(r.levelno, r.getMessage())
                                                                   for r in caplog.records]
    assert mps_message("dit_layerwise_offload") not in caplog.text  # already off, and said so, by the unified step
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastoffload_ext.policy"):
        resolve({"engine": {"use_fsdp_inference": False}}, DEVICE_POLICY_STEPS)
    assert "MPS" not in caplog.text  # nothing asked, nothing to report
