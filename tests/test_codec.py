"""The block codec on its own: round trips over raw bit patterns, the worst case, corrupted bytes.

Every test uses the host encoder and decoder of the compiled core (the same format the GPU kernel
decodes); the CUDA tests check the kernel against the host decoder byte for byte.
"""
from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastoffload_ext import _backend

core = _backend.require_ext()

ALIGN = 256
# Force coding of every bf16 span, however small or incompressible, so the coded path sees every size.
FORCE = {"max_ratio": 100.0, "min_bytes": 0}
HEADER = 64
SEGMENT = 80


def pack(parts: list[tuple[bytes, bool]]) -> tuple[torch.Tensor, list[tuple[int, int, bool]]]:
    """Packs byte strings back to back at ALIGN offsets, as the layer store does; returns bytes and spans."""
    spans = []
    offset = 0
    for data, bf16 in parts:
        spans.append((offset, len(data), bf16))
        offset = (offset + len(data) + ALIGN - 1) // ALIGN * ALIGN
    raw = torch.zeros(offset, dtype=torch.uint8)
    for (start, length, _), (data, _) in zip(spans, parts):
        if length:
            raw[start:start + length] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw, spans


def roundtrip(raw: torch.Tensor, spans, **options) -> torch.Tensor:
    encoded = core.codec_encode(raw, spans, **options)
    decoded = core.codec_decode(encoded, verify=True)
    assert torch.equal(decoded, raw)
    return encoded


def bf16_bytes(values: torch.Tensor) -> bytes:
    return values.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()


def test_every_bf16_bit_pattern_round_trips() -> None:
    # All 65536 patterns: every exponent, both zeros, +-inf, every NaN payload, every subnormal.
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.uint8).numpy().tobytes()
    raw, spans = pack([(patterns, True)])
    encoded = roundtrip(raw, spans, **FORCE)
    info = core.codec_inspect(encoded)
    assert info["coded_segments"] == 1
    assert info["exceptions"] == 65536 - 15 * 256  # 15 exponents in the table (code 15 escapes), 256 values each


def test_all_exponents_distinct_is_sent_raw_by_default() -> None:
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.uint8).numpy().tobytes()
    raw, spans = pack([(patterns, True)])
    encoded = roundtrip(raw, spans)  # default max_ratio: coding must pay
    info = core.codec_inspect(encoded)
    assert info["coded_segments"] == 0
    assert info["segments"] == 1


def test_typical_weights_compress_to_the_expected_ratio() -> None:
    torch.manual_seed(0)
    weight = torch.randn(512, 1024) * 0.02
    raw, spans = pack([(bf16_bytes(weight), True)])
    encoded = roundtrip(raw, spans)
    # 1 byte of sign+mantissa + half a byte of code per 2-byte value, plus few exceptions.
    assert encoded.numel() / raw.numel() < 0.76


part = st.one_of(
    st.tuples(st.binary(min_size=0, max_size=5000).map(lambda b: b[: len(b) // 2 * 2]), st.just(True)),
    st.tuples(st.binary(min_size=0, max_size=3000), st.just(False)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(part, min_size=0, max_size=6), force=st.booleans(), threads=st.sampled_from([1, 3]))
def test_random_bit_patterns_round_trip(parts, force: bool, threads: int) -> None:
    raw, spans = pack(parts)
    options = dict(FORCE) if force else {"min_bytes": 0}
    roundtrip(raw, spans, threads=threads, **options)


@settings(max_examples=80, deadline=None)
@given(gaps=st.lists(st.tuples(st.integers(min_value=0, max_value=40), st.integers(min_value=0, max_value=3000),
                               st.booleans()), min_size=0, max_size=6),
       tail=st.integers(min_value=0, max_value=33), seed=st.integers(min_value=0, max_value=2**31 - 1))
def test_spans_at_unaligned_offsets_round_trip(gaps, tail: int, seed: int) -> None:
    # Tensors need not start aligned (the engine aligns them, the format does not rely on it): unaligned
    # bf16 spans travel raw, and raw segments may start and end anywhere.
    spans, offset = [], 0
    for gap, nbytes, bf16 in gaps:
        offset += gap
        spans.append((offset, nbytes, bf16))
        offset += nbytes
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (offset + tail,), generator=g, dtype=torch.int32).to(torch.uint8)
    roundtrip(raw, spans, **FORCE)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(min_value=0, max_value=20000), distinct=st.integers(min_value=1, max_value=40),
       seed=st.integers(min_value=0, max_value=2**31 - 1))
def test_bf16_with_few_exponents_round_trips(n: int, distinct: int, seed: int) -> None:
    # Few distinct exponents (like trained weights), sizes around and across tile boundaries.
    g = torch.Generator().manual_seed(seed)
    exponents = torch.randint(100, 100 + distinct, (n,), generator=g, dtype=torch.int32)
    low = torch.randint(0, 1 << 7, (n,), generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int32) << 15
    values = (sign | (exponents << 7) | low).to(torch.int16)
    raw, spans = pack([(values.view(torch.uint8).numpy().tobytes(), True), (b"\x01\x02\x03", False)])
    roundtrip(raw, spans, **FORCE)


def test_mixed_dtypes_in_one_block() -> None:
    torch.manual_seed(1)
    parts = [
        (bf16_bytes(torch.randn(300, 257)), True),
        (torch.randn(33).to(torch.float16).view(torch.uint8).numpy().tobytes(), False),
        (torch.randn(1000).view(torch.uint8).numpy().tobytes(), False),
        (torch.randint(-100, 100, (77,), dtype=torch.int8).view(torch.uint8).numpy().tobytes(), False),
        (bf16_bytes(torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 1e-40])), True),
        (bf16_bytes(torch.randn(40001) * 0.02), True),
    ]
    raw, spans = pack(parts)
    encoded = roundtrip(raw, spans, min_bytes=0)
    assert core.codec_inspect(encoded)["coded_segments"] >= 2


