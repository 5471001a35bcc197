"""Offload with compressed host copies, against the resident model bit for bit.

bf16 blocks at d=128 have Linear weights above the codec's 4 KiB minimum (coded) and biases and norms
below it (raw), so every block mixes coded and raw segments. On the CPU the engine decodes with the
host decoder each step (the same format the GPU kernel decodes); the ``cuda`` tests run the kernel.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fastoffload_ext as fo

from ._models import OFFLOAD_DEVICES, make_pair, offload_hook, params_equal, place_outside_blocks

D = 128


def _device(name: str) -> torch.device:
    return torch.device("cpu") if name == "cpu" else torch.device("cuda", torch.cuda.current_device())


def _setup(n_blocks: int, device: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    model, reference = make_pair(n_blocks, dtype, d=D, seed=seed)
    reference.to(_device(device))
    place_outside_blocks(model, device)
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(_device(device))
    return model, reference, x


def _modes(group) -> list[str]:
    return [block["mode"] for block in group.stats()["codec"]]


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("n_blocks", [1, 2, 3, 5])
def test_compressed_offload_is_bit_exact(device: str, depth: int, n_blocks: int) -> None:
    model, reference, x = _setup(n_blocks, device)
    with torch.inference_mode():
        want = reference(x)
    group = fo.enable_layerwise_offload(model, device=device, prefetch_depth=depth, compress=True)
    stats = group.stats()
    assert _modes(group) == ["compressed"] * n_blocks
    assert all(0.5 < block["ratio"] < 0.85 for block in stats["codec"])
    # The raw copies are gone: the host holds the compressed bytes only.
    assert stats["host_bytes"] == stats["compressed_bytes"] < 0.85 * stats["weight_bytes"]
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(model(x), want)
    assert group.engine.stats()["decodes"] >= min(n_blocks, 3)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_stats_report_mode_ratio_and_bytes() -> None:
    model, _, _ = _setup(2, "cpu")
    group = fo.enable_layerwise_offload(model, device="cpu", compress=True)
    stats = group.stats()
    assert stats["compress"] == "on" and stats["compressed_blocks"] == 2
    for block in stats["codec"]:
        assert set(block) >= {"mode", "ratio", "raw_bytes", "compressed_bytes", "host_bytes", "segments"}
        assert block["ratio"] == pytest.approx(block["compressed_bytes"] / block["raw_bytes"])
    assert stats["transfer_ratio"] == pytest.approx(stats["compressed_bytes"] / sum(b["raw_bytes"] for b in stats["codec"]))
    fo.disable_layerwise_offload(model)


def test_float32_blocks_travel_raw_and_stay_exact() -> None:
    model, reference, x = _setup(3, "cpu", dtype=torch.float32)
    with torch.inference_mode():
        want = reference(x)
    group = fo.enable_layerwise_offload(model, device="cpu", compress=True)
    assert _modes(group) == ["raw"] * 3
    assert group.stats()["compressed_bytes"] == 0
    with torch.inference_mode():
        assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


def _bits_equal(a: nn.Module, b: nn.Module) -> bool:
    """Parameters equal bit for bit (NaN payloads included, which torch.equal would call unequal)."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(
        torch.equal(pa[k].detach().cpu().view(torch.int16), pb[k].detach().cpu().view(torch.int16)) for k in pa)


