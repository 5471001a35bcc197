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


# HunyuanVideo: 2 dual-stream blocks, then 2 single-stream blocks (the refiner blocks sit inside context_embedder).
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


# HunyuanVideo 1.5 (i2v path: non-zero image_embeds); its ByT5 projection's 2048-wide layer is fixed: 4.4M parameters.
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


# Cosmos (1.0 text2world layout: padding mask concatenated, learnable extra position embedding).
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


# LTX-Video: tokens already patchified, (batch, frames * height * width, channels).
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


# CogVideoX (1.0 layout: sincos positions, no RoPE). Input is (batch, frames, channels, height, width); the text
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


# Mochi: 3 blocks (the last one is context_pre_only). text_embed_dim must divide by the pooler's 8 heads.
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


# SkyReels-V2 (T2V layout, no diffusion forcing: one timestep per sample).
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


# Wan VACE: 3 main blocks, VACE hints injected after blocks 0 and 2. The forward runs ALL vace_blocks first
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


# SD3 / SD3.5: 8x8 latent, patch 2 -> 16 image tokens; blocks 0-1 use dual attention (SD3.5 style).
def _sd3_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "pooled_projections": _randn(g, 1, 16),
        "timestep": torch.tensor([500.0]),
    }


# Qwen-Image: packed latents (4 channels x 2x2 patch = 16), 4x4 token grid; last 2 text tokens masked out.
def _qwenimage_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "encoder_hidden_states_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.int64),
        "timestep": torch.tensor([0.5]),
        "img_shapes": [[(1, 4, 4)]],
    }


def _flux_ids(h, w, modality=0.0, offset=0.0):
    ids = torch.zeros(h, w, 3)
    ids[..., 0] = modality
    ids[..., 1] = torch.arange(h)[:, None] + offset
    ids[..., 2] = torch.arange(w)[None, :] + offset
    return ids.reshape(h * w, 3)


# Chroma: Flux-like packed latents, 4x4 token grid, 2D ids.
def _chroma_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "timestep": torch.tensor([0.5]),
        "img_ids": _flux_ids(4, 4),
        "txt_ids": torch.zeros(8, 3),
    }


# HiDream-I1: square 8x8 latent (patch 2 -> 16 tokens); llama3 hidden states stacked over 5 "layers".
def _hidream_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "timesteps": torch.tensor([500.0]),
        "encoder_hidden_states_t5": _randn(g, 1, 8, 24),
        "encoder_hidden_states_llama3": _randn(g, 5, 1, 8, 16),
        "pooled_embeds": _randn(g, 1, 20),
    }


# Sana: 8x8 latent, patch 1 -> 64 tokens, linear attention.
def _sana_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "timestep": torch.tensor([500.0]),
        "encoder_attention_mask": torch.ones(1, 8, dtype=torch.int64),
    }


# Lumina2: 8x8 latent, patch 2 -> 16 tokens.
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


# Flux.2: packed latents (16 channels), 4x4 token grid, 4-axis ids, guidance-distilled.
def _flux2_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "timestep": torch.tensor([0.5]),
        "img_ids": _flux2_img_ids(4, 4),
        "txt_ids": _flux2_txt_ids(8),
        "guidance": torch.tensor([4.0]),
    }


# Z-Image: list inputs (one (C, F, H, W) latent, one (seq, dim) caption); output is a list, first_tensor takes [0].
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


# More image and video DiTs.
def _grid_ids(height, width):
    """(height * width, 3) Flux-style image position ids: (0, row, column)."""
    ids = torch.zeros(height, width, 3)
    ids[..., 1] = torch.arange(height)[:, None]
    ids[..., 2] = torch.arange(width)[None, :]
    return ids.reshape(height * width, 3)


# CogView4: (B, C, H, W) latents, SDXL-style size conditions; RoPE computed inside.
def _cogview4_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "timestep": torch.tensor([500.0]),
        "original_size": torch.tensor([[64.0, 64.0]]),
        "target_size": torch.tensor([[64.0, 64.0]]),
        "crop_coords": torch.tensor([[0.0, 0.0]]),
    }


