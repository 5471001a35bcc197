"""Small models shared by the tests: the benchmarks' DiT-like block (docs/DESIGN.md, "Workloads and targets"), at
toy sizes."""
from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from torch import nn

from benchmarks.workloads import Block, BlockStack
from fastoffload_ext import LayerwiseOffloadHook
from fastoffload_ext.engine.offload_hook import offload_hook_of

__all__ = ["OFFLOAD_DEVICES", "Block", "Stack", "TwoLists", "count_calls", "make_pair", "offload_hook", "params_equal",
           "place_outside_blocks"]

OFFLOAD_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class Stack(BlockStack):
    """A transformer-shaped model: an input projection, the block list, an output projection."""

    def __init__(self, n_blocks: int, d: int = 16, n_norms: int = 2) -> None:
        super().__init__(d, n_blocks, n_norms, projections=True)


class TwoLists(nn.Module):
    """Flux-shaped: double-stream blocks (MLP ratio ``double_ratio``), then single-stream blocks, with projections
    around them and an empty list beside them."""

    def __init__(self, doubles: int = 3, singles: int = 4, d: int = 16, double_ratio: int = 2) -> None:
        super().__init__()
        self.proj_in = nn.Linear(d, d)
        self.transformer_blocks = nn.ModuleList(Block(d, double_ratio) for _ in range(doubles))
        self.single_transformer_blocks = nn.ModuleList(Block(d, 2) for _ in range(singles))
        self.empty = nn.ModuleList()
        self.proj_out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.transformer_blocks:
            x = block(x)
        for block in self.single_transformer_blocks:
            x = block(x)
        return self.proj_out(x)


def make_pair(n_blocks: int, dtype: torch.dtype = torch.float32, d: int = 16, seed: int = 0) -> tuple[Stack, Stack]:
    """Two identical models: one to offload, one to stay resident as the reference."""
    torch.manual_seed(seed)
    model = Stack(n_blocks, d).to(dtype)
    torch.manual_seed(seed)
    reference = Stack(n_blocks, d).to(dtype)
    return model, reference


def place_outside_blocks(model: nn.Module, device: str) -> None:
    """Moves everything but the block list to ``device`` (the caller's job, as with FastVideo)."""
    for name, child in model.named_children():
        if name != "blocks":
            child.to(device)


def count_calls(blocks: Iterable[nn.Module]) -> list[int]:
    """How often each of ``blocks`` has been called from now on (a forward pre-hook on each counts its calls)."""
    calls: list[int] = []
    for block in blocks:
        calls.append(0)
        block.register_forward_pre_hook(lambda *_, i=len(calls) - 1: calls.__setitem__(i, calls[i] + 1))
    return calls


def params_equal(a: nn.Module, b: nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(
        pa[k].shape == pb[k].shape and pa[k].dtype == pb[k].dtype and torch.equal(pa[k].cpu(), pb[k].cpu()) for k in pa)


def offload_hook(block: nn.Module) -> LayerwiseOffloadHook:
    """The layerwise offload hook on ``block`` (it must have one)."""
    hook = offload_hook_of(block)
    assert hook is not None
    return hook
