"""diffusers DiT architectures at toy sizes, random weights: what users offload, beyond the models the project builds.

Each :class:`DiT` names a diffusers transformer class, a tiny config of it and the keyword arguments of one
forward. :func:`build` makes the model (float32, eval, seeded) and :func:`first_tensor` takes the output the
pipelines use (``return_dict=False`` gives a tuple whose first item is the sample).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class DiT:
    name: str
    cls_name: str  # the class in ``diffusers``
    config: dict[str, Any]
    # The forward's keyword arguments (on the CPU, float32 where floating), made from the generator.
    inputs: Callable[[torch.Generator], dict[str, Any]]
    # The direct-child ModuleLists holding blocks, in the order the forward runs them.
    lists: tuple[str, ...]
    extra_forward_kwargs: dict[str, Any] = field(default_factory=dict)


def build(spec: DiT, seed: int = 0) -> nn.Module:
    import diffusers

    torch.manual_seed(seed)
    model = getattr(diffusers, spec.cls_name)(**spec.config)
    # Random weights everywhere: some classes zero-initialise their output layers, which would hide a wrong block.
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model.eval()


def inputs(spec: DiT, device: str = "cpu", seed: int = 7) -> dict[str, Any]:
    made = spec.inputs(torch.Generator().manual_seed(seed))
    return {name: _to(value, device) for name, value in made.items()}


def _to(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):  # Z-Image takes lists of per-sample tensors
        return type(value)(_to(item, device) for item in value)
    return value


def first_tensor(output: Any) -> torch.Tensor:
    while not isinstance(output, torch.Tensor):
        output = output[0] if isinstance(output, (tuple, list)) else output.sample
    return output


def run(model: nn.Module, spec: DiT, kwargs: dict[str, Any]) -> torch.Tensor:
    return first_tensor(model(**kwargs, **spec.extra_forward_kwargs, return_dict=False))


# The specs. Every list has at least two blocks; ``lists`` is in the order the forward runs them.
def _randn(g, *shape):
    return torch.randn(*shape, generator=g)


def _mask(length, valid, dtype=torch.long):
    """(1, length) mask: the first ``valid`` tokens on, the rest padding."""
    mask = torch.zeros(1, length, dtype=dtype)
    mask[:, :valid] = 1
    return mask


# 1. HunyuanVideo: 2 dual-stream blocks, then 2 single-stream blocks (the refiner blocks sit inside context_embedder).
def _hunyuan_video_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 2, 4, 4),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "encoder_attention_mask": _mask(8, 6),
        "pooled_projections": _randn(g, 1, 8),
        "guidance": torch.tensor([6000.0]),
    }


HUNYUAN_VIDEO = DiT(
    name="hunyuan_video",
    cls_name="HunyuanVideoTransformer3DModel",
    config=dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_single_layers=2, num_refiner_layers=2, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(4, 6, 6),
    ),
    inputs=_hunyuan_video_inputs,
    lists=("transformer_blocks", "single_transformer_blocks"),
)


# 2. HunyuanVideo 1.5 (i2v path: non-zero image_embeds); its ByT5 projection's 2048-wide layer is fixed: 4.4M parameters.
def _hunyuan_video15_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 9, 2, 4, 4),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "encoder_attention_mask": _mask(8, 6),
        "encoder_hidden_states_2": _randn(g, 1, 4, 8),
        "encoder_attention_mask_2": _mask(4, 3),
        "image_embeds": _randn(g, 1, 4, 8),
    }


HUNYUAN_VIDEO15 = DiT(
    name="hunyuan_video15",
    cls_name="HunyuanVideo15Transformer3DModel",
    config=dict(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_refiner_layers=2, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
        text_embed_2_dim=8, image_embed_dim=8, rope_axes_dim=(4, 6, 6),
    ),
    inputs=_hunyuan_video15_inputs,
    lists=("transformer_blocks",),
)


# 3. Cosmos (1.0 text2world layout: padding mask concatenated, learnable extra position embedding).
def _cosmos_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 2, 4, 4),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "fps": 24,
        "padding_mask": torch.zeros(1, 1, 8, 8),
    }


COSMOS = DiT(
    name="cosmos",
    cls_name="CosmosTransformer3DModel",
    config=dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        mlp_ratio=2.0, text_embed_dim=16, adaln_lora_dim=8, max_size=(4, 8, 8), patch_size=(1, 2, 2),
        rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=True, extra_pos_embed_type="learnable",
    ),
    inputs=_cosmos_inputs,
    lists=("transformer_blocks",),
)


# 4. LTX-Video: tokens already patchified, (batch, frames * height * width, channels).
def _ltx_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 2 * 4 * 4, 8),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "timestep": torch.tensor([500.0]),
        "encoder_attention_mask": _mask(8, 6),
        "num_frames": 2,
        "height": 4,
        "width": 4,
        "rope_interpolation_scale": (8 / 25, 32.0, 32.0),
    }


LTX = DiT(
    name="ltx_video",
    cls_name="LTXVideoTransformer3DModel",
    config=dict(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
        num_layers=2, caption_channels=16,
    ),
    inputs=_ltx_inputs,
    lists=("transformer_blocks",),
)


# 5. CogVideoX (1.0 layout: sincos positions, no RoPE). Input is (batch, frames, channels, height, width); the text
# length must equal max_text_seq_length.
def _cogvideox_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 2, 4, 4, 4),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "timestep": torch.tensor([500]),
    }


COGVIDEOX = DiT(
    name="cogvideox",
    cls_name="CogVideoXTransformer3DModel",
    config=dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=16,
        text_embed_dim=16, num_layers=2, sample_width=4, sample_height=4, sample_frames=5, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=8,
    ),
    inputs=_cogvideox_inputs,
    lists=("transformer_blocks",),
)


# 6. Mochi: 3 blocks (the last one is context_pre_only). text_embed_dim must divide by the pooler's 8 heads.
def _mochi_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 2, 4, 4),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "timestep": torch.tensor([500.0]),
        "encoder_attention_mask": _mask(8, 6, torch.bool),
    }


MOCHI = DiT(
    name="mochi",
    cls_name="MochiTransformer3DModel",
    config=dict(
        patch_size=2, num_attention_heads=2, attention_head_dim=16, num_layers=3, pooled_projection_dim=16,
        in_channels=4, text_embed_dim=16, time_embed_dim=16, max_sequence_length=8,
    ),
    inputs=_mochi_inputs,
    lists=("transformer_blocks",),
)


# 7. SkyReels-V2 (T2V layout, no diffusion forcing: one timestep per sample).
def _skyreels_v2_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 2, 4, 4),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
    }


SKYREELS_V2 = DiT(
    name="skyreels_v2",
    cls_name="SkyReelsV2Transformer3DModel",
    config=dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=64, num_layers=2, rope_max_seq_len=32,
    ),
    inputs=_skyreels_v2_inputs,
    lists=("blocks",),
)


# 8. Wan VACE: 3 main blocks, VACE hints injected after blocks 0 and 2. The forward runs ALL vace_blocks first
# (registered second), then the main blocks.
def _wan_vace_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 2, 4, 4),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "control_hidden_states": _randn(g, 1, 8, 2, 4, 4),
        "control_hidden_states_scale": torch.tensor([1.0, 0.75]),
    }


WAN_VACE = DiT(
    name="wan_vace",
    cls_name="WanVACETransformer3DModel",
    config=dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=64, num_layers=3, rope_max_seq_len=32, vace_layers=[0, 2],
        vace_in_channels=8,
    ),
    inputs=_wan_vace_inputs,
    lists=("vace_blocks", "blocks"),
)


_VIDEO = [WAN_VACE, SKYREELS_V2, HUNYUAN_VIDEO, HUNYUAN_VIDEO15, COSMOS, LTX, COGVIDEOX, MOCHI]


# 1. SD3 / SD3.5: 8x8 latent, patch 2 -> 16 image tokens; blocks 0-1 use dual attention (SD3.5 style).
def _sd3_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "pooled_projections": _randn(g, 1, 16),
        "timestep": torch.tensor([500.0]),
    }


# 2. Qwen-Image: packed latents (4 channels x 2x2 patch = 16), 4x4 token grid; last 2 text tokens masked out.
def _qwenimage_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "encoder_hidden_states_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.int64),
        "timestep": torch.tensor([0.5]),
        "img_shapes": [[(1, 4, 4)]],
    }


def _flux_ids(h, w):
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


# 3. Chroma: Flux-like packed latents, 4x4 token grid, 2D ids.
def _chroma_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "timestep": torch.tensor([0.5]),
        "img_ids": _flux_ids(4, 4),
        "txt_ids": torch.zeros(8, 3),
    }


# 4. HiDream-I1: square 8x8 latent (patch 2 -> 16 tokens); llama3 hidden states stacked over 5 "layers".
def _hidream_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "timesteps": torch.tensor([500.0]),
        "encoder_hidden_states_t5": _randn(g, 1, 8, 24),
        "encoder_hidden_states_llama3": _randn(g, 5, 1, 8, 16),
        "pooled_embeds": _randn(g, 1, 20),
    }


# 5. Sana: 8x8 latent, patch 1 -> 64 tokens, linear attention.
def _sana_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "timestep": torch.tensor([500.0]),
        "encoder_attention_mask": torch.ones(1, 8, dtype=torch.int64),
    }


# 6. Lumina2: 8x8 latent, patch 2 -> 16 tokens.
def _lumina2_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "timestep": torch.tensor([0.5]),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "encoder_attention_mask": torch.ones(1, 8, dtype=torch.bool),
    }


def _flux2_img_ids(h, w):
    ids = torch.zeros(h, w, 4)  # (t, h, w, l)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(1, h * w, 4)


def _flux2_txt_ids(n):
    ids = torch.zeros(1, n, 4)
    ids[..., 3] = torch.arange(n)
    return ids


# 7. Flux.2: packed latents (16 channels), 4x4 token grid, 4-axis ids, guidance-distilled.
def _flux2_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "timestep": torch.tensor([0.5]),
        "img_ids": _flux2_img_ids(4, 4),
        "txt_ids": _flux2_txt_ids(8),
        "guidance": torch.tensor([4.0]),
    }


# 8. Z-Image: list inputs (one (C, F, H, W) latent, one (seq, dim) caption); output is a list, first_tensor takes [0].
def _zimage_inputs(g):
    return {
        "x": [_randn(g, 4, 1, 8, 8)],
        "t": torch.tensor([0.5]),
        "cap_feats": [_randn(g, 8, 24)],
    }


_IMAGE = [
    DiT(
        name="sd3",
        cls_name="SD3Transformer2DModel",
        config=dict(
            sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=24, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
            pos_embed_max_size=8, dual_attention_layers=(0, 1), qk_norm="rms_norm",
        ),
        inputs=_sd3_inputs,
        lists=("transformer_blocks",),
    ),
    DiT(
        name="qwenimage",
        cls_name="QwenImageTransformer2DModel",
        config=dict(
            patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=24, axes_dims_rope=(4, 6, 6),
        ),
        inputs=_qwenimage_inputs,
        lists=("transformer_blocks",),
    ),
    DiT(
        name="chroma",
        cls_name="ChromaTransformer2DModel",
        config=dict(
            patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6), approximator_num_channels=16,
            approximator_hidden_dim=32, approximator_layers=2,
        ),
        inputs=_chroma_inputs,
        lists=("transformer_blocks", "single_transformer_blocks"),
    ),
    DiT(
        name="hidream",
        cls_name="HiDreamImageTransformer2DModel",
        config=dict(
            patch_size=2, in_channels=4, out_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, caption_channels=[24, 16], text_emb_dim=20, num_routed_experts=4,
            num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(8, 8), llama_layers=[1, 2, 3, 4],
        ),
        inputs=_hidream_inputs,
        # caption_projection is also a direct-child ModuleList, of per-block text projections (not blocks).
        lists=("double_stream_blocks", "single_stream_blocks"),
    ),
    DiT(
        name="sana",
        cls_name="SanaTransformer2DModel",
        config=dict(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=3,
            num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=24,
            sample_size=8, patch_size=1,
        ),
        inputs=_sana_inputs,
        lists=("transformer_blocks",),
    ),
    DiT(
        name="lumina2",
        cls_name="Lumina2Transformer2DModel",
        config=dict(
            sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=3, num_refiner_layers=2,
            num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(64, 16, 16),
            cap_feat_dim=24,
        ),
        inputs=_lumina2_inputs,
        # Registered noise_refiner, context_refiner, layers; the forward runs context_refiner first.
        lists=("context_refiner", "noise_refiner", "layers"),
    ),
    DiT(
        name="flux2",
        cls_name="Flux2Transformer2DModel",
        config=dict(
            patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=24, timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True,
        ),
        inputs=_flux2_inputs,
        lists=("transformer_blocks", "single_transformer_blocks"),
    ),
    DiT(
        name="zimage",
        cls_name="ZImageTransformer2DModel",
        config=dict(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=3, n_refiner_layers=2,
            n_heads=2, n_kv_heads=2, cap_feat_dim=24, axes_dims=[4, 6, 6], axes_lens=[64, 16, 16],
        ),
        inputs=_zimage_inputs,
        lists=("noise_refiner", "context_refiner", "layers"),
    ),
]


# Wan 2.1 (the examples' tiny transformer) and Flux.1 (both lists): the models the project's own tests start from.
def _wan_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 16, 3, 4, 4),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": _randn(g, 1, 8, 32),
    }


WAN = DiT(
    name="wan",
    cls_name="WanTransformer3DModel",
    config=dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
                text_dim=32, freq_dim=256, ffn_dim=32, num_layers=3, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
    inputs=_wan_inputs,
    lists=("blocks",),
)


def _flux_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 16, 4),
        "encoder_hidden_states": _randn(g, 1, 8, 32),
        "pooled_projections": _randn(g, 1, 32),
        "timestep": torch.tensor([0.5]),
        "img_ids": _flux_ids(4, 4),
        "txt_ids": torch.zeros(8, 3),
    }


FLUX = DiT(
    name="flux",
    cls_name="FluxTransformer2DModel",
    config=dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=3, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),
    inputs=_flux_inputs,
    lists=("transformer_blocks", "single_transformer_blocks"),
)

SPECS = [WAN, *_VIDEO, FLUX, *_IMAGE]
BY_NAME = {spec.name: spec for spec in SPECS}
