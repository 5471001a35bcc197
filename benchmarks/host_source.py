"""One host copy of a model's weights that every peer's model of the models section is bound to.

Moving a 24-28 GB model from the device to fresh pageable host memory takes about 20 s on the H200
machine, and each peer needs the whole model on the host. None of the peers writes into the host
tensors it is given: each pins copies of them (FastVideo, SGLang, diffusers, mmgp) or keeps them as
the source of its own moves (accelerate), and rebinds ``param.data`` rather than writing through it.
So the host copy is made once per model and every peer's model is a device-side deep copy of the
master whose parameters and buffers are then rebound to it: no copy at all.

Because a peer could still write into them, :func:`fingerprint` samples every tensor (a strided sum)
after each peer; when it changed, the caller drops the copy and the next peer gets a fresh one, and
every peer's output is compared with the resident model's bit for bit anyway.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch import nn

FINGERPRINT_STRIDE = 4099  # a prime: no alignment with a tensor's rows


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))


def host_source(master: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``master`` on the host, by name; a tensor shared under two names is one."""
    seen: dict[tuple[int, torch.Size, torch.dtype], torch.Tensor] = {}
    source: dict[str, torch.Tensor] = {}
    for name, tensor in _named_tensors(master):
        key = (tensor.data_ptr(), tensor.shape, tensor.dtype)
        if key not in seen:
            seen[key] = tensor.detach().to("cpu", copy=True)  # a copy also where the master is on the host
        source[name] = seen[key]
    return source


def bind(model: nn.Module, source: dict[str, torch.Tensor]) -> None:
    """Rebinds every parameter and buffer of ``model`` (a copy of the source's model) to the source's tensor."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        head = f"{prefix}." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None:
                param.data = source[head + name]
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = source[head + name]


def fingerprint(source: dict[str, torch.Tensor]) -> list[float]:
    """A strided sample sum of every distinct tensor: changes when a peer writes into the copy."""
    unique = {id(tensor): tensor for tensor in source.values()}
    with torch.no_grad():
        return [float(tensor.reshape(-1)[::FINGERPRINT_STRIDE].double().sum()) for tensor in unique.values()]
