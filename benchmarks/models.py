"""Section models: real DiT architectures from diffusers, offloaded, against resident and the peers.

Models (diffusers classes with their published configurations and random bf16 weights; nothing is
downloaded): ``WanTransformer3DModel`` at the Wan2.1 1.3B and 14B sizes (``blocks``), and
``FluxTransformer2DModel`` at FLUX.1 size (19 double-stream ``transformer_blocks``, then 38
``single_transformer_blocks``). Each runs at token counts where copying the blocks takes longer than
computing them (transfer-bound), where the two are close (balanced), and for Wan-1.3B one between
(mid, 4096 tokens); the ``compute/copy`` column of each floor row (resident time / that configuration's
copy time) says which a row is on this machine.

Like for like: on a model with several block lists ext runs twice, ``ext`` with default settings
(FastVideo's rule: the first list only) and ``ext all lists`` (``block_lists="all"``: every list in
one ring). What each peer offloads is read from where its weights are after its set-up
(``benchmarks/peers.py``), and the peer is compared (``x ext``, ``vs ext``, its ``pass``: that ext is
faster) with the ext configuration that offloads the same lists: FastVideo with ``ext``; SGLang
(one manager per list), diffusers and the rest, which move every list, with ``ext all lists``. Each
offloader has its own floor, max(resident, the bytes it moves / peak H2D): a ``floor`` row per ext
configuration, the peers' in their ``x floor`` column and note.

Schedule bound: with (k+1) slots a copy-bound block's excess copy time cannot hide behind the slack
of a compute-bound block further on, so max(resident, bytes / peak) is out of reach where the blocks
alternate (Flux at 9216 tokens: double-stream blocks copy longer than they compute, single-stream
ones the reverse). ``sched bound ms`` is the best depth-k schedule of the blocks
(``benchmarks/schedule_bound.py``): per-block compute from CUDA events around every block of the
resident model, timed as one more configuration inside the same interleaved rounds, and per-block
copies at peak H2D. ``x sched bound`` is ext against it, round by round; where ext misses the floor
target because the bound itself is above it, the row's note says so, and one more row shows the fix:
ext with every list under the least ``device_budget`` that ``plan_offload``, fed this run's cost table,
predicts at or under the target (``benchmarks/model_budget.py``; after the three strongest peers).

Measurement: host speed drifts between processes and over minutes, so every figure here comes from
interleaved rounds in one process (``benchmarks/interleave.py``). The resident model and the ext
configurations stay alive for the whole model. A first session times them (and the block clock);
each peer is then set up in turn and timed in rounds together with resident and its matching ext
configuration (in rotating order), and its ratios are taken within each round. Every ratio is the
median of the per-round ratios, with the lowest and highest round beside it. Each configuration's turn in a
round is timed as a denoising loop runs it (``benchmarks/steady.py``): a lead forward, then the timed ones back
to back with no wait between them; the lead follows a wait, as a step after a readback does, and ``x floor after
readback`` sets ext's lead against resident's. A peer whose first
forward takes over ``SLOW_PEER_FACTOR`` x its ext's is timed one forward a round.

Rows are written as soon as they are final: ext's after the first session, each peer's when its
session ends, so a run cut short (the command's time limit, SIGTERM) keeps every row measured; the
table shows them per token count (:func:`arrange_rows`).

Memory: a host copy of the 14B model is 28 GB and the GPU machine has 128 GB of RAM, so the section
keeps as few as it can. The master is built on the GPU and *is* the resident model. One host copy
of the whole model is made from it, once (``benchmarks/host_source.py``: a fresh 24 GB pageable copy
takes about 20 s); every ext configuration and every peer gets a device-side copy of the master
rebound to it (what stays resident moves back to the device), and each pins copies of its own. One
peer at a time: a peer's model, hooks and pinned blocks are freed before the next is built. The host
then holds the shared copy, ext's pinned copies (on Flux: the first list, and every list) and one
peer's pinned blocks; during the first session, one more pinned copy of the first list, the CUDA-graph
rows' own, freed before the first peer. Every phase prints a line with the time, host RSS and GPU
memory to stderr (a killed run shows where it was) and the phases go into the notes. Peers are set up strongest first;
the 14B model runs only FastVideo, SGLang and diffusers block (``BENCHMARK_MODEL_PEERS=all`` runs
all on every model, ``BENCHMARK_MODEL_PEERS=mmgp,accelerate`` only those two). The section has
``BENCHMARK_MODELS_BUDGET_S`` seconds (default 360); at each model's start
what is left is split evenly over the models still to run, and a peer starts only while the slowest
peer of that model so far would still finish within the model's share. Skipped peers have rows
saying why. A peer that is not bit-equal gets, in its note, the first traced op where its forward
parts from the resident one (``benchmarks/peer_diff.py``), and torch's numerics switches are
compared and put back around every peer.

``pass`` on an ext row: at most 1.05x its floor, and 1.02x on the host-bound rows named as targets (Flux at
1024 tokens with the first list, Wan-1.3B at 4096: ``ModelSpec.tight``). On a peer's row: its per-round
ratio to ext is above 1. The summary calls a peer tied with ext, not faster, when that ratio's median is
within 2 % below 1 and ext was at least as fast in one of the rounds (``model_rows.peer_verdict``).
Every offloaded output is compared with the resident one bit for bit. ext's peak GPU memory is its own
(the peak during its forwards less what was allocated before its copy existed), against (k+1) x its
largest block + the modules it leaves resident + activations. ``steady reserve MiB`` (on a GPU): what torch's
allocator reserved over a turn's forwards run back to back, above an emptied cache, for resident, ext and every
peer (``utils.steady_reserve``); an offloader's note gives it against the resident model's, in blocks. It counts
what the allocated figure misses: a block freed on the host while the device still uses it, as FastVideo's
prefetch leaves each block it allocated afresh (``record_stream``).

Like for like in memory too: where a peer was faster than its ext in every round (or beyond the tie band), it is
asked what it held. Its footprint (what its set-up left allocated, with the cache emptied, plus its steady
reserve) less the modules both keep resident becomes ext's ``device_budget``; ``plan_offload`` on this run's block
clock picks the resident blocks and depth, and ``ext, <peer>'s memory`` is timed in rounds with resident, ext and
the peer while the peer is still alive (``benchmarks/matched_memory.py``): ``x ext`` is what the memory bought ext,
its note has ``x peer``, and the summary line of that peer gives it.

``BENCHMARK_MODELS=wan-1.3b,flux,wan-14b`` picks the models (default: those three; ``--quick``:
wan-1.3b). ``W1``..``W4`` (``STACK_MODELS``) put the forward section's synthetic workloads through the
same sessions, so that the installed peers run on them too (the forward section measures FastVideo's
algorithm, diffusers and accelerate there); they run only when named. Without a GPU the same models
run at tiny configs on the host (device="cpu"), resident and ext only.

CUDA graphs (on a GPU): the first session also times the resident model and ext with default settings each
captured whole in a CUDA graph and replayed (``benchmarks/graph_rows.py``): ``resident, CUDA graph``, its
``floor, CUDA graph`` and ``ext, CUDA graph``, which shows what ext reaches where an eager forward is bound by the
host. Its ``pass`` uses the same targets, against the graph's floor. ``BENCHMARK_MODELS_GRAPHS=0`` leaves them
out (one skipped row says so), for a run that is after the peers' rows.

The link (on a GPU): the peak H2D that sets every floor is one probe before the section, and the link drifts
between machines and within a run. The first session times one more configuration, a 256 MiB pinned copy
(``benchmarks/link_probe.py``); a note per model gives the link's speed over the rounds against that peak, and
``x floor at round link`` sets each ext and graph row against max(resident, its bytes at that round's link).
Targets stay on the section's floor; the column tells a slow link from a slow offloader.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from benchmarks import graph_rows, matched_memory, model_rows, peer_diff
from benchmarks import peers as peer_setups
from benchmarks.copy_load import CopyLoad
from benchmarks.interleave import Interleaved, Timer, run_interleaved
from benchmarks.link_probe import LinkProbe, describe_link, link_floors
from benchmarks.model_budget import block_costs, least_budget_plan
from benchmarks.model_rows import (EXT_TARGET, TIGHT_TARGET, ExtConfig, bound_figures, floor_row, floors,
                                   matching_config, peer_values, ratio, reserve_values, transfer_ms)
from benchmarks.phases import PhaseLog
from benchmarks.host_source import bind, fingerprint, host_source
from benchmarks.schedule_bound import BlockClock
from benchmarks.steady import SteadyTimer
from benchmarks.utils import (GB, Column, Context, MiB, Table, device_allocated, device_peak, empty_host_cache, free_memory,
                              module_bytes, reset_device_peak, settled_reserved, steady_reserve, try_import)
from benchmarks.workloads import CPU_WORKLOADS, WORKLOADS, BlockStack, StackSpec, build_stack
from fastoffload_ext import enable_layerwise_offload
from fastoffload_ext.planning import OffloadPlan, plan_offload
from fastoffload_ext.planning.memory import probe_host

TITLE = ("models: Wan 1.3B / 14B and Flux (first list, all lists) vs resident and the peers that offload the same "
         "lists, interleaved rounds")

TABLES = {
    "models": Table(
        title="Real architectures (diffusers, random bf16 weights, batch 1, inference_mode): median of round medians; "
              "ratios are medians of per-round ratios [lowest, highest round]",
        columns=[
            Column("model", "model"),
            Column("tokens", "tokens"),
            Column("backend", "backend"),
            Column("ms", "ms", ".2f"),
            Column("spread", "spread", ".1%"),
            Column("x_resident", "x resident", ".3f"),
            Column("x_floor", "x floor", ".3f"),
            Column("range", "[round range]"),
            Column("x_loaded_floor", "x floor w/ copies", ".3f"),
            Column("x_link_floor", "x floor at round link", ".3f"),
            Column("x_floor_readback", "x floor after readback", ".3f"),
            Column("x_ext", "x ext", ".2f"),
            Column("x_ext_range", "[x ext range]"),
            Column("vs_ext", "vs ext"),
            Column("bound_ms", "sched bound ms", ".1f"),
            Column("x_bound", "x sched bound", ".3f"),
            Column("compute_over_copy", "compute/copy", ".2f"),
            Column("peak_mib", "peak MiB", ".0f"),
            Column("reserve_mib", "steady reserve MiB", ".0f"),
            Column("mem_ok", "mem<=bound"),
            Column("bit_equal", "bit-equal"),
            Column("pass", "pass"),
        ],
    ),
}

MEM_SLACK_BYTES = 64 * MiB
LOADED = "resident+copies"  # the first session's configuration: the resident forward with copies streaming
LINK = "h2d link"  # the first session's link probe: one pinned copy per forward (benchmarks/link_probe.py)
BIG_MODEL_BYTES = 8 * 1024**3  # above this: fewer iterations per round
ENV_MODELS = "BENCHMARK_MODELS"
ENV_PEERS = "BENCHMARK_MODEL_PEERS"  # "all" or peer names: those peers on every model, whatever its spec names
ENV_BUDGET = "BENCHMARK_MODELS_BUDGET_S"
ENV_GRAPHS = "BENCHMARK_MODELS_GRAPHS"  # "0": no CUDA-graph rows (a run that is after the peers' rows)
# Seconds from the section's start within which every peer must finish (one that would not, judged by the
# slowest peer of the model so far, is not set up; its rows say so): one model, its peers and the
# benchmark's start-up fit a GPU command of about 420 s.
DEFAULT_BUDGET_S = 360.0
INITIAL_EXTRA_ROUNDS = 2  # the first session gives ext's rows: a few more rounds than a peer's
# A peer's set-up takes up to this many times the model's bytes of host memory on top of what the section
# holds (measured on Flux: SGLang 1.7x, diffusers block level 1.6x); with less available it is not run, since
# the kernel would kill the whole section for it.
PEER_HOST_FACTOR = 2.0
SLOW_PEER_FACTOR = 4.0  # a peer whose first forward takes this many times ext's is timed 1 forward a round
# Peers in the order they are set up: the strongest first, so a spent time budget cuts the weakest.
RUN_ORDER = ("fastvideo", "sglang", "diffusers", "mmgp", "diffusers leaf", "accelerate")
# On a 28 GB model each peer costs a host copy, its pinning and its rounds: only the strongest run.
BIG_MODEL_PEERS = ("fastvideo", "sglang", "diffusers")
# The planned-budget row runs after this peer: after the strongest peers, before the ones a spent budget cuts.
BUDGET_ROW_AFTER = "diffusers"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    cls_name: str
    config: dict[str, Any]
    cpu_config: dict[str, Any]
    tokens: dict[str, int]  # label -> image/video tokens, on a GPU
    cpu_tokens: dict[str, int]
    block_lists: str | None
    inputs: Callable[[dict[str, Any], int, torch.device], dict[str, torch.Tensor]] = field(repr=False)
    peers: tuple[str, ...] | None = None  # None: every peer
    # Token counts (labels) where ext with default settings is held to TIGHT_TARGET x floor, not EXT_TARGET.
    tight: tuple[str, ...] = ()
    # Builds the model on a device from ``config``; None: the diffusers class ``cls_name``.
    build: Callable[[dict[str, Any], torch.device], nn.Module] | None = field(default=None, repr=False)


def _wan_grid(tokens: int, full_size: bool) -> tuple[int, int, int]:
    """(frames, latent height, latent width) for ``tokens`` with Wan's (1, 2, 2) patches: 480x832 frames
    (1560 tokens each) where the count is a multiple of that, else square frames (4096 = 4 of 32x32 patches)."""
    per_frame, height, width = (1560, 60, 104) if full_size else (16, 8, 8)
    if tokens % per_frame == 0:
        return tokens // per_frame, height, width
    for frames in (4, 2, 1):
        side = math.isqrt(tokens // frames)
        if frames * side * side == tokens:
            return frames, 2 * side, 2 * side
    raise ValueError(f"fastoffload: a Wan token count must be a multiple of {per_frame} or frames x a square, "
                     f"got {tokens}")


def _wan_inputs(config: dict[str, Any], tokens: int, device: torch.device) -> dict[str, torch.Tensor]:
    frames, height, width = _wan_grid(tokens, config["num_layers"] > 4)
    generator = torch.Generator("cpu").manual_seed(tokens)
    text = 512 if config["text_dim"] == 4096 else 8
    return _place(dict(
        hidden_states=torch.randn(1, config["in_channels"], frames, height, width, generator=generator, device="cpu"),
        timestep=torch.tensor([500], device="cpu"),
        encoder_hidden_states=torch.randn(1, text, config["text_dim"], generator=generator, device="cpu"),
    ), device)


def _place(inputs: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """On the device; activations in the weights' dtype, position ids as they are."""
    def dtype(name: str, tensor: torch.Tensor) -> torch.dtype | None:
        return torch.bfloat16 if tensor.is_floating_point() and not name.endswith("_ids") else None

    return {name: tensor.to(device, dtype(name, tensor)) for name, tensor in inputs.items()}


