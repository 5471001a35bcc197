"""Ranks of one host share one host copy, with real processes.

Two processes (``torch.multiprocessing``, spawn) form a gloo group through a file in ``tmp_path`` and
enable offload with ``device="cpu"``, ``backend="ext"``, ``share_host_copy=True``: the owner (rank 0)
packs into shared segments, rank 1 maps them. The test kills rank 1 with SIGKILL to show that nothing
is left in /dev/shm and that rank 0 keeps computing exactly.

Every wait has a timeout, so a hang fails the test instead of blocking CI; the processes are killed on
the way out whatever happened. The timeouts are generous (spawning two torch processes on a loaded CI
machine takes a while); the process group's own timeout is longer still, so "every rank raised at
once" and "a rank waited for the group's timeout" cannot be confused.
"""
from __future__ import annotations

import copy
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
from fastoffload_ext import LayerwiseOffloadHook, ModuleHookManager
from fastoffload_ext.engine import offload_state

from ._models import make_pair, params_equal, place_outside_blocks

WORLD = 2
D = 128  # 4 blocks of ~0.8 MB: big enough for the memory figures to mean something
N_BLOCKS = 4
SHM = Path("/dev/shm")
TIMEOUT_S = 90
GROUP_TIMEOUT_S = 300


def _names(job: str) -> list[str]:
    """Names in /dev/shm of the job ``job`` (its segments and its lock)."""
    return sorted(entry for entry in os.listdir(SHM) if entry.startswith(f"fastoffload-{job}-"))


def _segments(job: str) -> list[str]:
    """Shared segments in /dev/shm of the job ``job`` (without its lock)."""
    return [entry for entry in _names(job) if not entry.endswith("-lock")]


def _mapping_modes() -> set[str]:
    """The permissions ("r--s", "rw-s") of this process's mappings of fastoffload segments."""
    modes = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and "/fastoffload-" in fields[5]:
            modes.add(fields[1])
    return modes


def _pss_segments_bytes() -> int:
    """This process's proportional share of the pages of its fastoffload segments (a page mapped by 2
    counts half). Only those mappings: the CUDA driver maps shared memory of its own."""
    total, ours = -1, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            ours = any("/fastoffload-" in field for field in fields[5:])
        elif ours and fields and fields[0] == "Pss:":
            total = max(total, 0) + int(fields[1]) * 1024
    return total


def _init(rank: int, init_file: str) -> None:
    import torch.distributed as dist

    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))


def _model(device: str, up_width: int | None = None):
    model, reference = make_pair(N_BLOCKS, d=D, seed=0)
    if up_width is not None:
        # Rank 1 of the mismatch scenario: block 1's `up` has another shape.
        model.blocks[1].up = nn.Linear(D, up_width)
        reference.blocks[1].up = copy.deepcopy(model.blocks[1].up)
    reference.to(device)
    place_outside_blocks(model, device)
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(1)).to(device)
    if up_width is not None:
        return model, reference, x, None  # that block no longer fits the model: never run
    with torch.inference_mode():
        want = reference(x)
    return model, reference, x, want


def place_named(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p.detach().cpu()) for name, p in module.named_parameters()]


def _exact(model: nn.Module, x: torch.Tensor, want: torch.Tensor, steps: int = 3) -> bool:
    with torch.inference_mode():
        return all(torch.equal(model(x), want) for _ in range(steps))


def _scenario_main(rank: int, device: str, queue: Any, control: Path) -> None:
    model, reference, x, want = _model(device)
    group = fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy=True)
    result: dict[str, Any] = {"exact": _exact(model, x, want), "stats": group.stats(), "job": group.share.job,
                              "fallback_slabs": group.engine.pool.stats()["fallback_slabs"]}
    import torch.distributed as dist

    dist.barrier()  # both ranks have touched every shared page: each is charged half of it
    result["segment_pss_bytes"] = _pss_segments_bytes()
    result["mapping_modes"] = _mapping_modes()
    # Host views of a shared block are copies: writing into them (as rank 1 does here) must neither crash
    # on the read-only pages nor reach the other rank's weights, and the block refuses to run while the
    # written copies are alive (the write cannot reach the model).
    host = group.states[0].cpu_named_parameters
    result["host_views_equal"] = all(torch.equal(host[n], p) for n, p in place_named(reference.blocks[0]))
    if rank == 1:
        for tensor in host.values():
            tensor.add_(1.0)
        result["host_views_after_write"] = all(
            torch.equal(t, p) for t, (_, p) in zip(group.states[0].cpu_named_parameters.values(),
                                                   place_named(reference.blocks[0])))
        try:
            _exact(model, x, want, steps=1)
        except fo.OffloadStateError as error:
            result["write_refused"] = "was a copy" in str(error)
        del host, tensor  # said by the refusal: dropped, the write is forgotten
    dist.barrier()
    result["exact_after_write"] = _exact(model, x, want, steps=1)
    try:
        with ModuleHookManager.get_from(model.blocks[0]).get_forward_hook(
                LayerwiseOffloadHook.name()).mutate_params_scope():
            result["mutate"] = "allowed"
    except RuntimeError as error:
        result["mutate"] = str(error)
    result["exact_after_refusal"] = _exact(model, x, want, steps=1)
    queue.put((rank, "enabled", result))
    if rank == 1:
        time.sleep(TIMEOUT_S * 2)  # the test kills this process
        return
    deadline = time.monotonic() + TIMEOUT_S
    while not (control / "killed").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the test never killed rank 1")
        time.sleep(0.05)
    queue.put((rank, "after_kill", {"exact": _exact(model, x, want)}))


