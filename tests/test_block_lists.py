"""block_lists: several ModuleLists offloaded as one ring (a Flux-like two-list model, and diffusers'
FluxTransformer2DModel at a tiny config), bit-exact on both backends, with device="cpu"."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import nn

from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload
from fastoffload_ext.errors import OffloadConfigError
from tests._models import OFFLOAD_DEVICES, Block, TwoLists

BACKENDS = ["ext", "python"]


def _pair(seed: int = 0) -> tuple[TwoLists, TwoLists]:
    torch.manual_seed(seed)
    model = TwoLists()
    torch.manual_seed(seed)
    return model, TwoLists()


def _offloaded_blocks(model: nn.Module) -> list[nn.Module]:
    return [b for b in model.modules() if getattr(b, "_hook_manager", None) is not None]


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefetch_depth", [0, 1, 2])
def test_all_lists_form_one_ring_bit_exact(device: str, backend: str, prefetch_depth: int) -> None:
    model, reference = _pair()
    model.proj_in.to(device)
    model.proj_out.to(device)
    reference.to(device)
    group = enable_layerwise_offload(model, device=device, backend=backend, block_lists="all",
                                     prefetch_depth=prefetch_depth)
    assert group is not None and group.list_names == ["transformer_blocks", "single_transformer_blocks"]
    assert len(group.states) == 7 and len(_offloaded_blocks(model)) == 7
    x = torch.randn(2, 16, device=device)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
    if prefetch_depth == 1:
        # The last double-stream block prefetches the first single-stream block; the last of all, the first.
        states = group.states
        assert states[2].prefetch_targets == [states[3]]
        assert states[6].prefetch_targets == [states[0]]
    disable_layerwise_offload(model)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ext_copies_ahead_across_the_list_boundary(backend: str) -> None:
    model, reference = _pair()
    group = enable_layerwise_offload(model, device="cpu", backend=backend, block_lists="all")
    assert group is not None
    x = torch.randn(2, 16)
    with torch.no_grad():
        model(x)
        before = group.stats()
        assert torch.equal(model(x), reference(x))
        after = group.stats()
    if backend == "ext":
        # Steady state: every block was prefetched by the one before it, across lists and around the ring.
        assert after["sync_loads"] == before["sync_loads"]
        assert after["prefetch_hits"] - before["prefetch_hits"] == 7


@pytest.mark.parametrize("backend", BACKENDS)
def test_named_lists_in_the_given_order_and_resident_blocks_span_lists(backend: str) -> None:
    model, reference = _pair()
    group = enable_layerwise_offload(model, device="cpu", backend=backend,
                                     block_lists=["transformer_blocks", "single_transformer_blocks"], resident_blocks=4)
    assert group is not None and group.resident_blocks == 4 and len(group.states) == 3
    assert group.states[0].module_ref is model.single_transformer_blocks[1]
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_default_stays_the_first_list() -> None:
    model, _ = _pair()
    group = enable_layerwise_offload(model, device="cpu")
    assert group is not None and group.list_names == ["transformer_blocks"] and len(group.states) == 3
    assert all(getattr(b, "_hook_manager", None) is None for b in model.single_transformer_blocks)


def test_a_single_named_list() -> None:
    model, reference = _pair()
    group = enable_layerwise_offload(model, device="cpu", block_lists=["single_transformer_blocks"])
    assert group is not None and group.list_name == "single_transformer_blocks" and len(group.states) == 4
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_weights_tied_across_lists_are_refused_and_nothing_changes() -> None:
    model, _ = _pair()
    model.single_transformer_blocks[0].up.weight = model.transformer_blocks[1].up.weight
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OffloadConfigError, match=r"is the same tensor as"):
        enable_layerwise_offload(model, device="cpu", block_lists="all")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not _offloaded_blocks(model)


@pytest.mark.parametrize(("block_lists", "message"), [
    ("single_transformer_blocks", r"^fastoffload: block_lists must be None, 'all' or a list of attribute names, got "
                                  r"the string 'single_transformer_blocks'; write block_lists=\['single_transformer_"),
    (["proj_in"], r"^fastoffload: block_lists names 'proj_in', which is not a direct-child nn.ModuleList of the model; "
                  r"choose from: transformer_blocks, single_transformer_blocks, empty"),
    (["transformer_blocks", "transformer_blocks"], r"^fastoffload: block_lists names 'transformer_blocks' more than "
                                                   r"once"),
    ([], r"^fastoffload: block_lists must be None, 'all' or a non-empty list of attribute names"),
    (3, r"^fastoffload: block_lists must be None, 'all' or a non-empty list"),
])
def test_bad_block_lists_are_refused(block_lists: object, message: str) -> None:
    model, _ = _pair()
    with pytest.raises(OffloadConfigError, match=message):
        enable_layerwise_offload(model, device="cpu", block_lists=block_lists)  # type: ignore[arg-type]
    assert not _offloaded_blocks(model)


def test_an_empty_first_list_before_the_blocks_is_refused_as_fastvideo_does() -> None:
    # FastVideo's rule hooks the first list; empty, it hooks nothing and raises. Accepting it offloaded
    # nothing while the blocks of the next list stayed where they were.
    model = nn.Module()
    model.transformer_blocks = nn.ModuleList()
    model.late = nn.ModuleList(Block(16, 2) for _ in range(3))
    with pytest.raises(ValueError, match=r"^fastoffload: No nn\.ModuleList found in the model for layerwise "
                                         r"offloading: its first nn\.ModuleList, 'transformer_blocks', is empty\. Name "
                                         r"the lists that hold the blocks with block_lists= \(this model has blocks "
                                         r"in: late\)$"):
        enable_layerwise_offload(model, device="cpu")
    assert not _offloaded_blocks(model)
    group = enable_layerwise_offload(model, device="cpu", block_lists=["late"])
    assert group is not None and len(group.states) == 3


def test_all_with_only_empty_lists_is_refused() -> None:
    model = nn.Module()
    model.blocks = nn.ModuleList()
    with pytest.raises(OffloadConfigError, match=r"^fastoffload: block_lists='all' found only empty nn.ModuleLists"):
        enable_layerwise_offload(model, device="cpu", block_lists="all")


def test_named_lists_that_are_all_empty_are_refused_and_one_empty_beside_blocks_runs() -> None:
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    model.empty = nn.ModuleList()
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(OffloadConfigError,
                       match=r"^fastoffload: block_lists names only empty nn.ModuleLists \(empty\); there are no"):
        enable_layerwise_offload(model, device="cpu", block_lists=["empty"])
    assert all(torch.equal(p, before[name]) and p.numel() for name, p in model.named_parameters())
    group = enable_layerwise_offload(model, device="cpu", block_lists=["empty", "blocks"])
    assert group is not None and len(group.states) == 2


def test_enable_says_which_block_lists_it_leaves_where_they_are(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Module()
    model.double = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    model.single = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(3))
    model.empty = nn.ModuleList()
    with caplog.at_level(logging.INFO, logger="fastoffload_ext.engine.layerwise"):
        enable_layerwise_offload(model, device="cpu")
    assert "not offloaded: single (3 blocks, 768 B) (block_lists='all' offloads every list)" in caplog.text
    disable_layerwise_offload(model)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastoffload_ext.engine.layerwise"):
        enable_layerwise_offload(model, device="cpu", block_lists="all")
    assert "Layerwise offload enabled" in caplog.text and "not offloaded" not in caplog.text


def test_calibrating_an_offload_that_holds_no_block_is_refused_with_the_reason() -> None:
    model = nn.Module()
    model.blocks = nn.ModuleList()  # FastVideo's rule: an empty first list with nothing after it offloads nothing
    group = enable_layerwise_offload(model, device="cpu")
    assert group is not None and not group.blocks
    with pytest.raises(OffloadConfigError, match=r"^fastoffload: nothing to calibrate: this offload holds no block "
                                                 r"\(the block list 'blocks' is empty\)"):
        group.calibrate(lambda: None)
    assert group.costs is None


def _tiny_flux(seed: int) -> nn.Module:
    diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (scripts/setup_env.sh installs it)")
    torch.manual_seed(seed)
    return diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=3,
                                            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                            pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)).eval()


def _flux_inputs(device: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    image, text = 16, 8
    return {name: tensor.to(device) for name, tensor in dict(
        hidden_states=torch.randn(1, image, 4, generator=generator),
        encoder_hidden_states=torch.randn(1, text, 32, generator=generator),
        pooled_projections=torch.randn(1, 32, generator=generator),
        timestep=torch.tensor([0.5]),
        img_ids=torch.randn(image, 3, generator=generator),
        txt_ids=torch.zeros(text, 3),
    ).items()}


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_diffusers_flux_with_all_lists_is_bit_exact(device: str, backend: str) -> None:
    from fastoffload_ext.integrations.diffusers import offload_transformer

    model, reference = _tiny_flux(0), _tiny_flux(0).to(device)

    class Pipe:
        transformer = model

    groups = offload_transformer(Pipe, device=device, backend=backend, block_lists="all")
    assert groups["transformer"].list_names == ["transformer_blocks", "single_transformer_blocks"]
    assert len(groups["transformer"].states) == 5
    inputs = _flux_inputs(device)
    with torch.inference_mode():
        expected = reference(**inputs).sample
        for _ in range(2):
            assert torch.equal(model(**inputs).sample, expected)


@pytest.mark.cuda
@pytest.mark.parametrize("prefetch_depth", [1, 2])
def test_flux_all_lists_gpu_weights_stay_within_the_slots(prefetch_depth: int) -> None:
    diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (scripts/setup_env.sh installs it)")
    config = dict(patch_size=1, in_channels=64, num_layers=4, num_single_layers=8, attention_head_dim=128,
                  num_attention_heads=8, joint_attention_dim=256, pooled_projection_dim=128,
                  axes_dims_rope=(16, 56, 56))

    def build() -> nn.Module:
        torch.manual_seed(0)
        return diffusers.FluxTransformer2DModel(**config).to(torch.bfloat16).eval()

    inputs = {name: (t.to(torch.bfloat16) if t.is_floating_point() and not name.endswith("_ids") else t).cuda()
              for name, t in _flux_inputs("cpu").items()}
    inputs["hidden_states"] = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(1)).to("cuda",
                                                                                                       torch.bfloat16)
    inputs["encoder_hidden_states"] = torch.randn(1, 8, 256).to("cuda", torch.bfloat16)
    inputs["pooled_projections"] = torch.randn(1, 128).to("cuda", torch.bfloat16)
    model = build()
    blocks = list(model.transformer_blocks) + list(model.single_transformer_blocks)
    sizes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks]
    all_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    reference = build().cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        expected = reference(**inputs, return_dict=False)[0]
    activations = max(torch.cuda.max_memory_allocated() - all_bytes, 0)  # the output included
    del reference
    torch.cuda.empty_cache()

    from fastoffload_ext.integrations.diffusers import offload_transformer

    class Pipe:
        transformer = model

    offload_transformer(Pipe, device="cuda", backend="ext", block_lists="all", prefetch_depth=prefetch_depth)
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        output = model(**inputs, return_dict=False)[0]
    torch.cuda.synchronize()
    assert torch.equal(output, expected)
    # Weights on the GPU: k+1 slots of the largest block (double-stream) and the modules outside the lists.
    bound = (prefetch_depth + 1) * max(sizes) + (all_bytes - sum(sizes)) + activations + 16 * 1024**2
    assert torch.cuda.max_memory_allocated() <= bound


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replan_that_changes_the_layout_keeps_every_list(backend: str) -> None:
    from fastoffload_ext import get_offload_group
    from fastoffload_ext.planning import plan_offload
    model, reference = _pair()
    block = sum(p.numel() * p.element_size() for p in model.transformer_blocks[0].parameters())
    group = enable_layerwise_offload(model, device="cpu", backend=backend, block_lists="all",
                                     device_budget=5 * block)
    x = torch.randn(2, 16)
    # A table under which another layout wins: the re-plan offloads again, with the same lists.
    table = dataclasses.replace(group.plan.costs, calibrated=True, compute_ms=(0.1, 5.0, 0.1, 5.0, 0.1, 0.1, 5.0))
    assert not plan_offload(table, group.plan.device_budget).same_layout(group.plan)
    group.replan(table)
    fresh = get_offload_group(model)
    assert fresh is not group and fresh.list_names == ["transformer_blocks", "single_transformer_blocks"]
    assert len(fresh.states) + len(fresh.resident) == 7 and fresh.resident != group.resident
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_a_replan_whose_enable_fails_puts_the_old_layout_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import fastoffload_ext.engine.layerwise as layerwise
    from fastoffload_ext import get_offload_group
    model, reference = _pair()
    block = sum(p.numel() * p.element_size() for p in model.transformer_blocks[0].parameters())
    group = enable_layerwise_offload(model, device="cpu", block_lists="all", device_budget=5 * block)
    old = group.plan
    table = dataclasses.replace(old.costs, calibrated=True, compute_ms=(0.1, 5.0, 0.1, 5.0, 0.1, 0.1, 5.0))
    real = layerwise.enable_layerwise_offload

    def failing(model: nn.Module, **kwargs: object):
        if kwargs.get("plan") is not old:
            raise OffloadConfigError("fastoffload: injected")
        return real(model, **kwargs)
    monkeypatch.setattr(layerwise, "enable_layerwise_offload", failing)
    with pytest.raises(OffloadConfigError, match="injected"):
        group.replan(table)
    restored = get_offload_group(model)
    assert restored is not None and restored.resident == group.resident and restored.plan is old
    assert restored.list_names == group.list_names
    with torch.no_grad():
        assert torch.equal(model(torch.ones(2, 16)), reference(torch.ones(2, 16)))