def test_empty_and_single_value_blocks() -> None:
    for parts in ([], [(b"", True)], [(b"\x80\x3f", True)], [(b"\x00", False)]):
        raw, spans = pack(parts)
        roundtrip(raw, spans, **FORCE)


def test_overlapping_spans_are_refused() -> None:
    raw = torch.zeros(512, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"fastoffload: codec input tensors must lie inside the block and not overlap"):
        core.codec_encode(raw, [(0, 300, True), (256, 10, False)])
    with pytest.raises(RuntimeError, match=r"fastoffload: codec input tensors must lie inside the block"):
        core.codec_encode(raw, [(500, 100, True)])


def _sample_block() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(2)
    raw, spans = pack([(bf16_bytes(torch.randn(5000) * 0.05), True), (b"abc" * 100, False),
                       (bf16_bytes(torch.randn(3000)), True)])
    return raw, core.codec_encode(raw, spans, **FORCE)


@settings(max_examples=200, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=1, max_value=255)), min_size=1,
                      max_size=8))
def test_corrupted_bytes_never_crash(flips) -> None:
    raw, encoded = _sample_block()
    corrupted = encoded.clone()
    for position, mask in flips:
        corrupted[position % corrupted.numel()] ^= mask
    if torch.equal(corrupted, encoded):
        return
    with pytest.raises(RuntimeError, match=r"^fastoffload: corrupted compressed block"):
        core.codec_decode(corrupted, verify=True)
    # Without the checksum: a clear error or some bytes of the right size, never a crash.
    try:
        out = core.codec_decode(corrupted, verify=False)
    except RuntimeError as error:
        assert str(error).startswith("fastoffload: corrupted compressed block")
    else:
        assert out.numel() == raw.numel()


def _with_field(encoded: torch.Tensor, offset: int, fmt: str, value: int) -> torch.Tensor:
    corrupted = encoded.clone()
    data = bytearray(corrupted.numpy().tobytes())
    struct.pack_into(fmt, data, offset, value)
    return torch.frombuffer(data, dtype=torch.uint8).clone()


@pytest.mark.parametrize("offset, fmt, value, message", [
    (0, "<I", 0x12345678, r"bad magic or version"),
    (16, "<Q", 10**12, r"its header says"),
    (24, "<I", 10**6, r"segments do not fit in the region"),
    (28, "<I", 3, r"segments cover"),
    (HEADER + 0, "<I", 7, r"segment 0 has kind 7"),
    (HEADER + 8, "<Q", 16, r"segment 0 covers \[16"),
    (HEADER + 24, "<Q", 2**62, r"segment 0 reads past the end of the region"),
    (HEADER + 56, "<I", 2**31, r"segment 0 reads past the end of the region"),
    (HEADER + 4, "<I", 5, r"segment 0 starts at tile 5"),
])
def test_corrupted_header_fields_are_named(offset: int, fmt: str, value: int, message: str) -> None:
    _, encoded = _sample_block()
    corrupted = _with_field(encoded, offset, fmt, value)
    with pytest.raises(RuntimeError, match=r"^fastoffload: corrupted compressed block: .*" + message):
        core.codec_decode(corrupted, verify=False)