def _flux_inputs(config: dict[str, Any], tokens: int, device: torch.device) -> dict[str, torch.Tensor]:
    generator = torch.Generator("cpu").manual_seed(tokens)
    text = 512 if config["joint_attention_dim"] == 4096 else 8
    inputs = dict(
        hidden_states=torch.randn(1, tokens, config["in_channels"], generator=generator, device="cpu"),
        encoder_hidden_states=torch.randn(1, text, config["joint_attention_dim"], generator=generator, device="cpu"),
        pooled_projections=torch.randn(1, config["pooled_projection_dim"], generator=generator, device="cpu"),
        timestep=torch.tensor([0.5], device="cpu"),
        img_ids=torch.randn(tokens, 3, generator=generator, device="cpu"),
        txt_ids=torch.zeros(text, 3, device="cpu"),
    )
    if config.get("guidance_embeds"):
        inputs["guidance"] = torch.tensor([3.5], device="cpu")
    return _place(inputs, device)


_WAN_COMMON = dict(patch_size=(1, 2, 2), in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
                   cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
_WAN_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
                 text_dim=32, freq_dim=256, ffn_dim=32, num_layers=3, cross_attn_norm=True,
                 qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
MODELS = {
    "wan-1.3b": ModelSpec("wan-1.3b", "WanTransformer3DModel",
                          dict(_WAN_COMMON, num_attention_heads=12, attention_head_dim=128, ffn_dim=8960,
                               num_layers=30),
                          _WAN_TINY, {"transfer-bound": 1560, "mid": 4096, "balanced": 6240},
                          {"small": 16, "mid": 32, "large": 64}, None,
                          _wan_inputs, tight=("mid",)),
    "flux": ModelSpec("flux", "FluxTransformer2DModel",
                      dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                           num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                           guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
                      dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=3, attention_head_dim=16,
                           num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                           axes_dims_rope=(4, 6, 6)),
                      {"transfer-bound": 1024, "balanced": 9216}, {"small": 16, "large": 64}, "all", _flux_inputs,
                      tight=("transfer-bound",)),
    "wan-14b": ModelSpec("wan-14b", "WanTransformer3DModel",
                         dict(_WAN_COMMON, num_attention_heads=40, attention_head_dim=128, ffn_dim=13824,
                              num_layers=40),
                         _WAN_TINY, {"transfer-bound": 1560, "balanced": 9360}, {"small": 16, "large": 64}, None,
                         _wan_inputs, BIG_MODEL_PEERS),
}


