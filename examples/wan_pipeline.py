"""A diffusers WanPipeline with its transformer offloaded layer by layer, end to end.

The transformer runs under this engine; the text encoder and the VAE are LazyModules that the
release schedule drops right after their last stage (encode -> denoise -> decode), so at most one
large component is loaded at a time besides the offloaded transformer's device slots.

    python examples/wan_pipeline.py --device cpu              # tiny random config, on the host
    python examples/wan_pipeline.py --device cuda --config 1.3b

``--cuda-graph`` (CUDA, ext backend) replays the transformer from a CUDA graph: the first call captures it,
and every later one, both guidance branches of every step, replays it.

``--config 1.3b`` builds the Wan2.1-1.3B transformer and VAE architectures with random bf16 weights
(no checkpoint is downloaded) and a two-layer UMT5 of the real width, so the prompt embeddings have
the transformer's text dimension. ``--check`` also runs the same pipeline fully resident, with the
same seed, and exits non-zero unless the two videos are bit-identical.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fastoffload_ext import LazyModule, run_pipeline
from fastoffload_ext.engine.graph_forward import get_graph_forward
from fastoffload_ext.integrations.diffusers import bound, offload_transformer
from fastoffload_ext.pipeline.schedule import Stage

logger = logging.getLogger("wan_pipeline")

WORDS = ("a", "cat", "dog", "walks", "runs", "on", "the", "beach", "at", "sunset", "in", "snow", "city", "night")


@dataclass(frozen=True)
class WanSizes:
    """The configs of one pipeline size, and the call that suits it."""

    transformer: dict[str, Any]
    text_encoder: dict[str, Any]
    vae: dict[str, Any]
    height: int
    width: int
    num_frames: int
    max_sequence_length: int


TINY = WanSizes(
    transformer=dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                     out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=3, cross_attn_norm=True,
                     qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
    text_encoder=dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8),
    vae=dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]),
    height=16, width=16, num_frames=9, max_sequence_length=16,
)
WAN_1_3B = WanSizes(
    transformer=dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                     out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                     qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
    text_encoder=dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=2, num_heads=64, relative_attention_num_buckets=32),
    vae=dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True]),
    height=480, width=832, num_frames=33, max_sequence_length=512,
)
SIZES = {"tiny": TINY, "1.3b": WAN_1_3B}


def make_tokenizer() -> Any:
    """A word-level tokenizer built here (no download): the pipeline only needs ids and a mask."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{word: i + 3 for i, word in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def loaders(sizes: WanSizes, dtype: torch.dtype, seed: int, device: str) -> dict[str, Callable[[], Any]]:
    """Zero-argument builders, each seeded on its own so every build of a component is the same."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    def build(make: Callable[[], torch.nn.Module], offset: int, to_device: bool = True,
              cast: bool = True) -> torch.nn.Module:
        torch.manual_seed(seed + offset)
        module = make()
        if cast and dtype != torch.float32:
            module = module.to(dtype)  # random weights: diffusers' float32-module advice does not apply
        module = module.eval().requires_grad_(False)
        return module.to(device) if to_device else module

    vocab = len(WORDS) + 3
    return {
        "text_encoder": lambda: build(lambda: UMT5EncoderModel(UMT5Config(vocab_size=vocab, **sizes.text_encoder)), 1),
        # The transformer stays on the host: enable_layerwise_offload streams its blocks.
        "transformer": lambda: build(lambda: WanTransformer3DModel(**sizes.transformer), 2, to_device=False),
        # The VAE runs in float32, as Wan's pipelines load it.
        "vae": lambda: build(lambda: AutoencoderKLWan(**sizes.vae), 3, cast=False),
    }


def make_pipeline(sizes: WanSizes, transformer: torch.nn.Module, text_encoder: Any = None, vae: Any = None) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    pipe = WanPipeline(tokenizer=make_tokenizer(), text_encoder=text_encoder, transformer=transformer, vae=vae,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    pipe.set_progress_bar_config(disable=True)
    if vae is None:
        # WanPipeline reads these from the VAE it is given; the lazy one must not be loaded for them.
        downsample = sizes.vae["temperal_downsample"]
        pipe.vae_scale_factor_temporal = 2 ** sum(downsample)
        pipe.vae_scale_factor_spatial = 2 ** len(downsample)
        pipe.video_processor.config.vae_scale_factor = pipe.vae_scale_factor_spatial
    return pipe


def call_arguments(sizes: WanSizes, steps: int, seed: int) -> dict[str, Any]:
    return dict(prompt="a cat walks on the beach at sunset", negative_prompt="snow", height=sizes.height,
                width=sizes.width, num_frames=sizes.num_frames, num_inference_steps=steps, guidance_scale=5.0,
                max_sequence_length=sizes.max_sequence_length, generator=torch.Generator().manual_seed(seed),
                output_type="pt")


def decode(pipe: Any, latents: torch.Tensor, output_type: str) -> torch.Tensor:
    """WanPipeline's own decode step, with the VAE of this stage."""
    vae = pipe.vae
    device = next(vae.parameters()).device
    latents = latents.to(device, dtype=vae.dtype)
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
    video = vae.decode(latents / inverse_std + mean, return_dict=False)[0]
    return pipe.video_processor.postprocess_video(video, output_type=output_type)


