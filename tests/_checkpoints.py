"""Checkpoints written by the tests with safetensors, and models built on the meta device to fill from them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from tests._models import Stack


def reference_stack(n_blocks: int, d: int = 32, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    return Stack(n_blocks, d).to(dtype)


def meta_stack(n_blocks: int, d: int = 32, dtype: torch.dtype = torch.bfloat16) -> Stack:
    with torch.device("meta"):
        return Stack(n_blocks, d).to(dtype)


def write_single(model: nn.Module, path: Path) -> Path:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def write_sharded(model: nn.Module, folder: Path, shards: int = 3,
                  stem: str = "diffusion_pytorch_model") -> Path:
    """``shards`` files plus ``<stem>.safetensors.index.json``, as diffusers and transformers write them."""
    folder.mkdir(parents=True, exist_ok=True)
    names = list(model.state_dict())
    state = model.state_dict()
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        file = f"{stem}-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k].contiguous() for k in part}, str(folder / file))
        weight_map.update({k: file for k in part})
    index = folder / f"{stem}.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def block_bytes(model: Stack) -> int:
    return sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())


def inputs(d: int = 32, dtype: torch.dtype = torch.bfloat16, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(2, 5, d, dtype=dtype)


def record_reads(monkeypatch: Any) -> list[tuple[int, int]]:
    """Makes the compiled core's DiskReader record every (offset, length) it is asked to read, for the code
    that gets it through ``_backend.require_ext()``; returns the list it fills."""
    from fastoffload_ext import _backend
    core = _backend.require_ext()
    reads: list[tuple[int, int]] = []

    class Recording:
        def __init__(self, *args: object) -> None:
            self.inner = core.DiskReader(*args)

        def open(self, name: str) -> int:
            return self.inner.open(name)

        def read(self, spans: list, buffer: torch.Tensor, scratch: bool = False) -> None:
            reads.extend((offset, length) for _, offset, length, _ in spans)
            self.inner.read(spans, buffer, scratch=scratch)

        def stats(self) -> dict:
            return self.inner.stats()

    class Ext:
        DiskReader = Recording

    monkeypatch.setattr(_backend, "require_ext", lambda: Ext)
    return reads

