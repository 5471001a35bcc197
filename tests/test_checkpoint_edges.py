"""Edge cases of start-up from a checkpoint and of the disk tier: exact values or a clear refusal."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload
from fastoffload_ext.storage.checkpoint import open_checkpoint
from tests._checkpoints import block_bytes, inputs, meta_stack, reference_stack, write_single
from tests._models import OFFLOAD_DEVICES, params_equal

REPO = Path(__file__).resolve().parents[1]


def _overwrite_outside_blocks(path: Path) -> None:
    """Writes zeros over the bytes of every tensor outside the block list, in place (same size)."""
    checkpoint = open_checkpoint(path)
    with open(path, "r+b") as file:
        for name, entry in checkpoint.entries.items():
            if not name.startswith("blocks."):
                file.seek(entry.offset)
                file.write(b"\0" * entry.nbytes)


def test_resident_tensors_on_the_host_do_not_follow_a_checkpoint_rewritten_in_place(tmp_path: Path) -> None:
    reference = reference_stack(4)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(4)
    enable_layerwise_offload(model, device="cpu", weights=path)
    x = inputs()
    with torch.no_grad():
        expected = reference(x)
        assert torch.equal(model(x), expected)
        _overwrite_outside_blocks(path)
        assert torch.equal(model(x), expected)
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)


def test_resident_tensors_on_the_host_survive_a_truncated_checkpoint(tmp_path: Path) -> None:
    # Run in a child: a tensor still mapped from the file would kill the process (SIGBUS) when read.
    script = textwrap.dedent(f"""
        import os, torch
        from fastoffload_ext import enable_layerwise_offload
        from tests._checkpoints import inputs, meta_stack, reference_stack, write_single
        reference = reference_stack(4)
        path = write_single(reference, {str(tmp_path / "model.safetensors")!r})
        model = meta_stack(4)
        enable_layerwise_offload(model, device="cpu", weights=path, resident_blocks=4)
        os.truncate(path, 100)
        with torch.no_grad():
            assert torch.equal(model(inputs()), reference(inputs()))
        print("exact")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and "exact" in done.stdout, (done.returncode, done.stderr[-2000:])