def run_offloaded(pipe: Any, components: Mapping[str, Any], arguments: dict[str, Any], device: str) -> torch.Tensor:
    """encode -> denoise -> decode, each lazy component released right after its stage."""
    call = dict(arguments)
    output_type = call.pop("output_type")

    def encode(_: Any, c: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        with bound(pipe, "text_encoder", c["text_encoder"]):
            return pipe.encode_prompt(call["prompt"], call["negative_prompt"], do_classifier_free_guidance=True,
                                      max_sequence_length=call["max_sequence_length"], device=torch.device(device))

    def denoise(embeddings: tuple[torch.Tensor, torch.Tensor], c: Mapping[str, Any]) -> torch.Tensor:
        rest = {k: v for k, v in call.items() if k not in ("prompt", "negative_prompt")}
        return pipe(prompt_embeds=embeddings[0], negative_prompt_embeds=embeddings[1], output_type="latent",
                    **rest).frames

    def decode_stage(latents: torch.Tensor, c: Mapping[str, Any]) -> torch.Tensor:
        with bound(pipe, "vae", c["vae"]):
            return decode(pipe, latents, output_type)

    stages = [Stage("encode", ["text_encoder"], encode), Stage("denoise", ["transformer"], denoise),
              Stage("decode", ["vae"], decode_stage)]
    return run_pipeline(stages, components, keep=("transformer",))


def run(device: str, config: str, steps: int, seed: int, backend: str, check: bool, cuda_graph: bool = False) -> int:
    sizes = SIZES[config]
    dtype = torch.float32 if config == "tiny" else torch.bfloat16
    build = loaders(sizes, dtype, seed, device)
    transformer = build["transformer"]()
    pipe = make_pipeline(sizes, transformer)
    groups = offload_transformer(pipe, device=device, backend=backend, cuda_graph=cuda_graph)
    components = {"text_encoder": LazyModule("text_encoder", build["text_encoder"]), "transformer": transformer,
                  "vae": LazyModule("vae", build["vae"])}
    start = time.perf_counter()
    with torch.inference_mode():
        video = run_offloaded(pipe, components, call_arguments(sizes, steps, seed), device)
    elapsed = time.perf_counter() - start
    stats = groups["transformer"].stats()
    print(f"offloaded: video {tuple(video.shape)} in {elapsed:.2f} s; {stats['offloaded_blocks']} blocks by "
          f"backend {stats['backend']} on {stats['device']}; text_encoder loaded after the run: "
          f"{components['text_encoder'].is_materialized}, vae: {components['vae'].is_materialized}")
    graphed = get_graph_forward(transformer)
    if graphed is not None:
        print(f"CUDA graphs: {graphed.stats()}")
    if not check:
        return 0
    resident = make_pipeline(sizes, build["transformer"]().to(device), build["text_encoder"](), build["vae"]())
    with torch.inference_mode():
        expected = resident(**call_arguments(sizes, steps, seed)).frames
    same = torch.equal(video.cpu(), expected.cpu())
    print(f"resident: video {tuple(expected.shape)}; bit-exact: {same}")
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="offload device: cuda, cuda:N or cpu")
    parser.add_argument("--config", choices=sorted(SIZES), default=None,
                        help="model sizes (default: tiny on cpu, 1.3b otherwise)")
    parser.add_argument("--steps", type=int, default=2, help="denoising steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("auto", "ext", "python"), default="auto")
    parser.add_argument("--check", action="store_true", help="compare with the resident pipeline, bit for bit")
    parser.add_argument("--cuda-graph", action="store_true", help="replay the transformer from CUDA graphs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    config = args.config or ("tiny" if args.device == "cpu" else "1.3b")
    return run(args.device, config, args.steps, args.seed, args.backend, args.check, args.cuda_graph)


if __name__ == "__main__":
    sys.exit(main())
