"""PinnedPool, through the compiled core: exact-size sub-allocation, accounting, lifetime, pinning.

On the CPU the pool is built for the host "device" (``device_index=-1``): the same slabs,
sub-allocator and accounting, with ordinary page-aligned memory instead of pinned memory. That is what
CI tests; the ``cuda`` tests check the pinning backings, the limit and the pageable fallback on a GPU.
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastoffload_ext import _C

ROOT = Path(__file__).resolve().parent.parent
ALIGNMENT: int = _C.build_info()["alignment"]
PAGE = 4096
KiB = 1024
MiB = 1024 * 1024
STAT_KEYS = {"reserved_bytes", "pinned_bytes", "in_use_bytes", "peak_in_use_bytes", "peak_reserved_bytes",
             "slab_count", "allocation_count", "fallback_slabs", "shared_bytes", "shared_owned_bytes", "pin_seconds",
             "populate_seconds", "register_seconds", "deferred_pins", "backing"}


def aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT


def host_pool(min_slab_bytes: int = 0) -> _C.PinnedPool:
    return _C.PinnedPool(-1, "pageable", 0, False, min_slab_bytes)


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """Position-dependent bytes, so an overlap or a shifted view shows up as a mismatch."""
    return ((torch.arange(nbytes, dtype=torch.int64) * 7 + seed * 31 + 1) % 256).to(torch.uint8)


@pytest.fixture(scope="module")
def cxx_errors_reach_python() -> None:
    """Fails (instead of letting the session crash) when _C cannot raise an error with a formatted number.

    A _C linked against a static copy of libstdc++ segfaults formatting any TORCH_CHECK/TORCH_WARN message
    with a number in it; tests that provoke such errors in-process ask for this probe first.
    """
    code = ("from fastoffload_ext import _C\n"
            "try:\n    _C.PinnedPool(-1, 'pageable', 0, False, 0).allocate(1 << 60)\n"
            "except RuntimeError:\n    print('raised')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=20)
    if result.returncode != 0 or result.stdout.strip() != "raised":
        pytest.fail(f"fastoffload_ext._C crashes (rc={result.returncode}) when it raises an error with a number in its "
                    "message; see tests/test_build.py::test_cxx_errors_reach_python_as_exceptions")


# Basics ------------------------------------------------------------------------------------------------

def test_alignment_is_a_power_of_two_at_least_a_cache_line() -> None:
    assert ALIGNMENT >= 64 and ALIGNMENT & (ALIGNMENT - 1) == 0


def test_host_pool_hands_out_uint8_cpu_tensors_of_the_exact_size() -> None:
    pool = host_pool()
    assert pool.device_index == -1
    assert pool.pins is False
    assert pool.backing == "pageable"
    tensor = pool.allocate(1000)
    assert tensor.dtype == torch.uint8
    assert tensor.device.type == "cpu"
    assert tensor.shape == (1000,)
    assert tensor.is_contiguous()
    assert tensor.data_ptr() % ALIGNMENT == 0
    tensor.copy_(pattern(1000, 3))
    assert torch.equal(tensor, pattern(1000, 3))


def test_host_device_never_pins_whatever_backing_is_asked() -> None:
    for backing in ("host_alloc", "register", "pageable"):
        pool = _C.PinnedPool(-1, backing, 0, False, 0)
        tensor = pool.allocate(5000)
        stats = pool.stats()
        assert pool.pins is False
        assert stats["backing"] == "pageable"
        assert stats["pinned_bytes"] == 0
        assert stats["fallback_slabs"] == 0
        assert stats["reserved_bytes"] == 8192
        del tensor


def test_fresh_pool_stats_are_zero() -> None:
    stats = host_pool().stats()
    assert set(stats) == STAT_KEYS
    assert {key: value for key, value in stats.items() if key != "backing"} == dict.fromkeys(STAT_KEYS - {"backing"}, 0)
    assert stats["backing"] == "pageable"


def test_invalid_backing_lists_the_allowed_names() -> None:
    with pytest.raises(RuntimeError, match="backing must be 'host_alloc', 'register' or 'pageable', got 'bogus'"):
        _C.PinnedPool(-1, "bogus", 0, False, 0)


def test_host_out_of_memory_names_the_sizes(cxx_errors_reach_python: None) -> None:
    pool = host_pool()
    kept = pool.allocate(3 * MiB + 300 * KiB)  # 3.29 MiB reserved
    with pytest.raises(RuntimeError, match=r"could not map \S+ MiB of host memory \(3\.(3|29)\d* MiB already reserved "
                                           r"by this pool\); the host is out of memory"):
        pool.allocate(1 << 60)
    # The failed request left nothing behind.
    stats = pool.stats()
    assert (stats["slab_count"], stats["reserved_bytes"], stats["in_use_bytes"]) == (1, 3 * MiB + 300 * KiB,
                                                                                      3 * MiB + 300 * KiB)
    assert stats["peak_reserved_bytes"] == 3 * MiB + 300 * KiB
    del kept


def test_negative_size_is_refused() -> None:
    with pytest.raises(TypeError):
        host_pool().allocate(-1)


# Accounting --------------------------------------------------------------------------------------------

def test_in_use_is_the_sum_of_aligned_sizes() -> None:
    pool = host_pool()
    sizes = [1, ALIGNMENT - 1, ALIGNMENT, ALIGNMENT + 1, 1000, 4096, 10_000, 123_457]
    tensors = []
    for count, size in enumerate(sizes, start=1):
        tensors.append(pool.allocate(size))
        stats = pool.stats()
        assert stats["in_use_bytes"] == sum(aligned(s) for s in sizes[:count])
        assert stats["allocation_count"] == count
        assert stats["peak_in_use_bytes"] == stats["in_use_bytes"]
        assert stats["reserved_bytes"] >= stats["in_use_bytes"]
        assert stats["reserved_bytes"] % PAGE == 0
    assert [t.numel() for t in tensors] == sizes
    peak = pool.stats()["peak_in_use_bytes"]
    del tensors[3]
    stats = pool.stats()
    assert stats["in_use_bytes"] == peak - aligned(sizes[3])
    assert stats["peak_in_use_bytes"] == peak
    tensors.clear()
    stats = pool.stats()
    assert (stats["in_use_bytes"], stats["reserved_bytes"], stats["slab_count"], stats["allocation_count"]) == \
        (0, 0, 0, 0)
    assert stats["peak_in_use_bytes"] == peak


def test_exact_slabs_are_page_rounded_and_shared_by_later_requests() -> None:
    pool = host_pool(min_slab_bytes=0)
    first = pool.allocate(5000)  # 5120 in use, one 8192-byte slab
    assert pool.stats()["reserved_bytes"] == 8192
    assert pool.stats()["slab_count"] == 1
    second = pool.allocate(3000)  # 3072: exactly the tail of the first slab
    stats = pool.stats()
    assert (stats["reserved_bytes"], stats["slab_count"], stats["in_use_bytes"]) == (8192, 1, 8192)
    assert second.data_ptr() == first.data_ptr() + 5120
    third = pool.allocate(1)  # no room left: a new page
    stats = pool.stats()
    assert (stats["reserved_bytes"], stats["slab_count"], stats["in_use_bytes"]) == (12288, 2, 8192 + ALIGNMENT)
    assert stats["peak_reserved_bytes"] == 12288
    # A slab goes back as soon as it is empty, and not before.
    del first
    assert pool.stats()["slab_count"] == 2
    del second
    stats = pool.stats()
    assert (stats["reserved_bytes"], stats["slab_count"], stats["in_use_bytes"]) == (4096, 1, ALIGNMENT)
    assert stats["peak_reserved_bytes"] == 12288
    del third
    assert pool.stats()["reserved_bytes"] == 0


def test_pin_seconds_accumulates_slab_time() -> None:
    pool = host_pool()
    tensor = pool.allocate(64 * KiB)
    assert pool.stats()["pin_seconds"] > 0.0
    del tensor


# Random sequences ----------------------------------------------------------------------------------------

operation = st.one_of(
    st.tuples(st.just("alloc"), st.integers(min_value=1, max_value=70_000)),
    st.tuples(st.just("free"), st.integers(min_value=0, max_value=10_000)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=st.lists(operation, max_size=40),
       min_slab_bytes=st.sampled_from([0, PAGE, 64 * KiB, 1 * MiB]))
def test_random_alloc_free_sequences(operations: list[tuple[str, int]], min_slab_bytes: int) -> None:
    pool = host_pool(min_slab_bytes)
    live: dict[int, torch.Tensor] = {}  # allocation number -> tensor
    max_in_use = 0
    max_reserved = 0
    for number, (kind, value) in enumerate(operations):
        if kind == "alloc":
            live[number] = pool.allocate(value)  # no local name: only `live` may keep it alive
            assert live[number].numel() == value
            assert live[number].data_ptr() % ALIGNMENT == 0
            live[number].copy_(pattern(value, number))
        elif live:
            victim = sorted(live)[value % len(live)]
            del live[victim]

        stats = pool.stats()
        in_use = sum(aligned(t.numel()) for t in live.values())
        assert stats["in_use_bytes"] == in_use
        assert stats["allocation_count"] == len(live)
        assert stats["in_use_bytes"] <= stats["reserved_bytes"]
        assert stats["reserved_bytes"] % PAGE == 0
        assert stats["pinned_bytes"] == 0
        if min_slab_bytes:
            assert stats["reserved_bytes"] >= stats["slab_count"] * min_slab_bytes
        max_in_use = max(max_in_use, stats["in_use_bytes"])
        max_reserved = max(max_reserved, stats["reserved_bytes"])
        # Both only grow inside allocate(), and every allocate is observed: the peaks are exact.
        assert stats["peak_in_use_bytes"] == max_in_use
        assert stats["peak_reserved_bytes"] == max_reserved

        # No two live allocations overlap, counting their aligned sizes.
        ranges = sorted((t.data_ptr(), t.data_ptr() + aligned(t.numel())) for t in live.values())
        for (_, end), (start, _) in itertools.pairwise(ranges):
            assert end <= start, f"overlapping allocations: {ranges}"
        # And every one still holds exactly what was written to it.
        for written_at in live:
            assert torch.equal(live[written_at], pattern(live[written_at].numel(), written_at)), \
                f"allocation {written_at} was overwritten"

    live.clear()
    stats = pool.stats()
    assert stats["in_use_bytes"] == 0
    assert stats["reserved_bytes"] == 0
    assert stats["slab_count"] == 0
    assert stats["allocation_count"] == 0
    assert stats["peak_in_use_bytes"] == max_in_use
    assert stats["peak_reserved_bytes"] == max_reserved


def test_concurrent_allocate_and_free_keep_exact_accounting() -> None:
    pool = host_pool(min_slab_bytes=256 * KiB)
    errors: list[BaseException] = []
    kept: list[torch.Tensor] = []
    kept_lock = threading.Lock()

    def worker(seed: int) -> None:
        try:
            mine = []
            for step in range(200):
                size = 1 + (seed * 7919 + step * 104_729) % 20_000
                tensor = pool.allocate(size)
                tensor.fill_((seed + step) % 256)
                mine.append(tensor)
                if step % 3 == 2:
                    mine.pop(0)
            for step, tensor in enumerate(mine):
                assert int(tensor[0]) == int(tensor[-1])
            with kept_lock:
                kept.extend(mine)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    stats = pool.stats()
    assert stats["allocation_count"] == len(kept)
    assert stats["in_use_bytes"] == sum(aligned(t.numel()) for t in kept)
    ranges = sorted((t.data_ptr(), t.data_ptr() + aligned(t.numel())) for t in kept)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(ranges))
    kept.clear()
    stats = pool.stats()
    assert (stats["in_use_bytes"], stats["reserved_bytes"], stats["slab_count"]) == (0, 0, 0)


# Sub-allocation and coalescing -----------------------------------------------------------------------

PIECE = 64 * KiB
PIECES_PER_SLAB = MiB // PIECE


def full_slab(pool: _C.PinnedPool) -> tuple[list[torch.Tensor | None], int]:
    """Fills one 1 MiB slab with 64 KiB pieces; returns them and the slab's base address."""
    pieces: list[torch.Tensor | None] = [pool.allocate(PIECE) for _ in range(PIECES_PER_SLAB)]
    stats = pool.stats()
    assert (stats["slab_count"], stats["reserved_bytes"], stats["in_use_bytes"]) == (1, MiB, MiB)
    base = min(p.data_ptr() for p in pieces if p is not None)
    assert sorted(p.data_ptr() - base for p in pieces if p is not None) == [i * PIECE for i in range(PIECES_PER_SLAB)]
    return pieces, base


