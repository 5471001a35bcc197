"""Why a peer's output is not bit-equal to the resident model's: the first op where the two runs part.

Both models run the same forward under a ``TorchFunctionMode`` that records every call of the ops that
decide numerics (GEMMs, attention, norms, convolutions): each tensor argument and the output. The
resident trace is kept; the peer's is compared op by op as it runs. The first op whose arguments or
output differ says what happened:

- an argument that is a weight differs: the peer computed with other values than the resident's
  (a cast, or a copy still in flight when the op read it);
- every argument equal, the output not: the same inputs went through another kernel; the note gives
  the weights' pointer alignment and layout, which cuBLASLt and the attention kernels choose by;
- an activation argument differs while every traced op before matched: an untraced op in between
  (elementwise, a cast) computed differently;
- another op altogether: the peer changed the model's code path.

Torch's global numerics settings (TF32, reduced-precision reductions, SDPA backends) are compared too:
a peer that changes them would make every later row differ for a reason that is not its offload.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

TRACED: dict[Any, str] = {
    F.linear: "linear", F.scaled_dot_product_attention: "scaled_dot_product_attention", F.layer_norm: "layer_norm",
    F.rms_norm: "rms_norm", F.group_norm: "group_norm", F.conv2d: "conv2d", F.conv3d: "conv3d",
    torch.matmul: "matmul", torch.bmm: "bmm", torch.baddbmm: "baddbmm", torch.addmm: "addmm", torch.mm: "mm",
}


def numerics_settings() -> dict[str, Any]:
    """The global switches that change what a GEMM or an attention kernel computes."""
    cuda = torch.backends.cuda
    return {
        "matmul.allow_tf32": cuda.matmul.allow_tf32,
        "matmul.allow_bf16_reduced_precision_reduction": cuda.matmul.allow_bf16_reduced_precision_reduction,
        "matmul.allow_fp16_reduced_precision_reduction": cuda.matmul.allow_fp16_reduced_precision_reduction,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "flash_sdp": cuda.flash_sdp_enabled(), "mem_efficient_sdp": cuda.mem_efficient_sdp_enabled(),
        "math_sdp": cuda.math_sdp_enabled(), "cudnn_sdp": cuda.cudnn_sdp_enabled(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        # Not numerics, but a peer that leaves them set moves every later model's tensors.
        "default_device": str(torch.get_default_device()), "default_dtype": torch.get_default_dtype(),
    }


def settings_changed(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    changed = [f"{key} {before[key]} -> {after.get(key)}" for key in before if after.get(key) != before[key]]
    return ", ".join(changed) or None


def restore_settings(settings: dict[str, Any]) -> None:
    cuda = torch.backends.cuda
    torch.set_float32_matmul_precision(settings["float32_matmul_precision"])  # first: it sets allow_tf32 too
    cuda.matmul.allow_tf32 = settings["matmul.allow_tf32"]
    cuda.matmul.allow_bf16_reduced_precision_reduction = settings["matmul.allow_bf16_reduced_precision_reduction"]
    cuda.matmul.allow_fp16_reduced_precision_reduction = settings["matmul.allow_fp16_reduced_precision_reduction"]
    torch.backends.cudnn.allow_tf32 = settings["cudnn.allow_tf32"]
    torch.backends.cudnn.benchmark = settings["cudnn.benchmark"]
    cuda.enable_flash_sdp(settings["flash_sdp"])
    cuda.enable_mem_efficient_sdp(settings["mem_efficient_sdp"])
    cuda.enable_math_sdp(settings["math_sdp"])
    cuda.enable_cudnn_sdp(settings["cudnn_sdp"])
    torch.use_deterministic_algorithms(settings["deterministic_algorithms"])
    torch.set_default_device(settings["default_device"])
    torch.set_default_dtype(settings["default_dtype"])


def alignment(tensor: torch.Tensor) -> int:
    """The largest power of two up to 256 that divides the tensor's data pointer (what cuBLASLt asks)."""
    pointer = tensor.data_ptr()
    size = 256
    while size > 1 and pointer % size:
        size //= 2
    return size