def _scenario_failures(rank: int, device: str, queue: Any, control: Path) -> None:
    import torch.distributed as dist

    result: dict[str, Any] = {}
    # (g) rank 1 builds block 1 with another shape: refused on both ranks before anything is created.
    model, reference, _, _ = _model(device, up_width=5 * D if rank == 1 else None)
    try:
        fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy=True)
        result["mismatch"] = "enabled"
    except RuntimeError as error:
        result["mismatch"] = str(error)
    result["mismatch_untouched"] = params_equal(model, reference) and fo.get_offload_group(model) is None
    dist.barrier()

    # (h) same model, but rank 1 fails while attaching its third block, after the owner packed all four:
    # every rank rolls back and the owner unlinks the segments it had created.
    model, reference, x, want = _model(device)
    original = offload_state.ExtLayerwiseOffloadState.on_init
    attached = []

    def failing_on_init(state: Any, module: nn.Module) -> None:
        if rank == 1 and len(attached) == 2:
            result["job"] = state.shared_segment.split("-")[1]
            result["segments_while_attaching"] = _segments(result["job"])
            raise OSError("injected attach failure")
        original(state, module)
        attached.append(module)

    offload_state.ExtLayerwiseOffloadState.on_init = failing_on_init  # type: ignore[method-assign]
    try:
        fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy=True)
        result["attach_failure"] = "enabled"
    except (RuntimeError, OSError) as error:
        result["attach_failure"] = f"{type(error).__name__}: {error}"
    finally:
        offload_state.ExtLayerwiseOffloadState.on_init = original  # type: ignore[method-assign]
    result["rolled_back"] = params_equal(model, reference) and fo.get_offload_group(model) is None
    dist.barrier()
    # The group still works after both failures: a third enable shares and computes exactly.
    group = fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy=True)
    result["third_enable_exact"] = _exact(model, x, want)
    result["third_enable_job"] = group.share.job
    dist.barrier()
    queue.put((rank, "done", result))


def _scenario_small_shm(rank: int, device: str, queue: Any, control: Path) -> None:
    """/dev/shm reports less free space than the host copy needs (Docker's default is 64 MiB)."""
    from fastoffload_ext.engine import sharing

    sharing._shm_free_bytes = lambda: 1 << 20  # type: ignore[assignment]
    result: dict[str, Any] = {}
    model, reference, x, want = _model(device)
    try:
        fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy=True)
        result["true"] = "enabled"
    except RuntimeError as error:
        result["true"] = str(error)
    result["untouched"] = params_equal(model, reference) and fo.get_offload_group(model) is None
    group = fo.enable_layerwise_offload(model, device=device, backend="ext")  # "auto": falls back, one copy per rank
    result["auto_shared"] = group.share is not None
    result["auto_exact"] = _exact(model, x, want)
    queue.put((rank, "done", result))


def _scenario_interrupts(rank: int, device: str, queue: Any, control: Path) -> None:
    """Ctrl-C on one rank in the middle of enable: first on rank 1 while it attaches its third block (the
    owner has packed all four), then on the owner while it packs its second block."""
    import torch.distributed as dist

    result: dict[str, Any] = {}
    model, reference, x, want = _model(device)
    original = offload_state.ExtLayerwiseOffloadState.on_init
    for label, victim, at_block in (("attaching", 1, 2), ("packing", 0, 1)):
        done_blocks = []

        def interrupted_on_init(state: Any, module: nn.Module) -> None:
            if rank == victim and len(done_blocks) == at_block:
                raise KeyboardInterrupt
            original(state, module)
            done_blocks.append(module)

        offload_state.ExtLayerwiseOffloadState.on_init = interrupted_on_init  # type: ignore[method-assign]
        try:
            fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy=True)
            result[label] = "enabled"
        except BaseException as error:  # KeyboardInterrupt is what this checks
            result[label] = f"{type(error).__name__}: {error}"
        finally:
            offload_state.ExtLayerwiseOffloadState.on_init = original  # type: ignore[method-assign]
        result[f"{label}_rolled_back"] = params_equal(model, reference) and fo.get_offload_group(model) is None
        dist.barrier()
        result[f"{label}_names_after"] = [entry for entry in os.listdir(SHM) if entry.startswith("fastoffload-")]
        dist.barrier()
    fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy=True)
    result["then_exact"] = _exact(model, x, want)
    dist.barrier()
    queue.put((rank, "done", result))


def _scenario_out_of_step(rank: int, device: str, queue: Any, control: Path) -> None:
    """Rank 1 fails before the negotiation (a meta parameter): every rank raises at once, together."""
    result: dict[str, Any] = {}
    for mode in (True, "auto"):
        model, reference, x, want = _model(device)
        if rank == 1:
            model.blocks[2].up.weight = nn.Parameter(torch.empty(4 * D, D, device="meta"), requires_grad=False)
        start = time.monotonic()
        try:
            fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy=mode)
            result[str(mode)] = "enabled"
        except (RuntimeError, ValueError) as error:
            result[str(mode)] = f"{type(error).__name__}: {error}"
        result[f"{mode}_seconds"] = time.monotonic() - start
        result[f"{mode}_untouched"] = fo.get_offload_group(model) is None
    # The collectives are still in step: the next enable (same model everywhere) shares and is exact.
    model, reference, x, want = _model(device)
    group = fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy=True)
    result["then_shared"] = group.share is not None and group.share.shared_by == WORLD
    result["then_exact"] = _exact(model, x, want)
    queue.put((rank, "done", result))


def _scenario_values(rank: int, device: str, queue: Any, control: Path) -> None:
    """Rank 1 changed one element of one weight (layouts equal): True raises, "auto" keeps one copy each."""
    result: dict[str, Any] = {}
    for mode in (True, "auto"):
        model, reference, x, _ = _model(device)
        if rank == 1:
            with torch.no_grad():
                for m in (model, reference):
                    m.blocks[1].up.weight[7, 3] += 0.5
        with torch.inference_mode():
            want = reference(x)
        try:
            group = fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy=mode)
            result[str(mode)] = "enabled"
            result[f"{mode}_shared"] = group.share is not None
            result[f"{mode}_shared_bytes"] = group.stats()["shared_bytes"]
            result[f"{mode}_exact"] = _exact(model, x, want)
            fo.disable_layerwise_offload(model, device="cpu")
        except RuntimeError as error:
            result[str(mode)] = f"{type(error).__name__}: {error}"
        # Either way each rank keeps (or gets back) exactly its own weights.
        result[f"{mode}_own_weights"] = params_equal(model, reference) and fo.get_offload_group(model) is None
    queue.put((rank, "done", result))