class TiedBlock(torch.nn.Module):
    """Two projections sharing one weight inside the block (as an encoder-decoder pair may)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(d, d)
        self.b = torch.nn.Linear(d, d)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class TiedStack(torch.nn.Module):
    def __init__(self, n_blocks: int, d: int = 32) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.blocks = torch.nn.ModuleList(TiedBlock(d) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


def _tied_checkpoint(tmp_path: Path) -> tuple[TiedStack, Path]:
    from safetensors.torch import save_file
    torch.manual_seed(0)
    reference = TiedStack(4)
    path = tmp_path / "tied.safetensors"
    save_file({k: v.clone().contiguous() for k, v in reference.state_dict().items()}, str(path))
    return reference, path


@pytest.mark.parametrize("host_budget", ["all", "one block"])
def test_a_weight_tied_inside_a_block_is_filled_under_both_names(tmp_path: Path, host_budget: str) -> None:
    from fastoffload_ext.planning.tiers import STAGING_SLACK
    reference, path = _tied_checkpoint(tmp_path)
    with torch.device("meta"):
        model = TiedStack(4)
    budget = None if host_budget == "all" else 2 * (32 * 32 + 32) * 4 + 8192 + 2 * STAGING_SLACK
    enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget)
    x = torch.randn(3, 32)
    with torch.no_grad():
        expected = reference(x)
        for _ in range(3):
            assert torch.equal(model(x), expected)
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)
    assert all(block.b.weight is block.a.weight for block in model.blocks)
    enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget)
    disable_layerwise_offload(model, device="meta")
    assert all(block.b.weight is block.a.weight and block.a.weight.is_meta for block in model.blocks)


@pytest.mark.parametrize("host_budget", ["all", "half"])
def test_a_block_list_reached_by_a_second_name_is_offloaded_from_the_checkpoint(tmp_path: Path,
                                                                                 host_budget: str) -> None:
    from safetensors.torch import save_model

    from fastoffload_ext.planning.tiers import STAGING_SLACK
    reference = reference_stack(6)
    reference.stages = reference.blocks
    path = tmp_path / "aliased.safetensors"
    save_model(reference, str(path))  # one name of each tensor: blocks.*
    model = meta_stack(6)
    model.stages = model.blocks  # the same modules: their parameters are named stages.* too
    budget = None if host_budget == "all" else 3 * block_bytes(reference) + 8192 + 2 * STAGING_SLACK
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget)
    assert any(state.on_disk for state in group.states) == (host_budget == "half")
    # Offloaded: the stages.* names were read as tensors outside the blocks, which put every block's real
    # values in place of the engine's placeholders (on a GPU, the whole model on the device).
    assert all(p.numel() == 0 for p in model.blocks.parameters())
    x = inputs()
    with torch.no_grad():
        expected = reference(x)
        for _ in range(2):
            assert torch.equal(model(x), expected)
    assert all(p.numel() == 0 for p in model.blocks.parameters())
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)


@pytest.mark.parametrize("weight_map", [["a.safetensors"], {"blocks.0.qkv.weight": None}, {"x": 3}])
def test_a_malformed_index_is_refused_naming_it(tmp_path: Path, weight_map: object) -> None:
    import json
    from fastoffload_ext.errors import CheckpointError
    from tests._checkpoints import write_sharded
    index = write_sharded(reference_stack(2), tmp_path / "ckpt", shards=2)
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = meta_stack(2)
    with pytest.raises(CheckpointError, match=f"fastoffload: {index} is not a safetensors index"):
        enable_layerwise_offload(model, device="cpu", weights=index)
    assert all(p.is_meta for p in model.parameters())


class TiedOutside(torch.nn.Module):
    """An output projection tied to the input one (as a language model's head to its embedding)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(d, d, bias=False)
        self.blocks = torch.nn.ModuleList(TiedBlockFirstB(d) for _ in range(3))
        self.out = torch.nn.Linear(d, d, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class TiedBlockFirstB(torch.nn.Module):
    """A tie inside the block whose first-listed name ('b.weight') is the one save_model drops."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.b = torch.nn.Linear(d, d)
        self.a = torch.nn.Linear(d, d)
        self.a.weight = self.b.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _tied_outside_from(path: Path, reference: TiedOutside, resident_blocks: int | None) -> TiedOutside:
    """A meta TiedOutside offloaded from ``path``, two steps bit-equal to ``reference``."""
    with torch.device("meta"):
        model = TiedOutside()
    enable_layerwise_offload(model, device="cpu", weights=path, resident_blocks=resident_blocks)
    x = torch.randn(3, 32)
    with torch.no_grad():
        expected = reference(x)
        for _ in range(2):
            assert torch.equal(model(x), expected)
    return model


@pytest.mark.parametrize("resident_blocks", [None, 3])
def test_a_checkpoint_written_by_save_model_fills_every_name_of_a_tie(tmp_path: Path, resident_blocks) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_model
    torch.manual_seed(0)
    reference = TiedOutside()
    path = tmp_path / "tied.safetensors"
    save_model(reference, str(path))  # keeps one name of each tie
    with safe_open(str(path), "pt") as handle:
        assert "out.weight" not in handle.keys() and "blocks.0.b.weight" not in handle.keys()
    model = _tied_outside_from(path, reference, resident_blocks)
    assert model.out.weight is model.inp.weight
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)
    assert all(block.a.weight is block.b.weight for block in model.blocks)


@pytest.mark.parametrize("resident_blocks", [None, 3])
def test_a_tie_held_under_both_names_with_other_values_takes_what_load_state_dict_keeps(
        tmp_path: Path, resident_blocks) -> None:
    """A file that holds both names of a tied weight, with different values (written from an untied copy): the
    tie keeps the values of the name load_state_dict copies last, inside a block and outside the blocks."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    state = {k: v.clone().contiguous() for k, v in TiedOutside().state_dict().items()}
    for name in ("out.weight", *(f"blocks.{i}.a.weight" for i in range(3))):
        state[name] = torch.randn_like(state[name])  # the second name of each tie, other values
    path = tmp_path / "both.safetensors"
    save_file(state, str(path))
    reference = TiedOutside()
    reference.load_state_dict(state)
    assert torch.equal(reference.out.weight, state["out.weight"])  # the later name's values are the ones kept
    assert all(torch.equal(block.b.weight, state[f"blocks.{i}.a.weight"]) for i, block in enumerate(reference.blocks))
    model = _tied_outside_from(path, reference, resident_blocks)
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)
    assert model.out.weight is model.inp.weight and all(block.a.weight is block.b.weight for block in model.blocks)


class StridedBlock(torch.nn.Module):
    """A block with a parameter created transposed (strides (1, 3)): its sum depends on the layout."""

    def __init__(self, d: int = 48) -> None:
        super().__init__()
        self.t = torch.nn.Parameter(torch.randn(d, 3).t())
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.t.sum()


class StridedStack(torch.nn.Module):
    def __init__(self, n_blocks: int = 3) -> None:
        super().__init__()
        self.head = StridedBlock()
        self.blocks = torch.nn.ModuleList(StridedBlock() for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(x)
        for block in self.blocks:
            x = block(x)
        return x


def _strided_checkpoint(tmp_path: Path) -> tuple[StridedStack, Path]:
    from safetensors.torch import save_file
    torch.manual_seed(0)
    reference = StridedStack()
    path = tmp_path / "strided.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    return reference, path


def test_tensors_outside_the_offloaded_blocks_keep_the_model_s_strides(tmp_path: Path) -> None:
    reference, path = _strided_checkpoint(tmp_path)
    with torch.device("meta"):
        model = StridedStack()
    enable_layerwise_offload(model, device="cpu", weights=path, resident_blocks=3)  # nothing offloaded
    x = torch.randn(2, 48)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert model.head.t.stride() == reference.head.t.stride() and model.blocks[0].t.stride() == (1, 3)
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)


def test_a_strided_parameter_of_an_offloaded_block_is_refused_before_anything_changes(tmp_path: Path) -> None:
    from fastoffload_ext.errors import CheckpointError
    reference, path = _strided_checkpoint(tmp_path)
    with torch.device("meta"):
        model = StridedStack()
    with pytest.raises(CheckpointError, match=r"fastoffload: parameter 'blocks.0.t' has strides \[1, 3\].*"
                                              "keep that block resident"):
        enable_layerwise_offload(model, device="cpu", weights=path)
    assert all(p.is_meta for p in model.parameters())
    enable_layerwise_offload(model, device="cpu", weights=path, resident_blocks=3)
    x = torch.randn(2, 48)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("budget", [{}, {"device_budget": 1 << 20}])
def test_a_state_dict_passed_as_weights_is_refused_saying_what_to_do(budget: dict) -> None:
    from fastoffload_ext.errors import OffloadConfigError
    model = meta_stack(3)
    with pytest.raises(OffloadConfigError, match="fastoffload: weights= takes the path of a safetensors checkpoint.*"
                                                 "got OrderedDict.*load them into the model first"):
        enable_layerwise_offload(model, device="cpu", weights=reference_stack(3).state_dict(), **budget)
    assert all(p.is_meta for p in model.parameters())


class _InterruptAfterAcquire:
    """The engine, with a Ctrl-C raised the moment one acquire has returned: where CPython raises a
    SIGINT that arrived while the acquire waited for a disk read with the GIL released."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.armed = True

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def _then_interrupt(self) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt

    def acquire_and_prefetch(self, *args: object) -> None:
        self.inner.acquire_and_prefetch(*args)
        self._then_interrupt()

    def acquire(self, *args: object) -> None:
        self.inner.acquire(*args)
        self._then_interrupt()


def test_ctrl_c_landing_just_after_a_disk_block_is_acquired_leaves_no_slot_held(tmp_path: Path) -> None:
    from fastoffload_ext.planning.tiers import STAGING_SLACK
    from tests._checkpoints import block_bytes
    reference = reference_stack(6)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(6)
    group = enable_layerwise_offload(model, device="cpu", weights=path,
                                     host_budget=2 * block_bytes(reference) + 8192 + 2 * STAGING_SLACK)
    x = inputs()
    with torch.no_grad():
        expected = reference(x)
        for index in (1, 3):  # two interrupted steps: as many as there are slots
            state = group.states[index]
            state.engine = _InterruptAfterAcquire(state.engine)
            with pytest.raises(KeyboardInterrupt):
                model(x)
            state.engine = state.engine.inner
        for _ in range(3):
            assert torch.equal(model(x), expected)
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)


@pytest.mark.parametrize("how", ["ext", "python", "weights"])
def test_state_dict_of_a_block_with_a_tied_weight_holds_the_value_under_every_name(tmp_path: Path, how: str) -> None:
    reference, path = _tied_checkpoint(tmp_path)
    if how == "weights":
        with torch.device("meta"):
            model = TiedStack(4)
        enable_layerwise_offload(model, device="cpu", weights=path)
    else:
        model = TiedStack(4)
        model.load_state_dict(reference.state_dict())
        enable_layerwise_offload(model, device="cpu", backend=how)
    saved, expected = model.state_dict(), reference.state_dict()
    assert saved.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(saved[key], value), key
    fresh = TiedStack(4)
    fresh.load_state_dict(saved)  # what a caller does with a saved state dict
    assert params_equal(fresh, reference)
    disable_layerwise_offload(model, device="cpu")


class Adapted(torch.nn.Module):
    """An adapter conversion's wrapper: the old layer moves to ``base`` and a new parameter comes beside it."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.scale = torch.nn.Parameter(torch.full((base.out_features,), 2.0, dtype=base.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) * self.scale


def test_disable_to_meta_after_a_scope_changed_a_block_s_parameters(tmp_path: Path) -> None:
    from fastoffload_ext.engine.hooks import ModuleHookManager
    from fastoffload_ext.engine.layerwise import get_offload_group
    reference = reference_stack(4)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(4)
    enable_layerwise_offload(model, device="cpu", weights=path, host_budget=None)
    hook = ModuleHookManager.get_from(model.blocks[1]).get_forward_hook("LayerwiseOffloadHook")
    with hook.mutate_params_scope():
        model.blocks[1].o = Adapted(model.blocks[1].o)
    reference.blocks[1].o = Adapted(reference.blocks[1].o)
    with torch.no_grad():
        assert torch.equal(model(inputs()), reference(inputs()))
    # The checkpoint's names (o.weight) are not the block's any more, and o.scale is not in it: the detach
    # raised a KeyError half way, leaving the model offloaded, with every later forward failing.
    disable_layerwise_offload(model, device="meta")
    assert get_offload_group(model) is None
    got = dict(model.blocks.named_parameters())
    want = dict(reference.blocks.named_parameters())
    assert got.keys() == want.keys()
    assert all(p.is_meta and p.shape == want[k].shape and p.dtype == want[k].dtype for k, p in got.items())
    # Enabled again from a checkpoint of the adapted model, it runs it.
    adapted = write_single(reference, tmp_path / "adapted.safetensors")
    enable_layerwise_offload(model, device="cpu", weights=adapted, host_budget=None)
    with torch.no_grad():
        assert torch.equal(model(inputs()), reference(inputs()))
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_freeze_made_while_offloaded_survives_a_disable_to_meta(tmp_path: Path, tier: str) -> None:
    from fastoffload_ext.planning.tiers import STAGING_SLACK
    from tests._checkpoints import block_bytes
    reference = reference_stack(6)
    path = write_single(reference, tmp_path / "model.safetensors")
    budget = None if tier == "host" else 3 * block_bytes(reference) + 4096 + 3 * STAGING_SLACK
    model = meta_stack(6)
    group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget)
    assert any(state.on_disk for state in group.states) == (tier == "disk")
    model.blocks.requires_grad_(False)  # frozen while offloaded, as before training what sits outside the blocks
    # The way to a new layout of a model streamed from disk: through the meta device, then weights= again.
    disable_layerwise_offload(model, device="meta")
    assert all(p.is_meta and not p.requires_grad for p in model.blocks.parameters())
    assert all(p.requires_grad for p in model.proj_in.parameters())
    enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget, prefetch_depth=2)
    reference.blocks.requires_grad_(False)
    x = inputs()
    out = model(x)  # grad mode: an offloaded parameter that requires grad would be refused here
    assert out.requires_grad and torch.equal(out, reference(x))
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)
    assert [p.requires_grad for p in model.parameters()] == [p.requires_grad for p in reference.parameters()]