def test_small_allocations_share_one_min_size_slab() -> None:
    pool = host_pool(min_slab_bytes=MiB)
    tensors = [pool.allocate(size) for size in (1000, 20_000, 300, 64 * KiB)]
    stats = pool.stats()
    assert (stats["slab_count"], stats["reserved_bytes"]) == (1, MiB)
    base = min(t.data_ptr() for t in tensors)
    assert all(base <= t.data_ptr() and t.data_ptr() + t.numel() <= base + MiB for t in tensors)


@pytest.mark.parametrize("free_order", list(itertools.permutations([5, 6, 7])))
def test_freed_neighbours_coalesce_into_one_range(free_order: tuple[int, ...]) -> None:
    pool = host_pool(min_slab_bytes=MiB)
    pieces, base = full_slab(pool)
    for index in range(PIECES_PER_SLAB):
        pieces[index].copy_(pattern(PIECE, index))  # type: ignore[union-attr]
    hole = pieces[5].data_ptr()  # type: ignore[union-attr]
    for index in free_order:
        pieces[index] = None
    # The slab is full except for the hole: a 3-piece request fits only if the three ranges merged.
    merged = pool.allocate(3 * PIECE)
    stats = pool.stats()
    assert stats["slab_count"] == 1, "the freed neighbours did not coalesce: a new slab was reserved"
    assert stats["reserved_bytes"] == MiB
    assert merged.data_ptr() == hole
    assert base <= merged.data_ptr() and merged.data_ptr() + merged.numel() <= base + MiB
    merged.copy_(pattern(3 * PIECE, 99))
    for index, piece in enumerate(pieces):
        if piece is not None:
            assert torch.equal(piece, pattern(PIECE, index))


