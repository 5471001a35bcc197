"""Random module trees for the property tests: specs (what hypothesis draws) and the modules built from them.

A tree is a model whose ``blocks`` ``nn.ModuleList`` holds blocks made of a random nesting of nodes:
``Linear`` (optionally with a transposed weight), ``LayerNorm``, ``Conv2d`` with a channels_last weight,
and a "bag" of loose parameters of mixed dtypes (fp32/bf16/fp16/fp8/int8, transposed, channels_last,
zero-size, scalar) with int8/bool buffers. Every node folds an exact float64 checksum of each of its own
parameters and buffers into a running accumulator, and float nodes also run real matmuls/norms/convs on
the activation, so the model's output depends on every byte of every parameter: comparing it with
``torch.equal`` against the resident model checks all of them, whatever backend moved them.

Values come from a seeded ``torch.Generator`` (hypothesis draws the seed), never from random bits, so
no float parameter holds a NaN (which would make ``torch.equal`` fail on an exact copy).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import nn

from fastoffload_ext import ModuleHookManager

D = 16  # activation width; Conv2d sees it as (4 channels, 2, 2)
BATCH = 3
FP8 = getattr(torch, "float8_e4m3fn", None)
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PARAM_DTYPES = COMPUTE_DTYPES + ((FP8,) if FP8 is not None else ()) + (torch.int8,)
BUFFER_DTYPES = (torch.int8, torch.bool)
PARAM_KINDS = ("vector", "matrix", "transposed", "channels_last", "zero", "scalar")


# ---- specs ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LinearSpec:
    dtype: torch.dtype
    bias: bool
    transposed: bool  # weight stored with strides (1, D): a non-contiguous parameter


@dataclass(frozen=True)
class NormSpec:
    dtype: torch.dtype


@dataclass(frozen=True)
class ConvSpec:
    dtype: torch.dtype
    bias: bool


@dataclass(frozen=True)
class ParamSpec:
    dtype: torch.dtype
    kind: str


@dataclass(frozen=True)
class BagSpec:
    params: tuple[ParamSpec, ...]
    buffers: tuple[torch.dtype, ...]


@dataclass(frozen=True)
class SeqSpec:
    children: tuple[object, ...]
    container: str  # "list" (nn.ModuleList) or "dict" (nn.ModuleDict)


@dataclass(frozen=True)
class TreeSpec:
    blocks: tuple[SeqSpec, ...]
    seed: int


# ---- strategies ----------------------------------------------------------------------------------

def _leaf() -> st.SearchStrategy[object]:
    compute = st.sampled_from(COMPUTE_DTYPES)
    return st.one_of(
        st.builds(LinearSpec, compute, st.booleans(), st.booleans()),
        st.builds(NormSpec, st.sampled_from((torch.float32, torch.bfloat16))),
        st.builds(ConvSpec, st.sampled_from((torch.float32, torch.bfloat16)), st.booleans()),
        st.builds(BagSpec,
                  st.lists(st.builds(ParamSpec, st.sampled_from(PARAM_DTYPES), st.sampled_from(PARAM_KINDS)),
                           max_size=4).map(tuple),
                  st.lists(st.sampled_from(BUFFER_DTYPES), max_size=2).map(tuple)),
    )


def _node(depth: int) -> st.SearchStrategy[object]:
    if depth == 0:
        return _leaf()
    return st.one_of(_leaf(), _seq(depth - 1, min_size=1))


def _seq(depth: int, min_size: int = 0) -> st.SearchStrategy[SeqSpec]:
    return st.builds(SeqSpec, st.lists(_node(depth), min_size=min_size, max_size=3).map(tuple),
                     st.sampled_from(("list", "dict")))


def _block() -> st.SearchStrategy[SeqSpec]:
    # One block in ten has no parameters at all (a pure function between weighted blocks).
    empty = st.just(SeqSpec((), "list"))
    return st.sampled_from(range(10)).flatmap(lambda k: empty if k == 0 else _seq(2, min_size=1))


def trees(min_blocks: int = 1, max_blocks: int = 7) -> st.SearchStrategy[TreeSpec]:
    """Trees of ``min_blocks``..``max_blocks`` blocks, each a nesting (depth <= 3) of 1-3 nodes per level.

    The block count is drawn uniformly (``sampled_from``), not from ``lists``' size distribution, which
    favours short lists: the wrap-around cases need 5-7 blocks as often as 1-2.
    """
    counts = st.sampled_from(range(min_blocks, max_blocks + 1))
    return st.builds(TreeSpec, counts.flatmap(lambda n: st.lists(_block(), min_size=n, max_size=n).map(tuple)),
                     st.integers(0, 2**31 - 1))


# ---- modules -------------------------------------------------------------------------------------

def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """A float64 scalar that changes with any element's value or position (exact for every dtype here)."""
    flat = tensor.detach().to(torch.float64).reshape(-1)
    return (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)).sum()


