"""Edges of sharing one host copy between ranks and of compressed host copies.

Two ranks (``torch.multiprocessing``, spawn, gloo through a file in ``tmp_path``) with ``device="cpu"``
and the ext backend, as tests/test_sharing.py runs them; the codec cases run in this process.
"""
from __future__ import annotations

import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import fastoffload_ext as fo

from ._models import make_pair, params_equal, place_outside_blocks

WORLD = 2
D = 32
N_BLOCKS = 3
TIMEOUT_S = 120


def _init(rank: int, init_file: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))


def _model(n_blocks: int = N_BLOCKS, dtype: torch.dtype = torch.float32):
    model, reference = make_pair(n_blocks, dtype=dtype, d=D, seed=0)
    place_outside_blocks(model, "cpu")
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    return model, reference, x


def _exact(model: nn.Module, reference: nn.Module, x: torch.Tensor, steps: int = 3) -> bool:
    with torch.inference_mode():
        want = reference(x)
        return all(torch.equal(model(x), want) for _ in range(steps))


def _scenario_negative_view(rank: int, queue: Any) -> None:
    """Rank 1's weight is a negative view (its values are minus its storage); the owner's storage holds the
    same bytes with the opposite values. The ranks' weights differ, so they must not share."""
    result: dict[str, Any] = {}
    for mode in (True, "auto"):
        model, reference, x = _model()
        if rank == 1:
            with torch.no_grad():
                weight = model.blocks[1].up.weight
                # Same storage bytes as the owner's weight, values negated through the negative bit.
                model.blocks[1].up.weight = nn.Parameter(torch._neg_view(weight.detach().clone()),
                                                         requires_grad=False)
                reference.blocks[1].up.weight = nn.Parameter(-weight.detach().clone(), requires_grad=False)
        try:
            group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", share_host_copy=mode)
            result[str(mode)] = "enabled"
            result[f"{mode}_shared"] = group.share is not None
            result[f"{mode}_exact"] = _exact(model, reference, x)
            fo.disable_layerwise_offload(model, device="cpu")
        except RuntimeError as error:
            result[str(mode)] = f"{type(error).__name__}: {error}"
        result[f"{mode}_own_weights"] = params_equal(model, reference) and fo.get_offload_group(model) is None
    queue.put((rank, "done", result))


SCENARIOS = {"negative_view": _scenario_negative_view}


def _worker(rank: int, init_file: str, scenario: str, queue: Any) -> None:
    try:
        _init(rank, init_file)
        SCENARIOS[scenario](rank, queue)
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


def _run(tmp_path: Path, scenario: str) -> dict[int, Any]:
    context = mp.get_context("spawn")
    queues = [context.Queue() for _ in range(WORLD)]
    processes = [context.Process(target=_worker, args=(rank, str(tmp_path / "rendezvous"), scenario, queues[rank]),
                                 daemon=True) for rank in range(WORLD)]
    for process in processes:
        process.start()
    got: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(got) < WORLD:
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for the ranks (got {sorted(got)})")
            rank = [r for r in range(WORLD) if r not in got][0]
            try:
                _, kind, payload = queues[rank].get(timeout=0.2)
            except Exception:
                continue
            if kind == "error":
                pytest.fail(f"rank {rank} failed:\n{payload}")
            got[rank] = payload
    finally:
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            process.join(10)
    return got


def test_a_negative_view_weight_with_the_owners_bytes_is_not_shared(tmp_path: Path) -> None:
    """The digest must hash a parameter's values, not its storage: a negative view holding the owner's
    bytes has other values, so True raises naming it and "auto" keeps one copy per rank, exact."""
    done = _run(tmp_path, "negative_view")
    for rank in range(WORLD):
        assert done[rank]["True"].startswith("OffloadStateError"), done[rank]
        assert "'blocks.1.up.weight' holds different values on rank 1" in done[rank]["True"], done[rank]
        assert done[rank]["True_own_weights"], done[rank]
        assert done[rank]["auto"] == "enabled" and not done[rank]["auto_shared"], done[rank]
        assert done[rank]["auto_exact"] and done[rank]["auto_own_weights"], done[rank]