def _every_pattern(p: torch.Tensor) -> torch.Tensor:
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return patterns.repeat(p.numel() // 65536 + 1)[: p.numel()].reshape(p.shape)


@pytest.mark.parametrize("compress", [True, "auto"])
def test_block_with_every_exponent_travels_raw(compress) -> None:
    # Worst case: every bf16 bit pattern (all 256 exponents equally frequent, NaN payloads, +-inf,
    # subnormals, -0): no tensor pays for coding, so the block is sent raw, and comes back bit for bit.
    model, reference, _ = _setup(2, "cpu")
    with torch.no_grad():
        for m in (model, reference):
            for p in m.blocks[1].parameters():
                p.copy_(_every_pattern(p))
    group = fo.enable_layerwise_offload(model, device="cpu", compress=compress)
    first, second = group.stats()["codec"]
    assert first["mode"] == ("compressed" if compress is True else "measuring")
    assert second["mode"] == "raw" and second["compressed_bytes"] == 0
    fo.disable_layerwise_offload(model)
    assert _bits_equal(model, reference)


def test_every_bit_pattern_in_a_coded_tensor_survives_the_engine() -> None:
    # One weight full of every pattern next to ordinary ones: the block is still coded (the others
    # pay), and the odd tensor goes through its exception list or raw, bit for bit.
    model, reference, _ = _setup(1, "cpu")
    with torch.no_grad():
        for m in (model, reference):
            m.blocks[0].o.weight.copy_(_every_pattern(m.blocks[0].o.weight))
    group = fo.enable_layerwise_offload(model, device="cpu", compress=True)
    assert _modes(group) == ["compressed"]
    fo.disable_layerwise_offload(model)
    assert _bits_equal(model, reference)


def test_compiled_blocks_with_compression() -> None:
    torch._dynamo.reset()
    model, reference, x = _setup(3, "cpu")
    fo.enable_layerwise_offload(model, device="cpu", compress=True)
    for block in model.blocks:
        block.compile(backend="eager")
    with torch.inference_mode():
        want = reference(x)
        for _ in range(3):
            assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model)
    torch._dynamo.reset()
    assert params_equal(model, reference)


@pytest.mark.parametrize("threshold, expected", [(0.0, "compressed"), (1e9, "raw")])
def test_auto_measures_then_decides(threshold: float, expected: str) -> None:
    model, reference, x = _setup(3, "cpu")
    with torch.inference_mode():
        want = reference(x)
    group = fo.enable_layerwise_offload(model, device="cpu", compress="auto")
    group.engine.set_auto_threshold(threshold)
    assert _modes(group) == ["measuring"] * 3
    assert group.stats()["host_bytes"] > group.stats()["weight_bytes"]  # both copies while measuring
    with torch.inference_mode():
        for step in range(4):
            assert torch.equal(model(x), want)
    assert _modes(group) == [expected] * 3
    stats = group.stats()
    assert stats["host_bytes"] == (stats["compressed_bytes"] if expected == "compressed"
                                   else sum(b["raw_bytes"] for b in stats["codec"]))
    timings = group.engine.auto_timings()
    assert timings["compute_ms"] > 0
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("compress", [True, "auto"])
def test_mutate_params_scope_re_encodes(device: str, compress) -> None:
    model, reference, x = _setup(3, device)
    group = fo.enable_layerwise_offload(model, device=device, compress=compress)
    if compress == "auto":
        group.engine.set_auto_threshold(0.0)
    with torch.inference_mode():
        model(x)
    with torch.no_grad():
        for m in (model, reference):
            block = m.blocks[1]
            if m is model:
                with offload_hook(block).mutate_params_scope():
                    block.up.weight.mul_(1.5)
                    block.qkv.bias.add_(0.25)
            else:
                block.up.weight.mul_(1.5)
                block.qkv.bias.add_(0.25)
    with torch.inference_mode():
        want = reference(x)
        for _ in range(3):
            assert torch.equal(model(x), want)
    assert _modes(group)[1] == "compressed"
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_detach_mid_forward_keeps_exact_values() -> None:
    model, reference, x = _setup(3, "cpu")
    fo.enable_layerwise_offload(model, device="cpu", compress=True)

    def detach_in_block_1(module, args):
        fo.disable_layerwise_offload(model, device="cpu")
        raise RuntimeError("stop")

    handle = model.blocks[1].register_forward_pre_hook(detach_in_block_1)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="stop"):
        model(x)
    handle.remove()
    assert params_equal(model, reference)


def test_exception_mid_forward_loses_nothing() -> None:
    model, reference, x = _setup(3, "cpu")
    with torch.inference_mode():
        want = reference(x)
    fo.enable_layerwise_offload(model, device="cpu", compress=True)

    def fail(module, args, output):
        raise RuntimeError("boom")

    handle = model.blocks[2].register_forward_hook(fail)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="boom"):
        model(x)
    handle.remove()
    with torch.inference_mode():
        assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_host_views_decode_the_current_values() -> None:
    model, reference, _ = _setup(2, "cpu")
    group = fo.enable_layerwise_offload(model, device="cpu", compress=True)
    state = group.states[0]
    want = dict(reference.blocks[0].named_parameters())
    views = state.cpu_named_parameters
    assert views.keys() == want.keys()
    assert all(torch.equal(views[name], want[name]) for name in want)
    fo.disable_layerwise_offload(model)