def _scenario_taken_name(rank: int, device: str, queue: Any, control: Path) -> None:
    """Someone took the owner's first segment name before it could create it: "auto" falls back on every
    rank together, True raises on every rank."""
    import itertools

    from fastoffload_ext.engine import sharing

    result: dict[str, Any] = {}
    for mode in ("auto", True):
        counter = itertools.count(1)
        # The names are random; here they are made predictable so that the test can take one first.
        sharing.secrets.token_hex = lambda nbytes=16: f"{rank + 1:02x}{next(counter):030x}"  # type: ignore[assignment]
        taken = SHM / f"fastoffload-01{1:030x}-01{2:030x}"
        if rank == 0:
            taken.write_bytes(b"squatter")
        model, reference, x, want = _model(device)
        import torch.distributed as dist

        dist.barrier()
        try:
            group = fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy=mode)
            result[str(mode)] = "enabled"
            result[f"{mode}_shared"] = group.share is not None
            result[f"{mode}_exact"] = _exact(model, x, want)
            fo.disable_layerwise_offload(model, device="cpu")
        except RuntimeError as error:
            result[str(mode)] = f"{type(error).__name__}: {error}"
        result[f"{mode}_own_weights"] = params_equal(model, reference)
        result[f"{mode}_names_after"] = _names(f"01{1:030x}")
        dist.barrier()
        if rank == 0:
            taken.unlink()
    queue.put((rank, "done", result))


def _bf16_model(device: str):
    """The bf16 model whose blocks the codec compresses (the float32 one travels raw)."""
    model, reference = make_pair(N_BLOCKS, dtype=torch.bfloat16, d=D, seed=0)
    reference.to(device)
    place_outside_blocks(model, device)
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    with torch.inference_mode():
        want = reference(x)
    return model, reference, x, want


def _scenario_codec(rank: int, device: str, queue: Any, control: Path) -> None:
    """Compressed shared host copies: the owner encodes, rank 1 maps the same compressed bytes."""
    import torch.distributed as dist

    result: dict[str, Any] = {}
    for mode in (True, "auto"):
        model, reference, x, want = _bf16_model(device)
        group = fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy=True, compress=mode)
        stats = group.stats()
        host = group.states[1].cpu_named_parameters
        result[str(mode)] = {
            "exact": _exact(model, x, want), "stats": {k: v for k, v in stats.items() if k != "codec"},
            "codec": stats["codec"], "job": group.share.job, "mapping_modes": _mapping_modes(),
            "host_views_equal": all(torch.equal(host[n], p) for n, p in place_named(reference.blocks[1]))}
        try:
            with ModuleHookManager.get_from(model.blocks[0]).get_forward_hook(
                    LayerwiseOffloadHook.name()).mutate_params_scope():
                result[str(mode)]["mutate"] = "allowed"
        except RuntimeError as error:
            result[str(mode)]["mutate"] = str(error)
        dist.barrier()
        fo.disable_layerwise_offload(model, device="cpu")
        result[str(mode)]["own_weights"] = params_equal(model, reference)
    # The ranks disagree on the codec: True raises on every rank, "auto" keeps one copy per rank.
    for share in (True, "auto"):
        model, reference, x, want = _bf16_model(device)
        try:
            group = fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy=share,
                                                compress=True if rank == 0 else "auto")
            result[f"mismatch_{share}"] = {"shared": group.share is not None, "exact": _exact(model, x, want)}
            fo.disable_layerwise_offload(model, device="cpu")
        except RuntimeError as error:
            result[f"mismatch_{share}"] = f"{type(error).__name__}: {error}"
        result[f"mismatch_{share}_own_weights"] = params_equal(model, reference)
    queue.put((rank, "done", result))


def _scenario_replan(rank: int, device: str, queue: Any, control: Path) -> None:
    """Rank 0 alone re-plans a shared, planned offload to another layout: refused there at once (applying it
    would start enable's collective on rank 0 alone), nothing changed on either rank, and the ranks' next
    collective (a disable, then an enable with the new plan on both) is still in step."""
    from fastoffload_ext.planning import BlockCosts, module_packed_bytes

    result: dict[str, Any] = {}
    model, reference, x, want = _model(device)
    block = module_packed_bytes(model.blocks[0])
    group = fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy="auto",
                                        device_budget=3 * block)
    result["resident"] = group.resident
    table = BlockCosts([0.1, 0.1, 0.1, 9.0], [block] * N_BLOCKS, 5.0)  # keeps block 1, not block 0
    new = None
    if rank == 0:
        start = time.monotonic()
        try:
            group.replan(table)
            result["replan"] = "applied"
        except RuntimeError as error:
            result["replan"] = f"{type(error).__name__}: {error}"
        result["replan_seconds"] = time.monotonic() - start
        result["unchanged"] = fo.get_offload_group(model) is group and group.resident == result["resident"]
    result["exact"] = _exact(model, x, want)
    new = fo.plan_offload(table, 3 * block)
    result["new_resident"] = new.resident
    fo.disable_layerwise_offload(model, device="cpu")
    group = fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy="auto", plan=new,
                                        device_budget=3 * block)
    result["then_resident"] = group.resident
    result["then_shared"] = group.share is not None and group.share.shared_by == WORLD
    result["then_exact"] = _exact(model, x, want)
    fo.disable_layerwise_offload(model, device="cpu")
    result["own_weights"] = params_equal(model, reference)
    queue.put((rank, "done", result))


def _scenario_dropped(rank: int, device: str, queue: Any, control: Path) -> None:
    """Each rank drops its shared offload in turn (the owner first), the collector off: each is freed with its
    last reference, and the other rank, still offloaded from the same pages, stays exact."""
    import gc
    import weakref

    import torch.distributed as dist

    model, _, x, want = _model(device)
    group = fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy=True)
    result: dict[str, Any] = {"shared": group.share is not None, "exact": _exact(model, x, want)}
    refs = [weakref.ref(model), weakref.ref(group), weakref.ref(group.engine)]
    group = None
    gc.collect()
    gc.disable()
    try:
        for turn in range(WORLD):
            dist.barrier()
            if turn == rank:
                del model
                result["freed"] = [ref() is None for ref in refs]
            elif turn < rank:
                result["exact_after_other_dropped"] = _exact(model, x, want)
        dist.barrier()
    finally:
        gc.enable()
    queue.put((rank, "dropped", result))