def test_non_adjacent_holes_do_not_merge() -> None:
    pool = host_pool(min_slab_bytes=MiB)
    pieces, base = full_slab(pool)
    for index in (3, 5, 7):
        pieces[index] = None
    larger = pool.allocate(2 * PIECE)
    stats = pool.stats()
    assert stats["slab_count"] == 2
    assert stats["reserved_bytes"] == 2 * MiB
    assert not base <= larger.data_ptr() < base + MiB
    # The holes are still usable at their own size, first fit.
    small = pool.allocate(PIECE)
    assert small.data_ptr() == base + 3 * PIECE
    assert pool.stats()["slab_count"] == 2


def test_request_larger_than_min_slab_gets_its_own_slab() -> None:
    pool = host_pool(min_slab_bytes=MiB)
    small = pool.allocate(PIECE)
    big = pool.allocate(3 * MiB + 1)
    stats = pool.stats()
    assert stats["slab_count"] == 2
    assert stats["reserved_bytes"] == MiB + 3 * MiB + PAGE
    del big
    stats = pool.stats()
    assert (stats["slab_count"], stats["reserved_bytes"]) == (1, MiB)
    del small
    assert pool.stats()["reserved_bytes"] == 0


def test_emptied_slab_is_released_and_a_new_one_reserved_on_demand() -> None:
    pool = host_pool(min_slab_bytes=MiB)
    pieces, _ = full_slab(pool)
    pieces.clear()
    assert pool.stats()["slab_count"] == 0
    again = pool.allocate(PIECE)
    stats = pool.stats()
    assert (stats["slab_count"], stats["reserved_bytes"], stats["peak_reserved_bytes"]) == (1, MiB, MiB)
    del again