COGVIEW4 = DiT(
    name="cogview4",
    cls_name="CogView4Transformer2DModel",
    config=dict(
        patch_size=2, in_channels=4, out_channels=4, num_layers=3, attention_head_dim=16, num_attention_heads=2,
        text_embed_dim=24, time_embed_dim=32, condition_dim=16, pos_embed_max_size=8, sample_size=8,
        rope_axes_dim=(8, 8),
    ),
    inputs=_cogview4_inputs,
    lists=("transformer_blocks",),
)


# CogView3Plus: same conditioning as CogView4, sincos positions instead of RoPE.
def _cogview3plus_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "timestep": torch.tensor([500]),
        "original_size": torch.tensor([[64.0, 64.0]]),
        "target_size": torch.tensor([[64.0, 64.0]]),
        "crop_coords": torch.tensor([[0.0, 0.0]]),
    }


COGVIEW3PLUS = DiT(
    name="cogview3plus",
    cls_name="CogView3PlusTransformer2DModel",
    config=dict(
        patch_size=2, in_channels=4, num_layers=3, attention_head_dim=16, num_attention_heads=2, out_channels=4,
        text_embed_dim=24, time_embed_dim=32, condition_dim=16, pos_embed_max_size=8, sample_size=8,
    ),
    inputs=_cogview3plus_inputs,
    lists=("transformer_blocks",),
)


# Allegro: (B, C, F, H, W) latents; the pipeline passes a precomputed 3D RoPE ((cos, sin) per axis, positions).
def _allegro_rope(head_dim, frames, grid_h, grid_w, interpolation_scale=(2.2, 2.0, 2.0)):
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro

    freqs_t, freqs_h, freqs_w, pos_t, pos_h, pos_w = get_3d_rotary_pos_embed_allegro(
        embed_dim=head_dim, crops_coords=((0, 0), (grid_h, grid_w)), grid_size=(grid_h, grid_w),
        temporal_size=frames, interpolation_scale=interpolation_scale,
    )
    pos = torch.cartesian_prod(pos_t.long(), pos_h.long(), pos_w.long())
    pos = pos.reshape(-1, 3).transpose(0, 1).reshape(3, 1, -1).contiguous()
    return (freqs_t, freqs_h, freqs_w), tuple(pos)


def _allegro_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "timestep": torch.tensor([500]),
        "encoder_attention_mask": _mask(8, 6),
        "image_rotary_emb": _allegro_rope(24, 2, 4, 4),
    }


ALLEGRO = DiT(
    name="allegro",
    cls_name="AllegroTransformer3DModel",
    config=dict(
        patch_size=2, patch_size_t=1, num_attention_heads=2, attention_head_dim=24, in_channels=4, out_channels=4,
        num_layers=3, cross_attention_dim=48, sample_height=8, sample_width=8, sample_frames=2, caption_channels=24,
    ),
    inputs=_allegro_inputs,
    lists=("transformer_blocks",),
)


# LTX-2 (2.0 layout): patchified video tokens (B, F*H*W, C) and audio tokens (B, T, C); output is (video, audio).
def _ltx2_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 2 * 4 * 4, 8),
        "audio_hidden_states": _randn(g, 1, 4, 8),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "audio_encoder_hidden_states": _randn(g, 1, 8, 16),
        "timestep": torch.tensor([500.0]),
        "sigma": torch.tensor([500.0]),
        "encoder_attention_mask": _mask(8, 6),
        "audio_encoder_attention_mask": _mask(8, 6),
        "num_frames": 2,
        "height": 4,
        "width": 4,
        "fps": 24.0,
        "audio_num_frames": 4,
    }


LTX2 = DiT(
    name="ltx2",
    cls_name="LTX2VideoTransformer3DModel",
    config=dict(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
        audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=8,
        audio_cross_attention_dim=16, num_layers=3, caption_channels=16,
    ),
    inputs=_ltx2_inputs,
    lists=("transformer_blocks",),
)


