"""Layerwise offload against the resident model, bit for bit, through the public API.

Every test runs on the CPU (the engine with the host as its device) and, with the ``cuda`` marker, on
a GPU; both backends ("ext": the compiled core, "python": FastVideo's algorithm).
"""
from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext import ModuleHookManager, LayerwiseOffloadHook

from fastoffload_ext.planning import BlockCosts, module_packed_bytes

from ._models import OFFLOAD_DEVICES, Block, Stack, make_pair, offload_hook, params_equal, place_outside_blocks

BACKENDS = ["ext", "python"]


def _device(name: str) -> torch.device:
    return torch.device("cpu") if name == "cpu" else torch.device("cuda", torch.cuda.current_device())


def _setup(n_blocks: int, device: str, dtype: torch.dtype = torch.float32, seed: int = 0, d: int = 16):
    model, reference = make_pair(n_blocks, dtype, d=d, seed=seed)
    reference.to(_device(device))
    place_outside_blocks(model, device)
    x = torch.randn(3, 5, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(_device(device))
    return model, reference, x


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("n_blocks", [1, 2, 3, 5, 7])
def test_bit_exact_over_steps(device: str, backend: str, dtype: torch.dtype, depth: int, n_blocks: int) -> None:
    model, reference, x = _setup(n_blocks, device, dtype)
    with torch.inference_mode():
        want = reference(x)
    group = fo.enable_layerwise_offload(model, device=device, backend=backend, prefetch_depth=depth)
    assert group is not None and group.backend == backend
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(model(x), want)
    for block in model.blocks:
        assert all(p.numel() == 0 for p in block.parameters())
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
    with torch.inference_mode():
        assert torch.equal(model(x), want)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("resident", [0, 1, 3, 4])
@pytest.mark.parametrize("cyclic", [True, False])
def test_resident_blocks_and_cyclic(device: str, backend: str, resident: int, cyclic: bool) -> None:
    model, reference, x = _setup(4, device)
    with torch.no_grad():
        want = reference(x)
    group = fo.enable_layerwise_offload(model, device=device, backend=backend, resident_blocks=resident, cyclic=cyclic)
    target = _device(device)
    for i, block in enumerate(model.blocks):
        if i < resident:
            # Resident blocks: real tensors on the device, no hook.
            assert all(p.numel() > 0 and p.device == target for p in block.parameters())
            assert ModuleHookManager.get_from(block) is None
        else:
            assert all(p.numel() == 0 for p in block.parameters())
    states = group.states
    assert len(states) == 4 - resident
    if states:
        last = states[-1]
        assert (last.next_state is states[0]) == (cyclic and len(states) > 1) or (cyclic and len(states) == 1)
        if not cyclic:
            assert last.next_state is None and last.prefetch_targets == []
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), want)
    if backend == "ext" and states:
        stats = group.stats()
        offloaded = len(states)
        # Non-cyclic: every step's first offloaded block is loaded on demand; cyclic: only the first step's.
        expected_sync = 1 if (cyclic or offloaded <= 2) else 3
        assert stats["sync_loads"] == expected_sync
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_depth_zero_loads_on_demand(device: str, backend: str) -> None:
    model, reference, x = _setup(3, device)
    with torch.no_grad():
        want = reference(x)
    group = fo.enable_layerwise_offload(model, device=device, backend=backend, prefetch_depth=0)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
    if backend == "ext":
        assert group.stats()["num_slots"] == 1
    fo.disable_layerwise_offload(model)


class _Skipping(nn.Module):
    """A cache-based accelerator's pattern: some steps skip blocks, some run a block twice."""

    def __init__(self, stack: Stack) -> None:
        super().__init__()
        self.blocks = stack.blocks
        self.proj_in = stack.proj_in
        self.proj_out = stack.proj_out

    def forward(self, x: torch.Tensor, order: list[int]) -> torch.Tensor:
        x = self.proj_in(x)
        for i in order:
            x = self.blocks[i](x)
        return self.proj_out(x)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("depth", [1, 2])