def _layout(tensor: torch.Tensor) -> str:
    return f"{alignment(tensor)} B aligned{'' if tensor.is_contiguous() else ', strided ' + str(tensor.stride())}"


@dataclass
class Op:
    name: str
    args: list[torch.Tensor]
    output: torch.Tensor | None
    weights: list[bool]  # per tensor argument: a parameter of the model (not an activation)


def _tensor_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    return [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]


class _Recorder(TorchFunctionMode):
    """Keeps every traced op of the resident run (parameters by reference, activations cloned)."""

    def __init__(self, weight_pointers: set[int]) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.weight_pointers = weight_pointers

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        name = TRACED.get(func)
        if name is not None:
            tensors = _tensor_args(args, kwargs)
            weights = [t.data_ptr() in self.weight_pointers for t in tensors]
            self.ops.append(Op(name, [t if w else t.detach().clone() for t, w in zip(tensors, weights)],
                               output.detach().clone() if isinstance(output, torch.Tensor) else None, weights))
        return output


class _Comparer(TorchFunctionMode):
    """Compares the peer's traced ops with the resident's as they run; keeps the first difference."""

    def __init__(self, reference: list[Op]) -> None:
        super().__init__()
        self.reference = reference
        self.index = 0
        self.finding: str | None = None

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        name = TRACED.get(func)
        if name is None or self.finding is not None:
            return output
        if self.index >= len(self.reference):
            self.finding = f"the peer runs more traced ops than resident ({name} at op {self.index})"
            return output
        self.finding = _compare(self.index, self.reference[self.index], name, _tensor_args(args, kwargs), output)
        self.index += 1
        return output


def _compare(index: int, want: Op, name: str, tensors: list[torch.Tensor], output: Any) -> str | None:
    where = f"op {index} ({name})"
    if name != want.name or len(tensors) != len(want.args):
        return f"{where}: resident runs {want.name} there; the peer takes another code path"
    for position, (mine, theirs, weight) in enumerate(zip(tensors, want.args, want.weights)):
        if mine.dtype != theirs.dtype or mine.shape != theirs.shape:
            return f"{where}: argument {position} is {mine.dtype} {tuple(mine.shape)}, resident's {theirs.dtype} " \
                   f"{tuple(theirs.shape)} (a cast)"
        if not torch.equal(mine, theirs):
            if weight:
                return f"{where}: a weight holds other values than the resident's when the op reads it " \
                       f"(argument {position}: a cast or a copy still in flight)"
            return f"{where}: an input already differs while every traced op before matched (an untraced op in " \
                   "between, elementwise or a cast, computed differently)"
    if isinstance(output, torch.Tensor) and want.output is not None and not torch.equal(output, want.output):
        layouts = "; ".join(f"arg {i}: {_layout(mine)} vs resident {_layout(theirs)}"
                            for i, (mine, theirs) in enumerate(zip(tensors, want.args)) if _layout(mine) != _layout(theirs))
        return f"{where}: identical inputs and weights, different output: another kernel ran" + \
               (f" ({layouts})" if layouts else " (same pointer alignment and layout)")
    return None


def first_difference(resident: torch.nn.Module, run_resident: Callable[[], Any], run_peer: Callable[[], Any]) -> str:
    """One clause: where and why the peer's forward parts from the resident's."""
    pointers = {param.data_ptr() for param in resident.parameters()}
    recorder = _Recorder(pointers)
    with torch.inference_mode(), recorder:
        run_resident()
    comparer = _Comparer(recorder.ops)
    with torch.inference_mode(), comparer:
        run_peer()
    if comparer.finding is not None:
        return comparer.finding
    if comparer.index < len(recorder.ops):
        return f"the peer runs fewer traced ops ({comparer.index} of {len(recorder.ops)})"
    return "every traced op matched; the difference is in an untraced op after the last one"


__all__ = ["alignment", "first_difference", "numerics_settings", "restore_settings", "settings_changed"]
