"""Calls that change an offloaded model's layout, refused: the offload that was running stays, bit-exact.

enable_layerwise_offload(is_replace=True): a refusal that the arguments alone tell is raised before
anything changes, so the very group stays on the model. One that needs the blocks' real weights (a
budget, the model checks) or a failure while enabling comes after the running offload was undone; that
offload is then applied again, same layout, before the error is raised. disable_layerwise_offload: a
device it cannot restore to is refused before any block is detached. Both backends, the host as the
device.
"""
from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext.planning import module_packed_bytes, plan_offload
from fastoffload_ext.planning.costs import BlockCosts

from ._models import Block, make_pair, offload_hook, params_equal
from ._trees import has_hooks

BACKENDS = ["ext", "python"]
N = 4
BLOCK_BYTES = module_packed_bytes(Block(16, 2))


def _setup(backend: str, **enable: Any) -> tuple[nn.Module, nn.Module, torch.Tensor, Any]:
    model, reference = make_pair(N, seed=3)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(4))
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, **enable)
    return model, reference, x, group


def _runs_exactly(model: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), reference(x))


def _finish(model: nn.Module, reference: nn.Module) -> None:
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
    assert not any(has_hooks(block) for block in model.blocks)


# Arguments that enable refuses from themselves and the model's structure: checked before the running
# offload is undone (before the fix, it was undone first and the model was left with no offload at all).
ARGUMENT_REFUSALS = [
    (dict(prefetch_depth=-1), r"prefetch_depth must be an integer >= 0 \(blocks copied ahead\) or 'auto', got -1"),
    (dict(resident_blocks=[99]), r"resident_blocks indices must be integers in 0\.\.3 \(the blocks of 'blocks'\)"),
    (dict(resident_blocks=9), r"resident_blocks must be an integer between 0 and the 4 blocks of 'blocks', got 9"),
    (dict(backend="nope"), r"backend must be one of 'auto', 'ext', 'python', got 'nope'"),
    (dict(pin_backing="zzz"), r"pin_backing must be one of 'host_alloc', 'register', 'pageable', got 'zzz'"),
    (dict(cyclic="yes"), r"cyclic must be True or False, got 'yes'"),
    (dict(block_lists=["nope"]), r"block_lists names 'nope', which is not a direct-child nn\.ModuleList"),
    (dict(compress="maybe"), r"compress must be False, True or 'auto', got 'maybe'"),
    (dict(device_budget="lots"), r"device_budget must be None, a number of bytes, or a size"),
    (dict(host_budget=-5), r"host_budget must not be negative, got -5"),
    (dict(activation_reserve=1024), r"activation_reserve is the part of a device_budget kept for activations"),
    (dict(plan=3), r"plan must be an OffloadPlan from plan_offload\(\), got int"),
    (dict(share_host_copy=True), r"share_host_copy=True shares the host copy between the ranks of a "
                                 r"torch\.distributed process group, but none is initialized"),
    (dict(disk_options=object()), r"disk_options needs weights="),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad, message", ARGUMENT_REFUSALS, ids=[next(iter(b)) + "-" + str(i)
                                                                for i, (b, _) in enumerate(ARGUMENT_REFUSALS)])
