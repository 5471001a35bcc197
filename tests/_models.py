"""Small models shared by the tests: the docs/DESIGN.md DiT-like block, at toy sizes."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import pytest

OFFLOAD_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class Block(nn.Module):
    """docs/DESIGN.md's block: qkv, o, up, down linears and a list of norms."""

    def __init__(self, d: int = 16, n_norms: int = 2) -> None:
        super().__init__()
        self.d = d
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(max(n_norms, 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.o(self.qkv(self.norms[0](x))[..., : self.d])
        x = x + h
        return x + self.down(F.gelu(self.up(self.norms[1](x))))


class Stack(nn.Module):
    """A transformer-shaped model: an embedding, the block list, a head."""

    def __init__(self, n_blocks: int, d: int = 16, n_norms: int = 2) -> None:
        super().__init__()
        self.proj_in = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d, n_norms) for _ in range(n_blocks))
        self.proj_out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
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


def params_equal(a: nn.Module, b: nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(
        pa[k].shape == pb[k].shape and pa[k].dtype == pb[k].dtype and torch.equal(pa[k].cpu(), pb[k].cpu()) for k in pa)
