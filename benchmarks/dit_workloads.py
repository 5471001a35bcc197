"""Real diffusers DiT architectures with random weights (no download), for the budgets section.

Built from the ``models`` section's specifications (``benchmarks/models.py``: configurations, weight
initialisation and inputs), at token counts that put one row on each side of the copy/compute balance:

- ``Wan-1.3B``: ``WanTransformer3DModel`` with the Wan2.1 1.3B configuration (30 blocks), at 1560 video
  tokens (one 480x832 frame: transfer-bound on an H200) and 6240 (four frames: balanced).
- ``Flux-4+8``: ``FluxTransformer2DModel`` with FLUX.1's block sizes (dim 3072, 24 heads) and *both*
  block lists offloaded as one ring (``block_lists="all"``), cut to 4 double-stream and 8 single-stream
  blocks: the budgets grid keeps up to five copies of a model alive, and five host copies of the full
  24 GB model do not fit the host (nor its rounds the section's time; ``benchmarks/budgets.py``). 1024
  image tokens (transfer-bound) and, outside ``--quick``, 9216 (balanced: the double-stream blocks are
  copy-bound, the single-stream ones compute-bound).

Without a GPU the same classes run at the models section's tiny configurations on the host.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from benchmarks.utils import Context, try_import
from benchmarks.workloads import Workload

FLUX_CUT = dict(num_layers=4, num_single_layers=8)
WAN_TOKENS = {"transfer-bound": 1560, "balanced": 6240}
FLUX_TOKENS = {"transfer-bound": 1024, "balanced": 9216}
QUICK_FLUX_TOKENS = ("transfer-bound",)


def _workload(ctx: Context, spec: Any, name: str, label: str, tokens: int) -> Workload:
    from benchmarks import models

    config = spec.config if ctx.cuda else spec.cpu_config

    def build() -> nn.Module:
        return models.build_host(spec, ctx).to("cpu")

    def make_inputs(device: torch.device) -> tuple[tuple, dict]:
        return (), {**spec.inputs(config, tokens, device), "return_dict": False}

    info = {"tokens": tokens, "regime": label, "block_lists": spec.block_lists}
    return Workload(name=f"{name}{'' if ctx.cuda else '-cpu'} {tokens}t",
                    character=f"diffusers {spec.cls_name}, {tokens} tokens ({label})",
                    build_host=build, make_inputs=make_inputs, output=lambda out: out[0], target=None, info=info)


NAMES = {"wan-1.3b": "Wan-1.3B", "flux": "Flux-4+8"}


def dit_workloads(ctx: Context, keys: Sequence[str] = ("wan-1.3b", "flux")) -> list[tuple[str, Workload | None, str]]:
    """(name, workload or None, why not) per DiT row group of the budgets section, for ``keys`` in their order."""
    diffusers, reason = try_import("diffusers")
    if diffusers is None:
        return [(NAMES[key], None, reason) for key in keys]
    from benchmarks import models

    flux_full = models.MODELS["flux"]
    specs = {"wan-1.3b": (models.MODELS["wan-1.3b"], WAN_TOKENS),
             "flux": (dataclasses.replace(flux_full, config={**flux_full.config, **FLUX_CUT}), FLUX_TOKENS)}
    items: list[tuple[str, Workload | None, str]] = []
    for key in keys:
        spec, gpu_tokens = specs[key]
        token_counts = gpu_tokens if ctx.cuda else dict(zip(gpu_tokens, spec.cpu_tokens.values()))
        for label, tokens in token_counts.items():
            if key == "flux" and ctx.quick and label not in QUICK_FLUX_TOKENS:
                continue
            items.append((NAMES[key], _workload(ctx, spec, NAMES[key], label, tokens), ""))
    return items


__all__ = ["FLUX_CUT", "FLUX_TOKENS", "WAN_TOKENS", "dit_workloads"]
