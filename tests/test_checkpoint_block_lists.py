"""weights= with several block lists: a Flux-shaped model built on the meta device and filled from a checkpoint,
every list in one ring, the blocks beyond host_budget read from disk in both lists, bit-exact against the loaded
model; and diffusers' FluxTransformer2DModel from a folder written by save_pretrained."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload
from fastoffload_ext.errors import CheckpointError, OffloadConfigError
from fastoffload_ext.planning.tiers import STAGING_SLACK
from fastoffload_ext.storage import DiskOptions
from tests._checkpoints import write_sharded, write_single
from tests._models import OFFLOAD_DEVICES, Block, TwoLists, params_equal

D = 32
DOUBLES, SINGLES = 3, 5
LISTS = ["transformer_blocks", "single_transformer_blocks"]


def _two_lists() -> TwoLists:
    return TwoLists(DOUBLES, SINGLES, D, double_ratio=4).to(torch.bfloat16).eval()


def _reference() -> TwoLists:
    torch.manual_seed(0)
    return _two_lists()


def _meta() -> TwoLists:
    with torch.device("meta"):
        return _two_lists()


def _written(tmp_path: Path) -> tuple[TwoLists, Path, TwoLists]:
    """The reference model, its checkpoint, and the same architecture on the meta device to fill from it."""
    reference = _reference()
    return reference, write_single(reference, tmp_path / "model.safetensors"), _meta()


def _inputs(device: str) -> torch.Tensor:
    return torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _ring(model: TwoLists) -> list[nn.Module]:
    return list(model.transformer_blocks) + list(model.single_transformer_blocks)


def _half_the_blocks(reference: TwoLists, staging: int) -> int:
    """A host budget that holds about half the blocks beside a staging ring of ``staging`` buffers."""
    sizes = sorted(_bytes(block) for block in _ring(reference))
    return sum(sizes[:len(sizes) // 2]) + staging * (sizes[-1] + STAGING_SLACK)


def _check_runs(model: TwoLists, reference: TwoLists, device: str, steps: int = 3) -> None:
    x = _inputs(device)
    with torch.no_grad():
        expected = reference.to(device)(x)
        for _ in range(steps):
            assert torch.equal(model(x), expected)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("sharded", [False, True])
def test_every_list_from_a_checkpoint_is_bit_exact(tmp_path: Path, device: str, sharded: bool) -> None:
    reference = _reference()
    path = write_sharded(reference, tmp_path / "ckpt") if sharded else write_single(reference, tmp_path / "m.st")
    model = _meta()
    group = enable_layerwise_offload(model, device=device, weights=path, block_lists="all", host_budget=None)
    assert group is not None and group.list_names == LISTS and len(group.states) == DOUBLES + SINGLES
    assert not any(state.on_disk for state in group.states)
    for name, param in model.named_parameters():  # outside the lists: read onto the device
        if not name.startswith(tuple(LISTS)):
            assert param.device.type == device and not param.is_meta
    _check_runs(model, reference, device)
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference.cpu())


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("depth,staging", [(1, 1), (1, 2), (2, 2), (3, 3)])
def test_blocks_of_both_lists_stream_from_disk_bit_exact(tmp_path: Path, device: str, depth: int,
                                                          staging: int) -> None:
    reference, path, model = _written(tmp_path)
    budget = _half_the_blocks(reference, staging)
    group = enable_layerwise_offload(model, device=device, weights=path, block_lists="all", host_budget=budget,
                                     prefetch_depth=depth, disk_options=DiskOptions(staging_buffers=staging))
    on_disk = [i for i, state in enumerate(group.states) if state.on_disk]
    # The disk tier is spread over the ring, so both lists keep blocks on disk.
    assert any(i < DOUBLES for i in on_disk) and any(i >= DOUBLES for i in on_disk), on_disk
    assert group.engine.pool.stats()["in_use_bytes"] <= budget
    _check_runs(model, reference, device, steps=4)
    stats = group.engine.disk_stats()
    # The ring runs in the order the forward does, across the list boundary and around: no read on demand.
    assert stats["reads"] >= 4 * len(on_disk) and stats["out_of_order"] == 0
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference.cpu())


def test_resident_blocks_of_either_list_are_read_onto_the_device(tmp_path: Path) -> None:
    reference, path, model = _written(tmp_path)
    resident = {1, DOUBLES + 2}  # one double-stream block, one single-stream block
    group = enable_layerwise_offload(model, device="cpu", weights=path, block_lists="all",
                                     resident_blocks=resident, host_budget=_half_the_blocks(reference, 2))
    assert len(group.states) == DOUBLES + SINGLES - 2
    for index in resident:
        block = _ring(model)[index]
        assert getattr(block, "_hook_manager", None) is None
        assert params_equal(block, _ring(reference)[index])
    _check_runs(model, reference, "cpu")


def test_compressed_disk_tier_across_lists_is_bit_exact(tmp_path: Path) -> None:
    reference, path, model = _written(tmp_path)
    group = enable_layerwise_offload(model, device="cpu", weights=path, block_lists="all", compress=True,
                                     host_budget=_half_the_blocks(reference, 2),
                                     disk_options=DiskOptions(spill_dir=str(tmp_path)))
    assert any(state.on_disk for state in group.states)
    _check_runs(model, reference, "cpu")
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference.cpu())


def test_a_tensor_missing_from_the_second_list_is_named_and_nothing_changes(tmp_path: Path) -> None:
    reference = _reference()
    state = {k: v for k, v in reference.state_dict().items() if k != "single_transformer_blocks.3.up.weight"}
    from safetensors.torch import save_file
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    model = _meta()
    with pytest.raises(CheckpointError, match=r"the model's parameter 'single_transformer_blocks\.3\.up\.weight' "
                                              r"is not in checkpoint"):
        enable_layerwise_offload(model, device="cpu", weights=path, block_lists="all")
    assert all(p.is_meta for p in model.parameters())
    assert not [b for b in model.modules() if getattr(b, "_hook_manager", None) is not None]


def test_the_first_list_alone_reads_the_second_onto_the_device(tmp_path: Path) -> None:
    """FastVideo's rule from a checkpoint: the second list is not offloaded, so it is read like the rest."""
    reference, path, model = _written(tmp_path)
    group = enable_layerwise_offload(model, device="cpu", weights=path)
    assert group.list_names == ["transformer_blocks"] and len(group.states) == DOUBLES
    assert params_equal(model.single_transformer_blocks, reference.single_transformer_blocks)
    _check_runs(model, reference, "cpu")