class KeywordStack(BlockStack):
    """A forward-section workload called the way this section calls a diffusers model: the input by keyword,
    a tuple out with ``return_dict=False``. Same parameters, same names, same weights as ``BlockStack``."""

    def forward(self, hidden_states: torch.Tensor, return_dict: bool = True) -> Any:  # type: ignore[override]
        out = super().forward(hidden_states)
        return (out,) if not return_dict else out


def _stack_of(config: dict[str, Any]) -> StackSpec:
    return (CPU_WORKLOADS if config["cpu"] else WORKLOADS)[config["workload"]]


def _build_stack(config: dict[str, Any], device: torch.device) -> nn.Module:
    return build_stack(_stack_of(config), device, seed=1, cls=KeywordStack).requires_grad_(False)


def _stack_inputs(config: dict[str, Any], tokens: int, device: torch.device) -> dict[str, torch.Tensor]:
    spec = _stack_of(config)
    generator = torch.Generator("cpu").manual_seed(1000 + int(config["workload"][1:]))
    return _place(dict(hidden_states=torch.randn(1, tokens, spec.d, generator=generator, device="cpu")), device)


def _stack_spec(key: str) -> ModelSpec:
    gpu, cpu = WORKLOADS[key], CPU_WORKLOADS[key]
    return ModelSpec(key, "BlockStack", {"workload": key, "cpu": False}, {"workload": key, "cpu": True},
                     {gpu.character: gpu.tokens}, {cpu.character.split(" (")[0]: cpu.tokens}, None, _stack_inputs,
                     build=_build_stack)


# The forward section's workloads, run here only when BENCHMARK_MODELS names them.
STACK_MODELS = {key: _stack_spec(key) for key in ("W1", "W2", "W3", "W4")}


def selected_models(ctx: Context) -> list[ModelSpec]:
    wanted = os.environ.get(ENV_MODELS)
    if wanted:
        known = {**MODELS, **STACK_MODELS}
        names = [name.strip() for name in wanted.split(",") if name.strip()]
        unknown = [name for name in names if name not in known]
        if unknown:
            ctx.note(f"{ENV_MODELS}: unknown model(s) {', '.join(unknown)} ignored; known: {', '.join(known)}")
        return [known[name] for name in names if name in known]
    if ctx.cuda and ctx.quick:
        return [MODELS["wan-1.3b"]]
    if not ctx.cuda:
        return [MODELS["wan-1.3b"], MODELS["flux"]]  # the 14B shape is the 1.3B's at tiny size
    return list(MODELS.values())