SCENARIOS = {"main": _scenario_main, "codec": _scenario_codec, "failures": _scenario_failures,
             "small_shm": _scenario_small_shm, "interrupts": _scenario_interrupts, "out_of_step": _scenario_out_of_step,
             "values": _scenario_values, "taken_name": _scenario_taken_name, "replan": _scenario_replan,
             "dropped": _scenario_dropped}


def _worker(rank: int, init_file: str, scenario: str, device: str, queue: Any, control: str) -> None:
    try:
        if device.startswith("cuda"):
            # "cuda": one GPU per rank, as torchrun runs; "cuda:0": both ranks on GPU 0 (a one-GPU machine).
            index = rank if device == "cuda" else int(device.split(":")[1])
            torch.cuda.set_device(index)
            device = f"cuda:{index}"
        _init(rank, init_file)
        SCENARIOS[scenario](rank, device, queue, Path(control))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)  # no process-group teardown: rank 1 may already be dead


class _Ranks:
    """Two spawned ranks and their result queues; kills whatever is still alive on exit.

    One queue per rank: a queue's write lock is shared by its writers, and a rank killed with SIGKILL
    must not be able to take it down with it.
    """

    def __init__(self, tmp_path: Path, scenario: str, device: str = "cpu") -> None:
        context = mp.get_context("spawn")
        self.queues = [context.Queue() for _ in range(WORLD)]
        self.control = tmp_path
        init_file = tmp_path / "rendezvous"
        self.processes = [context.Process(target=_worker, args=(rank, str(init_file), scenario, device,
                                                                  self.queues[rank], str(tmp_path)), daemon=True)
                          for rank in range(WORLD)]

    def __enter__(self) -> _Ranks:
        for process in self.processes:
            process.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for process in self.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            process.join(10)

    def expect(self, what: str, ranks: range | list[int]) -> dict[int, Any]:
        """Message ``what`` from each of ``ranks``; a rank's error or a timeout fails the test."""
        got: dict[int, Any] = {}
        deadline = time.monotonic() + TIMEOUT_S
        while len(got) < len(ranks):
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {TIMEOUT_S} s waiting for {what!r} from the ranks (got {sorted(got)})")
            try:
                rank, kind, payload = self.queues[[r for r in ranks if r not in got][0]].get(timeout=0.2)
            except Exception:
                continue
            if kind == "error":
                pytest.fail(f"rank {rank} failed:\n{payload}")
            assert kind == what, (rank, kind, payload)
            got[rank] = payload
        return got


def _run_main(tmp_path: Path, device: str) -> None:
    with _Ranks(tmp_path, "main", device) as ranks:
        enabled = ranks.expect("enabled", range(WORLD))
        job = enabled[0]["job"]
        # (a) bit-identical to the resident model over 3 steps, on both ranks, under the owner's random names.
        assert enabled[0]["exact"] and enabled[1]["exact"]
        assert enabled[1]["job"] == job and len(job) == 32
        # (b) one copy on the host: the owner's pool owns the bytes, rank 1 only maps them.
        s0, s1 = enabled[0]["stats"], enabled[1]["stats"]
        packed = s0["host_bytes"]
        assert s0["shared_owner"] and not s1["shared_owner"] and s0["shared_by"] == s1["shared_by"] == 2
        assert s0["shared_owned_bytes"] == s0["shared_bytes"] >= packed > 0
        assert s1["shared_owned_bytes"] == 0 and s1["shared_bytes"] == s0["shared_bytes"]
        owned_on_host = s0["shared_owned_bytes"] + s1["shared_owned_bytes"]
        assert owned_on_host <= 1.01 * packed + 4096 * N_BLOCKS
        pss = enabled[0]["segment_pss_bytes"] + enabled[1]["segment_pss_bytes"]
        # The kernel's count: each rank is charged half of every shared page, so the sum is ~1x.
        assert enabled[0]["segment_pss_bytes"] > 0 and enabled[1]["segment_pss_bytes"] > 0
        assert pss < 1.5 * packed, (pss, packed)
        if device.startswith("cuda"):
            # Each rank registered its own mapping; rank 1's is read-only (cudaHostRegisterReadOnly where
            # the device supports it), and nothing fell back to pageable memory.
            assert s0["pinned_bytes"] >= packed and s1["pinned_bytes"] >= packed
            assert enabled[0]["fallback_slabs"] == enabled[1]["fallback_slabs"] == 0
        print(f"\nshared host copy, {device}: packed {packed} B; rank 0 {({k: s0[k] for k in _FIGURES})}; "
              f"rank 1 {({k: s1[k] for k in _FIGURES})}; owned on host {owned_on_host} B "
              f"({owned_on_host / packed:.3f}x packed); segment PSS rank 0 {enabled[0]['segment_pss_bytes']} B + rank 1 "
              f"{enabled[1]['segment_pss_bytes']} B = {pss} B ({pss / packed:.3f}x packed)")
        # (e) mutate_params_scope refused with the message, and offload still exact afterwards.
        for rank in range(WORLD):
            assert "the host copy is shared by 2 ranks of this host; mutate before enabling offload, or enable " \
                   "with share_host_copy=False" in enabled[rank]["mutate"]
            assert enabled[rank]["exact_after_refusal"]
        # (f) rank 1 maps the shared pages read-only, the owner read-write; host views are copies, so rank
        # 1's writes into them changed nothing, on either rank, and its next forward refused while they lived.
        assert enabled[1]["mapping_modes"] == {"r--s"} and enabled[0]["mapping_modes"] == {"rw-s"}
        for rank in range(WORLD):
            assert enabled[rank]["host_views_equal"] and enabled[rank]["exact_after_write"]
        assert enabled[1]["host_views_after_write"] and enabled[1].get("write_refused")
        # (c) after enable returned on both ranks the names (and the owner's lock) are gone.
        assert _names(job) == []
        # (d) kill -9 of rank 1: nothing left behind, rank 0 still exact.
        os.kill(ranks.processes[1].pid, signal.SIGKILL)
        ranks.processes[1].join(10)
        assert ranks.processes[1].exitcode == -signal.SIGKILL
        assert _names(job) == []
        (ranks.control / "killed").touch()
        assert ranks.expect("after_kill", [0])[0]["exact"]
        ranks.processes[0].join(TIMEOUT_S)
    assert _names(job) == []


