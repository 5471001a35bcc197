"""compress="auto" under a budget: the planner plans raw and coded copies and applies the faster predicted."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning import BlockCosts, plan_offload
from fastoffload_ext.planning.codec_choice import CODED_MARGIN, choose_codec_plan
from fastoffload_ext.planning.costs import module_packed_bytes
from fastoffload_ext.planning.layout import resolve_layout

from ._models import make_pair, place_outside_blocks

MiB = 1024**2
BLOCK = 100 * MiB
GBPS = 50.0
COPY_MS = BLOCK / (GBPS * 1e6)


def uniform(n: int, compute_ms: float) -> BlockCosts:
    return BlockCosts([compute_ms] * n, [BLOCK] * n, GBPS)


def coded(costs: BlockCosts, ratio: float = 0.75) -> BlockCosts:
    return dataclasses.replace(costs, transfer_bytes=tuple(int(b * ratio) for b in costs.block_bytes))


def half_budget(n: int) -> int:
    """Two slots (the least offload runs in) plus half of the block bytes, as the budgets section sizes it."""
    return 2 * BLOCK + n * BLOCK // 2


def test_few_large_blocks_keep_raw_copies_the_staging_would_cost_two_resident_blocks() -> None:
    table = coded(uniform(8, 0.2))  # transfer-bound, W4's shape: 8 large blocks
    budget = half_budget(8)
    forced = plan_offload(table, budget)  # compress=True: coded bytes, staging counted
    assert forced.compressed and forced.staging_bytes == 2 * int(0.75 * BLOCK)
    assert forced.device_bytes <= budget and len(forced.resident) == 2
    chosen = choose_codec_plan(table, table, budget)
    assert not chosen.compressed and len(chosen.resident) == 4 and chosen.staging_bytes == 0
    assert chosen.predicted_step_ms == pytest.approx(4 * COPY_MS, rel=1e-6)
    assert chosen.predicted_step_ms < forced.predicted_step_ms
    assert "compress='auto': raw copies predicted" in chosen.why and "staging takes" in chosen.why


def test_many_small_blocks_take_coded_copies_with_the_staging_within_the_budget() -> None:
    table = coded(uniform(16, 0.2))  # W1's shape: 16 blocks
    budget = half_budget(16)
    chosen = choose_codec_plan(uniform(16, 0.2), table, budget)
    raw = plan_offload(uniform(16, 0.2), budget)
    assert chosen.compressed and chosen.staging_bytes == 2 * int(0.75 * BLOCK)
    assert chosen.device_bytes <= budget and len(chosen.resident) == 6 and len(raw.resident) == 8
    assert chosen.predicted_step_ms < raw.predicted_step_ms * (1 - CODED_MARGIN)
    assert "compress='auto': coded copies predicted" in chosen.why


def test_a_compute_bound_step_ties_and_the_tie_goes_to_raw_copies() -> None:
    table = coded(uniform(8, 4.0))  # every copy hides behind compute either way
    chosen = choose_codec_plan(table, table, half_budget(8))
    assert not chosen.compressed
    assert chosen.predicted_step_ms == pytest.approx(plan_offload(coded(uniform(8, 4.0)),
                                                                  half_budget(8)).predicted_step_ms, rel=0.02)


def test_a_host_budget_only_coded_copies_fit_takes_them() -> None:
    table = coded(uniform(16, 0.2))
    chosen = choose_codec_plan(table, table, 6 * BLOCK, host_budget=11 * BLOCK)
    assert chosen.compressed and chosen.host_bytes <= 11 * BLOCK
    assert "only coded copies fit the budgets" in chosen.why


def test_no_smaller_coded_copy_or_no_coded_layout_that_fits_keeps_raw_copies() -> None:
    raw = uniform(8, 0.2)
    assert "no block's coded copy is smaller" in choose_codec_plan(raw, raw, half_budget(8)).why
    # 2 slots + 1.5 blocks of staging do not fit 3 blocks; 2 raw slots do.
    assert "no layout with coded copies fits" in choose_codec_plan(raw, coded(raw), 3 * BLOCK).why
    assert "copies no coded block" in choose_codec_plan(raw, coded(raw), 9 * BLOCK).why


def test_nothing_fits_raises_the_raw_refusal() -> None:
    table = coded(uniform(8, 0.2))
    with pytest.raises(OffloadConfigError, match=re.escape("is smaller than what offload needs at least")):
        choose_codec_plan(table, table, BLOCK)


@pytest.mark.parametrize("margin", [-0.1, 1.0])
def test_bad_margin_is_refused(margin: float) -> None:
    table = coded(uniform(4, 0.2))
    with pytest.raises(OffloadConfigError, match=re.escape("choose_codec_plan's margin must be in [0, 1)")):
        choose_codec_plan(table, table, None, margin=margin)


@pytest.mark.parametrize("n, mode, resident", [(8, "off", 4), (16, "on", 6)])
def test_the_layout_names_the_codec_mode_its_plan_was_made_for(n: int, mode: str, resident: int) -> None:
    blocks = [nn.Linear(4, 4) for _ in range(n)]
    layout = resolve_layout(blocks, torch.device("cpu"), "blocks", resident_blocks=None, prefetch_depth=None,
                            device_budget=half_budget(n), host_budget=None, activation_reserve=0,
                            costs=coded(uniform(n, 0.2)), compress="auto")
    assert layout.compress == mode and len(layout.resident) == resident
    assert layout.plan is not None and layout.plan.compressed is (mode == "on")
    fixed = resolve_layout(blocks, torch.device("cpu"), "blocks", resident_blocks=None, prefetch_depth=None,
                           device_budget=half_budget(n), host_budget=None, activation_reserve=0,
                           costs=coded(uniform(n, 0.2)), compress="on")
    assert fixed.compress is None and fixed.plan is not None and fixed.plan.compressed


def test_blocks_without_values_plan_raw_copies_and_leave_auto_to_the_engine() -> None:
    from fastoffload_ext.planning.compressed import tensor_ratio

    blocks = [nn.Linear(256, 256, device="meta", dtype=torch.bfloat16) for _ in range(6)]
    assert tensor_ratio(blocks[0].weight) == 1.0  # nothing to sample on the meta device
    block = module_packed_bytes(blocks[0])
    layout = resolve_layout(blocks, torch.device("cpu"), "blocks", resident_blocks=None, prefetch_depth=None,
                            device_budget=4 * block, host_budget=None, activation_reserve=0, compress="auto")
    assert layout.compress is None and layout.plan is not None and not layout.plan.compressed
    assert len(layout.resident) == 2


def test_a_raw_plan_applied_with_compress_true_is_checked_with_the_staging() -> None:
    blocks = [nn.Linear(256, 256, dtype=torch.bfloat16) for _ in range(6)]
    block = module_packed_bytes(blocks[0])
    table = BlockCosts([0.1] * 6, [block] * 6, GBPS)  # a GPU's table: the decoder needs staging there
    kwargs = dict(resident_blocks=None, prefetch_depth=None, host_budget=None, activation_reserve=0)
    roomy = plan_offload(table, 6 * block, resident=(0, 1), prefetch_depth=1)
    layout = resolve_layout(blocks, torch.device("cpu"), "blocks", plan=roomy, compress="on", **kwargs)
    assert layout.plan is not None and layout.plan.compressed and layout.plan.staging_bytes > 0
    assert layout.resident == (0, 1) and layout.plan.device_bytes <= 6 * block
    tight = plan_offload(table, 4 * block)  # 2 resident + 2 slots: no room for the staging
    with pytest.raises(OffloadConfigError, match=re.escape("is too small for 2 resident blocks")
                       + ".*" + re.escape("staging for compressed copies + 0 B activation reserve")):
        resolve_layout(blocks, torch.device("cpu"), "blocks", plan=tight, compress="on", **kwargs)


# --- with the engine (ext backend, the host as the device) --------------------------------------------------

D = 128


def test_auto_under_a_budget_runs_the_mode_its_plan_chose_bit_exactly_and_after_a_replan() -> None:
    pytest.importorskip("fastoffload_ext._C")
    model, reference = make_pair(6, torch.bfloat16, d=D)
    place_outside_blocks(model, "cpu")
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    block = module_packed_bytes(model.blocks[0])
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", compress="auto",
                                        device_budget=4 * block, activation_reserve=0)
    # Bytes only: every layout is copy-bound, so the coded copies (a quarter fewer bytes) win.
    assert group.plan.compressed and group.compress_mode == "on"
    assert "compress='auto': coded copies predicted" in group.plan.why
    assert all(b["mode"] == "compressed" for b in group.stats()["codec"])
    with torch.inference_mode():
        expected = reference(x)
        assert torch.equal(model(x), expected)
        group.calibrate(lambda: model(x))
    group = fo.get_offload_group(model)
    assert group.compress_mode == ("on" if group.plan.compressed else "off")
    assert "compress='auto'" in group.plan.why
    with torch.inference_mode():
        assert torch.equal(model(x), expected) and torch.equal(model(x), expected)
    fo.disable_layerwise_offload(model, "cpu")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.cuda
@pytest.mark.parametrize("n, blocks_of_budget, mode", [(12, 6, "on"), (6, 5, "off")])
def test_cuda_auto_under_a_budget_stays_within_it_in_the_mode_it_chose(n: int, blocks_of_budget: int,
                                                                        mode: str) -> None:
    model, reference = make_pair(n, torch.bfloat16, d=D)
    reference.to("cuda")
    place_outside_blocks(model, "cuda")
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).cuda()
    block = module_packed_bytes(model.blocks[0])
    reserve = 256 * 1024  # activations of a 2x5x128 input and the allocator's rounding of each tensor
    budget = blocks_of_budget * block + reserve
    with torch.inference_mode():
        want = reference(x)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    group = fo.enable_layerwise_offload(model, device="cuda", backend="ext", compress="auto", device_budget=budget,
                                        activation_reserve=reserve)
    # Bytes only: of 12 blocks the coded copies move fewer bytes than the raw ones; of 6, more.
    assert group.compress_mode == mode and group.plan.compressed is (mode == "on")
    assert group.plan.device_bytes <= budget
    coded_blocks = [b for b in group.stats()["codec"] if b["mode"] == "compressed"]
    assert (len(coded_blocks) == len(group.plan.offloaded)) if mode == "on" else not coded_blocks
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(model(x), want)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= budget
    fo.disable_layerwise_offload(model, "cpu")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q.to(p.device)), name


@pytest.mark.parametrize("compress", [True, "auto"])
def test_a_negative_view_weight_is_sampled_for_its_coded_size_and_runs_bit_exactly(compress) -> None:
    # Offload resolves a negative view when it packs the block; the coded-size estimate a plan needs
    # sampled its raw bytes with a byte view, which torch refuses on such a tensor, so enable raised a bare
    # RuntimeError under a budget with compress= although the same model enabled without compress=.
    pytest.importorskip("fastoffload_ext._C")
    from fastoffload_ext.planning.compressed import tensor_ratio

    model, reference = make_pair(6, torch.bfloat16, d=D)
    place_outside_blocks(model, "cpu")
    for block in model.blocks:
        weight = block.up.weight.detach()
        block.up.weight = nn.Parameter(torch._neg_view((-weight).clone()), requires_grad=False)
        assert block.up.weight.is_neg() and torch.equal(block.up.weight, weight)
    assert tensor_ratio(model.blocks[-1].up.weight) == tensor_ratio(weight) < 0.9
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    block = module_packed_bytes(model.blocks[0])
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", compress=compress,
                                        device_budget=4 * block, activation_reserve=0)
    assert group.plan is not None and group.plan.compressed and group.states
    assert all(b["mode"] == "compressed" for b in group.stats()["codec"])
    with torch.inference_mode():
        expected = reference(x)
        assert torch.equal(model(x), expected) and torch.equal(model(x), expected)
    fo.disable_layerwise_offload(model, "cpu")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def test_a_plan_made_for_coded_copies_applied_without_compression_is_scored_and_checked_raw() -> None:
    # compress=False sends raw copies whatever plan it is given: a coded plan kept as it was made reported
    # coded blocks, coded host bytes and a coded step, none of which ran, and was never held to its own host
    # budget with the raw bytes the host pins.
    pytest.importorskip("fastoffload_ext._C")
    model, reference = make_pair(6, torch.bfloat16, d=D)
    place_outside_blocks(model, "cpu")
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    block = module_packed_bytes(model.blocks[0])
    table = coded(BlockCosts([0.1] * 6, [block] * 6, GBPS), ratio=0.76)
    plan = plan_offload(table, 4 * block)
    assert plan.compressed and plan.resident == ()
    group = fo.enable_layerwise_offload(model, device="cpu", backend="ext", plan=plan, compress=False)
    stats = group.stats()
    assert stats["compressed_blocks"] == 0 and not group.plan.compressed and group.plan.resident == plan.resident
    assert stats["plan"]["compressed_blocks"] == 0 and stats["plan"]["host_bytes"] == stats["host_bytes"] == 6 * block
    with torch.inference_mode():
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model, "cpu")
    # Within a host budget that only the coded copies fit, the raw copies are refused before anything changes.
    tight = plan_offload(table, 4 * block, host_budget=5 * block)
    assert tight.compressed and tight.resident == ()
    with pytest.raises(OffloadConfigError, match="host_budget .* cannot hold the .* of pinned host copies that the 6 "
                                                 "offloaded blocks need"):
        fo.enable_layerwise_offload(model, device="cpu", backend="ext", plan=tight, compress=False)
    assert fo.get_offload_group(model) is None
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