def build_master(spec: ModelSpec, ctx: Context) -> nn.Module:
    """Random bf16 weights, built and kept on the device (the resident model, and the source every offloaded
    copy is made from): initialising on the GPU takes seconds, and no host copy exists beyond the ones the
    offloaders themselves hold."""
    config = spec.config if ctx.cuda else spec.cpu_config
    if spec.build is not None:
        return spec.build(config, ctx.device).eval().requires_grad_(False)
    import diffusers

    previous = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(ctx.device):
            model = getattr(diffusers, spec.cls_name)(**config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                # Default-initialised norms and biases (ones, zeros) would hide a weight copied to the wrong slot.
                param.add_(torch.randn_like(param), alpha=0.02)
    return model.eval().requires_grad_(False)


def build_host(spec: ModelSpec, ctx: Context) -> nn.Module:
    """:func:`build_master`, then on the host (for sections that want a host model to copy from)."""
    return build_master(spec, ctx).to("cpu")


def host_copy(master: nn.Module, lists: list[str] | None = None,
              source: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """A copy of ``master`` with the listed block lists (all of it when None) on the host, the rest where
    ``master`` is. The copy is made on the device and moved tensor by tensor, so the host never holds
    more than the copy itself. With ``source`` the copy's host tensors are the source's
    (``benchmarks/host_source.py``): nothing is copied to the host, and what is not listed moves back
    to the master's device."""
    model = copy.deepcopy(master)
    if source is not None:
        bind(model, source)
        if lists is not None:
            from benchmarks.workloads import move_all_but
            move_all_but(model, next(master.parameters()).device, [getattr(model, name) for name in lists])
    else:
        for part in ([getattr(model, name) for name in lists] if lists is not None else [model]):
            part.to("cpu")
    free_memory()
    return model


def block_list_names(model: nn.Module, block_lists: str | None) -> list[str]:
    from fastoffload_ext.engine.model_checks import find_block_lists
    return [name for name, _ in find_block_lists(model, block_lists)]


def _raise(error: Exception) -> dict[str, Any]:
    raise error


def _timer(ctx: Context, fn: Callable[[], Any], iters: int) -> SteadyTimer:
    return SteadyTimer(fn, iters, ctx.cuda)


def _forward(model: nn.Module, inputs: dict[str, Any]) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with torch.inference_mode():
            return model(**inputs, return_dict=False)[0]
    return run


@dataclass
class ModelRun:
    """What one model's rows share: the models alive, inputs, references and the block clocks."""

    spec: ModelSpec
    master: nn.Module  # on the device: the resident model
    lists: list[str]  # every list the widest ext configuration offloads, in execution order
    inputs: dict[str, dict[str, Any]]
    log: PhaseLog
    configs: list[ExtConfig] = field(default_factory=list)
    token_counts: dict[str, int] = field(default_factory=dict)  # label -> tokens, as run here
    references: dict[str, torch.Tensor] = field(default_factory=dict)
    forwards: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)  # "config|label"
    warmed: set[str] = field(default_factory=set)
    model_bytes: int = 0
    block_bytes: dict[str, list[int]] = field(default_factory=dict)  # per list, per block
    shapes: dict[str, torch.Size] = field(default_factory=dict)  # the master's parameters, by name
    activations: dict[str, int] = field(default_factory=dict)
    reserves: dict[str, int] = field(default_factory=dict)  # "config|label" -> bytes (utils.steady_reserve), on a GPU
    clocks: dict[str, BlockClock] = field(default_factory=dict)  # per label: per-block compute of the resident model
    peer_seconds: list[float] = field(default_factory=list)  # how long each peer of this model took
    medians: dict[str, float] = field(default_factory=dict)  # "config|label" -> ms, from the first session
    first: Interleaved | None = None  # the first session: resident, the ext configurations, the block clocks
    copy_load: CopyLoad | None = None  # the copies streaming beside the resident model in the first session
    link: LinkProbe | None = None  # the link's speed in each round of the first session
    graphs: graph_rows.GraphRows | None = None  # the CUDA-graph configurations of the first session (freed after it)
    graph_error: Exception | None = None  # why they could not be built
    graph_skip: str | None = None  # why they were not built (BENCHMARK_MODELS_GRAPHS=0)
    source: dict[str, torch.Tensor] | None = None  # the host copy every peer's model is bound to
    source_print: list[float] = field(default_factory=list)
    # Torch's numerics switches when the references were computed; every peer runs under them too.
    settings: dict[str, Any] = field(default_factory=peer_diff.numerics_settings)

    def blocks(self) -> list[nn.Module]:
        return [block for name in self.lists for block in getattr(self.master, name)]

    def part_bytes(self, parts: frozenset[str]) -> int:
        """Bytes of the named block lists, plus everything else when REST is among them."""
        lists = sum(sum(self.block_bytes[name]) for name in self.lists if name in parts)
        rest = self.model_bytes - sum(sum(sizes) for sizes in self.block_bytes.values())
        return lists + (rest if peer_setups.REST in parts else 0)


def ext_configs(lists: list[str], block_lists: str | None) -> list[ExtConfig]:
    """ext with default settings (the first list, FastVideo's rule) and, on a model with several lists, with all."""
    configs = [ExtConfig("ext", lists[:1], {})]
    if len(lists) > 1:
        configs.append(ExtConfig("ext all lists", list(lists), {"block_lists": block_lists}))
    return configs


def _prepare(ctx: Context, spec: ModelSpec, enable: Callable[..., Any], log: PhaseLog) -> ModelRun:
    master = build_master(spec, ctx)
    log.mark(f"{spec.name}: master built on {ctx.device} ({module_bytes(master) / GB:.1f} GB)")
    lists = block_list_names(master, spec.block_lists)
    tokens = spec.tokens if ctx.cuda else spec.cpu_tokens
    config = spec.config if ctx.cuda else spec.cpu_config
    inputs = {label: spec.inputs(config, count, ctx.device) for label, count in tokens.items()}
    run = ModelRun(spec, master, lists, inputs, log, ext_configs(lists, spec.block_lists), dict(tokens))
    run.model_bytes = module_bytes(master)
    run.block_bytes = {name: [module_bytes(block) for block in getattr(master, name)] for name in lists}
    run.shapes = {name: param.shape for name, param in master.named_parameters()}
    for label, inputs in run.inputs.items():
        before = device_allocated(ctx)
        reset_device_peak(ctx)
        run.references[label] = _forward(master, inputs)().to("cpu", copy=True)
        if ctx.cuda:
            run.activations[label] = max(0, device_peak(ctx) - before)
        run.forwards[f"resident|{label}"] = _forward(master, inputs)
        run.clocks[label] = BlockClock(run.blocks(), ctx.cuda)
    _ensure_source(run)
    for ext_config in run.configs:
        _enable_config(ctx, run, ext_config, enable)
    names = [f"{config}|{label}" for label in run.inputs for config in ["resident", *(c.name for c in run.configs)]]
    _measure_reserves(ctx, run, {name: run.forwards[name] for name in names}, _iterations(ctx, run)[0] + 1)
    log.mark(f"{spec.name}: ext and resident checked")
    run.graph_skip = graphs_skipped(ctx)
    if ctx.cuda and run.graph_skip is None:
        _build_graphs(ctx, run, enable)
    return run


def graphs_skipped(ctx: Context) -> str | None:
    """Why the CUDA-graph rows are left out of a GPU run (``BENCHMARK_MODELS_GRAPHS=0``), or None."""
    if ctx.cuda and os.environ.get(ENV_GRAPHS, "1").strip() == "0":
        return f"{ENV_GRAPHS}=0: the CUDA-graph rows were not built (the peers' rounds get their time)"
    return None


def _build_graphs(ctx: Context, run: ModelRun, enable: Callable[..., Any]) -> None:
    """The resident model and ext with default settings, each captured in a CUDA graph (``benchmarks/graph_rows.py``);
    a model that cannot be captured gets an error row instead of its graph rows."""
    config = run.configs[0]
    try:
        offloaded = host_copy(run.master, config.lists, _ensure_source(run))
        if enable(offloaded, device=ctx.device, **config.kwargs) is None:
            raise RuntimeError("enable_layerwise_offload returned None (offload skipped)")
        run.graphs = graph_rows.GraphRows(run.master, offloaded, config, run.inputs, run.references)
    except Exception as error:  # a model that cannot be captured costs its graph rows only
        error.__traceback__ = None
        run.graph_error = error
        free_memory()
    run.log.mark(f"{run.spec.name}: CUDA graphs captured" if run.graphs else f"{run.spec.name}: no CUDA graphs")


def _ensure_source(run: ModelRun) -> dict[str, torch.Tensor]:
    """The host copy every offloaded copy of this model is bound to, made when first needed."""
    if run.source is None:
        run.source = host_source(run.master)
        run.source_print = fingerprint(run.source)
        run.log.mark(f"{run.spec.name}: host copy of the weights")
    return run.source


def _enable_config(ctx: Context, run: ModelRun, ext_config: ExtConfig, enable: Callable[..., Any]) -> None:
    """One ext configuration on its own host copy, checked bit for bit at every token count; its peak GPU
    memory is what it adds to what was allocated before its copy existed."""
    sizes = [size for name in ext_config.lists for size in run.block_bytes[name]]
    ext_config.offloaded_bytes, ext_config.largest_block = sum(sizes), max(sizes)
    before = device_allocated(ctx)
    ext = host_copy(run.master, ext_config.lists, _ensure_source(run))
    run.log.mark(f"{run.spec.name}: {ext_config.name}: bound, {len(ext_config.lists)} list(s) on the host")
    if enable(ext, device=ctx.device, **ext_config.kwargs) is None:
        raise RuntimeError("enable_layerwise_offload returned None (offload skipped)")
    run.log.mark(f"{run.spec.name}: {ext_config.name} enabled")
    for label, inputs in run.inputs.items():
        reset_device_peak(ctx)
        output = _forward(ext, inputs)().to("cpu", copy=True)
        ext_config.peak[label] = max(0, device_peak(ctx) - before)
        ext_config.equal[label] = bool(torch.equal(output, run.references[label]))
        run.forwards[f"{ext_config.name}|{label}"] = _forward(ext, inputs)
        run.warmed.update((f"resident|{label}", f"{ext_config.name}|{label}"))  # both ran once already


def _measure_reserves(ctx: Context, run: ModelRun, forwards: dict[str, Callable[[], Any]], count: int) -> None:
    """Each forward's steady reserve (``utils.steady_reserve``) over ``count`` forwards, as a timed turn runs them,
    into ``run.reserves`` under its "config|label" name; on a GPU only."""
    if ctx.cuda:
        for name, forward in forwards.items():
            run.reserves[name] = steady_reserve(forward, count)


def _iterations(ctx: Context, run: ModelRun) -> tuple[int, int]:
    """(forwards per round, rounds) of a peer's session; the first session runs INITIAL_EXTRA_ROUNDS more."""
    big = run.model_bytes > BIG_MODEL_BYTES
    iters = 2 if (big or not ctx.cuda) else (3 if ctx.quick else 5)
    rounds = 3 if (big or ctx.quick or not ctx.cuda) else 5  # on the host the point is the bit-equal column
    return iters, rounds


def _session(ctx: Context, run: ModelRun, names: list[str], extra: dict[str, Timer], rounds: int) -> Interleaved:
    """Interleaved rounds of the named forwards of ``run`` and the ``extra`` timers.

    A forward that already ran once (the bit-equal checks) is warm: first loads, lazy inits and the
    allocator's growth are behind it, and on a 28 GB model a second warm-up costs seconds per forward.
    """
    iters, _ = _iterations(ctx, run)
    for name in names:
        if name not in run.warmed:
            run.forwards[name]()
            run.warmed.add(name)
    timers: dict[str, Timer] = {name: _timer(ctx, run.forwards[name], iters) for name in names}
    timers.update(extra)
    result = run_interleaved(timers, rounds)
    leads = {name: timer.leads for name, timer in timers.items() if isinstance(timer, SteadyTimer) and timer.leads}
    return dataclasses.replace(result, leads=leads)


def _first_session(ctx: Context, run: ModelRun) -> Interleaved:
    """Resident, every ext configuration and the block clocks, every token count: the rows of ext."""
    iters, rounds = _iterations(ctx, run)
    names = [f"{config}|{label}" for label in run.inputs for config in ["resident", *(c.name for c in run.configs)]]
    clocks = {f"blocks|{label}": run.clocks[label].timer(run.forwards[f"resident|{label}"], iters)
              for label in run.inputs}
    if ctx.cuda:
        # The resident model again, with copies streaming beside it: the copy interference no offloader avoids.
        run.copy_load = run.copy_load or CopyLoad(ctx.device)
        clocks.update({f"{LOADED}|{label}": run.copy_load.timer(run.forwards[f"resident|{label}"], iters)
                       for label in run.inputs})
        run.link = run.link or LinkProbe(ctx.device)
        clocks[LINK] = _timer(ctx, run.link.copy, iters)
    if run.graphs is not None:
        clocks.update(run.graphs.timers(lambda fn, count: _timer(ctx, fn, count), iters))
    return _session(ctx, run, names, clocks, rounds + (INITIAL_EXTRA_ROUNDS if ctx.cuda else 0))


def named_peers() -> tuple[str, ...] | None:
    """The peers ``BENCHMARK_MODEL_PEERS`` names (every peer for ``all``), or None: each model's own choice."""
    value = os.environ.get(ENV_PEERS, "").strip()
    if not value:
        return None
    known = tuple(peer.name for peer in peer_setups.PEERS)
    if value == "all":
        return known
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"{ENV_PEERS}: unknown peer(s) {', '.join(unknown)}; known: all, {', '.join(known)}")
    return names


