"""What users get wrong, and the exact message each one gets: one table, one parametrized test.

Every row is a mistake (or a corner case that must simply work), the exception type, and the exact
message (a full match). After a refusal the model must be exactly as it was: no offload group, no
hook, every parameter its original self.

Already covered elsewhere, so not repeated here:
- tests/test_layerwise.py::test_bad_arguments: prefetch_depth -1 and 1.5, resident_blocks 5 and -1
  (larger than the list / negative), backend 'cuda', device 'mps' and 'banana', pin_backing 'gpu';
- tests/test_layerwise.py::test_seed_errors_and_enable_twice: a model with no ModuleList at all,
  is_replace without hooks, enabling twice; ::test_tied_weights_are_refused_and_nothing_changes;
  ::test_meta_parameters_are_refused (a whole meta model); ::test_grad_recording_forward_is_refused;
- tests/test_lazy.py: a loader returning None, copies and threads; tests/test_resolution.py: a named
  step's unknown path; tests/test_configure.py: every bad layerwise option before any loader runs;
- tests/test_sharing.py: ranks out of step, differing values, a taken segment name, /dev/shm too small.
"""
from __future__ import annotations

import copy
import functools
import io
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext import LazyModule
from fastoffload_ext.engine.messages import COPY_ERROR
from fastoffload_ext.planning import BlockCosts, module_packed_bytes, plan_offload
from fastoffload_ext.policy.resolution import DEFAULT_SCHEMA, UnknownPathError, resolve

from ._models import Block, make_pair, params_equal
from ._trees import has_hooks, mismatches, snapshot

N_BLOCKS = 3
NO_BLOCK_LIST = ("fastoffload: No nn.ModuleList found in the model for layerwise offloading. Keep the blocks in an "
                 "nn.ModuleList that is a direct child of the model, or name the lists with block_lists=")
NOT_ENABLED = ("fastoffload: layerwise offload is not enabled on this model (no enable_layerwise_offload call to "
               "undo); call disable only after enable")
KNOWN_SETTINGS = ", ".join(sorted(DEFAULT_SCHEMA))
DEVICE_HINT = ("layerwise offload moves weights between host memory and a CUDA device ('cpu' runs the same engine "
               "with the host as its device, for tests)")
NO_CUDA_HINT = ("was asked for but CUDA is not available; pass device='cpu' to run the offload engine on the host, "
                "or None to skip offloading on machines without CUDA")


