"""Real diffusers DiT architectures with random weights (no download), for the budgets section.

- ``Wan-1.3B``: ``WanTransformer3DModel`` with the Wan2.1 1.3B configuration (30 blocks, dim 1536, ffn
  8960, 12 heads), at 4096 video tokens (4 latent frames of 64x64): close to balanced on an H200.
- ``Flux-8``: ``FluxTransformer2DModel`` with Flux.1's block sizes (dim 3072, 24 heads) but 8 double
  blocks and 2 single blocks, at 1024 image + 256 text tokens: transfer-bound (each ~0.65 GiB double
  block computes in a fraction of its copy time).

Weights are random, normal(0, 0.02) for matrices and normal(1, 0.1) / normal(0, 0.1) for vectors, drawn
from a seeded generator on the device the model is built on, in bf16. Only the first ModuleList (Wan:
``blocks``, Flux: ``transformer_blocks``) is offloaded; the rest goes to the device.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from benchmarks.utils import try_import
from benchmarks.workloads import DTYPE, Workload

WAN_13B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
               text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6)
FLUX_8 = dict(patch_size=1, in_channels=64, num_layers=8, num_single_layers=2, attention_head_dim=128,
              num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=False,
              axes_dims_rope=(16, 56, 56))
CPU_SCALE = {"Wan": dict(num_attention_heads=2, attention_head_dim=32, ffn_dim=256, num_layers=6, text_dim=64,
                         freq_dim=32),
             "Flux": dict(num_attention_heads=2, attention_head_dim=32, num_layers=4, num_single_layers=1,
                          joint_attention_dim=64, pooled_projection_dim=32, in_channels=16, axes_dims_rope=(8, 12, 12))}


def randomize_(model: nn.Module, seed: int) -> nn.Module:
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.normal_(0.0, 0.02, generator=generator)
            elif name.endswith("weight"):
                param.normal_(1.0, 0.1, generator=generator)
            else:
                param.normal_(0.0, 0.1, generator=generator)
    return model


def _build(cls: Any, config: dict[str, Any], seed: int) -> nn.Module:
    init_device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(init_device):
        model = cls(**config)
    model = randomize_(model.to(DTYPE), seed).eval()
    if init_device != "cpu":
        model = model.to("cpu")
        torch.cuda.empty_cache()
    return model


def wan_workload(cpu: bool) -> tuple[Workload | None, str]:
    diffusers, reason = try_import("diffusers")
    if diffusers is None:
        return None, reason
    try:
        from diffusers import WanTransformer3DModel
    except Exception as error:
        return None, f"diffusers {diffusers.__version__} has no WanTransformer3DModel: {error}"
    config = {**WAN_13B, **(CPU_SCALE["Wan"] if cpu else {})}
    frames, side, text = (1, 8, 16) if cpu else (4, 64, 512)

    def make_inputs(device: torch.device) -> tuple[tuple, dict]:
        generator = torch.Generator(device=device).manual_seed(31)
        latents = torch.randn(1, config["in_channels"], frames, side, side, device=device, dtype=DTYPE,
                              generator=generator)
        context = torch.randn(1, text, config["text_dim"], device=device, dtype=DTYPE, generator=generator)
        timestep = torch.tensor([500], device=device, dtype=torch.long)
        return (), {"hidden_states": latents, "timestep": timestep, "encoder_hidden_states": context,
                    "return_dict": False}

    tokens = frames * (side // 2) ** 2
    return Workload(name="Wan-1.3B" + ("-cpu" if cpu else ""), character=f"diffusers Wan2.1 1.3B config, {tokens} tokens",
                    build_host=lambda: _build(WanTransformer3DModel, config, 3), make_inputs=make_inputs,
                    output=lambda out: out[0], target=None, info={"tokens": tokens}), ""


def flux_workload(cpu: bool) -> tuple[Workload | None, str]:
    diffusers, reason = try_import("diffusers")
    if diffusers is None:
        return None, reason
    try:
        from diffusers import FluxTransformer2DModel
    except Exception as error:
        return None, f"diffusers {diffusers.__version__} has no FluxTransformer2DModel: {error}"
    config = {**FLUX_8, **(CPU_SCALE["Flux"] if cpu else {})}
    side, text = (4, 8) if cpu else (32, 256)

    def make_inputs(device: torch.device) -> tuple[tuple, dict]:
        generator = torch.Generator(device=device).manual_seed(37)
        image = torch.randn(1, side * side, config["in_channels"], device=device, dtype=DTYPE, generator=generator)
        context = torch.randn(1, text, config["joint_attention_dim"], device=device, dtype=DTYPE, generator=generator)
        pooled = torch.randn(1, config["pooled_projection_dim"], device=device, dtype=DTYPE, generator=generator)
        rows, cols = torch.meshgrid(torch.arange(side, device=device), torch.arange(side, device=device), indexing="ij")
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).to(DTYPE)
        txt_ids = torch.zeros(text, 3, device=device, dtype=DTYPE)
        timestep = torch.tensor([0.5], device=device, dtype=DTYPE)
        return (), {"hidden_states": image, "encoder_hidden_states": context, "pooled_projections": pooled,
                    "timestep": timestep, "img_ids": img_ids, "txt_ids": txt_ids, "return_dict": False}

    return Workload(name="Flux-8" + ("-cpu" if cpu else ""),
                    character=f"diffusers Flux.1 block sizes, 8 double blocks, {side * side}+{text} tokens",
                    build_host=lambda: _build(FluxTransformer2DModel, config, 5), make_inputs=make_inputs,
                    output=lambda out: out[0], target=None, info={"tokens": side * side + text}), ""


def dit_workloads(cpu: bool) -> list[tuple[str, Workload | None, str]]:
    items = []
    for name, factory in (("Wan-1.3B", wan_workload), ("Flux-8", flux_workload)):
        workload, reason = factory(cpu)
        items.append((workload.name if workload is not None else name, workload, reason))
    return items


__all__ = ["FLUX_8", "WAN_13B", "dit_workloads", "flux_workload", "randomize_", "wan_workload"]