def test_a_relative_weights_path_keeps_working_after_the_process_changes_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastoffload_ext.planning.tiers import STAGING_SLACK
    from tests._checkpoints import block_bytes
    reference = reference_stack(6)
    write_single(reference, tmp_path / "model.safetensors")
    monkeypatch.chdir(tmp_path)
    model = meta_stack(6)
    group = enable_layerwise_offload(model, device="cpu", weights="model.safetensors",
                                     host_budget=3 * block_bytes(reference) + 8192 + 2 * STAGING_SLACK)
    assert any(state.on_disk for state in group.states)
    # The reader checks each file by name before every read: a relative name said the file had disappeared,
    # and every later forward (and a disable to a real device) failed.
    monkeypatch.chdir(tmp_path.parent)
    with torch.no_grad():
        expected = reference(inputs())
        for _ in range(2):
            assert torch.equal(model(inputs()), expected)
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)


@pytest.mark.parametrize("host_budget", ["all", "half"])
def test_enable_from_weights_inside_inference_mode_makes_ordinary_tensors(tmp_path: Path, host_budget: str) -> None:
    from fastoffload_ext.planning.tiers import STAGING_SLACK
    from tests._checkpoints import block_bytes
    reference = reference_stack(6)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(6)
    budget = None if host_budget == "all" else 3 * block_bytes(reference) + 8192 + 2 * STAGING_SLACK
    # A pipeline's __call__ under @torch.inference_mode() that builds its transformer there: enable raised
    # "Inference tensors do not track version counter" (the meta parameters' replacements were inference
    # tensors), and the tensors read outside the blocks would have refused every later in-place update.
    with torch.inference_mode():
        group = enable_layerwise_offload(model, device="cpu", weights=path, host_budget=budget, resident_blocks=[0])
    assert any(state.on_disk for state in group.states) == (host_budget == "half")
    assert not any(t.is_inference() for t in [*model.parameters(), *model.buffers()])
    x = inputs()
    with torch.no_grad():
        expected = reference(x)
        assert torch.equal(model(x), expected)
    with torch.inference_mode():
        assert torch.equal(model(x), expected)
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)
    model.load_state_dict(reference.state_dict())  # an in-place copy into every parameter
    assert params_equal(model, reference)


