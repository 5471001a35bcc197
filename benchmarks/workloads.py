"""The benchmark vocabulary of docs/DESIGN.md ("Workloads and targets"), and one third-party architecture.

``Block(d, n_norms)`` and W1..W4 are exactly the table in docs/DESIGN.md, "Workloads and targets" (bf16, batch 1); their weight
sizes are checked against the table below (3.38 / 3.38 / 1.52 / 3.00 GiB). The third-party model is a
``transformers`` LlamaModel with a small random config (no download): its ``layers`` ModuleList is the
first direct-child ModuleList, which is what ``enable_layerwise_offload`` hooks.

Weights are random but deliberately *not* default-initialised: every LayerNorm weight and bias and
every Linear bias is perturbed, so a parameter that an engine forgets to copy, or copies into the wrong
slot, changes the output and fails the bit-identity column. Initialising on the GPU and copying to the
host takes a fraction of a second for 3.4 GiB, where CPU init takes tens of seconds on a small host.

Without a GPU the same workloads exist in a scaled-down form (``*-cpu``) that keeps their shape
(block count, norms per block, param count per block) at a size a 2-core machine runs in seconds.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.utils import GiB, try_import

DTYPE = torch.bfloat16


class Block(nn.Module):
    """The DiT-like block of docs/DESIGN.md, "Workloads and targets": attention-shaped and MLP-shaped Linears plus ``n_norms`` LayerNorms."""

    def __init__(self, d: int, n_norms: int) -> None:
        super().__init__()
        if n_norms < 2:
            raise ValueError(f"Block needs n_norms >= 2 (forward uses norms[0] and norms[1]), got {n_norms}")
        self.d = d
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_norms))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.o(self.qkv(self.norms[0](x))[..., : self.d])
        x = x + h
        x = x + self.down(F.gelu(self.up(self.norms[1](x))))
        return x


class BlockStack(nn.Module):
    """The benchmark model: the ModuleList of blocks, so every weight is offloadable.

    ``projections=True`` adds an input and an output Linear around the list: the transformer shape the
    tests and the soak use, where modules outside the block list are the caller's to place.
    """

    def __init__(self, d: int, num_blocks: int, n_norms: int, *, projections: bool = False) -> None:
        super().__init__()
        # Created in forward order (proj_in, blocks, proj_out): a seeded model gets the same weights.
        self.proj_in = nn.Linear(d, d) if projections else None
        self.blocks = nn.ModuleList(Block(d, n_norms) for _ in range(num_blocks))
        self.proj_out = nn.Linear(d, d) if projections else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.proj_in is not None:
            x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return x if self.proj_out is None else self.proj_out(x)


@dataclasses.dataclass(frozen=True)
class StackSpec:
    name: str
    d: int
    blocks: int
    tokens: int
    n_norms: int
    character: str
    table_gib: float | None = None  # the weight column of docs/DESIGN.md, "Workloads and targets", checked by tests of this module

    def weight_bytes(self, dtype: torch.dtype = DTYPE) -> int:
        d = self.d
        per_block = (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d) + self.n_norms * 2 * d
        return per_block * self.blocks * torch.empty((), dtype=dtype).element_size()

    def params_per_block(self) -> int:
        return 8 + 2 * self.n_norms


# docs/DESIGN.md, "Workloads and targets", exactly.
WORKLOADS: dict[str, StackSpec] = {
    "W1": StackSpec("W1", d=3072, blocks=16, tokens=256, n_norms=4, character="transfer-bound", table_gib=3.38),
    "W2": StackSpec("W2", d=3072, blocks=16, tokens=16384, n_norms=4, character="compute-bound", table_gib=3.38),
    "W3": StackSpec("W3", d=1024, blocks=64, tokens=256, n_norms=64, character="many-small-params", table_gib=1.52),
    "W4": StackSpec("W4", d=4096, blocks=8, tokens=4096, n_norms=4, character="large blocks", table_gib=3.00),
}

# Same shapes (block count, params per block), sizes a 2-core host without a GPU runs in seconds.
CPU_WORKLOADS: dict[str, StackSpec] = {
    "W1": StackSpec("W1-cpu", d=256, blocks=16, tokens=32, n_norms=4, character="transfer-bound (scaled)"),
    "W2": StackSpec("W2-cpu", d=256, blocks=16, tokens=512, n_norms=4, character="compute-bound (scaled)"),
    "W3": StackSpec("W3-cpu", d=64, blocks=64, tokens=32, n_norms=64, character="many-small-params (scaled)"),
    "W4": StackSpec("W4-cpu", d=384, blocks=8, tokens=64, n_norms=4, character="large blocks (scaled)"),
}

# (reference, factor): the engine's forward must be <= factor x reference (docs/DESIGN.md, "Workloads and targets").
TARGETS: dict[str, tuple[str, float]] = {
    "W1": ("floor", 1.03),
    "W2": ("resident", 1.02),
    "W3": ("floor", 1.10),
    "W4": ("floor", 1.03),
}


def init_weights_(model: nn.Module, seed: int) -> nn.Module:
    """Deterministic random weights on whatever device the model is on (see the module docstring)."""
    generator_device = next(model.parameters()).device
    generator = torch.Generator(device=generator_device)
    generator.manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, 0.02, generator=generator)
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.02, generator=generator)
            elif isinstance(module, nn.LayerNorm):
                module.weight.normal_(1.0, 0.1, generator=generator)
                module.bias.normal_(0.0, 0.1, generator=generator)
    return model


def build_stack(spec: StackSpec, device: torch.device | str, *, seed: int = 0,
                dtype: torch.dtype = DTYPE, cls: type[BlockStack] = BlockStack) -> BlockStack:
    """Allocate without CPU init (meta, then to_empty) and fill deterministically on ``device``; ``cls``: a
    subclass of :class:`BlockStack` with the same parameters (the models section calls it by keyword)."""
    with torch.device("meta"):
        model = cls(spec.d, spec.blocks, spec.n_norms).to(dtype)  # free on meta: no fp32 copy is ever made
    model = model.to_empty(device=device)
    init_weights_(model, seed)
    return model.eval()


def build_stack_on_host(spec: StackSpec, *, seed: int = 0, init_device: torch.device | str | None = None) -> BlockStack:
    """A host (pageable) copy of the workload, initialised on the GPU when there is one (much faster)."""
    if init_device is None:
        init_device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_stack(spec, init_device, seed=seed)
    if torch.device(init_device).type != "cpu":
        model = model.to("cpu")
        torch.cuda.empty_cache()
    return model


# --------------------------------------------------------------------------------------------------
# Uniform workload objects for the forward / startup sections
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Workload:
    """Everything a section needs to run one model: build it, feed it, read its output, find its blocks."""

    name: str
    character: str
    build_host: Callable[[], nn.Module]                      # a fresh host copy with the workload's weights
    make_inputs: Callable[[torch.device], tuple[tuple, dict]]  # built outside the timed region
    output: Callable[[Any], torch.Tensor]
    target: tuple[str, float] | None
    info: dict[str, Any]

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        return first_module_list(model)


def first_module_list(model: nn.Module) -> nn.ModuleList:
    for child in model.children():
        if isinstance(child, nn.ModuleList):
            return child
    raise ValueError(f"{type(model).__name__} has no direct-child nn.ModuleList")


def move_non_block_modules(model: nn.Module, device: torch.device) -> None:
    """Everything but the offloaded ModuleList goes to the device: that is the caller's job by contract."""
    move_all_but(model, device, [first_module_list(model)])