# Lifetime ----------------------------------------------------------------------------------------------

def test_tensor_keeps_its_memory_after_the_pool_object_is_gone() -> None:
    # In a subprocess: if the pool freed its slabs under a live view, the writes below would touch
    # unmapped memory and crash the interpreter, not just fail an assertion.
    code = textwrap.dedent("""
        import gc, torch
        from fastoffload_ext import _C
        pool = _C.PinnedPool(-1, "pageable", 0, False, 0)
        keep = pool.allocate(100_000)
        other = pool.allocate(3_000)
        expected = (torch.arange(100_000) % 251).to(torch.uint8)
        keep.copy_(expected)
        other.fill_(5)
        del pool
        gc.collect()
        churn = [torch.full((50_000,), 7, dtype=torch.uint8) for _ in range(64)]
        assert torch.equal(keep, expected), "pool memory changed after the pool object was deleted"
        keep.fill_(3)
        assert int(keep.sum()) == 300_000
        view = keep[10:20]
        del keep
        gc.collect()
        view.fill_(1)
        assert int(view.sum()) == 10
        del view, churn
        gc.collect()
        assert int(other.sum()) == 15_000
        other.fill_(9)
        assert int(other.sum()) == 27_000
        del other
        gc.collect()
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=20)
    assert result.returncode == 0, f"rc={result.returncode}\n{result.stdout}\n{result.stderr}"
    assert result.stdout.strip() == "ok"


def test_views_of_an_allocation_keep_it_allocated() -> None:
    pool = host_pool()
    tensor = pool.allocate(10_000)
    view = tensor[100:200].view(torch.int32)
    del tensor
    assert pool.stats()["allocation_count"] == 1
    view.fill_(0x01020304)
    assert torch.equal(view, torch.full((25,), 0x01020304, dtype=torch.int32))
    del view
    assert pool.stats()["allocation_count"] == 0
    assert pool.stats()["reserved_bytes"] == 0


# CUDA ----------------------------------------------------------------------------------------------------

def _cuda_pool(backing: str, limit_bytes: int = 0, allow_pageable_fallback: bool = False,
               min_slab_bytes: int = 0) -> _C.PinnedPool:
    if not _C.build_info()["cuda"]:
        pytest.fail("a GPU is present but fastoffload_ext._C is a CPU-only build; rebuild with FASTOFFLOAD_CUDA=1")
    return _C.PinnedPool(torch.cuda.current_device(), backing, limit_bytes, allow_pageable_fallback, min_slab_bytes)


@pytest.mark.cuda
@pytest.mark.parametrize("backing", ["host_alloc", "register"])
def test_cuda_backings_pin(backing: str) -> None:
    pool = _cuda_pool(backing)
    assert pool.pins is True
    assert pool.backing == backing
    tensor = pool.allocate(3 * MiB + 5)
    stats = pool.stats()
    assert stats["backing"] == backing
    assert stats["pinned_bytes"] > 0
    assert stats["pinned_bytes"] == stats["reserved_bytes"] == 3 * MiB + PAGE
    assert stats["fallback_slabs"] == 0
    assert tensor.is_pinned()
    del tensor
    assert pool.stats()["pinned_bytes"] == 0


@pytest.mark.cuda
def test_cuda_pageable_backing_does_not_pin() -> None:
    pool = _cuda_pool("pageable")
    assert pool.pins is False
    tensor = pool.allocate(MiB)
    assert pool.stats()["pinned_bytes"] == 0
    assert not tensor.is_pinned()


@pytest.mark.cuda
@pytest.mark.parametrize("backing", ["host_alloc", "register", "pageable"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_cuda_copy_from_pool_memory_is_bit_exact(backing: str, dtype: torch.dtype) -> None:
    pool = _cuda_pool(backing)
    nbytes = 5 * MiB + 768
    host = pool.allocate(nbytes)
    generator = torch.Generator().manual_seed(1234)
    host.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator))
    source = host.view(dtype)
    device = torch.empty(source.shape, dtype=dtype, device="cuda")
    device.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(device.cpu().view(torch.uint8), host)
    # And back: device to pool memory.
    back = pool.allocate(nbytes).view(dtype)
    back.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back.view(torch.uint8), host)


@pytest.mark.cuda
def test_cuda_limit_refuses_with_the_sizes_involved(cxx_errors_reach_python: None) -> None:
    pool = _cuda_pool("host_alloc", limit_bytes=MiB)
    first = pool.allocate(512 * KiB)
    with pytest.raises(RuntimeError, match=r"pinning 2(\.0+)? MiB") as raised:
        pool.allocate(2 * MiB)
    message = str(raised.value)
    assert "already holds 0.5" in message
    assert "allow_pageable_fallback=True" in message
    stats = pool.stats()
    assert (stats["pinned_bytes"], stats["slab_count"], stats["fallback_slabs"]) == (512 * KiB, 1, 0)
    del first


@pytest.mark.cuda
def test_cuda_limit_with_pageable_fallback_warns_and_succeeds(cxx_errors_reach_python: None) -> None:
    pool = _cuda_pool("host_alloc", limit_bytes=MiB, allow_pageable_fallback=True)
    first = pool.allocate(512 * KiB)
    with pytest.warns(UserWarning, match="falling back to pageable memory"):
        second = pool.allocate(2 * MiB)
    stats = pool.stats()
    assert stats["fallback_slabs"] == 1
    assert stats["pinned_bytes"] == 512 * KiB
    assert stats["reserved_bytes"] == 512 * KiB + 2 * MiB
    assert first.is_pinned()
    assert not second.is_pinned()
    second.copy_(pattern(2 * MiB, 1))
    assert torch.equal(second.cuda().cpu(), pattern(2 * MiB, 1))