class ComputedTable(torch.nn.Module):
    """A block with a table computed when it is built and not saved (a non-persistent buffer)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.register_buffer("table", torch.linspace(0.5, 1.5, d), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.table


class ComputedStack(torch.nn.Module):
    def __init__(self, n_blocks: int = 4, d: int = 32) -> None:
        super().__init__()
        self.head = ComputedTable(d)
        self.blocks = torch.nn.ModuleList(ComputedTable(d) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(x)
        for block in self.blocks:
            x = block(x)
        return x


def _empty_computed_stack() -> ComputedStack:
    """Built with empty weights: parameters on the meta device, buffers real on the host (accelerate's default)."""
    with torch.device("meta"):
        model = ComputedStack()
    for module in model.modules():
        if "table" in module._buffers:
            module._buffers["table"] = torch.linspace(0.5, 1.5, 32)
    return model


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("saved", ["older", "without"])
@pytest.mark.parametrize("resident_blocks", [None, 2])
def test_a_computed_buffer_keeps_its_values_and_runs_on_the_device(tmp_path: Path, resident_blocks, saved: str,
                                                                   device: str) -> None:
    from safetensors.torch import save_file
    torch.manual_seed(0)
    reference = ComputedStack()
    state = dict(reference.state_dict())
    if saved == "older":
        # A checkpoint from a version that saved the tables (with other values): the model built now computes
        # its own, and load_state_dict (which never loads a non-persistent buffer) keeps them.
        state.update({name: torch.zeros_like(table) for name, table in reference.named_buffers()})
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    model = _empty_computed_stack()
    enable_layerwise_offload(model, device=device, weights=path, resident_blocks=resident_blocks)
    # The tables outside the offloaded blocks move to the device with the tensors read from the file.
    assert all(buffer.device.type == device for buffer in model.buffers())
    reference.to(device)
    x = torch.randn(3, 32, device=device)
    with torch.no_grad():
        expected = reference(x)
        for _ in range(2):
            assert torch.equal(model(x), expected)
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(model.buffers(), reference.buffers()))