def move_all_but(model: nn.Module, device: torch.device, kept: list[nn.Module]) -> None:
    """``model``'s direct children other than ``kept``, and its own parameters and buffers, to ``device``."""
    for child in model.children():
        if all(child is not k for k in kept):
            child.to(device)
    for param in model._parameters.values():
        if param is not None:
            param.data = param.data.to(device)
    for name, buffer in list(model._buffers.items()):
        if buffer is not None:
            model._buffers[name] = buffer.to(device)


def stack_workload(key: str, cpu: bool) -> Workload:
    spec = (CPU_WORKLOADS if cpu else WORKLOADS)[key]
    seed = int(key[1:])
    # Weights depend on the shape only, so W1 and W2 (same stack, other token count) share one host
    # master in the forward section instead of building 3.4 GiB twice.
    weight_seed = 1

    def make_inputs(device: torch.device) -> tuple[tuple, dict]:
        generator = torch.Generator(device=device)
        generator.manual_seed(1000 + seed)
        x = torch.randn(1, spec.tokens, spec.d, device=device, dtype=DTYPE, generator=generator)
        return (x,), {}

    return Workload(
        name=spec.name,
        character=spec.character,
        build_host=lambda: build_stack_on_host(spec, seed=weight_seed),
        make_inputs=make_inputs,
        output=lambda out: out,
        target=TARGETS[key],
        info={"cache_key": f"stack-{spec.d}-{spec.blocks}-{spec.n_norms}-{weight_seed}",
              "d": spec.d, "blocks": spec.blocks, "tokens": spec.tokens, "n_norms": spec.n_norms,
              "params_per_block": spec.params_per_block(), "weight_bytes": spec.weight_bytes(),
              "weight_gib": spec.weight_bytes() / GiB},
    )


