"""Ranks of one host share one host copy, with real processes.

Two processes (``torch.multiprocessing``, spawn) form a gloo group through a file in ``tmp_path`` and
enable offload with ``device="cpu"``, ``backend="ext"``, ``share_host_copy=True``: the owner (rank 0)
packs into shared segments, rank 1 maps them. The test kills rank 1 with SIGKILL to show that nothing
is left in /dev/shm and that rank 0 keeps computing exactly.

Every wait has a timeout, so a hang fails the test instead of blocking CI; the processes are killed on
the way out whatever happened.
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
TIMEOUT_S = 20


def _segments(pid: int) -> list[str]:
    """Shared segments in /dev/shm whose owner is ``pid``."""
    return sorted(entry for entry in os.listdir(SHM) if entry.startswith(f"fastoffload-{pid}-"))


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

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)


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


def _exact(model: nn.Module, x: torch.Tensor, want: torch.Tensor, steps: int = 3) -> bool:
    with torch.inference_mode():
        return all(torch.equal(model(x), want) for _ in range(steps))


def _scenario_main(rank: int, device: str, queue: Any, control: Path) -> None:
    model, _, x, want = _model(device)
    group = fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy=True)
    owner_pid = int(group.share.prefix.split("-")[1])
    result: dict[str, Any] = {"exact": _exact(model, x, want), "stats": group.stats(), "owner_pid": owner_pid}
    import torch.distributed as dist

    dist.barrier()  # both ranks have touched every shared page: each is charged half of it
    result["segment_pss_bytes"] = _pss_segments_bytes()
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
            result["segments_while_attaching"] = _segments(int(state.shared_segment.split("-")[1]))
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
    result["third_enable_owner_pid"] = int(group.share.prefix.split("-")[1])
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
        result[f"{label}_segments_after"] = [entry for entry in os.listdir(SHM) if entry.startswith("fastoffload-")]
        dist.barrier()
    fo.enable_layerwise_offload(model, device=device, backend="ext", share_host_copy=True)
    result["then_exact"] = _exact(model, x, want)
    dist.barrier()
    queue.put((rank, "done", result))


SCENARIOS = {"main": _scenario_main, "failures": _scenario_failures, "small_shm": _scenario_small_shm,
             "interrupts": _scenario_interrupts}


def _worker(rank: int, init_file: str, scenario: str, device: str, queue: Any, control: str) -> None:
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
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
        owner_pid = ranks.processes[0].pid
        # (a) bit-identical to the resident model over 3 steps, on both ranks.
        assert enabled[0]["exact"] and enabled[1]["exact"]
        assert enabled[0]["owner_pid"] == enabled[1]["owner_pid"] == owner_pid
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
        if device == "cuda":
            assert s0["pinned_bytes"] >= packed and s1["pinned_bytes"] >= packed  # each rank registered its mapping
        print(f"\nshared host copy, {device}: packed {packed} B; rank 0 {({k: s0[k] for k in _FIGURES})}; "
              f"rank 1 {({k: s1[k] for k in _FIGURES})}; owned on host {owned_on_host} B "
              f"({owned_on_host / packed:.3f}x packed); segment PSS rank 0 {enabled[0]['segment_pss_bytes']} B + rank 1 "
              f"{enabled[1]['segment_pss_bytes']} B = {pss} B ({pss / packed:.3f}x packed)")
        # (e) mutate_params_scope refused with the message, and offload still exact afterwards.
        for rank in range(WORLD):
            assert "the host copy is shared by 2 ranks of this host; mutate before enabling offload, or enable " \
                   "with share_host_copy=False" in enabled[rank]["mutate"]
            assert enabled[rank]["exact_after_refusal"]
        # (c) after enable returned on both ranks the names are gone.
        assert _segments(owner_pid) == []
        # (d) kill -9 of rank 1: nothing left behind, rank 0 still exact.
        os.kill(ranks.processes[1].pid, signal.SIGKILL)
        ranks.processes[1].join(10)
        assert ranks.processes[1].exitcode == -signal.SIGKILL
        assert _segments(owner_pid) == []
        (ranks.control / "killed").touch()
        assert ranks.expect("after_kill", [0])[0]["exact"]
        ranks.processes[0].join(TIMEOUT_S)
    assert _segments(owner_pid) == []


_FIGURES = ("shared_owner", "shared_bytes", "shared_owned_bytes", "host_reserved_bytes", "pinned_bytes")


def test_two_ranks_share_one_host_copy(tmp_path: Path) -> None:
    _run_main(tmp_path, "cpu")


def test_mismatch_and_attach_failure_fail_every_rank_and_leave_nothing(tmp_path: Path) -> None:
    with _Ranks(tmp_path, "failures") as ranks:
        done = ranks.expect("done", range(WORLD))
        owner_pid = ranks.processes[0].pid
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
    assert _segments(owner_pid) == []


def test_keyboard_interrupt_during_enable_leaves_nothing_behind(tmp_path: Path) -> None:
    with _Ranks(tmp_path, "interrupts") as ranks:
        done = ranks.expect("done", range(WORLD))
        owner_pid = ranks.processes[0].pid
    # The interrupted rank sees its KeyboardInterrupt; the other rank is told which rank failed and how.
    assert done[1]["attaching"] == "KeyboardInterrupt: "
    assert done[0]["attaching"].startswith("RuntimeError: fastoffload: another rank of the group could not attach")
    assert "rank 1: KeyboardInterrupt" in done[0]["attaching"]
    assert done[0]["packing"] == "KeyboardInterrupt: "
    assert done[1]["packing"].startswith("RuntimeError: fastoffload: sharing the host copy failed on another rank")
    assert "rank 0: KeyboardInterrupt" in done[1]["packing"]
    for rank in range(WORLD):
        for label in ("attaching", "packing"):
            assert done[rank][f"{label}_rolled_back"], (rank, label)
            assert not any(entry.startswith(f"fastoffload-{owner_pid}-") for entry in done[rank][f"{label}_segments_after"])
        assert done[rank]["then_exact"]
    assert _segments(owner_pid) == []


def test_small_dev_shm_refuses_true_and_auto_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with _Ranks(tmp_path, "small_shm") as ranks:
        done = ranks.expect("done", range(WORLD))
        owner_pid = ranks.processes[0].pid
    for rank in range(WORLD):
        message = done[rank]["true"]
        assert message.startswith("fastoffload: cannot share the host copy: /dev/shm is too small (host "), message
        assert "GiB needed, 0.00 GiB free). Enlarge it (in Docker: --shm-size" in message, message
        assert message.endswith("or enable with share_host_copy=False"), message
        assert done[rank]["untouched"]
        assert done[rank]["auto_shared"] is False and done[rank]["auto_exact"]
    assert _segments(owner_pid) == []


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


def test_sweep_removes_segments_of_dead_owners_only(tmp_path: Path) -> None:
    from fastoffload_ext import _C

    dead = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join(TIMEOUT_S)
    stale = SHM / f"fastoffload-{dead.pid}-00ff-0"
    alive = SHM / f"fastoffload-{os.getpid()}-00ff-0"
    try:
        stale.write_bytes(b"x")
        alive.write_bytes(b"x")
        assert _C.sweep_stale_segments() >= 1
        assert not stale.exists() and alive.exists()
    finally:
        for path in (stale, alive):
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
        assert _segments(os.getpid()) == [name[1:]] and owner.is_shared(owner_handle)
        with pytest.raises(RuntimeError, match="could not create the shared segment .* File exists"):
            engine().add_block_shared(["w", "b"], block(10), name, True)
        # Rank 1's parameters hold zeros: what it computes with must be the owner's bytes, not a copy of its own.
        handle = other.add_block_shared(["w", "b"], mapped_params, name, False)
        other.acquire(handle)
        assert all(torch.equal(p, v) and p.stride() == v.stride() for p, v in zip(mapped_params, values))
        other.release(handle)
        assert other.pool.stats()["shared_owned_bytes"] == 0 and owner.pool.stats()["shared_owned_bytes"] > 0
        with pytest.raises(RuntimeError, match="holds 512 bytes but this rank's block packs to 1280 bytes: the ranks "
                                               "of this host built different parameters"):
            engine().add_block_shared(["w", "b"], block(70), name, False)
        with pytest.raises(RuntimeError, match="cannot be materialized for mutation: its host copy is shared"):
            other.materialize(handle)
        with pytest.raises(RuntimeError, match="must look like '/fastoffload-<pid>-<hex>-<index>'"):
            engine().add_block_shared(["w", "b"], block(10), "/elsewhere/x", True)
        assert owner.pool.unlink_shared() == 1 and _segments(os.getpid()) == []
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
def test_two_gpus_share_one_pinned_host_copy(tmp_path: Path) -> None:
    """torchrun-style: one process per GPU (device=cuda:rank), gloo for the coordination."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    _run_main(tmp_path, "cuda")


def test_fingerprint_of_a_parameter_past_float32_exact_integers() -> None:
    """28311552 = 3072 x 9216 elements: a float32 linspace over its indices rounds past the end."""
    from fastoffload_ext.engine.sharing import block_signature

    block = nn.Module()
    block.weight = nn.Parameter(torch.zeros(3072, 9216, dtype=torch.bfloat16), requires_grad=False)
    first = block_signature(block)
    block.weight.data[-1, -1] = 1.0  # the last element is sampled
    assert block_signature(block)[0][4] != first[0][4]
    assert first[0][:4] == ("weight", "torch.bfloat16", (3072, 9216), (9216, 1))
