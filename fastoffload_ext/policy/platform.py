"""What kind of accelerator this process runs on, asked without side effects at import.

The device policy (``fastoffload_ext.policy``) needs three answers: does the local device share one
memory pool with the host (then moving weights to the host duplicates them instead of freeing
anything), is the platform Apple's MPS (no layerwise offload, no FSDP there), and what to call the
device in a log message. This module answers those questions and nothing else.

Why every function here is defensive:

* Importing this module must never initialise CUDA. A CPU test suite, a forked data-loader worker or
  a process that picks its device later must be able to import the package; every query below runs
  only when called.
* A query that fails is not an error for the caller. The policy only needs a conservative answer:
  "not unified" keeps the user's offload settings as written, which is what FastVideo does when its
  platform cannot answer. Failures are logged at debug level so they can be found, not shouted.
* Naming a device is diagnostic only. ``torch.cuda.get_device_name`` can fail where the device still
  works (NVML missing on integrated boards such as Jetson, ``CUDA_VISIBLE_DEVICES`` holding UUID or
  MIG selectors that a physical-ordinal lookup cannot interpret), so the generic platform name is
  returned instead of an exception.

The policy looks these functions up on this module at call time, so a test can substitute a
unified-memory or MPS device with ``monkeypatch.setattr(fastoffload_ext.policy.platform, "is_mps", ...)``.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

__all__ = ["device_name", "has_unified_memory", "is_mps", "platform_name"]


def _cuda_available() -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception as error:  # a broken driver install can raise from the availability probe
        logger.debug("Treating CUDA as unavailable: torch.cuda.is_available() raised (%s)", error)
        return False


def is_mps() -> bool:
    """Whether Apple's MPS is the accelerator in use.

    MPS counts as the platform only when CUDA is absent: a machine that exposes both (which torch
    does not build today) should be treated as a CUDA machine, where the offload engine runs.
    """
    try:
        mps_backend = getattr(torch.backends, "mps", None)
        if mps_backend is None or not mps_backend.is_available():
            return False
    except Exception as error:
        logger.debug("Treating the platform as not MPS: the MPS availability query failed (%s)", error)
        return False
    return not _cuda_available()


def platform_name() -> str:
    """The generic name of the platform in use: ``"cuda"``, ``"mps"`` or ``"cpu"``."""
    if _cuda_available():
        return "cuda"
    if is_mps():
        return "mps"
    return "cpu"


def has_unified_memory(device_id: int | str | torch.device = 0) -> bool:
    """Whether device ``device_id`` shares one physical memory pool with the host.

    CUDA answers with the device property ``integrated`` (``cudaDevAttrIntegrated``: Jetson, Grace
    Blackwell's integrated parts, laptop iGPUs); Apple's MPS is always unified. A CPU-only process
    has no separate device memory to save, and the policy must then leave offload settings alone, so
    the answer is ``False``. Any failure of the query also answers ``False`` (logged at debug level):
    "discrete" is the answer that keeps the user's settings unchanged.
    """
    try:
        if is_mps():
            return True
        if not _cuda_available():
            return False
        return bool(torch.cuda.get_device_properties(device_id).is_integrated)
    except Exception as error:
        logger.debug("Treating device %s as discrete: the unified-memory query failed (%s)", device_id, error)
        return False


def device_name(device_id: int | str | torch.device = 0) -> str:
    """A human-readable name for device ``device_id``, for log messages; never raises.

    Falls back to :func:`platform_name` (``"cuda"``, ``"mps"``, ``"cpu"``) whenever the device
    cannot be named, because a log line is never worth failing a run for.
    """
    generic = platform_name()
    if generic != "cuda":
        # MPS and the host have no per-device name worth more than the platform's.
        return generic
    try:
        return str(torch.cuda.get_device_name(device_id))
    except Exception as error:
        logger.debug("Naming device %s %r: its name could not be read (%s)", device_id, generic, error)
        return generic