def test_skipped_and_repeated_blocks(device: str, backend: str, depth: int) -> None:
    model, reference, x = _setup(5, device)
    model, reference = _Skipping(model), _Skipping(reference)
    orders = [[0, 1, 2, 3, 4], [0, 2, 4], [0, 0, 1, 1, 4], [3, 1], [0, 1, 2, 3, 4], [4, 3, 2, 1, 0]]
    fo.enable_layerwise_offload(model, device=device, backend=backend, prefetch_depth=depth)
    with torch.no_grad():
        for order in orders:
            assert torch.equal(model(x, order), reference(x, order)), order
    group = fo.get_offload_group(model)
    if backend == "ext":
        engine = group.engine
        assert all(engine.slot_state(s) != "in_use" for s in range(engine.num_slots))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


class _ViewingLinear(nn.Linear):
    """A Linear whose forward also returns a tensor that views one of its weights, by ``kind``: ``w.t()``, ``w[0]``
    or ``b.view(-1)``."""

    def __init__(self, d: int, kind: int) -> None:
        super().__init__(d, d)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        view = self.weight.t() if self.kind == 0 else self.weight[0] if self.kind == 1 else self.bias.view(-1)
        return super().forward(x), view


class _KeepsWeightViews(nn.Module):
    """Keeps what each block returns beside its output, and reads it after the last block (a cache would)."""

    def __init__(self, n_blocks: int, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ViewingLinear(d, i % 3) for i in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = []
        for block in self.blocks:
            x, view = block(x)
            kept.append(view.sum(0) if view.dim() == 2 else view)
        return x + sum(kept)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "enable_grad"])