# Kandinsky 5: channels-last (B, F, H, W, C) latents, explicit RoPE positions; return_dict=False gives the tensor.
def _kandinsky5_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 2, 8, 8, 4),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "timestep": torch.tensor([500.0]),
        "pooled_projections": _randn(g, 1, 16),
        "visual_rope_pos": [torch.arange(2), torch.arange(4), torch.arange(4)],
        "text_rope_pos": torch.arange(8),
        "scale_factor": (1.0, 2.0, 2.0),
    }


KANDINSKY5 = DiT(
    name="kandinsky5",
    cls_name="Kandinsky5Transformer3DModel",
    config=dict(
        in_visual_dim=4, in_text_dim=24, in_text_dim2=16, time_dim=32, out_visual_dim=4, patch_size=(1, 2, 2),
        model_dim=32, ff_dim=64, num_text_blocks=2, num_visual_blocks=3, axes_dims=(4, 6, 6),
    ),
    inputs=_kandinsky5_inputs,
    lists=("text_transformer_blocks", "visual_transformer_blocks"),
)


# Bria (Flux-like, no pooled projection, no guidance): packed tokens (B, H*W, C*4), (N, 3) ids.
def _bria_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "timestep": torch.tensor([500.0]),
        "img_ids": _grid_ids(4, 4),
        "txt_ids": torch.zeros(8, 3),
    }


BRIA = DiT(
    name="bria",
    cls_name="BriaTransformer2DModel",
    config=dict(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, axes_dims_rope=[4, 6, 6],
    ),
    inputs=_bria_inputs,
    lists=("transformer_blocks", "single_transformer_blocks"),
)


# OmniGen: 8 condition tokens (ids 2..5 replaced by a 4-token input image), a time token, 16 output-image tokens;
# the processor's mask (causal over condition + time, image rows see everything) and positions.
def _omnigen_inputs(g):
    text, image = 8, 16
    seq = text + 1 + image
    mask = torch.zeros(seq, seq)
    mask[: text + 1, : text + 1] = torch.tril(torch.ones(text + 1, text + 1))
    mask[text + 1 :, :] = 1
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "timestep": torch.tensor([0.5]),
        "input_ids": torch.randint(1, 64, (1, text), generator=g),
        "input_img_latents": [_randn(g, 1, 4, 4, 4)],
        "input_image_sizes": {0: [[2, 6]]},
        "attention_mask": mask.unsqueeze(0),
        "position_ids": torch.arange(seq).unsqueeze(0),
    }


OMNIGEN = DiT(
    name="omnigen",
    cls_name="OmniGenTransformer2DModel",
    config=dict(
        in_channels=4, patch_size=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64, num_layers=3, pad_token_id=0, vocab_size=64, max_position_embeddings=8192,
        original_max_position_embeddings=4096, rope_scaling={"short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
        pos_embed_max_size=8, time_step_dim=32,
    ),
    inputs=_omnigen_inputs,
    lists=("layers",),
)


# HunyuanDiT (v1.0/1.1 layout: style and image-meta-size conditions). 4 blocks: block 3 takes block 0's output as a
# long skip (num_layers must be even for the skips to pair up). CLIP and T5 text lengths are fixed by the config.
def _hunyuan_dit_inputs(g):
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "text_embedding_mask": _mask(8, 6),
        "encoder_hidden_states_t5": _randn(g, 1, 8, 16),
        "text_embedding_mask_t5": _mask(8, 5),
        "image_meta_size": torch.tensor([[64.0, 64.0, 64.0, 64.0, 0.0, 0.0]]),
        "style": torch.tensor([0]),
        "image_rotary_emb": get_2d_rotary_pos_embed(16, ((0, 0), (4, 4)), (4, 4), output_type="pt"),
    }