# One row of the table: (labels, figures, reason it was skipped, error it raised).
PendingRow = tuple[dict[str, Any], dict[str, Any] | None, str | None, Exception | None]


def _peer_skip_reason(ctx: Context, run: ModelRun, peer: peer_setups.Peer, deadline_s: float) -> str | None:
    if not ctx.cuda:
        return "needs a CUDA device"
    named = named_peers()
    if named is not None:
        if peer.name not in named:
            return f"not run: {ENV_PEERS} names only {', '.join(named)}"
    elif run.spec.peers is not None and peer.name not in run.spec.peers:
        return (f"not run on {run.spec.name} so that the section fits one GPU command (each peer pins its "
                f"own copy of the blocks and needs its rounds); only {', '.join(run.spec.peers)} run here; "
                f"{ENV_PEERS}=all runs it")
    elapsed = run.log.elapsed_s()
    if elapsed > deadline_s:
        return (f"not run: {run.spec.name}'s share of the section's time budget ({ENV_BUDGET}) ended at "
                f"{deadline_s:.0f} s and it was {elapsed:.0f} s; the stronger peers ran first")
    slowest = max(run.peer_seconds, default=0.0)
    if elapsed + slowest > deadline_s:
        return (f"not run: {run.spec.name}'s share of the section's time budget ({ENV_BUDGET}) ends at "
                f"{deadline_s:.0f} s; at {elapsed:.0f} s the slowest peer so far ({slowest:.0f} s) would not "
                f"finish before it; the stronger peers ran first")
    need, usable = PEER_HOST_FACTOR * run.model_bytes, probe_host().usable
    if need > usable:
        return (f"not run: its set-up may take {need / GB:.0f} GB of host memory ({PEER_HOST_FACTOR:g}x the "
                f"model's {run.model_bytes / GB:.1f} GB) and {usable / GB:.0f} GB is available; the kernel would "
                "kill the section for it")
    return None


def _what_it_offloads(ctx: Context, run: ModelRun, peer: peer_setups.Peer, model: nn.Module,
                      notes: list[str]) -> frozenset[str]:
    declared = peer_setups.declared_parts(peer, run.lists)
    found = peer_setups.offloaded_parts(model, ctx.device, run.shapes, run.lists)
    if not found:  # on the host every tensor counts as "on the device": its hooks' rule decides
        return declared
    if found != declared:
        notes.append(f"its set-up left {', '.join(sorted(found))} off the device ({peer.offloads} by its rule)")
    return found


def _peer_session(ctx: Context, run: ModelRun, peer: peer_setups.Peer, holder: dict[str, Any], deadline_s: float,
                  peak_gbps: float | None) -> tuple[dict[str, bool], Interleaved]:
    """Sets the peer up on a model bound to the shared host copy and times it; every reference to its model
    lives in ``holder``, which the caller empties (an exception's frames must not keep 28 GB alive). Where the
    peer was faster than its ext, ext given the peer's device memory is timed against it while it is alive
    (``holder["matched"]``: its rows)."""
    name = run.spec.name
    before = _settled(ctx)
    holder["model"] = host_copy(run.master, source=_ensure_source(run))
    run.log.mark(f"{name} {peer.name}: model bound to the host copy")
    holder["teardown"] = peer.setup(holder["model"], ctx.device, run.lists)
    run.log.mark(f"{name} {peer.name}: set up")
    holder["parts"] = _what_it_offloads(ctx, run, peer, holder["model"], holder["notes"])
    holder["config"] = matching_config(run.configs, holder["parts"])
    changed = peer_diff.settings_changed(run.settings, peer_diff.numerics_settings())
    if changed:
        # Measured under its own switches, its rows (and the resident and ext rounds beside them) would
        # differ for a reason that is not offload.
        holder["notes"].append(f"its set-up changed torch's numerics ({changed}); put back for its rows")
        peer_diff.restore_settings(run.settings)
    forwards = {label: _forward(holder["model"], inputs) for label, inputs in run.inputs.items()}
    equal, slow = _check_peer(ctx, run, holder, forwards)
    run.log.mark(f"{name} {peer.name}: bit-equal checked")
    unequal = [label for label in run.inputs if not equal[label]]
    if unequal:
        label = unequal[0]
        why = peer_diff.first_difference(run.master, _forward(run.master, run.inputs[label]), forwards[label])
        holder["notes"].append(f"not bit-equal: {why}")
        free_memory()  # the resident trace
        run.log.mark(f"{name} {peer.name}: first difference traced")
    iters, rounds = _iterations(ctx, run)
    if slow:
        holder["notes"].append(f"over {SLOW_PEER_FACTOR:.0f}x {holder['config'].name} in its first forward: "
                               "1 forward a round after its lead")
    else:
        for forward in forwards.values():
            forward()  # its check was its first forward: one more, as the others had
    holder["persistent"] = _settled(ctx) - before  # the modules it keeps on the device, its own buffers
    _measure_reserves(ctx, run, {f"{peer.name}|{label}": forward for label, forward in forwards.items()},
                      2 if slow else iters + 1)
    timers = {f"{peer.name}|{label}": _timer(ctx, forward, 1 if slow else iters) for label, forward in forwards.items()}
    names = [f"{config}|{label}" for label in run.inputs for config in ("resident", holder["config"].name)]
    result = _session(ctx, run, names, timers, rounds)
    run.log.mark(f"{name} {peer.name}: timed")
    if ctx.device.type == "cuda":  # the footprints come from the device's allocator
        holder["matched"] = [_matched_row(ctx, run, peer.name, holder, forwards[label], label, deadline_s, peak_gbps)
                             for label in run.inputs
                             if matched_memory.peer_was_faster(result, f"{peer.name}|{label}",
                                                               f"{holder['config'].name}|{label}")]
    return equal, result


def _settled(ctx: Context) -> int:
    """What the device's allocator holds with its cache emptied (0 off CUDA, where there is no allocator)."""
    return settled_reserved() if ctx.cuda and ctx.device.type == "cuda" else 0