def test_a_device_budget_plans_over_both_lists_with_the_disk_tier(tmp_path: Path) -> None:
    reference, path, model = _written(tmp_path)
    sizes = [_bytes(block) for block in _ring(reference)]
    group = enable_layerwise_offload(model, device="cpu", weights=path, block_lists="all",
                                     device_budget=sum(sizes) // 2 + _bytes(reference) - sum(sizes),
                                     activation_reserve=0, host_budget=_half_the_blocks(reference, 2))
    plan = group.plan
    assert plan is not None and plan.blocks == DOUBLES + SINGLES and plan.resident
    assert any(state.on_disk for state in group.states)
    _check_runs(model, reference, "cpu")


def test_weights_with_the_python_backend_is_still_refused(tmp_path: Path) -> None:
    reference, path, model = _written(tmp_path)
    with pytest.raises(OffloadConfigError, match=r"weights="):
        enable_layerwise_offload(model, device="cpu", weights=path, block_lists="all", backend="python")
    assert all(p.is_meta for p in model.parameters())


def _tiny_flux(**kwargs: object) -> nn.Module:
    diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (scripts/setup_env.sh installs it)")
    return diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=3,
                                            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                            pooled_projection_dim=32, axes_dims_rope=(4, 6, 6), **kwargs)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
def test_diffusers_flux_from_a_saved_folder_with_every_list_on_disk_and_host(tmp_path: Path, device: str) -> None:
    torch.manual_seed(0)
    reference = _tiny_flux().to(torch.bfloat16).eval()
    reference.save_pretrained(tmp_path / "transformer")
    with torch.device("meta"):
        model = _tiny_flux().to(torch.bfloat16).eval()
    blocks = list(reference.transformer_blocks) + list(reference.single_transformer_blocks)
    sizes = [_bytes(block) for block in blocks]
    budget = sum(sorted(sizes)[:len(sizes) // 2]) + 2 * (max(sizes) + STAGING_SLACK)
    group = enable_layerwise_offload(model, device=device, weights=tmp_path / "transformer", block_lists="all",
                                     host_budget=budget)
    assert group.list_names == LISTS and any(state.on_disk for state in group.states)
    generator = torch.Generator().manual_seed(7)
    inputs = dict(hidden_states=torch.randn(1, 16, 4, generator=generator),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=generator),
                  pooled_projections=torch.randn(1, 32, generator=generator), timestep=torch.tensor([0.5]),
                  img_ids=torch.randn(16, 3, generator=generator), txt_ids=torch.zeros(8, 3))
    inputs = {k: (v.to(torch.bfloat16) if k not in ("img_ids", "txt_ids") else v).to(device) for k, v in inputs.items()}
    reference = reference.to(device)
    with torch.inference_mode():
        expected = reference(**inputs).sample
        for _ in range(2):
            assert torch.equal(model(**inputs).sample, expected)
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference.cpu())


