"""Offload decisions that depend on the local device's memory class, written as resolution steps.

These steps decide *whether* to offload; the engine (``fastoffload_ext.engine.layerwise``) never second-guesses
them. They run once, in the process that resolves the config, so every worker starts from settings that
are final. The rules, in the order :data:`DEVICE_POLICY_STEPS` applies them:

1. :func:`apply_unified_memory_offload_policy`: on a unified-memory device (Jetson, integrated GPUs,
   Apple silicon) every enabled host offload named in :data:`UNIFIED_MEMORY_OFFLOAD_PATHS` turns off,
   because moving weights to the host duplicates them in the same pool instead of freeing anything.
   It runs first so the later steps see only the offloads that survive it.
2. :func:`fill_lazy_module_load`: an unset ``engine.offload.lazy_module_load`` becomes True for
   non-training runs on unified memory (the components cannot all stay resident there) and False
   otherwise. An explicit value is never changed.
3. :func:`apply_mps_offload_policy`: on MPS, FSDP inference and layerwise offload turn off (with a
   warning for each that was on).
4. :func:`apply_layerwise_offload_conflicts`: with layerwise offload on, FSDP inference and whole-DiT
   CPU offload turn off (each would fight the layerwise engine for the same weights).

Every step asks about ``LOCAL_DEVICE_ID`` (device 0 of this process) and assumes the node does not mix
unified-memory and discrete devices. The platform is queried through ``fastoffload_ext.policy.platform`` at
call time, never at import, so importing this module initialises no device, and a test can stand in
a unified-memory or MPS device with ``monkeypatch.setattr(fastoffload_ext.policy.platform, ...)``. When the
platform cannot answer, the answer is "not unified", which leaves the user's settings as written.

``APPLY_DEVICE_POLICY`` switches every step off (they then decide nothing and the settings keep their
input values). It is read at call time; test isolation sets it to False so that expected configs do
not depend on the machine that produced them.

The decisions and log messages are FastVideo's (``fastvideo/api/device_policy.py``), so logs and
resolved configs read the same under either implementation, with one addition: the MPS step warns
when it turns off a setting that was on, where FastVideo turns it off without a word.
"""
from __future__ import annotations

import logging
from typing import Any

from fastoffload_ext.policy import platform as _platform
from fastoffload_ext.policy.resolution import ExecutionMode, ResolutionStep, ResolutionView

logger = logging.getLogger(__name__)

__all__ = [
    "APPLY_DEVICE_POLICY",
    "DEVICE_POLICY_STEPS",
    "LOCAL_DEVICE_ID",
    "UNIFIED_MEMORY_OFFLOAD_PATHS",
    "apply_layerwise_offload_conflicts",
    "apply_mps_offload_policy",
    "apply_unified_memory_offload_policy",
    "fill_lazy_module_load",
    "has_unified_memory",
]

# The device whose memory class decides the policy (see the module docstring).
LOCAL_DEVICE_ID = 0
# Master switch of every step here, read at call time (see the module docstring).
APPLY_DEVICE_POLICY = True

# Settings that trade device memory for host memory, keyed by the flag name that loaders and log
# messages use. Each one is a pure loss where host and device memory are one physical pool.
UNIFIED_MEMORY_OFFLOAD_PATHS: dict[str, str] = {
    "dit_layerwise_offload": "engine.offload.dit_layerwise",
    "dit_cpu_offload": "engine.offload.dit",
    "text_encoder_cpu_offload": "engine.offload.text_encoder",
    "image_encoder_cpu_offload": "engine.offload.image_encoder",
    "vae_cpu_offload": "engine.offload.vae",
}

_TRAINING_MODES = (ExecutionMode.FINETUNING, ExecutionMode.DISTILLATION)


def has_unified_memory(device_id: int = LOCAL_DEVICE_ID) -> bool:
    """Whether ``device_id`` shares one memory pool with the host; False when the platform cannot answer."""
    try:
        return bool(_platform.has_unified_memory(device_id))
    except Exception as error:
        logger.debug("Treating device %s as discrete: the unified-memory query failed (%s)", device_id, error)
        return False