class Env:
    """A fresh 3-block model and its resident twin for each row."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.model, self.reference = make_pair(N_BLOCKS)
        self.model.requires_grad_(False)
        self.reference.requires_grad_(False)
        self.x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(5))
        self.monkeypatch = monkeypatch
        self.untouched_check = True

    def enable(self, **kwargs: Any) -> fo.LayerwiseOffloadGroup | None:
        kwargs.setdefault("device", "cpu")
        return fo.enable_layerwise_offload(self.model, **kwargs)

    def without_cuda(self) -> None:
        self.monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def assert_runs_exactly(self, backend: str, check: Callable[[fo.LayerwiseOffloadGroup], None] | None = None,
                            **kwargs: Any) -> fo.LayerwiseOffloadGroup:
        """Enable, two exact steps, ``check(group)`` while offloaded, disable, originals back."""
        with torch.no_grad():
            want = self.reference(self.x)
        group = self.enable(backend=backend, **kwargs)
        assert group is not None
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(self.model(self.x), want)
        if check is not None:
            check(group)
        fo.disable_layerwise_offload(self.model)
        assert params_equal(self.model, self.reference)
        assert not any(has_hooks(b) for b in self.model.blocks)
        return group


@dataclass(frozen=True)
class Case:
    id: str
    run: Callable[[Env], Any]
    raises: type[BaseException] | None = None
    message: str | None = None  # a regex that must match the whole message (re.escape'd exact text mostly)

    def param(self) -> Any:
        return pytest.param(self, id=self.id)


def exact(text: str) -> str:
    return re.escape(text)


# ---- rows that must work ------------------------------------------------------------------------

class Doubler(nn.Module):
    """A block with no parameters (and a buffer): a pure function between weighted blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("two", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.two


def _block_without_parameters(backend: str) -> Callable[[Env], Any]:
    def run(env: Env) -> None:
        env.model.blocks[1] = Doubler()
        env.reference.blocks[1] = Doubler()
        def check(group: fo.LayerwiseOffloadGroup) -> None:
            assert len(group.states) == N_BLOCKS  # the parameter-less block is hooked like the others
            if backend == "ext":
                sizes = [group.engine.block_bytes(i) for i in range(N_BLOCKS)]
                assert sizes[1] == 0 and sizes[0] == sizes[2] > 0
            else:
                assert group.states[1].cpu_named_parameters == {}

        env.assert_runs_exactly(backend, check, prefetch_depth=2)

    return run


def _every_block_without_parameters(backend: str) -> Callable[[Env], Any]:
    def run(env: Env) -> None:
        for m in (env.model, env.reference):
            for i in range(N_BLOCKS):
                m.blocks[i] = Doubler()
        def check(group: fo.LayerwiseOffloadGroup) -> None:
            assert group.stats()["weight_bytes"] == 0
            if backend == "ext":
                stats = group.engine.stats()
                assert stats["bytes_copied"] == 0 and stats["packed_bytes"] == 0 and stats["slot_bytes"] == 0

        env.assert_runs_exactly(backend, check)

    return run


def _empty_block_list(env: Env) -> None:
    env.model.blocks = nn.ModuleList()
    env.reference.blocks = nn.ModuleList()
    group = env.assert_runs_exactly("ext")
    assert group.states == [] and group.engine is None


def _all_blocks_resident(env: Env) -> None:
    group = env.assert_runs_exactly("ext", resident_blocks=N_BLOCKS)
    assert group.states == [] and group.engine is None


# ---- rows that must be refused ------------------------------------------------------------------

def _parameter_wrapping_an_inference_tensor(backend: str) -> Callable[[Env], Any]:
    """Made outside inference_mode from an inference tensor: it counts versions, so it offloads."""
    def run(env: Env) -> None:
        with torch.inference_mode():
            weight = env.model.blocks[1].qkv.weight.clone()
        env.model.blocks[1].qkv.weight = nn.Parameter(weight, requires_grad=False)
        env.assert_runs_exactly(backend)
    return run


def _inference_parameter(backend: str) -> Callable[[Env], Any]:
    def run(env: Env) -> None:
        with torch.inference_mode():  # a parameter made in there has no version counter
            env.model.blocks[1].qkv.weight = nn.Parameter(env.model.blocks[1].qkv.weight.clone(), requires_grad=False)
        env.enable(backend=backend)
    return run


def _meta_parameter_deep_in_a_block(env: Env) -> None:
    env.model.blocks[2].norms[1].bias = nn.Parameter(torch.empty(16, device="meta"))
    env.untouched_check = False  # a meta tensor has no bytes to snapshot; checked by hand below
    before = snapshot(env.model.blocks[:2])
    try:
        env.enable()
    finally:
        assert fo.get_offload_group(env.model) is None and not any(has_hooks(b) for b in env.model.blocks)
        assert mismatches(env.model.blocks[:2], before) == []


def _sparse_parameter(env: Env) -> None:
    env.model.blocks[0].o.weight = nn.Parameter(env.reference.blocks[0].o.weight.to_sparse(), requires_grad=False)
    env.untouched_check = False  # block 0 keeps an empty hook manager (tests/test_faults.py, BUG)
    try:
        env.enable(backend="ext")
    finally:
        assert fo.get_offload_group(env.model) is None
        assert all(p.numel() > 0 for p in env.model.parameters())


def _nested_parameter(backend: str) -> Callable[[Env], Any]:
    def run(env: Env) -> None:
        nested = torch.nested.nested_tensor([torch.ones(2, 16), torch.ones(3, 16)])
        env.model.blocks[1].o.weight = nn.Parameter(nested, requires_grad=False)
        env.untouched_check = False  # a nested tensor cannot be snapshot or compared; checked by hand
        before = snapshot(env.model.blocks[::2])
        try:
            env.enable(backend=backend)
        finally:
            assert fo.get_offload_group(env.model) is None and not any(has_hooks(b) for b in env.model.blocks)
            assert env.model.blocks[1].o.weight.is_nested
            assert mismatches(env.model.blocks[::2], before) == []

    return run


def _wrapper_subclass_parameter(backend: str) -> Callable[[Env], Any]:
    """A parameter whose values live in inner tensors (how torchao and quanto hold quantized weights)."""
    def run(env: Env) -> None:
        from torch.testing._internal.two_tensor import TwoTensor

        weight = env.model.blocks[1].o.weight.detach()
        _refused_after(env, lambda: setattr(env.model.blocks[1].o, "weight", nn.Parameter(
            TwoTensor(weight.clone(), weight.clone()), requires_grad=False)), backend=backend)

    return run


def _norm_on_the_block_itself(backend: str, norm: Callable[[nn.Module], Any]) -> Callable[[Env], Any]:
    def run(env: Env) -> None:
        _refused_after(env, lambda: setattr(env.model.blocks, "1", norm(nn.Linear(16, 16))),
                       backend=backend)

    return run


def _block_listed_twice(backend: str) -> Callable[[Env], Any]:
    """blocks[2] is blocks[0], and the first N resident keeps only index 0: the hook for index 2 would take
    the resident block's parameters for placeholders, and moving it to the device would rebind them."""
    def run(env: Env) -> None:
        _refused_after(env, lambda: setattr(env.model.blocks, "2", env.model.blocks[0]), backend=backend,
                       resident_blocks=1)

    return run


def _weight_norms_that_work(backend: str) -> Callable[[Env], Any]:
    """The forms a block may carry: parametrizations (computed inside the forward; spectral_norm updates its
    buffers there, in training mode), and the older hooks on a submodule (run inside the block's forward)."""
    def run(env: Env) -> None:
        for m in (env.model, env.reference):
            torch.manual_seed(7)
            m.blocks[0] = nn.utils.parametrizations.weight_norm(nn.Linear(16, 16))
            m.blocks[1] = nn.utils.parametrizations.spectral_norm(nn.Linear(16, 16))
            m.blocks[2].o = nn.utils.spectral_norm(m.blocks[2].o)
            m.requires_grad_(False)
        fo.enable_layerwise_offload(env.model, device="cpu", backend=backend)
        with torch.no_grad():
            for _ in range(2):  # each training-mode step moves spectral_norm's vectors: step them together
                assert torch.equal(env.model(env.x), env.reference(env.x))
        fo.disable_layerwise_offload(env.model)
        assert params_equal(env.model, env.reference)
        buffers = dict(env.reference.named_buffers())
        assert dict(env.model.named_buffers()).keys() == buffers.keys()
        assert all(torch.equal(env.model.get_buffer(name), buffer) for name, buffer in buffers.items())

    return run


def _lazy_model_whose_loader_raises(env: Env) -> None:
    failure = OSError("checkpoint shard 3 of 4 is missing")

    def loader() -> nn.Module:
        raise failure

    proxy = LazyModule("transformer", loader)
    try:
        fo.enable_layerwise_offload(proxy, device="cpu")
    except OSError as error:
        # The loader's own exception, unchanged (same object, no wrapping), and the proxy stays unloaded.
        assert error is failure and error.__cause__ is None
        assert getattr(error, "__notes__", []) == ["while loading deferred module transformer"]
        assert proxy.is_materialized is False
        raise


def _resolution_lambda_step(env: Env) -> None:
    resolve({}, [lambda view: {"engine.offload.vea": True}])


def _setter(view: Any, value: bool) -> dict[str, bool]:
    return {"engine.offload.dit_layerwse": value}


def _resolution_partial_step(env: Env) -> None:
    resolve({}, [functools.partial(_setter, value=True)])


BLOCK_BYTES = module_packed_bytes(Block(16, 2))  # 14.0 KiB: the rows' sizes below are multiples of it
BUDGET_SHAPE = ("fastoffload: {what} must be None, a number of bytes, or a size such as '20GiB' or '512MB'{auto}; "
                "got {value!r}")


def _plan_for(blocks: int, resident: int) -> Any:
    costs = BlockCosts([1.0] * blocks, [BLOCK_BYTES] * blocks, 1.0, overlap=False)
    return plan_offload(costs, (resident + 2) * BLOCK_BYTES)


# ---- what users do to an offloaded model --------------------------------------------------------

def _huge_prefetch_depth(depth: int) -> Callable[[Env], Any]:
    def run(env: Env) -> None:
        def check(group: fo.LayerwiseOffloadGroup) -> None:
            assert group.prefetch_depth == N_BLOCKS  # clamped: deeper would copy nothing more
            assert group.engine.num_slots == N_BLOCKS + 1

        env.assert_runs_exactly("ext", check, prefetch_depth=depth)

    return run


def _refused_after(env: Env, setup: Callable[[], Any], **kwargs: Any) -> None:
    """``setup`` changes the model first (so the table's own snapshot no longer applies): snapshot after it."""
    setup()
    env.untouched_check = False
    before = snapshot(env.model)
    try:
        env.enable(**kwargs)
    finally:
        assert fo.get_offload_group(env.model) is None
        assert not any(has_hooks(m) for m in env.model.modules())
        assert mismatches(env.model, before) == []


def _nested_block_lists(env: Env) -> None:
    blocks = list(env.model.blocks)
    _refused_after(env, lambda: setattr(env.model, "blocks", nn.ModuleList([nn.ModuleList(blocks[:2]),
                                                                            nn.ModuleList(blocks[2:])])))


def _lazy_linear_in_a_block(env: Env) -> None:
    env.model.blocks[1].o = nn.LazyLinear(16)
    env.untouched_check = False  # an uninitialized parameter has no bytes to snapshot; checked by hand
    try:
        env.enable()
    finally:
        assert fo.get_offload_group(env.model) is None and not any(has_hooks(b) for b in env.model.blocks)
        assert params_equal(env.model.blocks[0], env.reference.blocks[0])


def _offloaded_then(env: Env, backend: str, action: Callable[[], Any]) -> None:
    """Enables, runs ``action`` (which raises), disables, re-raises: the model must come back as it was."""
    env.enable(backend=backend)
    try:
        action()
    finally:
        fo.disable_layerwise_offload(env.model)


def _second_forward_in_another_thread(backend: str) -> Callable[[Env], Any]:
    def run(env: Env) -> None:
        caught: list[BaseException] = []

        def second_forward() -> None:
            try:
                with torch.no_grad():
                    env.model(env.x)
            except RuntimeError as error:
                caught.append(error)

        def while_block_1_runs(module: nn.Module, args: Any) -> None:
            handle.remove()
            thread = threading.Thread(target=second_forward)
            thread.start()
            thread.join()

        handle = env.model.blocks[1].o.register_forward_pre_hook(while_block_1_runs)

        def forward_then_report() -> None:
            with torch.no_grad():
                assert torch.equal(env.model(env.x), env.reference(env.x))
            raise caught[0]

        _offloaded_then(env, backend, forward_then_report)

    return run


def _in_place_edit_while_offloaded(backend: str) -> Callable[[Env], Any]:
    def run(env: Env) -> None:
        env.enable(backend=backend)
        try:
            with torch.no_grad():
                env.model.blocks[2].up.bias.mul_(3)
                env.model(env.x)
        finally:
            # The refused edit is still on the placeholder: disable keeps the value from before it, and says so.
            with pytest.warns(RuntimeWarning, match=r"parameter 'up\.bias' of block 2 was changed while it was "
                                                    r"offloaded \(in place"):
                fo.disable_layerwise_offload(env.model)

    return run


def _copied_while_offloaded(backend: str, copy_it: Callable[[nn.Module], Any]) -> Callable[[Env], Any]:
    def run(env: Env) -> None:
        def copy_then_check() -> None:
            try:
                copy_it(env.model)
            finally:
                with torch.no_grad():
                    assert torch.equal(env.model(env.x), env.reference(env.x))  # the refused copy took nothing

        _offloaded_then(env, backend, copy_then_check)

    return run


def _half_after_enable(backend: str) -> Callable[[Env], Any]:
    def run(env: Env) -> None:
        env.untouched_check = False  # the cast is followed at disable: checked by hand below
        try:
            _offloaded_then(env, backend, lambda: (env.model.half(), env.model(env.x.half())))
        finally:
            env.reference.half()
            assert params_equal(env.model, env.reference)

    return run


def _storage_shared_with_proj_in(env: Env) -> None:
    def tie() -> None:
        env.model.blocks[0].o.weight = nn.Parameter(env.model.proj_in.weight.data, requires_grad=False)

    _refused_after(env, tie)


def _saved_input_modified_before_backward(backend: str) -> Callable[[Env], Any]:
    def run(env: Env) -> None:
        def forward_edit_backward() -> None:
            h = env.x.clone().requires_grad_(True) * 1.0
            out = env.model.blocks[0](h)
            with torch.no_grad():
                h.add_(1)  # h was saved by the block's first norm
            out.sum().backward()

        _offloaded_then(env, backend, forward_edit_backward)

    return run


CONCURRENT = ("fastoffload: this offloaded model is running a forward in another thread; one offloaded model runs one "
              "forward at a time. Run its forwards from one thread (or one after another under a lock), or give each "
              "thread its own copy of the model.")
IN_PLACE = ("fastoffload: parameter 'up.bias' of block 2 was changed in place while it was offloaded (its placeholder "
            "or device slot holds no lasting copy), so the change would be silently lost. Change a block's parameters "
            "inside mutate_params_scope(), which rebuilds the host copy, or disable offload first.")
HALF = ("fastoffload: parameter 'qkv.weight' of block 0 was cast or moved to Half on cpu after offload was enabled (its "
        "host copy holds Float for cpu); .half(), .to(dtype) and .to(device) do not reach an offloaded block's host "
        "copy. Cast or move the model before enable_layerwise_offload, or disable offload, cast, and enable it again.")
SAVED_MODIFIED = ("fastoffload: a tensor that an offloaded block saved for backward (shape (2, 4, 16)) was modified in "
                  "place after it was saved: it is at version 1, saved at version 0. Its gradient would be wrong. Clone "
                  "the tensor before changing it in place, or change it after backward.")


PARTIAL_NAME = r"functools\.partial\(<function _setter at 0x[0-9a-f]+>, value=True\)"


def _apply_config_with_a_bad_option(env: Env) -> None:
    from fastoffload_ext.pipeline.configure import apply_offload_config

    loads: list[str] = []

    def load_transformer() -> nn.Module:
        loads.append("transformer")
        return env.model

    try:
        apply_offload_config({"engine": {"offload": {"dit_layerwise": True, "lazy_module_load": False}}},
                             transformer="transformer", components={"transformer": load_transformer}, device="cpu",
                             layerwise_options={"prefetch_depth": -1})
    finally:
        assert loads == []  # refused before the (possibly huge) transformer was loaded


def _copies_of_a_lazy_module(env: Env) -> None:
    import copy
    import pickle

    proxy = LazyModule("transformer", functools.partial(nn.Linear, 4, 4))
    for clone in (copy.copy(proxy), copy.deepcopy(proxy), pickle.loads(pickle.dumps(proxy))):
        assert type(clone) is LazyModule and not clone.is_materialized and clone.lazy_name == "transformer"
    assert not proxy.is_materialized


def _resolve_a_config_holding_a_lock(env: Env) -> None:
    import threading

    lock = threading.Lock()
    result = resolve({"runtime": {"lock": lock}, "engine": {"offload": {"vae": True}}}, [])
    assert result.config["runtime"]["lock"] is lock and result.get("engine.offload.vae") is True

CASES = [
    # Must work.
    Case("block_without_parameters-ext", _block_without_parameters("ext")),
    Case("block_without_parameters-python", _block_without_parameters("python")),
    Case("every_block_without_parameters-ext", _every_block_without_parameters("ext")),
    Case("every_block_without_parameters-python", _every_block_without_parameters("python")),
    Case("empty_block_list", _empty_block_list),
    Case("all_blocks_resident", _all_blocks_resident),
    # Where the block list is.
    Case("model_is_the_block_list_itself", lambda env: fo.enable_layerwise_offload(env.model.blocks, device="cpu"),
         ValueError, exact(NO_BLOCK_LIST)),
    Case("block_list_one_level_down",
         lambda env: fo.enable_layerwise_offload(nn.ModuleDict({"transformer": env.model}), device="cpu"),
         ValueError, exact(NO_BLOCK_LIST)),
    # What the blocks hold.
    Case("meta_parameter_deep_in_block_2", _meta_parameter_deep_in_a_block, ValueError,
         exact("fastoffload: parameter 2.norms.1.bias is on the meta device and has no values to offload; materialize "
               "the model first (e.g. to_empty(device=...) then load_state_dict)")),
    *[Case(f"parameter_wrapping_an_inference_tensor-{backend}", _parameter_wrapping_an_inference_tensor(backend))
      for backend in ("ext", "python")],
    *[Case(f"inference_tensor_parameter-{backend}", _inference_parameter(backend), ValueError,
           exact("fastoffload: parameter 1.qkv.weight is an inference tensor (the model was built or loaded inside "
                 "torch.inference_mode()), which offload cannot watch for in-place writes; build or load the model "
                 "outside inference_mode (torch.no_grad() is fine) and run the forward inside it"))
      for backend in ("ext", "python")],
    Case("sparse_parameter-ext", _sparse_parameter, RuntimeError,
         exact("fastoffload: parameter 'o.weight' has layout Sparse; only dense (strided) tensors can be offloaded. "
               "Convert it with .to_dense() first")),
    *[Case(f"nested_tensor_parameter-{backend}", _nested_parameter(backend), ValueError,
           exact("fastoffload: parameter blocks.1.o.weight is a nested tensor; only dense (strided) tensors can be "
                 "offloaded. Hold its values as dense tensors, or keep that module outside the block list"))
      for backend in ("ext", "python")],
    *[Case(f"wrapper_subclass_parameter-{backend}", _wrapper_subclass_parameter(backend), ValueError,
           exact("fastoffload: parameter blocks.1.o.weight is of type TwoTensor, a tensor subclass that keeps its "
                 "values in inner tensors (a torchao or quanto quantized weight, for example) rather than in bytes of "
                 "its own, which are what this engine offloads. Keep that module outside the block list, or store the "
                 "blocks in a plain low-precision dtype (diffusers' enable_layerwise_casting before the offload moves "
                 "them in float8)"))
      for backend in ("ext", "python")],
    *[Case(f"{kind}_on_the_block_itself-{backend}",
           _norm_on_the_block_itself(backend, getattr(nn.utils, kind)), ValueError,
           exact(f"fastoffload: blocks.1 has torch.nn.utils.{kind} applied to the block itself: its forward pre-hook "
                 "recomputes the weight before offload loads the block, from empty placeholders. Use "
                 f"torch.nn.utils.parametrizations.{kind} (computed inside the forward), apply it to a submodule of "
                 "the block, or keep the block resident with resident_blocks"))
      for kind in ("weight_norm", "spectral_norm") for backend in ("ext", "python")],
    *[Case(f"weight_norms_that_work-{backend}", _weight_norms_that_work(backend)) for backend in ("ext", "python")],
    *[Case(f"block_listed_twice_resident_and_offloaded-{backend}", _block_listed_twice(backend), ValueError,
           exact("fastoffload: blocks.0 and blocks.2 are one module listed twice, and blocks.0 would stay resident "
                 "while blocks.2 is offloaded; keep both resident or offload both (resident_blocks)"))
      for backend in ("ext", "python")],
    # Devices.
    Case("device_xla", lambda env: env.enable(device="xla"), ValueError,
         exact(f"fastoffload: device must be 'cuda', 'cuda:N' or 'cpu', got 'xla': {DEVICE_HINT}")),
    Case("device_cuda_without_cuda", lambda env: (env.without_cuda(), env.enable(device="cuda")), RuntimeError,
         exact(f"fastoffload: device 'cuda' {NO_CUDA_HINT}")),
    Case("device_cuda_99_without_cuda", lambda env: (env.without_cuda(), env.enable(device="cuda:99")), RuntimeError,
         exact(f"fastoffload: device 'cuda:99' {NO_CUDA_HINT}")),
    Case("device_index_0_without_cuda", lambda env: (env.without_cuda(), env.enable(device=0)), RuntimeError,
         exact(f"fastoffload: device 'cuda:0' {NO_CUDA_HINT}")),
    Case("device_cuda_99_with_2_gpus",
         lambda env: (env.monkeypatch.setattr(torch.cuda, "is_available", lambda: True),
                      env.monkeypatch.setattr(torch.cuda, "device_count", lambda: 2), env.enable(device="cuda:99")),
         ValueError, exact("fastoffload: device 'cuda:99' does not exist: 2 CUDA device(s) visible; pass one of "
                           "those (or check CUDA_VISIBLE_DEVICES)")),
    # Knobs of the wrong type or spelling.
    Case("prefetch_depth_true", lambda env: env.enable(prefetch_depth=True), ValueError,
         exact("fastoffload: prefetch_depth must be an integer >= 0 (blocks copied ahead) or 'auto', got True")),
    Case("prefetch_depth_string", lambda env: env.enable(prefetch_depth="2"), ValueError,
         exact("fastoffload: prefetch_depth must be an integer >= 0 (blocks copied ahead) or 'auto', got '2'")),
    Case("resident_blocks_true", lambda env: env.enable(resident_blocks=True), ValueError,
         exact("fastoffload: resident_blocks must be an integer between 0 and the 3 blocks of 'blocks', got True")),
    Case("backend_upper_case", lambda env: env.enable(backend="EXT"), ValueError,
         exact("fastoffload: backend must be one of 'auto', 'ext', 'python', got 'EXT'")),
    Case("pin_backing_capitalised", lambda env: env.enable(pin_backing="Register"), ValueError,
         exact("fastoffload: pin_backing must be one of 'host_alloc', 'register', 'pageable', got 'Register'")),
    Case("pinned_limit_bytes_negative-ext", lambda env: env.enable(backend="ext", pinned_limit_bytes=-1), ValueError,
         exact("fastoffload: pinned_limit_bytes must be None or an integer >= 0 (bytes), got -1")),
    # Budgets and resident sets.
    Case("device_budget_unparseable", lambda env: env.enable(device_budget="20 gigs"), ValueError,
         exact(BUDGET_SHAPE.format(what="device_budget", auto=", or 'auto'", value="20 gigs"))),
    Case("device_budget_negative", lambda env: env.enable(device_budget=-1), ValueError,
         exact("fastoffload: device_budget must not be negative, got -1; pass a size such as '20GiB', or None for no "
               "limit")),
    Case("device_budget_below_two_slots", lambda env: env.enable(device_budget="20KiB"), ValueError,
         exact("fastoffload: device_budget 20.0 KiB is smaller than what offload needs at least: 2 slots x 14.0 KiB "
               "(the largest block) + 0 B activation reserve = 28.0 KiB. Raise device_budget to at least 28.0 KiB, "
               "lower prefetch_depth, or lower activation_reserve")),
    Case("device_budget_below_slots_and_reserve", lambda env: env.enable(device_budget="40KiB", activation_reserve="20KiB",
                                                                          prefetch_depth=2), ValueError,
         exact("fastoffload: device_budget 40.0 KiB is smaller than what offload needs at least: 3 slots x 14.0 KiB "
               "(the largest block) + 20.0 KiB activation reserve = 62.0 KiB. Raise device_budget to at least 62.0 KiB, "
               "lower prefetch_depth, or lower activation_reserve")),
    Case("device_budget_under_the_given_resident_blocks", lambda env: env.enable(device_budget="40KiB", resident_blocks=2),
         ValueError,
         exact("fastoffload: device_budget 40.0 KiB is too small for 2 resident blocks (28.0 KiB) + 2 slots x 14.0 KiB "
               "+ 0 B activation reserve = 56.0 KiB; keep fewer blocks resident, use resident_blocks='auto', or raise "
               "device_budget")),
    Case("host_budget_below_the_offloaded_blocks", lambda env: env.enable(host_budget="1KiB"), ValueError,
         exact("fastoffload: the offloaded blocks need 42.0 KiB of host memory, more than host_budget (1.0 KiB); keep "
               "more blocks resident (resident_blocks, or a device_budget), free host memory, or raise host_budget")),
    Case("host_budget_unparseable", lambda env: env.enable(host_budget=[1]), ValueError,
         exact(BUDGET_SHAPE.format(what="host_budget", auto=", or 'auto'", value=[1]))),
    Case("activation_reserve_auto", lambda env: env.enable(device_budget="1MiB", activation_reserve="auto"), ValueError,
         exact(BUDGET_SHAPE.format(what="activation_reserve", auto="", value="auto"))),
    Case("resident_blocks_index_out_of_range", lambda env: env.enable(resident_blocks=[0, 7]), ValueError,
         exact("fastoffload: resident_blocks indices must be integers in 0..2 (the blocks of 'blocks'), got [0, 7]")),
    Case("resident_blocks_unknown_word", lambda env: env.enable(resident_blocks="first"), ValueError,
         exact("fastoffload: resident_blocks must be an integer between 0 and the 3 blocks of 'blocks', got 'first'; "
               "or pass a collection of block indices, or 'auto'")),
    Case("prefetch_depth_unknown_word", lambda env: env.enable(prefetch_depth="max"), ValueError,
         exact("fastoffload: prefetch_depth must be an integer >= 0 (blocks copied ahead) or 'auto', got 'max'")),
    Case("plan_for_another_model", lambda env: env.enable(plan=_plan_for(5, 1)), ValueError,
         exact("fastoffload: the plan was made for 5 blocks, but 'blocks' has 3; make a plan from this model's costs")),
    Case("plan_and_resident_blocks", lambda env: env.enable(plan=_plan_for(3, 0), resident_blocks=1), ValueError,
         exact("fastoffload: pass either plan= or resident_blocks/prefetch_depth, not both: the plan already sets "
               "resident [] and depth 1")),
    Case("plan_is_not_a_plan", lambda env: env.enable(plan={"resident": [0]}), ValueError,
         exact("fastoffload: plan must be an OffloadPlan from plan_offload(), got dict")),
    Case("plan_over_the_device_budget", lambda env: env.enable(plan=_plan_for(3, 0), device_budget="20KiB"), ValueError,
         exact("fastoffload: the plan needs 28.0 KiB of device memory, more than device_budget 20.0 KiB; re-plan with "
               "this budget")),
    # The string "false" is truthy: taken as True it would silently turn the wrap-around on.
    Case("cyclic_as_a_string", lambda env: env.enable(cyclic="false"), ValueError,
         exact("fastoffload: cyclic must be True or False, got 'false'")),
    # Lazy components and resolution steps.
    Case("lazy_model_whose_loader_raises", _lazy_model_whose_loader_raises, OSError,
         exact("checkpoint shard 3 of 4 is missing")),
    Case("resolution_lambda_step_unknown_path", _resolution_lambda_step, UnknownPathError,
         exact("fastoffload: resolution step <lambda> set 'engine.offload.vea', which is not a known setting; fix the "
               f"path in <lambda> (known settings: {KNOWN_SETTINGS})")),
    Case("resolution_partial_step_unknown_path", _resolution_partial_step, UnknownPathError,
         f"fastoffload: resolution step {PARTIAL_NAME} set 'engine\\.offload\\.dit_layerwse', which is not a known "
         f"setting; fix the path in {PARTIAL_NAME} \\(known settings: {re.escape(KNOWN_SETTINGS)}\\)"),
    # What users do to an offloaded model.
    Case("prefetch_depth_10_to_the_9", _huge_prefetch_depth(10**9)),
    Case("prefetch_depth_2_to_the_64", _huge_prefetch_depth(2**64)),
    Case("nested_block_lists", _nested_block_lists, ValueError,
         exact("fastoffload: blocks.0 is an nn.ModuleList, which has no forward of its own, so offload could never "
               "load its weights (every forward would fail on empty placeholders). Make blocks hold the blocks "
               "themselves: flatten the nested lists into one nn.ModuleList")),
    Case("lazy_linear_in_a_block", _lazy_linear_in_a_block, ValueError,
         exact("fastoffload: parameter blocks.1.o.weight is not initialized yet (a lazy module such as nn.LazyLinear, "
               "which sizes its weights on its first forward); run one forward on the model before enabling offload, "
               "so the weights exist")),
    Case("weight_sharing_storage_with_proj_in", _storage_shared_with_proj_in, ValueError,
         exact("fastoffload: parameter proj_in.weight shares its storage with blocks.0.o.weight, which would be "
               "offloaded: weights tied between an offloaded block and the rest of the model are not supported. Untie "
               "them (clone one), or keep that block resident with resident_blocks")),
    *[Case(f"second_forward_in_another_thread-{b}", _second_forward_in_another_thread(b), RuntimeError,
           exact(CONCURRENT)) for b in ("ext", "python")],
    *[Case(f"in_place_edit_while_offloaded-{b}", _in_place_edit_while_offloaded(b), RuntimeError, exact(IN_PLACE))
      for b in ("ext", "python")],
    *[Case(f"half_after_enable-{b}", _half_after_enable(b), RuntimeError, exact(HALF)) for b in ("ext", "python")],
    *[Case(f"{what}_of_an_offloaded_model-{b}", _copied_while_offloaded(b, copy_it), RuntimeError, exact(COPY_ERROR))
      for what, copy_it in (("deepcopy", copy.deepcopy), ("torch_save", lambda m: torch.save(m, io.BytesIO())),
                            ("deepcopy_one_block", lambda m: copy.deepcopy(m.blocks[1])))
      for b in ("ext", "python")],
    *[Case(f"saved_input_modified_before_backward-{b}", _saved_input_modified_before_backward(b), RuntimeError,
           exact(SAVED_MODIFIED)) for b in ("ext", "python")],
    # Arguments that would otherwise reach the compiled core with the wrong type.
    Case("allow_pageable_fallback_string", lambda env: env.enable(backend="ext", allow_pageable_fallback="no"),
         ValueError, exact("fastoffload: allow_pageable_fallback must be True or False, got 'no'")),
    Case("is_replace_string", lambda env: env.enable(is_replace="yes"), ValueError,
         exact("fastoffload: is_replace must be True or False, got 'yes'")),
    Case("pinned_limit_bytes_2_to_the_64", lambda env: env.enable(backend="ext", pinned_limit_bytes=2**64), ValueError,
         exact("fastoffload: pinned_limit_bytes must be at most 2**63 - 1 bytes, got 18446744073709551616; pass None "
               "for no limit")),
    Case("pin_backing_not_a_string", lambda env: env.enable(backend="ext", pin_backing=["register"]), ValueError,
         exact("fastoffload: pin_backing must be one of 'host_alloc', 'register', 'pageable', got ['register']")),
    Case("device_cpu_1", lambda env: env.enable(device="cpu:1"), ValueError,
         exact("fastoffload: device 'cpu:1' names a CPU index, but the host is one device for offload; pass "
               "device='cpu'")),
    # Pipeline-level helpers.
    Case("apply_offload_config_checks_options_before_loading", _apply_config_with_a_bad_option, ValueError,
         exact("fastoffload: prefetch_depth must be an integer >= 0 (blocks copied ahead) or 'auto', got -1")),
    Case("copy_deepcopy_pickle_of_a_lazy_module", _copies_of_a_lazy_module),
    Case("resolve_a_config_holding_a_lock", _resolve_a_config_holding_a_lock),
    # Sharing the host copy between ranks (the multi-rank cases are in tests/test_sharing.py).
    Case("share_host_copy_yes", lambda env: env.enable(backend="ext", share_host_copy="yes"), ValueError,
         exact("fastoffload: share_host_copy must be True, False or 'auto', got 'yes'")),
    Case("share_host_copy_true_without_a_process_group", lambda env: env.enable(backend="ext", share_host_copy=True),
         RuntimeError,
         exact("fastoffload: share_host_copy=True shares the host copy between the ranks of a torch.distributed "
               "process group, but none is initialized: call torch.distributed.init_process_group(...) on every "
               "rank first (torchrun sets the environment for it), or pass share_host_copy=False")),
    # Undoing what was never done.
    Case("disable_never_enabled", lambda env: fo.disable_layerwise_offload(env.model), ValueError,
         exact(NOT_ENABLED)),
    Case("disable_on_a_plain_linear", lambda env: fo.disable_layerwise_offload(nn.Linear(2, 2)), ValueError,
         exact(NOT_ENABLED)),
]


@pytest.mark.parametrize("case", [case.param() for case in CASES])
def test_bad_input(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    env = Env(monkeypatch)
    if case.raises is None:
        case.run(env)
        return
    before = snapshot(env.model)
    with pytest.raises(case.raises) as raised:
        case.run(env)
    assert re.fullmatch(case.message, str(raised.value), flags=re.DOTALL), str(raised.value)
    if env.untouched_check:
        assert fo.get_offload_group(env.model) is None
        assert not any(has_hooks(block) for block in env.model.blocks)
        assert mismatches(env.model, before) == []


@pytest.mark.parametrize("backend", ["ext", "python"])
def test_a_wrapper_subclass_outside_the_block_list_runs_exactly(backend: str) -> None:
    """A quantized weight (a tensor subclass with inner tensors) outside the blocks stays resident and works; only
    one inside an offloaded block is refused (the table's wrapper_subclass_parameter rows)."""
    from torch.testing._internal.two_tensor import TwoTensor

    model, reference = make_pair(N_BLOCKS)
    for m in (model, reference):
        weight = m.proj_out.weight.detach()
        m.proj_out.weight = nn.Parameter(TwoTensor(weight.clone(), weight.clone() * 2), requires_grad=False)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = reference(x)
        assert fo.enable_layerwise_offload(model, device="cpu", backend=backend) is not None
        for _ in range(2):
            got = model(x)
            assert isinstance(got, TwoTensor) and torch.equal(got.a, want.a) and torch.equal(got.b, want.b)
    fo.disable_layerwise_offload(model)
    assert params_equal(model.blocks, reference.blocks)


def test_lazy_loader_failure_names_the_component() -> None:
    """A pipeline with several deferred components must say whose load failed: the loader's own
    exception (same type, same object) propagates with the module name in a note."""
    def loader() -> nn.Module:
        raise OSError("checkpoint shard 3 of 4 is missing")

    proxy = LazyModule("transformer", loader)
    with pytest.raises(OSError) as raised:
        proxy.materialize()
    text = " ".join([str(raised.value), *getattr(raised.value, "__notes__", [])])
    assert "transformer" in text, text


# ---- the same refusal, the same type on both backends -------------------------------------------------------------

def _rebind(model: nn.Module) -> None:
    model.blocks[1].up.weight.data = torch.zeros(model.blocks[1].up.weight.shape)


def _write(model: nn.Module) -> None:
    with torch.no_grad():
        model.blocks[1].up.weight.mul_(2)


def _train(model: nn.Module) -> None:
    model.blocks[1].up.weight.requires_grad_(True)


@pytest.mark.parametrize("backend", ["ext", "python"])
@pytest.mark.parametrize("mistake", [_rebind, _write, _train], ids=["rebound", "written", "requires grad"])
def test_a_refused_forward_raises_offload_state_error_on_both_backends(backend: str,
                                                                       mistake: Callable[[nn.Module], None]) -> None:
    """The ext backend's core raised a plain RuntimeError where the python backend raises OffloadStateError:
    ``except OffloadStateError`` missed the default backend. Both are still RuntimeErrors."""
    model, reference = make_pair(3)
    fo.enable_layerwise_offload(model, device="cpu", backend=backend)
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    mistake(model)
    with pytest.raises(fo.OffloadStateError, match="^fastoffload: ") as raised, torch.enable_grad():
        model(x)
    assert isinstance(raised.value, RuntimeError)