_FIGURES = ("shared_owner", "shared_bytes", "shared_owned_bytes", "host_reserved_bytes", "pinned_bytes")


def test_two_ranks_share_one_host_copy(tmp_path: Path) -> None:
    _run_main(tmp_path, "cpu")


def test_a_dropped_shared_offload_is_freed_without_the_collector_and_the_other_rank_runs_on(tmp_path: Path) -> None:
    with _Ranks(tmp_path, "dropped") as ranks:
        dropped = ranks.expect("dropped", range(WORLD))
    for rank in range(WORLD):
        assert dropped[rank]["shared"] and dropped[rank]["exact"]
        assert dropped[rank]["freed"] == [True, True, True], (rank, dropped[rank])
    assert dropped[1]["exact_after_other_dropped"]  # the owner dropped its model first


def _round_up(nbytes: int, alignment: int = 256) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


def test_two_ranks_share_one_compressed_host_copy(tmp_path: Path) -> None:
    """compress=True and "auto" on a shared copy: the segments hold the owner's compressed bytes, which
    rank 1 maps and decodes; both ranks bit-exact; ranks asking for other codec settings do not share."""
    _run_codec(tmp_path, "cpu")


@pytest.mark.cuda
def test_two_ranks_on_one_gpu_share_one_compressed_host_copy(tmp_path: Path) -> None:
    """Both ranks on cuda:0: each decodes the same compressed segment with the GPU kernel."""
    _run_codec(tmp_path, "cuda:0")