def _values(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    return (torch.randn(shape, generator=gen) * 0.5).to(dtype)


def _param_tensor(spec: ParamSpec, gen: torch.Generator) -> torch.Tensor:
    if spec.kind == "vector":
        return _values((5,), spec.dtype, gen)
    if spec.kind == "matrix":
        return _values((D, 3), spec.dtype, gen)
    if spec.kind == "transposed":
        return _values((3, D), spec.dtype, gen).t()  # (D, 3), strides (1, D)
    if spec.kind == "channels_last":
        return _values((2, 3, 2, 2), spec.dtype, gen).contiguous(memory_format=torch.channels_last)
    if spec.kind == "zero":
        return _values((0, 4), spec.dtype, gen)
    return _values((), spec.dtype, gen)


class Node(nn.Module):
    """Base: folds a checksum of the node's own parameters and buffers into ``acc``."""

    def fold(self, acc: torch.Tensor) -> torch.Tensor:
        for tensor in [*self._parameters.values(), *self._buffers.values()]:
            if tensor is not None:
                acc = acc + checksum(tensor)
        return acc


class LinearNode(Node):
    def __init__(self, spec: LinearSpec, gen: torch.Generator) -> None:
        super().__init__()
        self.dtype = spec.dtype
        self.linear = nn.Linear(D, D, bias=spec.bias, dtype=spec.dtype)
        weight = _values((D, D), spec.dtype, gen) * 0.5
        with torch.no_grad():
            self.linear.weight = nn.Parameter(weight.t().contiguous().t() if spec.transposed else weight)
            if spec.bias:
                self.linear.bias.copy_(_values((D,), spec.dtype, gen))

    def forward(self, x: torch.Tensor, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tanh(x + self.linear(x.to(self.dtype)).float())
        acc = acc + checksum(self.linear.weight)
        if self.linear.bias is not None:
            acc = acc + checksum(self.linear.bias)
        return x, self.fold(acc)


class NormNode(Node):
    def __init__(self, spec: NormSpec, gen: torch.Generator) -> None:
        super().__init__()
        self.dtype = spec.dtype
        self.norm = nn.LayerNorm(D, dtype=spec.dtype)
        with torch.no_grad():
            self.norm.weight.copy_(_values((D,), spec.dtype, gen) + 1)
            self.norm.bias.copy_(_values((D,), spec.dtype, gen))

    def forward(self, x: torch.Tensor, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + 0.5 * self.norm(x.to(self.dtype)).float()
        acc = acc + checksum(self.norm.weight) + checksum(self.norm.bias)
        return x, self.fold(acc)


class ConvNode(Node):
    def __init__(self, spec: ConvSpec, gen: torch.Generator) -> None:
        super().__init__()
        self.dtype = spec.dtype
        self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=spec.bias, dtype=spec.dtype)
        weight = (_values((4, 4, 3, 3), spec.dtype, gen) * 0.3).contiguous(memory_format=torch.channels_last)
        assert not weight.is_contiguous() and weight.is_contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            self.conv.weight = nn.Parameter(weight)
            if spec.bias:
                self.conv.bias.copy_(_values((4,), spec.dtype, gen))

    def forward(self, x: torch.Tensor, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.conv(x.reshape(-1, 4, 2, 2).to(self.dtype)).float().reshape(x.shape)
        x = torch.tanh(x + y)
        acc = acc + checksum(self.conv.weight)
        if self.conv.bias is not None:
            acc = acc + checksum(self.conv.bias)
        return x, self.fold(acc)


class BagNode(Node):
    """Loose parameters of mixed dtypes and layouts, int8/bool buffers; (D, 3) float ones join a matmul."""

    def __init__(self, spec: BagSpec, gen: torch.Generator) -> None:
        super().__init__()
        for i, param in enumerate(spec.params):
            tensor = _param_tensor(param, gen)
            # Only floating-point tensors can require grad; fp8 and int8 parameters must not.
            grad = param.dtype in COMPUTE_DTYPES
            self.register_parameter(f"p{i}", nn.Parameter(tensor, requires_grad=grad))
        for i, dtype in enumerate(spec.buffers):
            self.register_buffer(f"b{i}", _values((2, 3), dtype, gen))

    def forward(self, x: torch.Tensor, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for param in self._parameters.values():
            if param.dtype in COMPUTE_DTYPES and tuple(param.shape) == (D, 3):
                x = x + 0.1 * (x.to(param.dtype) @ param).float().sum(-1, keepdim=True)
        return x, self.fold(acc)


class SeqNode(Node):
    def __init__(self, spec: SeqSpec, gen: torch.Generator) -> None:
        super().__init__()
        children = [build_node(child, gen) for child in spec.children]
        self.container = spec.container
        if spec.container == "dict":
            self.parts = nn.ModuleDict({f"n{i}": child for i, child in enumerate(children)})
        else:
            self.parts = nn.ModuleList(children)

    def forward(self, x: torch.Tensor, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self.parts.values() if isinstance(self.parts, nn.ModuleDict) else self.parts
        for part in parts:
            x, acc = part(x, acc)
        return x, self.fold(acc)


def build_node(spec: object, gen: torch.Generator) -> Node:
    if isinstance(spec, LinearSpec):
        return LinearNode(spec, gen)
    if isinstance(spec, NormSpec):
        return NormNode(spec, gen)
    if isinstance(spec, ConvSpec):
        return ConvNode(spec, gen)
    if isinstance(spec, BagSpec):
        return BagNode(spec, gen)
    if isinstance(spec, SeqSpec):
        return SeqNode(spec, gen)
    raise TypeError(f"unknown node spec {spec!r}")


class TreeModel(nn.Module):
    """``blocks`` is the list that offload hooks; the forward returns the activation and the checksums."""

    def __init__(self, spec: TreeSpec) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(spec.seed)
        self.blocks = nn.ModuleList(SeqNode(block, gen) for block in spec.blocks)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        acc = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
        for block in self.blocks:
            x, acc = block(x, acc)
        return x, acc


def inputs(seed: int, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed ^ 0x5EED)
    return [torch.randn(BATCH, D, generator=gen) for _ in range(steps)]


# ---- bitwise snapshots ---------------------------------------------------------------------------

def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s elements in logical order (bit-exact comparison for any dtype)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


Snapshot = dict[str, tuple[torch.dtype, tuple[int, ...], tuple[int, ...], torch.Tensor]]


def snapshot(module: nn.Module) -> Snapshot:
    """Every parameter and buffer (tied ones under each name): dtype, shape, strides and bytes."""
    result: Snapshot = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        result[name] = (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), raw_bytes(tensor).clone())
    return result


def mismatches(module: nn.Module, want: Snapshot) -> list[str]:
    """Names whose dtype, shape, strides or bytes differ from ``want`` (and names missing on either side)."""
    have = snapshot(module)
    problems = sorted(set(have) ^ set(want))
    for name in sorted(set(have) & set(want)):
        a, b = have[name], want[name]
        if a[:3] != b[:3] or not torch.equal(a[3], b[3]):
            problems.append(f"{name}: {a[:3]} vs {b[:3]}")
    return problems


def snapshot_bytes(want: Snapshot, parameters_only_of: nn.Module | None = None) -> int:
    names = None if parameters_only_of is None else {n for n, _ in parameters_only_of.named_parameters(
        remove_duplicate=False)}
    return sum(entry[3].numel() for name, entry in want.items() if names is None or name in names)


def has_hooks(module: nn.Module) -> bool:
    """Whether a hook manager (or its wrapped forward) is left on ``module``."""
    return ModuleHookManager.get_from(module) is not None or "forward" in vars(module)


__all__ = ["BATCH", "D", "TreeModel", "TreeSpec", "checksum", "features", "has_hooks", "inputs", "mismatches",
           "raw_bytes", "snapshot", "snapshot_bytes", "trees"]


def features(model: TreeModel, spec: TreeSpec, *, depth: int, resident: int, cyclic: bool,
             steps: int) -> set[str]:
    """Labels of what one drawn case exercises, to check that the strategy covers every kind."""
    n = len(spec.blocks)
    found = {f"blocks={n}", f"depth={depth}", f"steps={steps}", "cyclic=on" if cyclic else "cyclic=off",
             "resident=0" if resident == 0 else "resident=all" if resident == n else "resident=some"}
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int8: "int8",
             torch.bool: "bool"}
    if FP8 is not None:
        names[FP8] = "fp8"

    def walk(node: object, level: int) -> None:
        if isinstance(node, SeqSpec):
            found.add(f"nesting={min(level, 3)}")
            for child in node.children:
                walk(child, level + 1)
        elif isinstance(node, LinearSpec) and node.transposed:
            found.add("linear.transposed")
        elif isinstance(node, ConvSpec):
            found.add("conv.channels_last")
        elif isinstance(node, BagSpec):
            for param in node.params:
                found.add(f"param.{names[param.dtype]}")
                found.add({"zero": "param.zero_size"}.get(param.kind, f"param.{param.kind}"))
            for dtype in node.buffers:
                found.add(f"buffer.{names[dtype]}")

    for block in spec.blocks:
        walk(block, 1)
    if any(not list(block.parameters()) for block in model.blocks):
        found.add("block.no_params")
    return found