class Refiners(nn.Module):
    """Lumina2-shaped: registered noise_refiner, context_refiner, layers; the forward runs context_refiner first,
    which is no rotation of the ring enable makes."""

    def __init__(self) -> None:
        super().__init__()
        self.noise_refiner = nn.ModuleList(Block(D, 2) for _ in range(3))
        self.context_refiner = nn.ModuleList(Block(D, 2) for _ in range(3))
        self.layers = nn.ModuleList(Block(D, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.context_refiner, *self.noise_refiner, *self.layers]:
            x = block(x)
        return x


def _refiners_written(tmp_path: Path) -> tuple[Refiners, Path, Refiners, list[int]]:
    """The reference, its checkpoint, the same architecture on the meta device, and its block sizes, sorted."""
    torch.manual_seed(0)
    reference = Refiners().to(torch.bfloat16).eval()
    path = write_single(reference, tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = Refiners().to(torch.bfloat16).eval()
    return reference, path, model, sorted(_bytes(block) for block in model.modules() if isinstance(block, Block))


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("depth,staging", [(1, 1), (1, 2), (2, 2), (2, 3)])
def test_the_disk_tier_reads_ahead_in_the_order_the_forward_runs(tmp_path: Path, device: str, depth: int,
                                                                 staging: int) -> None:
    reference, path, model, sizes = _refiners_written(tmp_path)
    budget = sum(sizes[:5]) + staging * (sizes[-1] + STAGING_SLACK)
    group = enable_layerwise_offload(model, device=device, weights=path, block_lists="all", host_budget=budget,
                                     prefetch_depth=depth, disk_options=DiskOptions(staging_buffers=staging))
    disk = sum(state.on_disk for state in group.states)
    assert disk >= 3
    x = _inputs(device)
    reference = reference.to(device)
    with torch.no_grad():
        expected = reference(x)
        # The first pass runs on the ring's order: where the forward jumps, a block is read on demand.
        assert torch.equal(model(x), expected)
        assert group.stats()["run_order"] == "rewired"
        if staging == 1:
            # One buffer may still hold a block staged in the ring's order, which the next step reads out of turn.
            assert torch.equal(model(x), expected)
        before = group.engine.disk_stats()
        for _ in range(4):
            assert torch.equal(model(x), expected)
    after = group.engine.disk_stats()
    # Then every disk block is read ahead, once a step, in the order the forward runs them. (A buffer is handed
    # its next block when the copy out of it is issued, by a prefetch when the read was done in time, else by the
    # block's own acquire: so each end of the window may count one hand-off per buffer more or less.)
    assert after["out_of_order"] == before["out_of_order"] == group.stats()["disk_reads_on_demand"]
    assert abs(after["handoffs"] - before["handoffs"] - 4 * disk) <= 2 * staging
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference.cpu())


def test_the_disk_order_refuses_what_the_tier_does_not_hold(tmp_path: Path) -> None:
    reference, path, model = _written(tmp_path)
    group = enable_layerwise_offload(model, device="cpu", weights=path, block_lists="all",
                                     host_budget=_half_the_blocks(reference, 2))
    disk = [state.handle for state in group.states if state.on_disk]
    with pytest.raises(RuntimeError, match="names block .* twice or not in the tier"):
        group.engine.set_disk_order(disk[:-1] + disk[:1])
    with pytest.raises(RuntimeError, match="has 1 blocks, the tier holds"):
        group.engine.set_disk_order(disk[:1])
    group.engine.set_disk_order(list(reversed(disk)))  # any order of the same blocks runs, bit-exact
    _check_runs(model, reference, "cpu")
    resident = enable_layerwise_offload(_reference(), device="cpu")
    with pytest.raises(RuntimeError, match="set_disk_order: this engine has no disk tier running"):
        resident.engine.set_disk_order([0])


def test_diffusers_lumina2_from_a_saved_folder_with_a_disk_tier(tmp_path: Path) -> None:
    pytest.importorskip("diffusers", reason="diffusers is not installed (scripts/setup_env.sh installs it)")
    from tests import _dits

    spec = _dits.BY_NAME["lumina2"]
    reference = _dits.build(spec)
    reference.save_pretrained(tmp_path / "transformer")
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (scripts/setup_env.sh installs it)")
    import diffusers
    # Parameters on the meta device, everything else real: Lumina2 keeps its rotary tables as plain attributes.
    with accelerate.init_empty_weights():
        model = getattr(diffusers, spec.cls_name)(**spec.config).eval()
    blocks = [block for name in spec.lists for block in getattr(reference, name)]
    sizes = sorted(_bytes(block) for block in blocks)
    budget = sum(sizes[:len(sizes) // 2]) + 2 * (sizes[-1] + STAGING_SLACK)
    group = enable_layerwise_offload(model, device="cpu", weights=tmp_path / "transformer", block_lists="all",
                                     host_budget=budget)
    assert any(state.on_disk for state in group.states)
    kwargs = _dits.inputs(spec)
    with torch.no_grad():
        expected = _dits.run(reference, spec, kwargs)
        for _ in range(3):
            assert torch.equal(_dits.run(model, spec, kwargs), expected)
    assert group.stats()["run_order"] == "rewired"


def test_a_new_layout_from_disk_goes_through_meta_as_the_refusal_says(tmp_path: Path) -> None:
    from fastoffload_ext.errors import OffloadStateError

    reference, path, model = _written(tmp_path)
    enable_layerwise_offload(model, device="cpu", weights=path, block_lists="all",
                             host_budget=_half_the_blocks(reference, 2))
    with pytest.raises(OffloadStateError, match=r"is_replace=True would undo an offload that streams \d+ blocks from "
                                                r"disk .* disable_layerwise_offload\(model, 'meta'\), then "
                                                r"enable_layerwise_offload\(model, weights=\.\.\., \.\.\.\)"):
        enable_layerwise_offload(model, device="cpu", is_replace=True, block_lists="all", prefetch_depth=2)
    _check_runs(model, reference, "cpu", steps=1)  # the refused swap changed nothing
    disable_layerwise_offload(model, "meta")
    assert all(p.is_meta for block in _ring(model) for p in block.parameters())  # nothing read into host memory
    group = enable_layerwise_offload(model, device="cpu", weights=path, block_lists="all", prefetch_depth=2,
                                     resident_blocks={0, DOUBLES},
                                     host_budget=2 * _bytes(reference.transformer_blocks[0]) + STAGING_SLACK,
                                     disk_options=DiskOptions(staging_buffers=1))
    assert group.prefetch_depth == 2 and len(group.states) == DOUBLES + SINGLES - 2
    assert any(state.on_disk for state in group.states)
    _check_runs(model, reference, "cpu")


@pytest.mark.parametrize("budgets", [[], ["--device-budget", "40%", "--host-budget", "20%"]],
                         ids=["host budget", "device budget"])
def test_the_flux_from_disk_example_runs_on_the_cpu_bit_exact(tmp_path: Path, budgets: list[str]) -> None:
    pytest.importorskip("diffusers", reason="diffusers is not installed (scripts/setup_env.sh installs it)")
    pytest.importorskip("accelerate", reason="accelerate is not installed (scripts/setup_env.sh installs it)")
    import os
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(root / "examples" / "flux_from_disk.py"), "--device", "cpu", "--check",
                           "--steps", "2", "--folder", str(tmp_path), *budgets], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    offloaded = 8 if budgets else 9  # under the device budget the planner keeps a block on the device
    on_disk = re.search(rf"blocks {offloaded} \(transformer_blocks, single_transformer_blocks\), (\d+) on disk",
                        done.stdout)
    assert on_disk is not None and int(on_disk.group(1)) > 0, done.stdout
    assert ("plan: disk-bound:" in done.stdout) == bool(budgets), done.stdout
    assert "of them on demand 0, run order ring" in done.stdout and "bit-exact: True" in done.stdout


def test_a_disk_order_that_cannot_be_set_leaves_the_rings_and_stays_exact(tmp_path: Path, monkeypatch,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from fastoffload_ext import _backend

    def refuse(engine: object, blocks: list[int]) -> None:
        raise RuntimeError("fastoffload: set_disk_order: refused for the test")

    monkeypatch.setattr(_backend.require_ext().OffloadEngine, "set_disk_order", refuse)
    reference, path, model, sizes = _refiners_written(tmp_path)
    group = enable_layerwise_offload(model, device="cpu", weights=path, block_lists="all",
                                     host_budget=sum(sizes[:5]) + 2 * (sizes[-1] + STAGING_SLACK))
    x = _inputs("cpu")
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fastoffload_ext.engine.layerwise"):
        expected = reference(x)
        for _ in range(3):
            assert torch.equal(model(x), expected)
    assert "the disk tier keeps reading ahead in the ring's order" in caplog.text
    assert group.stats()["run_order"] == "rewired"  # the prefetches follow the run order all the same
    assert group.stats()["disk_reads_on_demand"] > 0