def _matched_row(ctx: Context, run: ModelRun, peer: str, holder: dict[str, Any], peer_forward: Callable[[], Any],
                 label: str, deadline_s: float, peak_gbps: float | None) -> PendingRow:
    """ext with the lists the peer offloads, under a ``device_budget`` of what the peer held, timed in rounds with
    the resident model, ext with default settings and the peer (``benchmarks/matched_memory.py``)."""
    config: ExtConfig = holder["config"]
    labels = {"model": run.spec.name, "tokens": _tokens_label(run, label), "backend": matched_memory.backend_name(peer)}
    kept = run.model_bytes - run.part_bytes(holder["parts"])
    peer_footprint = holder.get("persistent", 0) + run.reserves.get(f"{peer}|{label}", 0)
    budget = matched_memory.budget_from(holder.get("persistent", 0), run.reserves.get(f"{peer}|{label}", 0), kept)
    # The activations as the allocator holds them (the resident model's steady reserve), as the footprint counts them.
    activations = max(run.activations.get(label, 0), run.reserves.get(f"resident|{label}", 0))
    least = matched_memory.least_ext_bytes(ctx.options.prefetch_depth, config.largest_block, activations)
    if budget <= least:
        return (labels, None, f"{peer} held {budget / GB:.2f} GB beyond the modules it keeps resident, no more than "
                              f"ext's {ctx.options.prefetch_depth + 1} slots and activations ({least / GB:.2f} GB)", None)
    elapsed = run.log.elapsed_s()
    if elapsed > deadline_s:
        return (labels, None, f"not run: at {elapsed:.0f} s, past {run.spec.name}'s share of the section's time "
                              f"budget ({deadline_s:.0f} s)", None)
    if not peak_gbps:
        return (labels, None, "not run: the planner needs the peak H2D, which is probed on a GPU only", None)
    pinned, usable = config.offloaded_bytes, probe_host().usable
    if pinned > usable:
        return (labels, None, f"not run: its pinned copy ({pinned / GB:.0f} GB) is more than the host has available "
                              f"beside the peer's ({usable / GB:.0f} GB)", None)
    mine: dict[str, Any] = {}
    try:
        blocks = [block for name in config.lists for block in getattr(run.master, name)]
        clock = run.clocks[label]
        step_ms = float(statistics.median(total for _, _, total in clock.rounds))
        costs = matched_memory.costs_for(clock.block_medians(), step_ms, run.lists,
                                         {name: len(getattr(run.master, name)) for name in run.lists}, config.lists,
                                         blocks, peak_gbps, activations)
        plan = plan_offload(costs, budget)
        before = _settled(ctx)
        mine["model"] = host_copy(run.master, config.lists, _ensure_source(run))
        if enable_layerwise_offload(mine["model"], device=ctx.device, plan=plan, **config.kwargs) is None:
            raise RuntimeError("enable_layerwise_offload returned None (offload skipped)")
        mine["forward"] = _forward(mine["model"], run.inputs[label])
        equal = bool(torch.equal(mine["forward"]().to("cpu"), run.references[label]))
        mine["forward"]()
        persistent = _settled(ctx) - before
        iters, rounds = _iterations(ctx, run)
        name = f"{labels['backend']}|{label}"
        _measure_reserves(ctx, run, {name: mine["forward"]}, iters + 1)
        result = _session(ctx, run, [f"resident|{label}", f"{config.name}|{label}"],
                          {f"{peer}|{label}": _timer(ctx, peer_forward, iters),
                           name: _timer(ctx, mine["forward"], iters)}, rounds)
    except Exception as error:  # the row's own failure costs the row only
        error.__traceback__ = None
        return (labels, None, None, error)
    finally:
        mine.clear()
        free_memory()
        empty_host_cache()
        run.log.mark(f"{run.spec.name} {peer} {label}: ext under its memory timed and released")
    figures = {"budget": budget, "kept": kept, "peer_footprint": peer_footprint, "plan": plan, "bit_equal": equal,
               "footprint": persistent + run.reserves.get(name, 0)}
    return (labels, matched_memory.row_values(result, name, peer, label, config.name,
                                              transfer_ms(config.offloaded_bytes, peak_gbps), figures), None, None)


def _check_peer(ctx: Context, run: ModelRun, holder: dict[str, Any],
                forwards: dict[str, Callable[[], torch.Tensor]]) -> tuple[dict[str, bool], bool]:
    """Bit-equal per token count; slow when its first forward took SLOW_PEER_FACTOR x the matching ext's."""
    equal: dict[str, bool] = {}
    slow = False
    for label, forward in forwards.items():
        started = time.perf_counter()
        output = forward().to("cpu")  # the copy to the host waits for the forward
        took_ms = (time.perf_counter() - started) * 1e3
        equal[label] = bool(torch.equal(output, run.references[label]))
        ext_ms = run.medians.get(f"{holder['config'].name}|{label}")
        slow = slow or bool(ext_ms and took_ms > SLOW_PEER_FACTOR * ext_ms)
    return equal, slow


def _release(holder: dict[str, Any], run: ModelRun, peer: peer_setups.Peer) -> None:
    teardown = holder.pop("teardown", None)
    try:
        if teardown is not None:
            teardown()
    finally:
        teardown = None  # what the peer's set-up holds goes before the memory is collected below
        kept = {key: holder[key] for key in ("notes", "parts", "config", "matched") if key in holder}
        holder.clear()
        holder.update(kept)
        peer_diff.restore_settings(run.settings)  # a teardown may leave switches of its own behind
        if run.source is not None and fingerprint(run.source) != run.source_print:
            holder["notes"].append("it wrote into the host copy of the weights it was given; the next peer gets "
                                   "a fresh one")
            run.source = None
        free_memory()
        empty_host_cache()  # pinned blocks a peer took through torch's host allocator
        run.log.mark(f"{run.spec.name} {peer.name}: released")


def _peer_rows(ctx: Context, run: ModelRun, peer: peer_setups.Peer, deadline_s: float,
               peak_gbps: float | None = None) -> list[PendingRow]:
    labels = {label: {"model": run.spec.name, "tokens": _tokens_label(run, label), "backend": peer.name}
              for label in run.inputs}
    skipped = _peer_skip_reason(ctx, run, peer, deadline_s)
    if skipped is not None:
        return [(row, None, skipped, None) for row in labels.values()]
    holder: dict[str, Any] = {"notes": []}
    started = time.monotonic()
    try:
        equal, result = _peer_session(ctx, run, peer, holder, deadline_s, peak_gbps)
    except peer_setups.PeerUnavailable as error:
        return [(row, None, str(error), None) for row in labels.values()]
    except Exception as error:  # a peer that breaks costs its rows only
        error.__traceback__ = None  # its frames would keep the peer's model alive until the rows are written
        return [(row, None, None, error) for row in labels.values()]
    finally:
        _release(holder, run, peer)
        run.peer_seconds.append(time.monotonic() - started)
    parts, config = holder["parts"], holder["config"]
    nbytes = run.part_bytes(parts)
    transfer = transfer_ms(nbytes, peak_gbps)
    floor = f"; floor max(resident, {nbytes / GB:.2f} GB / peak = {transfer:.1f} ms)" if transfer else ""
    notes = [peer.how, f"offloads {', '.join(sorted(parts))}{floor}", *holder["notes"]]
    if peer.name == "sglang" and peer_setups.STUBBED.get("sglang"):
        notes.append("stubbed (absent, not on its offload path): " + ", ".join(peer_setups.STUBBED["sglang"]))
    rows: list[PendingRow] = []
    for label, row in labels.items():
        values = peer_values(result, f"{peer.name}|{label}", label, config, nbytes, peak_gbps)
        reserve, note = reserve_values(run.reserves, peer.name, label, config.largest_block)
        rows.append((row, {**values, **reserve, "bit_equal": equal[label],
                           "note": "; ".join([*notes, *([note] if note else [])])}, None, None))
    return rows + holder.get("matched", [])


def _write(ctx: Context, rows: list[PendingRow]) -> None:
    for labels, values, skipped, error in rows:
        if skipped is not None:
            ctx.skip("models", labels, skipped)
        elif error is not None:
            ctx.run_row("models", labels, lambda error=error: _raise(error))
        else:
            ctx.run_row("models", labels, lambda values=values: values)


def _tokens_label(run: ModelRun, label: str) -> str:
    return f"{run.token_counts[label]} ({label})"