@pytest.mark.parametrize("compress, message", [
    ("yes", r"^fastoffload: compress must be False, True or 'auto', got 'yes'"),
    (1, r"^fastoffload: compress must be False, True or 'auto', got 1"),
])
def test_bad_compress_argument(compress, message: str) -> None:
    model, reference, _ = _setup(1, "cpu")
    with pytest.raises(fo.OffloadConfigError, match=message):
        fo.enable_layerwise_offload(model, device="cpu", compress=compress)
    assert fo.get_offload_group(model) is None
    assert params_equal(model, reference)


def test_compress_needs_the_compiled_core() -> None:
    model, reference, _ = _setup(1, "cpu")
    with pytest.raises(fo.OffloadConfigError, match=r"^fastoffload: compress=True needs the compiled core"):
        fo.enable_layerwise_offload(model, device="cpu", backend="python", compress=True)
    group = fo.enable_layerwise_offload(model, device="cpu", backend="python", compress="auto")
    assert group.backend == "python"
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_compress_mode_no_longer_depends_on_sharing() -> None:
    """A shared host copy is compressed too (the owner encodes, tests/test_sharing.py): the mode is the one asked for."""
    from fastoffload_ext.codec import resolve_compress
    assert resolve_compress(True, "ext") == "on"
    assert resolve_compress("auto", "ext") == "auto"
    assert resolve_compress(False, "ext") == "off"
    with pytest.raises(fo.OffloadConfigError, match=r"^fastoffload: compress must be False, True or 'auto', got 'yes'"):
        resolve_compress("yes", "ext")


def test_verify_mode_decodes_with_the_checksum(monkeypatch) -> None:
    monkeypatch.setenv("FASTOFFLOAD_VERIFY_CODEC", "1")
    model, reference, x = _setup(2, "cpu")
    with torch.inference_mode():
        want = reference(x)
    group = fo.enable_layerwise_offload(model, device="cpu", compress=True)
    assert group.engine.verify_checksums
    with torch.inference_mode():
        assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.cuda
@pytest.mark.parametrize("pin_backing", ["host_alloc", "register"])
def test_cuda_pin_backings(pin_backing: str) -> None:
    model, reference, x = _setup(4, "cuda")
    with torch.inference_mode():
        want = reference(x)
    group = fo.enable_layerwise_offload(model, device="cuda", compress=True, pin_backing=pin_backing)
    assert group.stats()["pinned_bytes"] >= group.stats()["compressed_bytes"]
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)


@pytest.mark.cuda
@pytest.mark.parametrize("compress", [True, "auto"])
def test_cuda_graph_replay_with_compression(compress) -> None:
    from fastoffload_ext.engine.graphs import OffloadedCUDAGraph
    model, reference, x = _setup(4, "cuda")
    group = fo.enable_layerwise_offload(model, device="cuda", compress=compress)
    graph = OffloadedCUDAGraph(model, x.clone())
    assert all(mode in ("compressed", "raw") for mode in _modes(group))
    for shift in (0, 1, 2):
        fresh = x.roll(shift, dims=-1)
        with torch.inference_mode():
            want = reference(fresh)
        assert torch.equal(graph(fresh), want)
    del graph
    fo.disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)


@pytest.mark.cuda
def test_torch_compile_with_compression() -> None:
    torch._dynamo.reset()
    model, reference, x = _setup(3, "cuda")
    group = fo.enable_layerwise_offload(model, device="cuda", compress=True)
    assert _modes(group) == ["compressed"] * 3
    for block in list(model.blocks) + list(reference.blocks):
        block.compile()
    with torch.inference_mode():
        want = reference(x)
        for _ in range(2):
            assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model, device="cpu")
    torch._dynamo.reset()
    assert params_equal(model, reference)