def _device_name(device_id: int) -> str:
    # platform.device_name already falls back to the platform name; a log line must never fail a run.
    try:
        return _platform.device_name(device_id)
    except Exception:
        return _platform.platform_name()


def apply_unified_memory_offload_policy(view: ResolutionView) -> dict[str, Any]:
    """Turn off every enabled offload of ``UNIFIED_MEMORY_OFFLOAD_PATHS`` on a unified-memory device.

    Moving weights to the host there duplicates them rather than freeing device memory.
    """
    if not APPLY_DEVICE_POLICY or not has_unified_memory(LOCAL_DEVICE_ID):
        return {}
    enabled = [flag for flag, path in UNIFIED_MEMORY_OFFLOAD_PATHS.items() if view.get(path)]
    if not enabled:
        return {}
    name = _device_name(LOCAL_DEVICE_ID)
    for flag in enabled:
        logger.info(
            "Disabling %s: %s has unified memory, so moving weights to the host duplicates them rather than "
            "freeing device memory.", flag, name)
    return {UNIFIED_MEMORY_OFFLOAD_PATHS[flag]: False for flag in enabled}


def fill_lazy_module_load(view: ResolutionView) -> dict[str, Any]:
    """Decide an unset ``engine.offload.lazy_module_load``: True on unified memory unless training, else False."""
    if not APPLY_DEVICE_POLICY or view.get("engine.offload.lazy_module_load") is not None:
        return {}
    training = view.get("mode") in _TRAINING_MODES
    lazy_module_load = not training and has_unified_memory(LOCAL_DEVICE_ID)
    if lazy_module_load:
        logger.info(
            "Enabling lazy_module_load: %s has unified memory, so encoder, DiT, and VAEs cannot stay resident "
            "together. Set engine.offload.lazy_module_load to false to keep every component loaded.",
            _device_name(LOCAL_DEVICE_ID))
    return {"engine.offload.lazy_module_load": lazy_module_load}


_MPS_DISABLED_PATHS: dict[str, str] = {
    "use_fsdp_inference": "engine.use_fsdp_inference",
    "dit_layerwise_offload": "engine.offload.dit_layerwise",
}


def apply_mps_offload_policy(view: ResolutionView) -> dict[str, Any]:
    """On MPS, turn off FSDP inference and layerwise offload (neither runs there).

    Both are decided whatever their input; one that was on is turned off with a warning, so a request
    is never dropped without a word.
    """
    if not APPLY_DEVICE_POLICY or not _platform.is_mps():
        return {}
    for flag, path in _MPS_DISABLED_PATHS.items():
        if view.get(path):
            logger.warning("Disabling %s: MPS runs neither FSDP inference nor layerwise offload.", flag)
    return {path: False for path in _MPS_DISABLED_PATHS.values()}


def apply_layerwise_offload_conflicts(view: ResolutionView) -> dict[str, Any]:
    """With layerwise offload on, turn off FSDP inference and whole-DiT CPU offload."""
    if not APPLY_DEVICE_POLICY or not view.get("engine.offload.dit_layerwise"):
        return {}
    decided: dict[str, Any] = {}
    if view.get("engine.use_fsdp_inference"):
        logger.warning("dit_layerwise_offload is enabled, automatically disabling use_fsdp_inference.")
        decided["engine.use_fsdp_inference"] = False
    if view.get("engine.offload.dit"):
        logger.warning("dit_layerwise_offload is enabled, automatically disabling dit_cpu_offload.")
        decided["engine.offload.dit"] = False
    return decided


DEVICE_POLICY_STEPS: tuple[ResolutionStep, ...] = (
    apply_unified_memory_offload_policy,
    fill_lazy_module_load,
    apply_mps_offload_policy,
    apply_layerwise_offload_conflicts,
)
"""The device-policy steps in the order they run (see the module docstring for why this order)."""