def _ext_values(ctx: Context, run: ModelRun, result: Interleaved, config: ExtConfig, label: str,
                peak_gbps: float | None) -> dict[str, Any]:
    resident, ext = result.rounds[f"resident|{label}"], result.rounds[f"{config.name}|{label}"]
    x_resident, spread = ratio([e / r for e, r in zip(ext, resident)])
    values: dict[str, Any] = {
        "ms": float(statistics.median(ext)), "spread": (max(ext) - min(ext)) / statistics.median(ext),
        "x_resident": x_resident, "range": spread, "bit_equal": config.equal[label]}
    settings = ("default settings" if not config.kwargs
                else ", ".join(f"{key}={value!r}" for key, value in config.kwargs.items()))
    notes = [f"{len(config.lists)} list(s) offloaded: {', '.join(config.lists)} ({settings}); {len(resident)} rounds"]
    transfer = transfer_ms(config.offloaded_bytes, peak_gbps)
    loaded = result.rounds.get(f"{LOADED}|{label}")
    if transfer and loaded:
        # Against max(resident with copies streaming, bytes / peak) in the same rounds: the floor less the
        # interference that every offloader pays, beside (not instead of) the floor its target is set on.
        values["x_loaded_floor"] = ratio([e / f for e, f in zip(ext, floors(loaded, transfer))])[0]
    link = _link_rounds(run, result)
    if transfer and link:
        values["x_link_floor"] = ratio([e / f for e, f in zip(ext, link_floors(resident, config.offloaded_bytes,
                                                                                *link))])[0]
    resident_leads, ext_leads = result.leads.get(f"resident|{label}"), result.leads.get(f"{config.name}|{label}")
    if transfer and resident_leads and ext_leads:
        # The step after a readback, against the resident one in the same rounds (benchmarks/steady.py).
        values["x_floor_readback"] = ratio([e / f for e, f in zip(ext_leads, floors(resident_leads, transfer))])[0]
    if transfer:
        floor = floors(resident, transfer)
        values["x_floor"], values["range"] = ratio([e / f for e, f in zip(ext, floor)])
        target = TIGHT_TARGET if (label in run.spec.tight and not config.kwargs) else EXT_TARGET
        values["pass"] = values["x_floor"] <= target
        if target != EXT_TARGET:
            values["target"] = target
        copies = [transfer_ms(size, peak_gbps) if name in config.lists else None
                  for name in run.lists for size in run.block_bytes[name]]
        slots = ctx.options.prefetch_depth + 1
        bound, note = bound_figures(ext, run.clocks[label].round_bounds(copies, ctx.options.prefetch_depth),
                                    float(statistics.median(floor)), values["x_floor"], slots)
        values.update(bound)
        notes += [note] if note else []
    if ctx.cuda and label in run.activations:
        non_block = run.model_bytes - config.offloaded_bytes
        bound_bytes = ((ctx.options.prefetch_depth + 1) * config.largest_block + non_block + run.activations[label]
                       + MEM_SLACK_BYTES)
        values.update(peak_mib=config.peak[label] / MiB, mem_bound_mib=bound_bytes / MiB,
                      mem_ok=config.peak[label] <= bound_bytes)
    reserve, note = reserve_values(run.reserves, config.name, label, config.largest_block)
    values.update(reserve)
    notes += [note] if note else []
    values["note"] = "; ".join(notes)
    return values


def _link_rounds(run: ModelRun, result: Interleaved) -> tuple[int, list[float]] | None:
    """(probe bytes, its ms in each round) of the first session, where the link was probed."""
    rounds = result.rounds.get(LINK)
    return (run.link.nbytes, rounds) if rounds and run.link is not None else None


def _own_rows(ctx: Context, run: ModelRun, result: Interleaved, peak_gbps: float | None) -> list[PendingRow]:
    """Per token count: resident, each ext configuration's floor, each ext configuration."""
    rows: list[PendingRow] = []
    for label in run.inputs:
        base = {"model": run.spec.name, "tokens": _tokens_label(run, label)}
        resident = result.rounds[f"resident|{label}"]
        resident_ms = float(statistics.median(resident))
        rows.append(({**base, "backend": "resident"}, {
            "ms": resident_ms, "spread": (max(resident) - min(resident)) / resident_ms, "x_resident": 1.0,
            **reserve_values(run.reserves, "resident", label, 0)[0]}, None, None))
        loaded = result.rounds.get(f"{LOADED}|{label}")
        if loaded:
            x_loaded, spread = ratio([c / r for c, r in zip(loaded, resident)])
            loaded_ms = float(statistics.median(loaded))
            rows.append(({**base, "backend": "resident, copies streaming"}, {
                "ms": loaded_ms, "spread": (max(loaded) - min(loaded)) / loaded_ms, "x_resident": x_loaded,
                "range": spread, "note": "the resident forward while pinned H2D copies stream on a side stream "
                                         "(benchmarks/copy_load.py): the interference no layerwise offloader avoids"},
                None, None))
        for config in run.configs:
            transfer = transfer_ms(config.offloaded_bytes, peak_gbps)
            if transfer and peak_gbps:
                floor = {**floor_row(config, resident, transfer, peak_gbps), "compute_over_copy": resident_ms / transfer}
                rows.append(({**base, "backend": config.floor_name}, floor, None, None))
        for config in run.configs:
            rows.append(({**base, "backend": config.name},
                         _ext_values(ctx, run, result, config, label, peak_gbps), None, None))
        rows += _graph_rows(run, result, label, base, peak_gbps)
    return rows


def _graph_rows(run: ModelRun, result: Interleaved, label: str, base: dict[str, Any],
                peak_gbps: float | None) -> list[PendingRow]:
    if run.graph_error is not None:
        return [({**base, "backend": graph_rows.EXT}, None, None, run.graph_error)]
    if run.graph_skip is not None:
        return [({**base, "backend": graph_rows.EXT}, None, run.graph_skip, None)]
    if run.graphs is None or f"{graph_rows.EXT}|{label}" not in result.rounds:
        return []
    target = TIGHT_TARGET if label in run.spec.tight else EXT_TARGET
    return [({**base, "backend": backend}, values, None, None)
            for backend, values in graph_rows.rows_for(result, label, run.graphs.config, run.graphs.equal[label],
                                                       run.graphs.num_slots, peak_gbps, target,
                                                       link=_link_rounds(run, result))]


def _budget_plan(ctx: Context, run: ModelRun, label: str,
                 peak_gbps: float | None) -> tuple[float, OffloadPlan] | None:
    """(floor ms, plan) where ext with every list misses the floor target and the schedule bound says why."""
    widest = run.configs[-1]
    transfer = transfer_ms(widest.offloaded_bytes, peak_gbps)
    if not transfer or not peak_gbps or run.first is None:
        return None
    resident, ext = run.first.rounds[f"resident|{label}"], run.first.rounds[f"{widest.name}|{label}"]
    floor = floors(resident, transfer)
    floor_ms = float(statistics.median(floor))
    copies = [transfer_ms(size, peak_gbps) for name in run.lists for size in run.block_bytes[name]]
    bounds = run.clocks[label].round_bounds(copies, ctx.options.prefetch_depth)
    if not bounds or ratio([e / f for e, f in zip(ext, floor)])[0] <= EXT_TARGET or \
            statistics.median(bounds) <= EXT_TARGET * floor_ms:
        return None
    clock = run.clocks[label]
    compute = clock.block_medians()
    other = float(statistics.median(total for _, _, total in clock.rounds)) - sum(compute)
    costs = block_costs(run.blocks(), compute, other, peak_gbps, run.activations.get(label, 0))
    plan = least_budget_plan(costs, EXT_TARGET * floor_ms)
    return (floor_ms, plan) if plan is not None else None