HUNYUAN_DIT = DiT(
    name="hunyuan_dit",
    cls_name="HunyuanDiT2DModel",
    config=dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, patch_size=2, sample_size=8, hidden_size=32,
        num_layers=4, mlp_ratio=2.0, learn_sigma=True, cross_attention_dim=24, cross_attention_dim_t5=16,
        pooled_projection_dim=16, text_len=8, text_len_t5=8, use_style_cond_and_image_meta_size=True,
    ),
    inputs=_hunyuan_dit_inputs,
    lists=("blocks",),
)


# PixArt (alpha layout: no resolution/aspect conditions since sample_size != 128); learn-sigma output (8 channels).
def _pixart_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "encoder_attention_mask": _mask(8, 6),
        "timestep": torch.tensor([500]),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
    }


PIXART = DiT(
    name="pixart",
    cls_name="PixArtTransformer2DModel",
    config=dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=3,
        cross_attention_dim=32, sample_size=8, patch_size=2, caption_channels=24,
    ),
    inputs=_pixart_inputs,
    lists=("transformer_blocks",),
)


# Latte: (B, C, F, H, W) latents. The forward INTERLEAVES its lists: spatial 0, temporal 0, spatial 1, temporal 1,
# ...; ``lists`` gives the list whose first block runs first. video_length must equal the frame count. No
# encoder_attention_mask (as the pipeline): the forward does not repeat it per frame, so it breaks with 2 frames.
def _latte_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
    }


LATTE = DiT(
    name="latte",
    cls_name="LatteTransformer3DModel",
    config=dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=3,
        cross_attention_dim=32, attention_bias=True, sample_size=8, patch_size=2, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
        caption_channels=24, video_length=2,
    ),
    inputs=_latte_inputs,
    lists=("transformer_blocks", "temporal_transformer_blocks"),
)


# AuraFlow: 8x8 latent, patch 2 -> 16 tokens (pos_embed_max_size 16 = a 4x4 grid); 2 joint (MMDiT) blocks, then 3
# single blocks. caption_projection_dim must equal the inner dim (2 x 16); 8 register tokens are prepended to the text.
def _auraflow_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "timestep": torch.tensor([0.5]),
    }


AURAFLOW = DiT(
    name="auraflow",
    cls_name="AuraFlowTransformer2DModel",
    config=dict(
        sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=2, num_single_dit_layers=3,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=32,
        out_channels=4, pos_embed_max_size=16,
    ),
    inputs=_auraflow_inputs,
    lists=("joint_transformer_blocks", "single_transformer_blocks"),
)


# EasyAnimate (V5.1 layout): 2 frames of a 4x4 latent, patch 2; blocks 0-1 are MMDiT blocks (own text FFN), block 2 a
# plain one (mmdit_layers=2). The output is unpatchified with the INPUT channel count, so out_channels == in_channels.
def _easyanimate_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 2, 4, 4),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
    }


EASYANIMATE = DiT(
    name="easyanimate",
    cls_name="EasyAnimateTransformer3DModel",
    config=dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, patch_size=2, sample_width=4,
        sample_height=4, num_layers=3, mmdit_layers=2, time_embed_dim=16, text_embed_dim=16,
    ),
    inputs=_easyanimate_inputs,
    lists=("transformer_blocks",),
)


# Sana-Video: 2 frames of a 4x4 latent, patch (1, 2, 2); linear self-attention + cross-attention + temporal GLUMB
# conv. cross_attention_dim must equal the inner dim (the caption is projected to it).
def _sana_video_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 2, 4, 4),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "timestep": torch.tensor([500.0]),
        "encoder_attention_mask": _mask(8, 6),
    }


SANA_VIDEO = DiT(
    name="sana_video",
    cls_name="SanaVideoTransformer3DModel",
    config=dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=3,
        num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=24,
        mlp_ratio=2.0, sample_size=4, patch_size=(1, 2, 2), rope_max_seq_len=32,
    ),
    inputs=_sana_video_inputs,
    lists=("transformer_blocks",),
)