def test_a_bad_argument_is_refused_before_the_running_offload_is_touched(backend: str, bad: dict[str, Any],
                                                                         message: str) -> None:
    model, reference, x, group = _setup(backend, resident_blocks=[1], prefetch_depth=2)
    hooks = [offload_hook(model.blocks[i]) for i in group.offloaded_indices]
    _runs_exactly(model, reference, x)
    arguments = dict(device="cpu", backend=backend)
    arguments.update(bad)
    # OffloadConfigError (a ValueError), or for share_host_copy an OffloadStateError (a RuntimeError).
    with pytest.raises((ValueError, RuntimeError), match="^fastoffload: " + message):
        fo.enable_layerwise_offload(model, is_replace=True, **arguments)
    # The very offload that ran: same group, same hooks, same layout.
    assert fo.get_offload_group(model) is group
    assert [offload_hook(model.blocks[i]) for i in group.offloaded_indices] == hooks
    assert group.stats()["resident"] == [1] and group.prefetch_depth == 2
    _runs_exactly(model, reference, x)
    _finish(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plan_for_another_model_is_refused_before_the_running_offload_is_touched(backend: str) -> None:
    model, reference, x, group = _setup(backend)
    plan = plan_offload(BlockCosts([0.1] * (N + 1), [BLOCK_BYTES] * (N + 1), 1e-3), 10 * BLOCK_BYTES)
    for kwargs, message in ((dict(plan=plan), r"the plan was made for 5 blocks, but 'blocks' has 4"),
                            (dict(plan=plan, resident_blocks=1), r"the plan was made for 5 blocks")):
        with pytest.raises(ValueError, match="^fastoffload: " + message):
            fo.enable_layerwise_offload(model, is_replace=True, device="cpu", backend=backend, **kwargs)
        assert fo.get_offload_group(model) is group
    _runs_exactly(model, reference, x)
    _finish(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("planned", [False, True])
def test_a_budget_refusal_after_the_undo_applies_the_running_offload_again(backend: str, planned: bool) -> None:
    """The budget needs the real weights (the running offload holds placeholders), so the offload is undone
    to plan; refused, the layout that ran is applied again: same resident set, depth and plan."""
    enable = dict(device_budget=3 * BLOCK_BYTES) if planned else dict(resident_blocks=[0, 3], prefetch_depth=1)
    model, reference, x, group = _setup(backend, **enable)
    with pytest.raises(ValueError, match=r"^fastoffload: device_budget 21\.0 KiB is smaller than what offload needs"):
        fo.enable_layerwise_offload(model, is_replace=True, device="cpu", backend=backend,
                                    device_budget=3 * BLOCK_BYTES // 2)
    again = fo.get_offload_group(model)
    assert again is not None and again is not group
    assert (again.resident, again.prefetch_depth, again.backend) == (group.resident, group.prefetch_depth, backend)
    if planned:
        assert again.plan is not None and again.plan.same_layout(group.plan)
        assert again.plan.device_budget == group.plan.device_budget
    else:
        assert again.plan is None
    assert all(has_hooks(model.blocks[i]) == (i not in group.resident) for i in range(N))
    _runs_exactly(model, reference, x)
    _finish(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_model_check_refusal_after_the_undo_applies_the_running_offload_again(backend: str) -> None:
    """Block 0 is resident and shares a weight with proj_in, which is allowed; offloading it is not, and
    the model checks that tell run on the undone model."""
    model, reference, x, _ = _setup(backend)
    fo.disable_layerwise_offload(model)
    for m in (model, reference):
        m.blocks[0].o.weight = nn.Parameter(m.proj_in.weight.data, requires_grad=False)
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, resident_blocks=1)
    with pytest.raises(ValueError, match=r"^fastoffload: parameter proj_in\.weight shares its storage with "
                                         r"blocks\.0\.o\.weight, which would be offloaded"):
        fo.enable_layerwise_offload(model, is_replace=True, device="cpu", backend=backend, resident_blocks=0)
    again = fo.get_offload_group(model)
    assert again is not None and again.resident == group.resident == (0,)
    _runs_exactly(model, reference, x)
    _finish(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failure_while_attaching_applies_the_running_offload_again(backend: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from fastoffload_ext.engine import layerwise

    model, reference, x, group = _setup(backend, resident_blocks=[2])
    attach = layerwise._attach_one
    calls = []

    def failing_once(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:  # the new offload's second block
            raise RuntimeError("fastoffload: test: out of pinned memory")
        return attach(*args)

    monkeypatch.setattr(layerwise, "_attach_one", failing_once)
    with pytest.raises(RuntimeError, match="out of pinned memory"):
        fo.enable_layerwise_offload(model, is_replace=True, device="cpu", backend=backend, prefetch_depth=2)
    again = fo.get_offload_group(model)
    assert again is not None and again.resident == (2,) and again.prefetch_depth == 1
    _runs_exactly(model, reference, x)
    _finish(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_when_the_running_offload_cannot_be_applied_again_the_error_says_so(
        backend: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from fastoffload_ext.planning import replan

    model, reference, x, _ = _setup(backend)

    def reapply(group: Any) -> Any:
        raise RuntimeError("fastoffload: test: no memory left")

    monkeypatch.setattr(replan, "reapply", reapply)
    with caplog.at_level(logging.ERROR, logger="fastoffload_ext"), pytest.raises(ValueError) as raised:
        fo.enable_layerwise_offload(model, is_replace=True, device="cpu", backend=backend, device_budget=1)
    note = ("fastoffload: the offload that was on the model before this is_replace=True call was undone to apply the "
            "new one, and could not be applied again (RuntimeError: fastoffload: test: no memory left); the model is "
            "in host memory without offload. Enable offload again (with the arguments that worked before)")
    assert raised.value.__notes__ == [note]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [note]
    # No offload, and every value exact, in host memory.
    assert fo.get_offload_group(model) is None and not any(has_hooks(b) for b in model.blocks)
    assert all(p.device.type == "cpu" and p.numel() > 0 for p in model.parameters())
    assert params_equal(model, reference)
    _runs_exactly(model, reference, x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_collective_offload_is_not_applied_again_by_one_rank(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Applying a collective's offload again would start enable's collective on this rank alone: the error
    says so instead, and the model is left in host memory with its values."""
    from fastoffload_ext.planning import replan

    model, reference, x, _ = _setup(backend)
    monkeypatch.setattr(replan, "_collective_ranks", lambda group: 2)
    with pytest.raises(ValueError) as raised:
        fo.enable_layerwise_offload(model, is_replace=True, device="cpu", backend=backend, device_budget=1)
    assert re.search(r"could not be applied again \(it was enabled as a collective of 2 ranks, which one rank cannot "
                     r"start again alone; on every rank, enable offload again\)", raised.value.__notes__[0])
    assert fo.get_offload_group(model) is None
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device, message", [
    ("nonsense", r"disable_layerwise_offload's device must be None \(the offload device\), 'cpu', 'cuda', 'cuda:N' "
                 r"or 'meta', got 'nonsense'; nothing was changed"),
    ("xpu", r"disable_layerwise_offload's device must be .* got 'xpu'; nothing was changed"),
    (True, r"disable_layerwise_offload's device must be .* got True; nothing was changed"),
    ("cuda:99", r"disable_layerwise_offload\(device='cuda:99'\) asks for a CUDA device(, but CUDA is not available| "
                r"that does not exist \(\d+ visible\)); pass device='cpu', or None for the offload device \(cpu\); "
                r"nothing was changed"),
])
def test_disable_to_a_device_it_cannot_restore_to_is_refused_before_anything_changes(backend: str, device: Any,
                                                                                   message: str) -> None:
    model, reference, x, group = _setup(backend, resident_blocks=[0])
    with pytest.raises((ValueError, RuntimeError), match="^fastoffload: " + message):
        fo.disable_layerwise_offload(model, device=device)
    assert fo.get_offload_group(model) is group and all(has_hooks(model.blocks[i]) for i in (1, 2, 3))
    _runs_exactly(model, reference, x)
    _finish(model, reference)


def test_is_replace_on_an_offload_that_streams_from_disk_is_refused_before_anything_changes(tmp_path) -> None:
    """Undoing a disk-tier offload to host memory would read every block into RAM at once (the disk tier is
    there because they do not fit): refused with the way out, and the offload keeps running from disk."""
    from tests._checkpoints import block_bytes, inputs, meta_stack, reference_stack, write_single

    reference = reference_stack(8)
    path = write_single(reference, tmp_path / "model.safetensors")
    budget = 4 * block_bytes(reference) + 4096 + 3 * fo.planning.tiers.STAGING_SLACK
    model = meta_stack(8)
    group = fo.enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget)
    on_disk = sum(1 for state in group.states if state.on_disk)
    assert on_disk >= 4
    with pytest.raises(RuntimeError, match=rf"^fastoffload: is_replace=True would undo an offload that streams "
                                           rf"{on_disk} blocks from disk .* nothing was changed. To swap it: "
                                           r"disable_layerwise_offload\(model, 'meta'\), then enable_layerwise_offload"
                                           r"\(model, weights=\.\.\., \.\.\.\) with the new arguments$"):
        fo.enable_layerwise_offload(model, is_replace=True, device="cpu", weights=path, prefetch_depth=2)
    assert fo.get_offload_group(model) is group
    with torch.no_grad():
        assert torch.equal(model(inputs()), reference(inputs()))
    fo.disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)
