"""A Flux transformer served from its checkpoint: both block lists offloaded, the blocks beyond a host budget read
from disk every step.

The model is built with empty weights (nothing is allocated for its parameters) and ``enable_layerwise_offload``
fills it from the safetensors folder: the blocks that fit ``--host-budget`` are read once into pinned host memory,
the others stay on disk and stream through a small pinned staging ring every step, and everything outside the
blocks is read onto the device. So a transformer larger than the host's RAM runs.

    python examples/flux_from_disk.py --device cpu --check          # tiny random Flux, written to a temp folder
    python examples/flux_from_disk.py --device cuda --config flux --host-budget 50%
    python examples/flux_from_disk.py --device cuda --weights /models/FLUX.1-dev/transformer --host-budget 24GiB

``--config flux`` writes FLUX.1's architecture (19 double-stream and 38 single-stream blocks, about 24 GB in bf16)
with random weights into ``--folder`` first, once; ``--layers D,S`` cuts the lists. ``--weights`` takes a diffusers
transformer folder as it is. ``--host-budget`` is bytes, a size ("24GiB"), a share of the blocks' bytes ("50%":
that share in host memory, plus the staging ring) or "auto" (what this process may use). ``--device-budget`` lets the planner keep blocks on the device, counting the disk tier's reads (each block kept
resident is one read less per step). ``--check`` also runs the saved model fully resident and exits non-zero
unless the outputs are bit-identical.
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload
from fastoffload_ext.planning import format_bytes, parse_size
from fastoffload_ext.planning.tiers import STAGING_SLACK
from fastoffload_ext.storage import DiskOptions

logger = logging.getLogger("flux_from_disk")

CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(patch_size=1, in_channels=4, num_layers=3, num_single_layers=6, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),
    "flux": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                 axes_dims_rope=(16, 56, 56)),
}


def flux_class() -> Any:
    from diffusers import FluxTransformer2DModel
    return FluxTransformer2DModel


def write_random(config: dict[str, Any], folder: Path, dtype: torch.dtype, seed: int) -> Path:
    """A transformer folder (config.json and safetensors) with seeded random weights, written once."""
    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    model = torch.nn.Module.to(flux_class()(**config), dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():  # Flux zero-initialises some output layers
            param.copy_(torch.randn(param.shape, generator=generator).to(dtype) * 0.05)
    model.save_pretrained(folder)
    return folder


DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def checkpoint_dtype(folder: Path) -> torch.dtype:
    """The dtype the folder's weights are stored in (its first tensor's, from the safetensors header)."""
    from safetensors import safe_open

    first = sorted(folder.glob("*.safetensors"))[0]
    with safe_open(str(first), framework="pt") as handle:
        return DTYPES[handle.get_slice(next(iter(handle.keys()))).get_dtype()]


def empty_model(folder: Path) -> torch.nn.Module:
    """The folder's architecture in its stored dtype, parameters on the meta device (accelerate's
    init_empty_weights, which leaves buffers and computed tables real)."""
    from accelerate import init_empty_weights

    cls = flux_class()
    with init_empty_weights():
        model = cls.from_config(cls.load_config(folder))
    return torch.nn.Module.to(model, checkpoint_dtype(folder))  # every parameter in the stored dtype, as saved


def block_bytes(model: torch.nn.Module) -> int:
    lists = (model.transformer_blocks, model.single_transformer_blocks)
    return sum(p.numel() * p.element_size() for blocks in lists for block in blocks for p in block.parameters())


def host_budget(value: str, model: torch.nn.Module, staging_buffers: int) -> Any:
    """``--host-budget``; a share is of the blocks' bytes, with the staging ring on top."""
    if value.endswith("%"):
        largest = max(sum(p.numel() * p.element_size() for p in block.parameters())
                      for blocks in (model.transformer_blocks, model.single_transformer_blocks) for block in blocks)
        return int(float(value[:-1]) / 100 * block_bytes(model)) + staging_buffers * (largest + STAGING_SLACK)
    return value if value == "auto" else parse_size(value, "--host-budget")


def device_budget(value: str | None, model: torch.nn.Module) -> Any:
    """``--device-budget``; a share is of the blocks' bytes, with what the model holds outside them on top."""
    if value is None or not value.endswith("%"):
        return value
    outside = sum(p.numel() * p.element_size() for p in model.parameters()) - block_bytes(model)
    return int(float(value[:-1]) / 100 * block_bytes(model)) + outside