def test_truncated_and_wrong_size_inputs() -> None:
    _, encoded = _sample_block()
    with pytest.raises(RuntimeError, match=r"fastoffload: corrupted compressed block: 10 bytes is shorter than its header"):
        core.codec_decode(encoded[:10].clone())
    with pytest.raises(RuntimeError, match=r"fastoffload: corrupted compressed block: its header says"):
        core.codec_decode(encoded[:-16].clone())
    with pytest.raises(RuntimeError, match=r"fastoffload: the compressed block must be a contiguous CPU uint8 tensor"):
        core.codec_decode(encoded.to(torch.int16))


def test_checksum_names_the_mismatch() -> None:
    _, encoded = _sample_block()
    corrupted = encoded.clone()
    corrupted[-1] ^= 1
    with pytest.raises(RuntimeError, match=r"checksum \d+ does not match the stored \d+; the host copy was overwritten"):
        core.codec_decode(corrupted, verify=True)


def test_encoding_is_deterministic_across_thread_counts() -> None:
    torch.manual_seed(3)
    raw, spans = pack([(bf16_bytes(torch.randn(300000) * 0.02), True), (bf16_bytes(torch.randn(70000)), True)])
    assert torch.equal(core.codec_encode(raw, spans, threads=1), core.codec_encode(raw, spans, threads=4))


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["every_pattern", "weights", "mixed", "tiny"])
def test_kernel_matches_host_decoder(case: str) -> None:
    torch.manual_seed(4)
    if case == "every_pattern":
        patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.uint8).numpy().tobytes()
        parts = [(patterns * 3, True)]
    elif case == "weights":
        parts = [(bf16_bytes(torch.randn(3072, 3072) * 0.02), True), (bf16_bytes(torch.randn(3072)), True)]
    elif case == "mixed":
        parts = [(bf16_bytes(torch.randn(40001) * 0.02), True), (b"xyz" * 1001, False),
                 (torch.randn(4097).view(torch.uint8).numpy().tobytes(), False), (bf16_bytes(torch.randn(8193)), True)]
    else:
        parts = [(b"\x80\x3f", True), (b"\x01", False), (bf16_bytes(torch.randn(17)), True)]
    raw, spans = pack(parts)
    encoded = core.codec_encode(raw, spans, **FORCE) if case != "weights" else core.codec_encode(raw, spans)
    host = core.codec_decode(encoded, verify=True)
    device_src = encoded.cuda()
    out = torch.full((raw.numel(),), 0xAB, dtype=torch.uint8, device="cuda")
    core.codec_decode_device(encoded, device_src, out)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), host)
    assert torch.equal(host, raw)


@pytest.mark.cuda
def test_kernel_launcher_checks_its_arguments() -> None:
    _, encoded = _sample_block()
    raw_bytes = core.codec_inspect(encoded)["raw_bytes"]
    with pytest.raises(RuntimeError, match=r"fastoffload: the output must hold the block's \d+ decoded bytes"):
        core.codec_decode_device(encoded, encoded.cuda(), torch.empty(raw_bytes + 1, dtype=torch.uint8, device="cuda"))
    with pytest.raises(RuntimeError, match=r"fastoffload: the device copy holds"):
        core.codec_decode_device(encoded, encoded[:-16].cuda(), torch.empty(raw_bytes, dtype=torch.uint8, device="cuda"))


@pytest.mark.parametrize("order", ["empty last", "empty first"])
def test_an_empty_tensor_at_a_neighbours_offset_is_no_overlap(order: str) -> None:
    """A zero-element tensor holds no bytes: a checkpoint's layout may put it at the offset of the tensor beside it,
    and the encoder must not take that for an overlap, whichever of the two it meets first."""
    raw = (torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    raw = raw.view(torch.uint8).clone()
    spans = [(0, 26, False), (512, 7680, True)]
    spans.insert(1 if order == "empty last" else 0, (0, 0, True))
    coded = core.codec_encode(raw, spans, max_ratio=0.9, min_bytes=4096)
    assert coded.numel() < raw.numel()  # the bf16 span was coded
    assert torch.equal(core.codec_decode(coded, verify=True), raw)