@pytest.mark.parametrize("offloaded", [[0, 1, 2, 3], [2, 3], []])
def test_the_buffers_moved_with_the_resident_tensors_are_those_outside_the_offloaded_blocks(
        tmp_path: Path, offloaded: list[int]) -> None:
    # On a GPU each of these is moved from the host, where a model built with empty weights keeps them; on
    # the host device the move is a no-op, so this checks which buffers are chosen.
    from safetensors.torch import save_file

    from fastoffload_ext.storage.source import CheckpointSource
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in ComputedStack().state_dict().items()}, str(path))
    model = _empty_computed_stack()
    names = [f"blocks.{i}" for i in range(4)]
    source = CheckpointSource.prepare(model, names, model.blocks, offloaded, path, "auto", None, torch.device("cpu"))
    assert source.kept == ["head.table"] + [f"blocks.{i}.table" for i in range(4) if i not in offloaded]


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
def test_a_failed_enable_puts_the_computed_buffers_back_where_they_were(tmp_path: Path, device: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import save_file

    from fastoffload_ext.storage.source import CheckpointSource
    reference = ComputedStack()
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    model = _empty_computed_stack()
    before = {name: (buffer, buffer.clone()) for name, buffer in model.named_buffers()}

    def failing(self: CheckpointSource, engine: object) -> None:
        raise RuntimeError("injected after the resident tensors were read")

    monkeypatch.setattr(CheckpointSource, "start", failing)
    with pytest.raises(RuntimeError, match="injected"):
        enable_layerwise_offload(model, device=device, weights=path, resident_blocks=2)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer.cpu(), before[name][1]), name
        if not name.startswith(("blocks.2.", "blocks.3.")):  # outside the offloaded blocks: the tensor it was
            assert buffer is before[name][0], name
    assert all(p.is_meta for p in model.parameters())