def inputs(config: dict[str, Any], device: str, dtype: torch.dtype, tokens: int, seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    text = 8
    made = dict(hidden_states=torch.randn(1, tokens, config["in_channels"], generator=generator).to(dtype),
                encoder_hidden_states=torch.randn(1, text, config["joint_attention_dim"], generator=generator).to(dtype),
                pooled_projections=torch.randn(1, config["pooled_projection_dim"], generator=generator).to(dtype),
                timestep=torch.tensor([0.5], dtype=dtype), img_ids=torch.randn(tokens, 3, generator=generator),
                txt_ids=torch.zeros(text, 3))
    if config.get("guidance_embeds"):
        made["guidance"] = torch.tensor([3.5], dtype=dtype)
    return {name: tensor.to(device) for name, tensor in made.items()}


def run(args: argparse.Namespace) -> int:
    if args.weights is not None:
        folder = Path(args.weights)
    else:
        config = dict(CONFIGS[args.config])
        if args.layers:
            config["num_layers"], config["num_single_layers"] = (int(n) for n in args.layers.split(","))
        base = Path(args.folder) if args.folder else Path(tempfile.mkdtemp(prefix="flux_from_disk_"))
        folder = write_random(config, base / f"{args.config}-{config['num_layers']}-{config['num_single_layers']}",
                              torch.bfloat16, args.seed)
    model = empty_model(folder).eval()
    dtype = checkpoint_dtype(folder)
    config = dict(model.config)
    weights = block_bytes(model)
    options = DiskOptions()
    started = time.perf_counter()
    group = enable_layerwise_offload(model, device=args.device, weights=folder, block_lists="all",
                                     host_budget=host_budget(args.host_budget, model, options.staging_buffers),
                                     device_budget=device_budget(args.device_budget, model), disk_options=options)
    enable_s = time.perf_counter() - started
    stats = group.stats()
    print(f"enabled in {enable_s:.2f} s: {group!r}")
    if group.plan is not None:
        print(f"plan: {group.plan.why}")
    print(f"blocks {len(group.states)} ({', '.join(group.list_names)}), {stats['disk_blocks']} on disk; "
          f"{format_bytes(stats['host_bytes'])} of the {format_bytes(weights)} of block weights in host memory, "
          f"staging {format_bytes(stats['staging_bytes'])}")
    kwargs = inputs(config, args.device, dtype, args.tokens, args.seed)
    with torch.inference_mode():
        outputs = []
        for step in range(args.steps):
            started = time.perf_counter()
            outputs.append(model(**kwargs, return_dict=False)[0].float().cpu())
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            print(f"step {step}: {1e3 * (time.perf_counter() - started):.1f} ms")
    stats = group.stats()
    print(f"disk reads {stats.get('disk_reads', 0)}, of them on demand {stats.get('disk_reads_on_demand', 0)}, "
          f"run order {stats['run_order']}")
    disable_layerwise_offload(model, device="meta")
    code = 0
    if args.check:
        resident = flux_class().from_pretrained(folder, torch_dtype=dtype).to(args.device).eval()
        with torch.inference_mode():
            started = time.perf_counter()
            expected = resident(**kwargs, return_dict=False)[0].float().cpu()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
        print(f"resident step: {1e3 * (time.perf_counter() - started):.1f} ms (the first, unwarmed)")
        exact = all(torch.equal(output, expected) for output in outputs)
        print(f"bit-exact: {exact}")
        code = 0 if exact else 1
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="offload device: cuda, cuda:N or cpu")
    parser.add_argument("--config", choices=sorted(CONFIGS), default=None,
                        help="architecture written with random weights (default: tiny on cpu, flux otherwise)")
    parser.add_argument("--layers", default=None, help="D,S: double- and single-stream blocks of --config")
    parser.add_argument("--weights", default=None, help="a diffusers Flux transformer folder to serve as it is")
    parser.add_argument("--folder", default=None, help="where --config writes its checkpoint (default: a temp folder)")
    parser.add_argument("--host-budget", default="50%", help='bytes, a size ("24GiB"), a share ("50%%") or "auto"')
    parser.add_argument("--device-budget", default=None,
                        help='device memory for weights, slots and activations: a size ("20GiB"), a share of the '
                             'blocks\' bytes ("50%%": that share resident, plus the rest of the model) or "auto"; '
                             'the planner keeps blocks resident knowing which ones the disk tier reads')
    parser.add_argument("--tokens", type=int, default=None, help="image tokens (default: 16 tiny, 1024 otherwise)")
    parser.add_argument("--steps", type=int, default=3, help="forwards to run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="compare with the resident model, bit for bit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    args.config = args.config or ("tiny" if args.device == "cpu" else "flux")
    args.tokens = args.tokens or (16 if args.config == "tiny" and args.weights is None else 1024)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