# LongCat-Image: Flux-like packed latents (16 channels), 4x4 token grid; ids as its pipeline makes them (text
# modality 0 on the diagonal, image modality 1 offset past the text).
def _longcat_image_inputs(g):
    txt_ids = torch.zeros(8, 3)
    txt_ids[:, 1] = torch.arange(8)
    txt_ids[:, 2] = torch.arange(8)
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "timestep": torch.tensor([0.5]),
        "img_ids": _flux_ids(4, 4, modality=1.0, offset=8.0),
        "txt_ids": txt_ids,
    }


LONGCAT_IMAGE = DiT(
    name="longcat_image",
    cls_name="LongCatImageTransformer2DModel",
    config=dict(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=24, axes_dims_rope=(4, 6, 6),
    ),
    inputs=_longcat_image_inputs,
    lists=("transformer_blocks", "single_transformer_blocks"),
)


# Ovis-Image: Flux-like packed latents (16 channels), 4x4 token grid, 2D ids.
OVIS_IMAGE = DiT(
    name="ovis_image",
    cls_name="OvisImageTransformer2DModel",
    config=dict(
        patch_size=1, in_channels=16, out_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6),
    ),
    inputs=_chroma_inputs,  # the same Flux-style inputs
    lists=("transformer_blocks", "single_transformer_blocks"),
)


# HunyuanImage-2.1 (guidance-distilled layout): 4x4 latent, patch (1, 1); 2 dual-stream then 3 single-stream blocks.
# The 2 refiner blocks sit inside context_embedder.token_refiner. No ByT5 input (text_embed_2_dim=None): its projection
# has a fixed 2048-wide hidden layer (~4.2M parameters).
def _hunyuanimage_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 4, 4),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "encoder_attention_mask": _mask(8, 6),
        "guidance": torch.tensor([3500.0]),
    }


HUNYUANIMAGE = DiT(
    name="hunyuanimage",
    cls_name="HunyuanImageTransformer2DModel",
    config=dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_single_layers=3, num_refiner_layers=2, mlp_ratio=2.0, patch_size=(1, 1), guidance_embeds=True,
        text_embed_dim=16, rope_axes_dim=(8, 8),
    ),
    inputs=_hunyuanimage_inputs,
    lists=("transformer_blocks", "single_transformer_blocks"),
)


# ChronoEdit: Wan-style, 2 latent frames (its RoPE takes the "temporal skip" path for exactly 2 frames).
# attention_head_dim 12 keeps the RoPE split (head_dim - 2 * (head_dim // 3), head_dim // 3, head_dim // 3) aligned
# with how the frequencies were built. Text-only: the image path (image_dim + added_kv_proj_dim) hard-codes 512 text
# tokens in the attention processor.
CHRONOEDIT = DiT(
    name="chronoedit",
    cls_name="ChronoEditTransformer3DModel",
    config=dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3, rope_max_seq_len=32,
    ),
    inputs=_skyreels_v2_inputs,  # the same Wan-style inputs
    lists=("blocks",),
)


# Wan-Animate: 2 latent frames (reference frame + 1), 4 latent channels -> in_channels 2 * 4 + 4 = 12; 1 pose frame;
# 1 face frame of 8x8 pixels (motion encoder size 8: one res block down to 4x4, then a 4x4 conv). 4 main blocks, a face
# adapter after blocks 0 and 2 (inject_face_latents_blocks=2), so the two lists INTERLEAVE:
# blocks.0, face_adapter.0, blocks.1, blocks.2, face_adapter.1, blocks.3. CLIP image tokens are concatenated to the
# text (added_kv_proj_dim=None; with it set the processor hard-codes 512 text tokens).
def _wan_animate_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 12, 2, 4, 4),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "encoder_hidden_states_image": _randn(g, 1, 4, 16),
        "pose_hidden_states": _randn(g, 1, 4, 1, 4, 4),
        "face_pixel_values": _randn(g, 1, 3, 1, 8, 8),
    }