@pytest.mark.cuda
def test_two_gpus_share_one_compressed_host_copy(tmp_path: Path) -> None:
    """torchrun-style, one process per GPU: each GPU decodes the one compressed host copy."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    _run_codec(tmp_path, "cuda")


def _run_codec(tmp_path: Path, device: str) -> None:
    with _Ranks(tmp_path, "codec", device) as ranks:
        done = ranks.expect("done", range(WORLD))
    for mode in ("True", "auto"):
        r0, r1 = done[0][mode], done[1][mode]
        for rank, r in enumerate((r0, r1)):
            assert r["exact"] and r["host_views_equal"] and r["own_weights"], (rank, mode)
            assert [b["mode"] for b in r["codec"]] == ["compressed"] * N_BLOCKS, (rank, mode, r["codec"])
            compressed = sum(b["compressed_bytes"] for b in r["codec"])
            raw = sum(b["raw_bytes"] for b in r["codec"])
            # The host holds the compressed bytes only, once: the segments are exactly their size.
            assert r["stats"]["host_bytes"] == compressed < 0.8 * raw, (rank, mode, compressed, raw)
            assert r["stats"]["shared_bytes"] == sum(_round_up(b["compressed_bytes"]) for b in r["codec"])
            assert "the host copy is shared by 2 ranks of this host" in r["mutate"]
            assert _names(r["job"]) == []
        assert r0["codec"] == r1["codec"]  # the same bytes: same sizes and checksums on both ranks
        assert r0["stats"]["shared_owned_bytes"] == r0["stats"]["shared_bytes"] and r1["stats"]["shared_owned_bytes"] == 0
        assert r1["mapping_modes"] == {"r--s"} and r0["mapping_modes"] == {"rw-s"}
    for rank in range(WORLD):
        refused = done[rank]["mismatch_True"]
        assert isinstance(refused, str) and refused.startswith("OffloadStateError: fastoffload: cannot share the host "
                                                               "copy"), refused
        assert ("rank 1 asked for compress='auto' (format 1, max_ratio 0.9, min_bytes 4096) but the owner for "
                "compress=True (format 1, max_ratio 0.9, min_bytes 4096); pass the same compress= on every rank"
                in refused), refused
        assert done[rank]["mismatch_auto"] == {"shared": False, "exact": True}
        assert done[rank]["mismatch_True_own_weights"] and done[rank]["mismatch_auto_own_weights"]


def test_mismatch_and_attach_failure_fail_every_rank_and_leave_nothing(tmp_path: Path) -> None:
    with _Ranks(tmp_path, "failures") as ranks:
        done = ranks.expect("done", range(WORLD))
        for process in ranks.processes:
            process.join(TIMEOUT_S)
    # (g) the rank that differs names the parameter; the owner names that rank.
    assert "blocks.1.up.weight" in done[1]["mismatch"] and "shape [640, 128]" in done[1]["mismatch"]
    assert "rank 1" in done[0]["mismatch"] and "blocks.1.up.weight" in done[0]["mismatch"]
    assert done[0]["mismatch_untouched"] and done[1]["mismatch_untouched"]
    # (h) the owner had packed all four segments when rank 1 failed; every rank rolled back.
    assert len(done[1]["segments_while_attaching"]) == N_BLOCKS
    assert "injected attach failure" in done[1]["attach_failure"]
    assert "could not attach the shared host copy" in done[0]["attach_failure"]
    assert "injected attach failure" in done[0]["attach_failure"]
    assert done[0]["rolled_back"] and done[1]["rolled_back"]
    assert done[0]["third_enable_exact"] and done[1]["third_enable_exact"]
    assert _names(done[1]["job"]) == [] and _names(done[0]["third_enable_job"]) == []


def test_keyboard_interrupt_during_enable_leaves_nothing_behind(tmp_path: Path) -> None:
    before = {entry for entry in os.listdir(SHM) if entry.startswith("fastoffload-")}
    with _Ranks(tmp_path, "interrupts") as ranks:
        done = ranks.expect("done", range(WORLD))
    # The interrupted rank sees its KeyboardInterrupt; the other rank is told which rank failed and how.
    assert done[1]["attaching"] == "KeyboardInterrupt: "
    assert done[0]["attaching"].startswith("OffloadStateError: fastoffload: another rank of the group could not "
                                           "attach")
    assert "rank 1: KeyboardInterrupt" in done[0]["attaching"]
    assert done[0]["packing"] == "KeyboardInterrupt: "
    assert done[1]["packing"].startswith("OffloadStateError: fastoffload: sharing the host copy failed on another "
                                         "rank so this rank did not attach")
    assert "rank 0: KeyboardInterrupt" in done[1]["packing"]
    for rank in range(WORLD):
        for label in ("attaching", "packing"):
            assert done[rank][f"{label}_rolled_back"], (rank, label)
            assert set(done[rank][f"{label}_names_after"]) <= before, (rank, label)
        assert done[rank]["then_exact"]


def test_small_dev_shm_refuses_true_and_auto_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with _Ranks(tmp_path, "small_shm") as ranks:
        done = ranks.expect("done", range(WORLD))
    for rank in range(WORLD):
        message = done[rank]["true"]
        assert message.startswith("fastoffload: cannot share the host copy: /dev/shm is too small (host "), message
        assert "GiB needed, 0.00 GiB free). Enlarge it (in Docker: --shm-size" in message, message
        assert message.endswith("or enable with share_host_copy=False"), message
        assert done[rank]["untouched"]
        assert done[rank]["auto_shared"] is False and done[rank]["auto_exact"]


def test_share_true_without_a_process_group_is_refused() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    model, _ = make_pair(2)
    with pytest.raises(RuntimeError, match="share_host_copy=True .* none is initialized: call "
                                           "torch.distributed.init_process_group"):
        fo.enable_layerwise_offload(model, device="cpu", backend="ext", share_host_copy=True)
    assert fo.get_offload_group(model) is None and all(p.numel() > 0 for p in model.parameters())
    with pytest.raises(ValueError, match="share_host_copy must be True, False or 'auto', got 'yes'"):
        fo.enable_layerwise_offload(model, device="cpu", backend="ext", share_host_copy="yes")
    # "auto" without a process group: today's behaviour, one private copy.
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext")
    assert group.share is None and group.stats()["shared_bytes"] == 0
    fo.disable_layerwise_offload(model)


def test_rank_failing_before_the_negotiation_makes_every_rank_raise_at_once(tmp_path: Path) -> None:
    with _Ranks(tmp_path, "out_of_step") as ranks:
        done = ranks.expect("done", range(WORLD))
    for mode in ("True", "auto"):
        failing, other = done[1][mode], done[0][mode]
        assert "parameter 2.up.weight is on the meta device" in failing, failing
        # The other rank names the failing rank and repeats its error as it was raised there.
        assert other.startswith("OffloadStateError: fastoffload: enable_layerwise_offload failed on another rank of "
                                "the group, so this rank (rank 0) did not enable offload either: rank 1: "
                                f"{failing}. "), other
        assert other.endswith("Fix that rank (its own error is in its log) and enable again on every rank"), other
    for rank in range(WORLD):
        for mode in (True, "auto"):
            # Raised in the negotiation, not by the group's timeout of GROUP_TIMEOUT_S s: a margin of ten
            # leaves room for a loaded 2-core machine (this is not a speed check).
            assert done[rank][f"{mode}_seconds"] < GROUP_TIMEOUT_S / 10, (rank, mode, done[rank][f"{mode}_seconds"])
            assert done[rank][f"{mode}_untouched"]
        assert done[rank]["then_shared"] and done[rank]["then_exact"]


def test_one_changed_element_is_seen_true_raises_and_auto_keeps_one_copy_per_rank(tmp_path: Path) -> None:
    with _Ranks(tmp_path, "values") as ranks:
        done = ranks.expect("done", range(WORLD))
    for rank in range(WORLD):
        message = done[rank]["True"]
        assert message.startswith("OffloadStateError: fastoffload: cannot share the host copy: rank 1: parameter "
                                  "'blocks.1.up.weight' holds different values on rank 1 than on the owner"), message
        assert message.endswith("Build the same model on every rank, or enable with share_host_copy=False"), message
        assert done[rank]["True_own_weights"]
        assert done[rank]["auto"] == "enabled" and done[rank]["auto_shared"] is False
        assert done[rank]["auto_shared_bytes"] == 0 and done[rank]["auto_exact"]
        # disable gives each rank its own weights back (rank 1 keeps its changed element).
        assert done[rank]["auto_own_weights"]


def test_a_taken_segment_name_falls_back_under_auto_and_raises_under_true(tmp_path: Path) -> None:
    with _Ranks(tmp_path, "taken_name") as ranks:
        done = ranks.expect("done", range(WORLD))
    for rank in range(WORLD):
        assert done[rank]["auto"] == "enabled" and done[rank]["auto_shared"] is False and done[rank]["auto_exact"]
        assert done[rank]["auto_own_weights"] and done[rank]["True_own_weights"]
        # Only the squatter's file is left: the owner's lock and reserved segments are gone.
        assert done[rank]["auto_names_after"] == [f"fastoffload-01{1:030x}-01{2:030x}"]
        assert done[rank]["True_names_after"] == [f"fastoffload-01{1:030x}-01{2:030x}"]
    assert done[0]["True"].startswith("OffloadStateError: fastoffload: could not create the shared segment"), \
        done[0]["True"]
    assert "File exists" in done[0]["True"] and "share_host_copy='auto'" in done[0]["True"]
    assert done[1]["True"].startswith("OffloadStateError: fastoffload: sharing the host copy failed on another rank so "
                                    "this rank did not attach: rank 0: OffloadStateError: fastoffload: could not create "
                                    "the shared segment"), done[1]["True"]


def _hold_a_live_job(job: str, segments: list[str], ready: Any) -> None:
    """Another job's owner, alive: it holds its lock and its segment names until it is killed."""
    from fastoffload_ext import _C

    lock = _C.JobLock(job)
    pool = _C.PinnedPool(-1, "pageable", 0, False, 0)
    for name in segments:
        pool.reserve_shared(f"/fastoffload-{job}-{name}", 4096)
    ready.set()
    time.sleep(TIMEOUT_S * 2)
    del lock, pool