def _budget_rows(ctx: Context, run: ModelRun, peak_gbps: float | None, deadline_s: float) -> list[PendingRow]:
    """Per token count where the floor is out of reach at depth 1: ext with every list under the least
    device budget the planner predicts at or under the floor target (``benchmarks/model_budget.py``)."""
    rows: list[PendingRow] = []
    widest = run.configs[-1]
    for label in run.inputs:
        found = _budget_plan(ctx, run, label, peak_gbps)
        if found is None:
            continue
        floor_ms, plan = found
        labels = {"model": run.spec.name, "tokens": _tokens_label(run, label),
                  "backend": f"{widest.name}, budget {plan.device_budget / GB:.1f} GB"}
        elapsed, slowest = run.log.elapsed_s(), max(run.peer_seconds, default=0.0)
        if elapsed + slowest > deadline_s:
            rows.append((labels, None, f"not run: at {elapsed:.0f} s it would not finish within {run.spec.name}'s "
                                       f"share of the time budget ({deadline_s:.0f} s)", None))
            continue
        try:
            values = _budget_session(ctx, run, label, plan, floor_ms, peak_gbps)
        except Exception as error:
            error.__traceback__ = None
            rows.append((labels, None, None, error))
            continue
        rows.append((labels, values, None, None))
    return rows


def _budget_session(ctx: Context, run: ModelRun, label: str, plan: OffloadPlan, floor_ms: float,
                    peak_gbps: float | None) -> dict[str, Any]:
    widest = run.configs[-1]
    holder: dict[str, Any] = {}
    try:
        holder["model"] = host_copy(run.master, widest.lists, _ensure_source(run))
        before = device_allocated(ctx)
        enable_layerwise_offload(holder["model"], device=ctx.device, plan=plan, **widest.kwargs)
        forward = _forward(holder["model"], run.inputs[label])
        reset_device_peak(ctx)
        equal = bool(torch.equal(forward().to("cpu"), run.references[label]))
        peak = max(0, device_peak(ctx) - before)
        forward()
        iters, rounds = _iterations(ctx, run)
        name = f"budget|{label}"
        result = _session(ctx, run, [f"resident|{label}", f"{widest.name}|{label}"],
                          {name: _timer(ctx, forward, iters)}, rounds)
    finally:
        holder.clear()
        free_memory()
        empty_host_cache()
        run.log.mark(f"{run.spec.name} {label}: planned budget timed and released")
    transfer = transfer_ms(widest.offloaded_bytes, peak_gbps) or 0.0
    x_floor, spread = ratio([b / f for b, f in zip(result.rounds[name], floors(result.rounds[f"resident|{label}"],
                                                                              transfer))])
    bound = plan.device_bytes + (run.model_bytes - widest.offloaded_bytes) + MEM_SLACK_BYTES
    return {"ms": result.median_ms(name), "spread": result.spread(name),
            "x_resident": result.ratio(name, f"resident|{label}"), "x_floor": x_floor, "range": spread,
            "x_ext": result.ratio(name, f"{widest.name}|{label}"), "vs_ext": widest.name, "bit_equal": equal,
            "pass": x_floor <= EXT_TARGET, "peak_mib": peak / MiB, "mem_ok": peak <= bound,
            "note": f"plan_offload on this run's per-block compute: the least device_budget predicted at <= "
                    f"{EXT_TARGET:.2f}x floor ({floor_ms:.1f} ms) keeps {len(plan.resident)} block(s) resident "
                    f"({', '.join(map(str, plan.resident))}), depth {plan.prefetch_depth}, predicted "
                    f"{plan.predicted_step_ms:.1f} ms; x ext is against {widest.name}"}


def _budget_s(ctx: Context) -> float:
    raw = os.environ.get(ENV_BUDGET, "").strip()
    try:
        return float(raw) if raw else DEFAULT_BUDGET_S
    except ValueError:
        ctx.note(f"{ENV_BUDGET}={raw!r} is not a number of seconds; using {DEFAULT_BUDGET_S:.0f}")
        return DEFAULT_BUDGET_S


def _peers_in_run_order() -> list[peer_setups.Peer]:
    rank = {name: index for index, name in enumerate(RUN_ORDER)}
    return sorted(peer_setups.PEERS, key=lambda peer: rank.get(peer.name, len(rank)))


def _run_model(ctx: Context, spec: ModelSpec, log: PhaseLog, peak: float | None, deadline_s: float) -> None:
    """ext's rows once its rounds are done, each peer's as soon as its session ends: a run cut short (the
    command's time limit, SIGTERM) keeps every row measured before it."""
    try:
        model_run = _prepare(ctx, spec, enable_layerwise_offload, log)
        result = _first_session(ctx, model_run)
    except Exception as error:
        error.__traceback__ = None
        ctx.run_row("models", {"model": spec.name, "backend": "all"}, lambda error=error: _raise(error))
        return
    model_run.first = result
    model_run.medians = {name: result.median_ms(name) for name in result.rounds}
    log.mark(f"{spec.name}: resident and ext timed")
    _write(ctx, _own_rows(ctx, model_run, result, peak))
    link = _link_rounds(model_run, result)
    if link:
        ctx.note(f"{spec.name}: the H2D link in the first session's rounds (one {link[0] // MiB} MiB pinned copy per "
                 f"forward): {describe_link(*link, peak)}")
    if model_run.graphs is not None:  # the peers need the host memory its offloaded copy holds
        model_run.graphs.close()
        model_run.graphs = None
        free_memory()
        empty_host_cache()
        log.mark(f"{spec.name}: CUDA graphs and their offloaded copy freed")
    ctx.progress.finish()
    for peer in _peers_in_run_order():
        _write(ctx, _peer_rows(ctx, model_run, peer, deadline_s, peak))
        ctx.progress.finish()
        if peer.name == BUDGET_ROW_AFTER:
            _write(ctx, _budget_rows(ctx, model_run, peak, deadline_s))


def run(ctx: Context) -> None:
    named_peers()  # a misspelt peer name fails here, before any model is built
    diffusers, reason = try_import("diffusers")
    specs = selected_models(ctx)
    if diffusers is None:
        for spec in specs:
            ctx.skip("models", {"model": spec.name, "backend": "all"}, reason)
        return
    from benchmarks.forward import peak_h2d_gbps
    peak = peak_h2d_gbps(ctx) if ctx.cuda else None
    if not ctx.cuda:
        ctx.note("no CUDA device: tiny configs of the same classes on the host (device='cpu'); resident and ext "
                 "only, for the bit-equal column; the peers and the CUDA-graph rows need a GPU")
    log = PhaseLog("models", echo=ctx.options.progress or ctx.cuda)  # on a GPU a killed run must show where it was
    budget_s = _budget_s(ctx)
    ctx.progress.add(len(specs) * (len(peer_setups.PEERS) + 1))
    for index, spec in enumerate(specs):
        # What is left of the budget, split evenly over the models still to run: time a small model
        # does not use goes to the large ones after it, and no model's peers can starve the next's.
        deadline_s = log.elapsed_s() + max(0.0, budget_s - log.elapsed_s()) / (len(specs) - index)
        log.mark(f"{spec.name}: peers may start until +{deadline_s:.0f}s")
        _run_model(ctx, spec, log, peak, deadline_s)
        free_memory()
        empty_host_cache()
        log.mark(f"{spec.name}: done, freed")
    ctx.note(log.summary())


def arrange_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as the table shows them: per model and token count, resident, the floors, ext, then the peers
    in PEERS' order (the journal has them in the order they were measured)."""
    models = list(dict.fromkeys(row.get("model") for row in rows))
    tokens = list(dict.fromkeys(row.get("tokens") for row in rows))
    rank = {peer.name: index for index, peer in enumerate(peer_setups.PEERS)}

    def backend(row: dict[str, Any]) -> tuple[int, int]:
        name = str(row.get("backend", ""))
        for group, prefix in enumerate(("resident", "floor", "ext")):
            if name.startswith(prefix):
                return group, 0
        return 3, rank.get(name, len(rank))

    return sorted(rows, key=lambda row: (models.index(row.get("model")), tokens.index(row.get("tokens")), backend(row)))


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    """Per model, token count and ext configuration: ext against its floor and schedule bound, and the fastest
    peer compared with that configuration (``benchmarks/model_rows.py``)."""
    return model_rows.summarize(rows)