def test_views_of_weights_made_in_a_forward_keep_their_values_after_the_release(device: str, backend: str, depth: int,
                                                                               mode: str) -> None:
    # Without grad mode the ext backend binds a running block to its device slot: a view of a weight that the
    # forward keeps past the block's release (an output, a cache) read whichever block the slot held next.
    torch.manual_seed(0)
    model = _KeepsWeightViews(5).requires_grad_(False)
    reference = copy.deepcopy(model).to(_device(device))
    x = torch.randn(3, 8, device=_device(device))
    group = fo.enable_layerwise_offload(model, device=device, backend=backend, prefetch_depth=depth)
    for _ in range(3):
        with getattr(torch, mode)():
            assert torch.equal(model(x), reference(x))
    if group.engine is not None:  # in grad mode the blocks run on private copies: no view of a slot escapes
        assert (group.stats()["slots_replaced"] > 0) == (mode != "enable_grad")
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
def test_slots_keep_their_buffers_when_no_view_of_a_weight_outlives_its_block(device: str, mode: str) -> None:
    # A slot gets a new buffer only where a tensor from the forward still views it after the release: an
    # ordinary model's forwards leave the slots where they are (a CUDA graph's addresses stay valid).
    model, reference, x = _setup(5, device)
    model.requires_grad_(False)
    group = fo.enable_layerwise_offload(model, device=device, backend="ext", prefetch_depth=1)
    engine = group.engine
    addresses = None
    for _ in range(3):
        with torch.no_grad() if mode == "no_grad" else torch.inference_mode() if mode == "inference_mode" else \
                torch.enable_grad():
            assert torch.equal(model(x), reference(x))
        now = [engine.slot_address(s) for s in range(engine.num_slots)]
        assert addresses is None or now == addresses
        addresses = now
    assert group.stats()["sync_loads"] == 1 and group.stats()["slots_replaced"] == 0
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_exception_mid_forward_loses_nothing(device: str, backend: str) -> None:
    model, reference, x = _setup(4, device)
    with torch.no_grad():
        want = reference(x)
    fo.enable_layerwise_offload(model, device=device, backend=backend)

    def boom(module, args):
        raise KeyboardInterrupt("interrupted inside block 2")

    handle = model.blocks[2].norms[0].register_forward_pre_hook(boom)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt, match="inside block 2"):
        model(x)
    handle.remove()
    # The failed block gave its weights back; the next step is exact.
    assert all(p.numel() == 0 for b in model.blocks for p in b.parameters())
    with torch.no_grad():
        assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_detach_mid_step_keeps_current_values(device: str, backend: str) -> None:
    model, reference, x = _setup(3, device)
    fo.enable_layerwise_offload(model, device=device, backend=backend)
    seen = {}

    def detach_now(module, args):
        # The running block keeps computing, so its weights stay on the device it runs on.
        fo.disable_layerwise_offload(model)
        seen["done"] = True

    handle = model.blocks[1].qkv.register_forward_pre_hook(detach_now)
    with torch.no_grad():
        model(x)
    handle.remove()
    assert seen["done"]
    assert fo.get_offload_group(model) is None
    assert all(ModuleHookManager.get_from(b) is None for b in model.blocks)
    assert all(p.device == _device(device) and p.numel() > 0 for b in model.blocks for p in b.parameters())
    assert params_equal(model.blocks, reference.blocks)
    with torch.no_grad():
        assert torch.equal(model(x), reference.to(_device(device))(x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_disable_puts_parameters_where_asked(backend: str) -> None:
    model, reference, x = _setup(3, "cpu")
    fo.enable_layerwise_offload(model, device="cpu", backend=backend, resident_blocks=1)
    fo.disable_layerwise_offload(model, device="cpu")
    for block in model.blocks:
        assert ModuleHookManager.get_from(block) is None
        assert "forward" not in vars(block)  # the original forward is back
        for p in block.parameters():
            assert p.device.type == "cpu" and p.numel() > 0
    assert params_equal(model, reference)
    with pytest.raises(ValueError, match="layerwise offload is not enabled on this model"):
        fo.disable_layerwise_offload(model)


@pytest.mark.parametrize("backend", BACKENDS)
def test_disable_inside_inference_mode_gives_back_ordinary_parameters(backend: str) -> None:
    model, reference, x = _setup(3, "cpu")
    model.requires_grad_(False)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend, resident_blocks=[0])
    with torch.inference_mode():
        model(x)
        fo.disable_layerwise_offload(model, device="cpu")
    assert [name for name, p in model.named_parameters() if p.is_inference()] == []
    assert params_equal(model, reference)
    # What an inference tensor would refuse: an in-place update, a load, autograd.
    with torch.no_grad():
        model.blocks[1].o.weight.add_(1.0)
        reference.blocks[1].o.weight.add_(1.0)
    model.load_state_dict(reference.state_dict())
    model.blocks[1].o.weight.requires_grad_(True)
    model(x).sum().backward()
    assert model.blocks[1].o.weight.grad is not None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rebuild", ["enable", "replace", "scope", "load_state_dict", "interrupted load"])
def test_an_offload_made_or_rebuilt_inside_inference_mode_keeps_ordinary_parameters(backend: str, rebuild: str) -> None:
    model, reference, x = _setup(3, "cpu")
    model.requires_grad_(False)
    reference.requires_grad_(False)
    if rebuild != "enable":
        fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.inference_mode():
        if rebuild in ("enable", "replace"):
            fo.enable_layerwise_offload(model, rebuild == "replace", device="cpu", backend=backend)
        elif rebuild == "scope":
            with offload_hook(model.blocks[1]).mutate_params_scope():
                model.blocks[1].o.weight.mul_(2.0)
        elif rebuild == "load_state_dict":
            model.load_state_dict(reference.state_dict() | {"blocks.1.o.weight": reference.blocks[1].o.weight * 2})
        else:  # raises inside block 1's load, after its offload hook made the block real (until its next load)
            def interrupt(*args: object) -> None:
                raise KeyboardInterrupt

            handle = model.blocks[1].o.register_load_state_dict_pre_hook(interrupt)
            with pytest.raises(KeyboardInterrupt):
                model.load_state_dict(reference.state_dict())
            handle.remove()
    if rebuild in ("scope", "load_state_dict"):
        with torch.no_grad():
            reference.blocks[1].o.weight.mul_(2.0)
    assert [name for name, p in model.named_parameters() if p.is_inference()] == []
    # An inference tensor would refuse this outside inference_mode.
    model.blocks[1].o.weight.requires_grad_(True)
    model.blocks[1].o.weight.requires_grad_(False)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_on_detach_through_the_hook_manager(backend: str) -> None:
    model, reference, x = _setup(2, "cpu")
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    for block in model.blocks:
        ModuleHookManager.get_from(block).remove_forward_hook(LayerwiseOffloadHook.name())
        assert all(p.numel() > 0 for p in block.parameters())
    assert params_equal(model, reference)


def test_seed_errors_and_enable_twice() -> None:
    # FastVideo's texts stand unchanged right after the prefix, where its callers search for them.
    with pytest.raises(ValueError, match=r"^fastoffload: No nn\.ModuleList found in the model for layerwise "
                                         r"offloading\. "):
        fo.enable_layerwise_offload(nn.Sequential(nn.Linear(2, 2)), device="cpu")
    model, _, _ = _setup(2, "cpu")
    with pytest.raises(AssertionError, match=r"^fastoffload: Expect hook exists in blocks for replacement\. "):
        fo.enable_layerwise_offload(model, is_replace=True, device="cpu")
    fo.enable_layerwise_offload(model, device="cpu")
    with pytest.raises(ValueError, match="layerwise offload is already enabled on this model"):
        fo.enable_layerwise_offload(model, device="cpu")
    fo.disable_layerwise_offload(model)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_named_parameters_hold_values_only_while_bound(backend: str) -> None:
    # The seed's dict: the device copy each parameter is bound to. A block that ran and is still cached in
    # its slot (ext) has placeholders bound, which are no values.
    model, reference, x = _setup(3, "cpu")
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    state = offload_hook(model.blocks[1]).state
    want = dict(reference.blocks[1].named_parameters())
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        assert state.gpu_named_parameters == {}
        state.wait_and_replace_params()
        bound = state.gpu_named_parameters
        assert bound.keys() == want.keys() and all(torch.equal(bound[k], want[k]) for k in want)
        state.release_gpu_params()
        assert state.gpu_named_parameters == {}
        with offload_hook(model.blocks[1]).mutate_params_scope():
            bound = state.gpu_named_parameters
            assert bound.keys() == want.keys() and all(torch.equal(bound[k], want[k]) for k in want)
        assert state.gpu_named_parameters == {}
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_enable_over_an_offload_hook_attached_by_hand_raises_fastvideos_error(backend: str) -> None:
    # FastVideo's enable appends, and a second hook of the name raises: only is_replace=True swaps it.
    model, reference, x = _setup(3, "cpu")
    by_hand = [LayerwiseOffloadHook(fo.LayerwiseOffloadState(None, torch.device("cpu"))) for _ in model.blocks]
    for block, hook in zip(model.blocks, by_hand):
        ModuleHookManager.get_from_or_default(block).append_forward_hook(hook)
    with pytest.raises(ValueError, match=r"^fastoffload: Hook with name LayerwiseOffloadHook is already registered "
                                         r"on blocks\.0; pass is_replace=True to swap it"):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    assert fo.get_offload_group(model) is None
    assert [offload_hook(block) for block in model.blocks] == by_hand
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    group = fo.enable_layerwise_offload(model, is_replace=True, device="cpu", backend=backend)
    assert [offload_hook(block).state for block in model.blocks] == group.states
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_is_replace_swaps_the_hooks(backend: str) -> None:
    model, reference, x = _setup(3, "cpu")
    with torch.no_grad():
        want = reference(x)
    first = fo.enable_layerwise_offload(model, device="cpu", backend="python")
    second = fo.enable_layerwise_offload(model, is_replace=True, device="cpu", backend=backend, prefetch_depth=2)
    assert fo.get_offload_group(model) is second and second is not first
    assert all(offload_hook(b).state in second.states for b in model.blocks)
    with torch.no_grad():
        assert torch.equal(model(x), want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_is_replace_plans_from_the_real_weights_not_the_placeholders(backend: str) -> None:
    from fastoffload_ext.planning import module_packed_bytes

    model, reference, x = _setup(6, "cpu")
    block = module_packed_bytes(model.blocks[0])
    budget = 3 * block // 2  # below the two slots of the smallest layout
    with pytest.raises(ValueError, match=r"^fastoffload: device_budget 21\.0 KiB is smaller than what offload needs"):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=budget)
    running = fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    # The running offload holds every block as a placeholder: the same budget is refused all the same.
    with pytest.raises(ValueError, match=r"^fastoffload: device_budget 21\.0 KiB is smaller than what offload needs"):
        fo.enable_layerwise_offload(model, is_replace=True, device="cpu", backend=backend, device_budget=budget)
    # The refusal needed the real weights, so the running offload was undone to plan; it was applied again.
    again = fo.get_offload_group(model)
    assert again is not None and again.resident == running.resident == () and again.prefetch_depth == 1
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    group = fo.enable_layerwise_offload(model, is_replace=True, device="cpu", backend=backend,
                                        device_budget=4 * block)
    assert len(group.resident) == 2 and group.plan.device_bytes == 4 * block
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_is_replace_offloads_a_block_the_running_offload_kept_resident(backend: str) -> None:
    model, reference, x = _setup(3, "cpu")
    fo.enable_layerwise_offload(model, device="cpu", backend=backend, resident_blocks=[0])
    group = fo.enable_layerwise_offload(model, is_replace=True, device="cpu", backend=backend, resident_blocks=0)
    assert fo.get_offload_group(model) is group and group.resident == ()
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_is_replace_never_brings_every_block_to_the_device(backend: str) -> None:
    """The running offload is undone into host memory: a model offloaded because its blocks do not fit
    the device must survive is_replace."""
    from fastoffload_ext.planning import module_packed_bytes

    model, reference, x = _setup(8, "cuda", d=256)
    blocks = sum(module_packed_bytes(block) for block in reference.blocks)
    fo.enable_layerwise_offload(model, device="cuda", backend=backend)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    group = fo.enable_layerwise_offload(model, is_replace=True, device="cuda", backend=backend, prefetch_depth=2)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < blocks // 2
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert fo.get_offload_group(model) is group
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


def test_without_cuda_and_no_device_it_warns_and_skips(monkeypatch, caplog) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, _, _ = _setup(2, "cpu")
    with caplog.at_level("WARNING"):
        assert fo.enable_layerwise_offload(model) is None
    assert "CUDA is not available. Layerwise offloading is disabled." in caplog.text
    assert all(p.numel() > 0 for p in model.parameters())


@pytest.mark.parametrize("kwargs, message", [
    ({"prefetch_depth": -1}, r"prefetch_depth must be an integer >= 0 \(blocks copied ahead\) or 'auto', got -1"),
    ({"prefetch_depth": 1.5}, r"prefetch_depth must be an integer >= 0 \(blocks copied ahead\) or 'auto', got 1.5"),
    ({"resident_blocks": 5}, r"resident_blocks must be an integer between 0 and the 2 blocks of 'blocks', got 5"),
    ({"resident_blocks": -1}, r"resident_blocks must be an integer between 0 and the 2 blocks of 'blocks', got -1"),
    ({"backend": "cuda"}, r"backend must be one of 'auto', 'ext', 'python', got 'cuda'"),
    ({"device": "mps"}, r"device must be 'cuda', 'cuda:N' or 'cpu', got 'mps'"),
    ({"device": "banana"}, r"device must be 'cuda', 'cuda:N' or 'cpu', got 'banana'"),
    ({"pin_backing": "gpu"}, r"pin_backing must be one of 'host_alloc', 'register', 'pageable', got 'gpu'"),
])
def test_bad_arguments(kwargs, message) -> None:
    model, reference, _ = _setup(2, "cpu")
    kwargs.setdefault("device", "cpu")
    with pytest.raises(ValueError, match=message):
        fo.enable_layerwise_offload(model, **kwargs)
    assert fo.get_offload_group(model) is None and params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_weights_are_refused_and_nothing_changes(backend: str) -> None:
    model, reference, _ = _setup(3, "cpu")
    model.blocks[2].o.weight = model.blocks[0].o.weight
    with pytest.raises(ValueError, match=r"parameter blocks.2.o.weight is the same tensor as blocks.0.o.weight"):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    assert all(p.numel() > 0 for p in model.parameters())
    model, _, _ = _setup(3, "cpu")
    model.proj_out.weight = model.blocks[1].o.weight
    with pytest.raises(ValueError, match=r"parameter proj_out.weight is the same tensor as blocks.1.o.weight"):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    # Keeping the tied block resident is the documented way out.
    model, _, _ = _setup(3, "cpu")
    model.proj_out.weight = model.blocks[0].o.weight
    assert fo.enable_layerwise_offload(model, device="cpu", backend=backend, resident_blocks=1) is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_planned_layout_keeps_tied_blocks_resident_through_re_plans(backend: str) -> None:
    """A budget leaves the resident set to the planner: blocks whose weights are tied to another block (2 and
    3) or to the rest of the model (0) stay resident in every plan, the first and the re-plans (enable used
    to refuse the tie whenever the plan offloaded one, and a calibrate could re-plan into that refusal)."""
    model, reference, x = _setup(6, "cpu")
    for m in (model, reference):
        m.blocks[3].o.weight = m.blocks[2].o.weight
        m.proj_out.weight = m.blocks[0].o.weight
    block = module_packed_bytes(model.blocks[1])
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=5 * block)
    assert {0, 2, 3} <= set(group.resident) and group.offloaded_indices
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    # Costs that would make any other blocks resident first: the tied ones still stay.
    costs = BlockCosts([1.0, 0.1, 0.1, 0.1, 0.1, 5.0], [block] * 6, 1e-3)
    group = group.replan(costs)
    assert {0, 2, 3} <= set(group.resident) and group.offloaded_indices
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert model.blocks[3].o.weight is model.blocks[2].o.weight and model.proj_out.weight is model.blocks[0].o.weight
    assert params_equal(model, reference)
    # A budget too small for the tied blocks is refused before anything changes, naming them.
    with pytest.raises(ValueError, match=r"too small for 3 resident blocks \(.*: blocks 0, 2, 3, whose weights are tied "
                                         r"to another block or to the rest of the model\).*untie those weights"):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=4 * block)
    assert fo.get_offload_group(model) is None and params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_scope_that_grows_a_block_past_the_budget_warns_with_the_numbers(backend: str) -> None:
    """The slots follow the largest offloaded block: a scope that adds parameters to one (an adapter) takes
    them above the plan's device budget from the next step, which a warning says, with the numbers."""
    model, reference, x = _setup(3, "cpu")
    block = module_packed_bytes(model.blocks[1])
    group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, device_budget=3 * block + 1024,
                                        resident_blocks=[0])
    assert group.plan.num_slots == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a scope that changes values only says nothing
        with offload_hook(model.blocks[2]).mutate_params_scope(), torch.no_grad():
            model.blocks[2].o.weight.mul_(1.0)
    with pytest.warns(RuntimeWarning, match=r"mutate_params_scope grew block 2 of 'blocks' to .*, more than the "
                                            r"plan's 2 slots of .* hold: from the next step they take .* of device "
                                            r"memory, above device_budget"):
        with offload_hook(model.blocks[2]).mutate_params_scope():
            model.blocks[2].adapter = nn.Linear(16, 16)  # not called by the block's forward
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    del model.blocks[2].adapter
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grad_forward_through_a_block_inside_mutate_params_scope_is_refused(backend: str) -> None:
    """Inside mutate_params_scope the block's parameters are real tensors, but it is still offloaded: its
    parameters become placeholders at the scope's end, so a gradient would have nowhere to live. Refused as
    for any offloaded block, on both backends (ext ran it)."""
    model, reference, x = _setup(3, "cpu")
    for m in (model, reference):  # only block 1, the one in the scope, has parameters that require grad
        m.blocks[0].requires_grad_(False)
        m.blocks[2].requires_grad_(False)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with offload_hook(model.blocks[1]).mutate_params_scope():
        with pytest.raises(RuntimeError, match=r"its parameter '\S+' requires grad, and grad mode is on"):
            model(x)
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_block_list_reached_by_a_second_name_is_offloaded_not_refused_as_tied(backend: str) -> None:
    model, reference, x = _setup(3, "cpu")
    model.stages = model.blocks  # the same modules under another attribute: calling them runs their hooks
    reference.stages = reference.blocks
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        assert torch.equal(model.stages[1](x), reference.stages[1](x))
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
    # A submodule of a block reached from outside it would run without the block's hook: still refused.
    model, _, _ = _setup(3, "cpu")
    model.side = model.blocks[1].o
    with pytest.raises(ValueError, match=r"parameter side.weight is the same tensor as blocks.1.o.weight"):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    assert fo.get_offload_group(model) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_meta_parameters_are_refused(backend: str) -> None:
    with torch.device("meta"):
        model = Stack(2)
    with pytest.raises(ValueError, match=r"parameter 0.qkv.weight is on the meta device and has no values to offload"):
        fo.enable_layerwise_offload(model, device="cpu", backend=backend)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_recording_forward_is_refused(device: str, backend: str) -> None:
    model, reference, x = _setup(2, device)
    fo.enable_layerwise_offload(model, device=device, backend=backend)
    with pytest.raises(RuntimeError, match=r"its parameter '\S+' requires grad, and grad mode is on"):
        model(x)
    # The refused forward loses nothing, and the normal (no-grad) path works afterwards.
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    model.requires_grad_(False)
    assert torch.equal(model(x), reference(x).detach())
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