def test_sweep_removes_only_the_names_of_jobs_whose_owner_died(tmp_path: Path) -> None:
    from fastoffload_ext import _C

    context = mp.get_context("spawn")
    ready = context.Event()
    live_job, dead_job, unlocked_job = "a1" * 16, "d2" * 16, "e3" * 16
    live = context.Process(target=_hold_a_live_job, args=(live_job, ["1", "2"], ready), daemon=True)
    legacy = SHM / f"fastoffload-{os.getpid() + 10**6}-00ff-0"  # the old pid-named layout: never ours to judge
    dead_names = [SHM / f"fastoffload-{dead_job}-{suffix}" for suffix in ("lock", "1", "2")]
    unlocked = SHM / f"fastoffload-{unlocked_job}-1"  # a segment without any lock: no proof, so kept
    live.start()
    try:
        assert ready.wait(TIMEOUT_S)
        for path in [legacy, unlocked, *dead_names]:
            path.write_bytes(b"x")  # a dead job: its lock file is there but nobody holds it
        assert _C.sweep_stale_segments() == 2
        assert not any(path.exists() for path in dead_names)
        assert _names(live_job) == [f"fastoffload-{live_job}-{n}" for n in ("1", "2", "lock")]
        assert legacy.exists() and unlocked.exists()
        os.kill(live.pid, signal.SIGKILL)  # the live job's owner dies without unlinking anything
        live.join(TIMEOUT_S)
        assert _names(live_job) != [] and _C.sweep_stale_segments() == 2 and _names(live_job) == []
    finally:
        if live.is_alive():
            os.kill(live.pid, signal.SIGKILL)
        for path in [legacy, unlocked, *dead_names, *(SHM / n for n in _names(live_job))]:
            path.unlink(missing_ok=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_sweep_as_root_leaves_other_users_names_alone() -> None:
    from fastoffload_ext import _C

    job = "b4" * 16
    lock, mine, theirs = (SHM / f"fastoffload-{job}-{suffix}" for suffix in ("lock", "1", "2"))
    try:
        for path in (lock, mine, theirs):
            path.write_bytes(b"x")
        os.chown(theirs, 4242, 4242)
        assert _C.sweep_stale_segments() == 1
        assert theirs.exists() and not mine.exists() and not lock.exists()
        foreign_lock = SHM / f"fastoffload-{job}-lock"
        foreign_lock.write_bytes(b"x")
        os.chown(foreign_lock, 4242, 4242)  # another user's dead job: not this user's to sweep
        assert _C.sweep_stale_segments() == 0 and theirs.exists() and foreign_lock.exists()
    finally:
        for path in (lock, mine, theirs):
            path.unlink(missing_ok=True)


def test_core_owner_packs_and_another_pool_maps_without_copying() -> None:
    """The C++ side alone, in one process: owner and non-owner engines over the same segment."""
    from fastoffload_ext import _C

    def block(width: int) -> list[nn.Parameter]:
        gen = torch.Generator().manual_seed(width)
        return [nn.Parameter(torch.randn(width, 3, generator=gen).t(), requires_grad=False),
                nn.Parameter(torch.arange(5, dtype=torch.bfloat16), requires_grad=False)]

    def engine() -> Any:
        return _C.OffloadEngine(torch.device("cpu"), 2, _C.PinnedPool(-1, "pageable", 0, False, 0))

    name = f"/fastoffload-{os.getpid()}-c0ffee-0"
    owner_params, mapped_params = block(10), [nn.Parameter(torch.zeros(10, 3).t(), requires_grad=False),
                                              nn.Parameter(torch.zeros(5, dtype=torch.bfloat16), requires_grad=False)]
    values = [p.detach().clone() for p in owner_params]
    owner, other = engine(), engine()
    try:
        owner_handle = owner.add_block_shared(["w", "b"], owner_params, name, True)
        assert _segments(str(os.getpid())) == [name[1:]] and owner.is_shared(owner_handle)
        # The owner hashed what it packed; the same values hash the same from the parameters themselves.
        assert list(owner.block_digests(owner_handle)) == list(_C.tensor_digests(["w", "b"], values))
        with pytest.raises(RuntimeError, match="could not create the shared segment .* File exists"):
            engine().add_block_shared(["w", "b"], block(10), name, True)
        # Rank 1's parameters hold zeros: what it computes with must be the owner's bytes, not a copy of its own.
        handle = other.add_block_shared(["w", "b"], mapped_params, name, False)
        other.acquire(handle)
        assert all(torch.equal(p, v) and p.stride() == v.stride() for p, v in zip(mapped_params, values))
        other.release(handle)
        # The non-owner's mapping is read-only; its host views are copies, so a write neither crashes nor
        # reaches the owner's bytes.
        assert _mapping_modes() == {"r--s", "rw-s"}
        view = other.host_view(handle, 0)
        view.add_(1.0)
        assert torch.equal(other.host_view(handle, 0), values[0]) and torch.equal(owner.host_view(owner_handle, 0),
                                                                                  values[0])
        assert other.host_view(handle, 0).stride() == values[0].stride()
        assert other.pool.stats()["shared_owned_bytes"] == 0 and owner.pool.stats()["shared_owned_bytes"] > 0
        with pytest.raises(RuntimeError, match="holds 512 bytes but this rank's block packs to 1280 bytes: the ranks "
                                               "of this host built different parameters"):
            engine().add_block_shared(["w", "b"], block(70), name, False)
        with pytest.raises(RuntimeError, match="cannot be materialized for mutation: its host copy is shared"):
            other.materialize(handle)
        for bad in ("/elsewhere/x", "/fastoffload-ABC-1", f"/fastoffload-{os.getpid()}-lock"):
            with pytest.raises(RuntimeError, match="must look like '/fastoffload-<job hex>-<segment hex>'"):
                engine().add_block_shared(["w", "b"], block(10), bad, True)
        assert owner.pool.unlink_shared() == 1 and _segments(str(os.getpid())) == []
        with pytest.raises(RuntimeError, match="could not open the shared segment .* No such file"):
            engine().add_block_shared(["w", "b"], block(10), name, False)
        # The mappings outlive the name.
        other.acquire(handle)
        assert all(torch.equal(p, v) for p, v in zip(mapped_params, values))
        other.restore(handle, torch.device("cpu"))
        assert other.pool.stats()["shared_bytes"] == 0
    finally:
        _C.unlink_shared_segment(name)


@pytest.mark.cuda
def test_two_ranks_on_one_gpu_share_one_pinned_host_copy(tmp_path: Path) -> None:
    """Both ranks on cuda:0: the read-only mapping of rank 1 is registered with CUDA like the owner's."""
    _run_main(tmp_path, "cuda:0")


@pytest.mark.cuda
def test_two_gpus_share_one_pinned_host_copy(tmp_path: Path) -> None:
    """torchrun-style: one process per GPU (device=cuda:rank), gloo for the coordination."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    _run_main(tmp_path, "cuda")


def test_digest_sees_one_changed_element_anywhere_and_only_the_bytes_count() -> None:
    """28311552 = 3072 x 9216 bf16 elements (several digest chunks): each single edit changes the digest."""
    from fastoffload_ext.engine.sharing import block_digests, block_layout

    block = nn.Module()
    block.weight = nn.Parameter(torch.zeros(3072, 9216, dtype=torch.bfloat16), requires_grad=False)
    block.bias = nn.Parameter(torch.arange(7, dtype=torch.float32), requires_grad=False)  # a tail of 28 bytes
    first = block_digests(block)
    assert block_digests(block) == first and len(first) == 2
    for index in ((0, 0), (1536, 4608), (-1, -1)):
        block.weight.data[index] = 1.0
        assert block_digests(block)[0] != first[0], index
        block.weight.data[index] = 0.0
    assert block_digests(block) == first
    block.bias.data[6] = -0.0  # one bit of the tail
    assert block_digests(block)[1] != first[1]
    assert block_layout(block)[0] == ("weight", "torch.bfloat16", (3072, 9216), (9216, 1))


def test_owner_takes_its_packed_copy_back_into_private_memory() -> None:
    """What the owner does when the ranks fall back after it packed: same values, no shared bytes left."""
    from fastoffload_ext import _C

    params = [nn.Parameter(torch.randn(6, 4).t(), requires_grad=False)]
    values = [p.detach().clone() for p in params]
    engine = _C.OffloadEngine(torch.device("cpu"), 2, _C.PinnedPool(-1, "pageable", 0, False, 0))
    name = f"/fastoffload-{os.getpid()}-beef-1"
    try:
        handle = engine.add_block_shared(["w"], params, name, True)
        engine.make_private(handle)
        assert not engine.is_shared(handle) and engine.pool.stats()["shared_bytes"] == 0
        assert _segments(str(os.getpid())) == []  # the segment went with its last mapping
        engine.acquire(handle)
        assert torch.equal(params[0], values[0]) and params[0].stride() == values[0].stride()
        engine.release(handle)
        engine.materialize(handle)  # a private block may be mutated again
    finally:
        _C.unlink_shared_segment(name)


def test_core_compressed_segment_is_checked_before_another_rank_uses_it() -> None:
    """The owner encodes into the segment; another engine maps it only with the owner's size and checksum and
    with compression on, and decodes the same values; the owner can take the compressed copy back."""
    from fastoffload_ext import _C

    def params(fill: bool) -> list[nn.Parameter]:
        gen = torch.Generator().manual_seed(3)
        values = [(torch.randn(64, 96, generator=gen) * 0.02).to(torch.bfloat16), torch.randn(7, generator=gen)]
        return [nn.Parameter(v if fill else torch.zeros_like(v), requires_grad=False) for v in values]

    def engine(mode: str) -> Any:
        e = _C.OffloadEngine(torch.device("cpu"), 2, _C.PinnedPool(-1, "pageable", 0, False, 0))
        e.set_compression(mode)
        return e

    name = f"/fastoffload-{os.getpid()}-c0dec-0"
    owner_params = params(True)
    values = [p.detach().clone() for p in owner_params]
    owner = engine("on")
    try:
        handle = owner.add_block_shared(["w", "b"], owner_params, name, True)
        info = owner.codec_info(handle)
        assert info["mode"] == "compressed" and info["host_bytes"] == info["compressed_bytes"] < info["raw_bytes"]
        assert owner.pool.stats()["shared_owned_bytes"] == (info["compressed_bytes"] + 255) // 256 * 256
        assert list(owner.block_digests(handle)) == list(_C.tensor_digests(["w", "b"], values))
        size, checksum = info["compressed_bytes"], info["checksum"]
        with pytest.raises(RuntimeError, match=r"holds compressed bytes with checksum \d+ but the owner encoded "
                                               r"\d+: the segment changed after the owner wrote it"):
            engine("on").add_block_shared(["w", "b"], params(False), name, False, size, checksum + 1)
        with pytest.raises(RuntimeError, match="compressed block 0 but this rank has compression off; pass the same "
                                               "compress= on every rank"):
            engine("off").add_block_shared(["w", "b"], params(False), name, False, size, checksum)
        wider = [nn.Parameter(torch.zeros(64, 128, dtype=torch.bfloat16), requires_grad=False),
                 nn.Parameter(torch.zeros(7), requires_grad=False)]
        with pytest.raises(RuntimeError, match="decodes to 12544 bytes but this rank's block packs to 16640 bytes: the "
                                               "ranks of this host built different parameters"):
            engine("on").add_block_shared(["w", "b"], wider, name, False, size, checksum)
        other_params = params(False)
        other = engine("auto")
        other_handle = other.add_block_shared(["w", "b"], other_params, name, False, size, checksum)
        assert other.codec_info(other_handle) == info and other.pool.stats()["shared_owned_bytes"] == 0
        other.acquire(other_handle)
        assert all(torch.equal(p, v) for p, v in zip(other_params, values))
        other.release(other_handle)
        owner.make_private(handle)  # the ranks fell back after the owner encoded
        assert not owner.is_shared(handle) and owner.pool.stats()["shared_bytes"] == 0
        owner.acquire(handle)
        assert all(torch.equal(p, v) for p, v in zip(owner_params, values))
        owner.release(handle)
        assert owner.codec_info(handle)["mode"] == "compressed"
    finally:
        _C.unlink_shared_segment(name)


def test_one_rank_re_planning_a_shared_offload_is_refused_and_the_ranks_stay_in_step(tmp_path: Path) -> None:
    with _Ranks(tmp_path, "replan") as ranks:
        done = ranks.expect("done", range(WORLD))
    first = done[0]
    assert first["replan"].startswith("OffloadStateError: fastoffload: this offload was enabled as a collective of 2 "
                                      "ranks"), first["replan"]
    assert "Nothing was changed" in first["replan"] and first["unchanged"] and first["replan_seconds"] < 10
    for rank in range(WORLD):
        result = done[rank]
        assert result["new_resident"] != result["resident"], result  # the plan it refused was a new layout
        assert result["exact"] and result["then_exact"] and result["then_shared"] and result["own_weights"], result
        assert result["then_resident"] == result["new_resident"], result