WAN_ANIMATE = DiT(
    name="wan_animate",
    cls_name="WanAnimateTransformer3DModel",
    config=dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=12, latent_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=4, image_dim=16, rope_max_seq_len=32,
        motion_encoder_channel_sizes={"4": 8, "8": 8}, motion_encoder_size=8, motion_style_dim=16, motion_dim=4,
        motion_encoder_dim=16, face_encoder_hidden_dim=8, face_encoder_num_heads=2, inject_face_latents_blocks=2,
    ),
    inputs=_wan_animate_inputs,
    # Interleaved (see above): blocks.0 runs first.
    lists=("blocks", "face_adapter"),
)


# HunyuanVideo-FramePack: the forward needs the clean / 2x / 4x history latents and their frame indices (it reads
# them unconditionally) and image_embeds. 1 latent frame of 8x8 (patch 2 -> 16 tokens); history: 2 clean frames
# (16 tokens each), 2 frames at 2x (4 tokens), 4 frames at 4x (1 token). Indices follow the pipeline's layout
# [prefix, 4x, 2x, 1x, latents] = [0, 1-4, 5-6, 7, 8].
def _framepack_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 4, 1, 8, 8),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": _randn(g, 1, 8, 16),
        "encoder_attention_mask": _mask(8, 6),
        "pooled_projections": _randn(g, 1, 8),
        "image_embeds": _randn(g, 1, 4, 16),
        "indices_latents": torch.tensor([8]),
        "guidance": torch.tensor([10000.0]),
        "latents_clean": _randn(g, 1, 4, 2, 8, 8),
        "indices_latents_clean": torch.tensor([0, 7]),
        "latents_history_2x": _randn(g, 1, 4, 2, 8, 8),
        "indices_latents_history_2x": torch.tensor([5, 6]),
        "latents_history_4x": _randn(g, 1, 4, 4, 8, 8),
        "indices_latents_history_4x": torch.tensor([1, 2, 3, 4]),
    }


FRAMEPACK = DiT(
    name="hunyuan_video_framepack",
    cls_name="HunyuanVideoFramepackTransformer3DModel",
    config=dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_single_layers=3, num_refiner_layers=2, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(4, 6, 6),
        has_image_proj=True, image_proj_dim=16, has_clean_x_embedder=True,
    ),
    inputs=_framepack_inputs,
    lists=("transformer_blocks", "single_transformer_blocks"),
)


# Qwen-Image 2.1: single-stream, one joint text+image sequence with block-causal attention (default SDPA processor,
# per-segment prefill). Text-to-image: 8 text tokens then the target image's 4 VLM slots (each slot = 2x2 latent
# tokens) -> a 4x4 target grid, 16 latent tokens; the last 2 text tokens padded. The output covers the whole joint
# sequence (8 + 16 tokens).
def _qwenimage21_inputs(g):
    return {
        "hidden_states": _randn(g, 1, 16, 16),
        "encoder_hidden_states": _randn(g, 1, 8, 24),
        "timestep": torch.tensor([0.5]),
        "img_shapes": [[(1, 4, 4)]],
        "img_mask": torch.tensor([[False] * 8 + [True] * 4]),
        "encoder_hidden_states_mask": _mask(8, 6, torch.bool),
    }


QWENIMAGE21 = DiT(
    name="qwenimage21",
    cls_name="QwenImage21Transformer2DModel",
    config=dict(
        patch_size=1, in_channels=16, out_channels=16, num_layers=3, attention_head_dim=16, num_attention_heads=2,
        context_in_dim=24, mlp_ratio=3, axes_dims_rope=(4, 6, 6),
    ),
    inputs=_qwenimage21_inputs,
    lists=("transformer_blocks",),
)


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

SPECS = [WAN, *_VIDEO, CHRONOEDIT, WAN_ANIMATE, ALLEGRO, LTX2, KANDINSKY5, LATTE, EASYANIMATE, SANA_VIDEO, FRAMEPACK,
         FLUX, *_IMAGE, COGVIEW4, COGVIEW3PLUS, BRIA, OMNIGEN, HUNYUAN_DIT, PIXART, AURAFLOW, LONGCAT_IMAGE, OVIS_IMAGE,
         HUNYUANIMAGE, QWENIMAGE21]
BY_NAME = {spec.name: spec for spec in SPECS}