LLAMA_CONFIGS: dict[str, dict[str, Any]] = {
    # ~1.4 GiB of bf16 block weights: 16 decoder layers of a 1B-class Llama with GQA.
    "full": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096, tokens=512),
    "quick": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096, tokens=512),
    "cpu": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, tokens=32),
}


def llama_workload(size: str) -> tuple[Workload | None, str]:
    """The transformers LlamaModel workload, or (None, why it cannot run here)."""
    transformers, reason = try_import("transformers")
    if transformers is None:
        return None, reason
    try:
        from transformers import LlamaConfig, LlamaModel
    except Exception as error:
        return None, f"transformers {transformers.__version__} has no LlamaModel: {error}"
    settings = dict(LLAMA_CONFIGS[size])
    tokens = settings.pop("tokens")

    def build_host() -> nn.Module:
        config = LlamaConfig(**settings)
        try:
            config._attn_implementation = "sdpa"
        except Exception:
            pass
        init_device = "cuda" if torch.cuda.is_available() else "cpu"
        torch.manual_seed(7)
        with torch.device(init_device):
            model = LlamaModel(config)
        # Parameters in bf16; the rotary buffers stay fp32 as transformers keeps them when loading.
        for param in model.parameters():
            param.data = param.data.to(DTYPE)
        init_weights_(model, 7)
        if init_device != "cpu":
            model = model.to("cpu")
            torch.cuda.empty_cache()
        return model.eval()

    def make_inputs(device: torch.device) -> tuple[tuple, dict]:
        generator = torch.Generator(device=device)
        generator.manual_seed(77)
        ids = torch.randint(0, settings["vocab_size"], (1, tokens), device=device, generator=generator)
        return (), {"input_ids": ids, "use_cache": False}

    def output(out: Any) -> torch.Tensor:
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    layer_params = (settings["hidden_size"] ** 2 * 2
                    + 2 * settings["hidden_size"] * settings["hidden_size"] * settings["num_key_value_heads"]
                    // settings["num_attention_heads"]
                    + 3 * settings["hidden_size"] * settings["intermediate_size"] + 2 * settings["hidden_size"])
    block_bytes = layer_params * settings["num_hidden_layers"] * 2
    return Workload(
        name=f"Llama-{settings['num_hidden_layers']}L-{settings['hidden_size']}",
        character=f"transformers {transformers.__version__} LlamaModel, random weights",
        build_host=build_host,
        make_inputs=make_inputs,
        output=output,
        target=None,
        info={"hidden_size": settings["hidden_size"], "layers": settings["num_hidden_layers"], "tokens": tokens,
              "weight_bytes": block_bytes, "weight_gib": block_bytes / GiB, "params_per_block": 9},
    ), ""
