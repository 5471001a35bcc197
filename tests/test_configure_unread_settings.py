"""apply_offload_config with a misspelled setting or FastVideo's flat argument name: the setting was carried
through unread, the offload it asked for silently stayed off. It now raises, naming the setting to write."""
from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.pipeline.configure import LayerwiseAction, apply_offload_config


class _Dit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])


@pytest.mark.parametrize(("config", "meant"), [
    ({"engine": {"offload": {"dit_layerwize": True}}}, "engine.offload.dit_layerwise"),
    ({"engine": {"offload": {"dit_layerwise_offload": True}}}, "engine.offload.dit_layerwise"),
    ({"dit_layerwise_offload": True}, "engine.offload.dit_layerwise"),
    ({"engine": {"dit_layerwise_offload": True}}, "engine.offload.dit_layerwise"),
    ({"vae_cpu_offload": True}, "engine.offload.vae"),
    ({"engine": {"offload": {"lazy_module_loads": True}}}, "engine.offload.lazy_module_load"),
    ({"use_fsdp_inference": True}, "engine.use_fsdp_inference"),
])
def test_a_misspelled_or_flat_offload_setting_is_refused_naming_the_setting(config: dict[str, Any],
                                                                           meant: str) -> None:
    model = _Dit()
    with pytest.raises(OffloadConfigError, match=r"^fastoffload: .*" + meant.replace(".", r"\.")):
        apply_offload_config(config, transformer=model, device="cpu")
    assert not any(hasattr(block, "_hook_manager") for block in model.blocks)


def test_fastvideos_other_offload_keys_and_unrelated_keys_are_still_carried_through() -> None:
    config = {"engine": {"offload": {"dit_layerwise": False, "pin_cpu_memory": True}, "num_gpus": 1},
              "sampling": {"steps": 4}, "model": "wan", "modes": ["t2v"]}
    applied = apply_offload_config(config, transformer=_Dit(), device="cpu")
    assert applied.layerwise is LayerwiseAction.DISABLED
    assert applied.config["engine"]["offload"]["pin_cpu_memory"] is True