class _LoRALinear(nn.Module):
    """What an adapter conversion does: replaces a Linear with a module holding more parameters."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        gen = torch.Generator().manual_seed(7)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features, generator=gen).to(base.weight.dtype)
                                   .to(base.weight.device) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank, generator=gen).to(base.weight.dtype)
                                   .to(base.weight.device) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def _convert_and_merge(block: Block) -> None:
    block.up = _LoRALinear(block.up)
    with torch.no_grad():
        block.o.weight.mul_(0.5)


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mutate_params_scope_follows_fastvideo_lora_pattern(device: str, backend: str) -> None:
    model, reference, x = _setup(3, device)
    model.requires_grad_(False)
    reference.requires_grad_(False)
    fo.enable_layerwise_offload(model, device=device, backend=backend)
    with torch.no_grad():
        model(x)  # offload is running
        for block in model.blocks:
            hook = offload_hook(block)
            with hook.mutate_params_scope():
                # Inside the scope the weights are real device tensors and stay there.
                assert all(p.numel() > 0 and p.device == _device(device) for p in block.parameters())
                _convert_and_merge(block)
        for block in reference.blocks:
            _convert_and_merge(block)
        assert all(p.numel() == 0 for b in model.blocks for p in b.parameters())
        for _ in range(2):
            assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mutate_scope_rebuilds_even_when_it_raises(backend: str) -> None:
    model, reference, x = _setup(2, "cpu")
    model.requires_grad_(False)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    hook = offload_hook(model.blocks[0])
    with pytest.raises(RuntimeError, match="conversion failed"):
        with hook.mutate_params_scope():
            with torch.no_grad():
                model.blocks[0].qkv.weight.add_(1.0)
            raise RuntimeError("conversion failed")
    with torch.no_grad():
        reference.blocks[0].qkv.weight.add_(1.0)
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("device", OFFLOAD_DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_buffers_go_to_the_device_and_stay(device: str, backend: str) -> None:
    model, reference, x = _setup(2, device)
    for m in (model, reference):
        for block in m.blocks:
            block.register_buffer("scale", torch.full((16,), 0.5))
    reference.to(_device(device))
    for m in (model, reference):
        for block in m.blocks:
            block.forward = (lambda blk: (lambda h: Block.forward(blk, h) * blk.scale))(block)
    fo.enable_layerwise_offload(model, device=device, backend=backend)
    assert all(b.scale.device == _device(device) for b in model.blocks)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_model_arriving_on_gpu_frees_its_memory(backend: str) -> None:
    # Tensors an earlier test left in reference cycles would otherwise be freed during .to("cuda") below,
    # and the allocated bytes would read less than the blocks brought.
    gc.collect()
    torch.cuda.empty_cache()
    model, reference, x = _setup(4, "cuda", d=256)
    before = torch.cuda.memory_allocated()
    model.to("cuda")
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    assert torch.cuda.memory_allocated() - before >= block_bytes
    group = fo.enable_layerwise_offload(model, backend=backend)
    assert group.device.type == "cuda"
    # The blocks' weights left the GPU (only slots of at most two blocks may be allocated, lazily).
    assert torch.cuda.memory_allocated() - before < block_bytes * 0.05 + 4096
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)


@pytest.mark.cuda
def test_ext_peak_gpu_memory_is_bounded_by_slots() -> None:
    model, reference, x = _setup(8, "cuda", dtype=torch.bfloat16, d=512)
    group = fo.enable_layerwise_offload(model, backend="ext", prefetch_depth=1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = model(x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    stats = group.stats()
    largest = max(group.engine.block_bytes(i) for i in range(len(group.states)))
    assert stats["num_slots"] == 2 and stats["slot_bytes"] == largest
    activations = 64 * x.numel() * x.element_size()
    assert peak <= 2 * largest + activations + (2 << 20)
    assert torch.equal(out, reference(x))


def _check_first_forwards_run_ahead(dtype: torch.dtype, **options):
    """Enable on 8 blocks with large activations, delay the GPU in block 0 so the host runs far ahead,
    and check the first two forwards and the restored weights bit for bit; returns the group."""
    model, reference, _ = _setup(8, "cuda", dtype=dtype, d=256)
    x = torch.randn(1, 65536, 256, generator=torch.Generator().manual_seed(3)).to(dtype).to("cuda")
    with torch.no_grad():
        want = reference(x)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    group = fo.enable_layerwise_offload(model, **options)
    delay = model.blocks[0].register_forward_pre_hook(lambda module, args: torch.cuda._sleep(100_000_000))
    try:
        with torch.no_grad():
            first = model(x)
            second = model(x)
    finally:
        delay.remove()
    assert torch.equal(first, want)
    assert torch.equal(second, want)
    fo.disable_layerwise_offload(model)
    assert params_equal(model, reference)
    return group


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("resident", [4, (0, 2, 4, 6), (1, 5)], ids=["first4", "even", "odd2"])
@pytest.mark.parametrize("depth", [1, 2])
def test_first_forward_exact_when_resident_blocks_run_ahead(backend: str, resident, depth: int) -> None:
    # Resident blocks before the first offloaded one free large activations whose kernels are still
    # queued (a GPU delay keeps the host far ahead); the slots the first acquire allocates may be that
    # memory, so the first copy into them must wait for the work already queued on the stream.
    _check_first_forwards_run_ahead(torch.float32, backend=backend, resident_blocks=resident, prefetch_depth=depth)


@pytest.mark.cuda
@pytest.mark.parametrize("resident", [4, (0, 2, 4, 6)], ids=["first4", "even"])
def test_first_compressed_forward_exact_when_resident_blocks_run_ahead(resident) -> None:
    # As above, with the host copies compressed: the decode's staging buffers are new memory too.
    group = _check_first_forwards_run_ahead(torch.bfloat16, backend="ext", resident_blocks=resident, compress=True)
    assert group.compress_mode == "on"


def test_transformers_decoder_layers_offload_bit_exact() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is installed by scripts/setup_env.sh")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaModel(config).eval()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 11))
    with torch.no_grad():
        want = reference(input_ids=ids).last_hidden_state
    for backend in BACKENDS:
        group = fo.enable_layerwise_offload(model, device="cpu", backend=backend)
        assert group.list_name == "layers" and len(group.states) == 3
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(input_ids=ids).last_hidden_state, want)
        fo.disable_layerwise_offload(model)
        assert params_equal(model, reference)
