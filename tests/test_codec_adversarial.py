"""Compressed host copies with adversarial weights and layouts, against the resident model bit for bit.

Each block mixes what the codec codes (bf16 weights above its minimum size, with NaN payloads of both
signs, -0.0, +-inf and subnormals among them) with what it leaves raw (float8, int16, float16, a
0-element tensor, small biases), and its bf16 weight is a strided, offset or expanded view. Values are
compared as bytes, so a NaN payload or the sign of a zero that changed would fail.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fastoffload_ext as fo

D = 64
SPECIALS = [0x7FC1, 0xFFC3, 0x7F81, 0xFF80, 0x7F80, 0x8000, 0x0001, 0x8001, 0x007F, 0x0000, 0xFFFF]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def _weights(shape: tuple[int, ...], g: torch.Generator, specials: bool = True) -> torch.Tensor:
    n = 1
    for size in shape:
        n *= size
    values = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).view(torch.int16).clone()
    if specials:
        where = torch.randint(0, n, (min(n, 200),), generator=g)
        chosen = torch.tensor(SPECIALS, dtype=torch.int32).to(torch.int16)
        values[where] = chosen[torch.randint(0, len(SPECIALS), (len(where),), generator=g)]
    return values.view(torch.bfloat16).view(shape)


class OddBlock(nn.Module):
    def __init__(self, layout: str, g: torch.Generator) -> None:
        super().__init__()
        if layout == "transposed":
            weight = _weights((D, 4 * D), g).t()
        elif layout == "offset":
            weight = _weights((5 * D * D + 7,), g)[7:7 + 4 * D * D].view(4 * D, D)
        elif layout == "strided":
            weight = _weights((8 * D, D), g)[::2]
        elif layout == "expanded":
            weight = _weights((D,), g).expand(4 * D, D)
        else:
            weight = _weights((4 * D, D), g)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(_weights((4 * D,), g, specials=False), requires_grad=False)
        self.gate = nn.Parameter(_weights((D, D), g), requires_grad=False)  # coded whatever the weight's layout
        self.empty = nn.Parameter(torch.empty(0, D, dtype=torch.bfloat16), requires_grad=False)
        self.f8 = nn.Parameter((torch.randn(4 * D * D, generator=g) * 0.02).to(torch.float8_e4m3fn), requires_grad=False)
        self.ints = nn.Parameter(torch.randint(-100, 100, (3001,), generator=g, dtype=torch.int16), requires_grad=False)
        self.f16 = nn.Parameter((torch.randn(4099, generator=g) * 0.02).to(torch.float16), requires_grad=False)
        self.register_buffer("scale", _weights((D,), g, specials=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x @ self.weight.t() + self.bias)[..., :D]
        extra = self.f8[:D].to(x.dtype) + self.ints[:D].to(x.dtype) + self.f16[:D].to(x.dtype) + self.empty.sum()
        return x + y * self.scale + extra + self.gate[0]


class OddStack(nn.Module):
    def __init__(self, layout: str, n_blocks: int = 3, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.blocks = nn.ModuleList(OddBlock(layout, g) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Size, torch.dtype]]:
    return {name: (_bits(p).clone(), p.shape, p.dtype) for name, p in model.named_parameters()}


def _same(model: nn.Module, snapshot: dict[str, tuple[torch.Tensor, torch.Size, torch.dtype]]) -> bool:
    now = dict(model.named_parameters())
    return now.keys() == snapshot.keys() and all(
        now[k].shape == shape and now[k].dtype == dtype and torch.equal(_bits(now[k]), bits)
        for k, (bits, shape, dtype) in snapshot.items())


def _inputs() -> torch.Tensor:
    return torch.randn(2, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


@pytest.mark.parametrize("layout", ["plain", "transposed", "offset", "strided"])
@pytest.mark.parametrize("compress", [True, "auto"])
@pytest.mark.parametrize("options", [{}, {"resident_blocks": 1}, {"prefetch_depth": 2}])
def test_adversarial_blocks_round_trip_bit_for_bit(layout: str, compress, options: dict) -> None:
    model = OddStack(layout)
    before = _snapshot(model)
    x = _inputs()
    with torch.inference_mode():
        want = _bits(model(x)).clone()
    group = fo.enable_layerwise_offload(model, device="cpu", compress=compress, **options)
    if compress == "auto":
        group.engine.set_auto_threshold(0.0)  # the chooser decides for coded copies after measuring
    with torch.inference_mode():
        for _ in range(4):
            assert torch.equal(_bits(model(x)), want)
    modes = [block["mode"] for block in group.stats()["codec"]]
    assert modes == ["compressed"] * len(modes)
    state = model.state_dict()
    assert all(torch.equal(_bits(state[k]), bits) for k, (bits, _, _) in before.items())
    fo.disable_layerwise_offload(model)
    assert _same(model, before)


@pytest.mark.parametrize("compress", [True, "auto"])
def test_load_state_dict_into_compressed_blocks_keeps_every_bit(compress) -> None:
    model, source = OddStack("offset"), OddStack("offset", seed=5)
    x = _inputs()
    with torch.inference_mode():
        want = _bits(source(x)).clone()
    group = fo.enable_layerwise_offload(model, device="cpu", compress=compress)
    if compress == "auto":
        group.engine.set_auto_threshold(0.0)
    with torch.inference_mode():
        model(x)
        model(x)
    model.load_state_dict(source.state_dict())
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(_bits(model(x)), want)
    assert [block["mode"] for block in group.stats()["codec"]] == ["compressed"] * 3
    fo.disable_layerwise_offload(model)
    assert _same(model, _snapshot(source))


def test_expanded_weight_round_trips_compressed() -> None:
    # An expanded row packs its storage span (one row): below the codec's minimum it travels raw beside
    # coded tensors, and comes back with its sizes and strides.
    model = OddStack("expanded")
    before = _snapshot(model)
    x = _inputs()
    with torch.inference_mode():
        want = _bits(model(x)).clone()
    group = fo.enable_layerwise_offload(model, device="cpu", compress=True)
    assert [block["mode"] for block in group.stats()["codec"]] == ["compressed"] * 3
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(_bits(model(x)), want)
    fo.disable_layerwise_offload(model)
    assert _same(model, before)
    assert all(block.weight.stride() == (0, 1) for block in model.blocks)


def test_codec_keeps_exponent_table_edges_exact() -> None:
    # 16 distinct exponents fill the table (no exceptions); 17 need the escape code and its list; both
    # across a tile boundary (4096 values) and with a last tile of one value.
    core = pytest.importorskip("fastoffload_ext._C")
    g = torch.Generator().manual_seed(7)
    for distinct in (1, 15, 16, 17, 40):
        n = 2 * 4096 + 1
        exponents = torch.randint(100, 100 + distinct, (n,), generator=g, dtype=torch.int32)
        sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int32) << 15
        low = torch.randint(0, 128, (n,), generator=g, dtype=torch.int32)
        values = (sign | (exponents << 7) | low).to(torch.int16).view(torch.uint8)
        raw = torch.zeros(values.numel() + 30, dtype=torch.uint8)
        raw[:values.numel()] = values
        encoded = core.codec_encode(raw, [(0, values.numel(), True)], max_ratio=100.0, min_bytes=0)
        info = core.codec_inspect(encoded)
        assert info["coded_segments"] == 1
        assert (info["exceptions"] == 0) == (distinct <= 16)
        assert torch.equal(core.codec_decode(encoded, verify=True), raw)
