"""The models section's explanation of a peer that is not bit-equal (benchmarks/peer_diff.py): the first traced
op where the peer's forward parts from the resident's, and torch's numerics switches."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import peer_diff
from tests._models import make_pair


class Scaled(nn.Module):
    """linear(x * scale): the scale is an untraced elementwise op."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(8, 8), requires_grad=False)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.weight) * self.scale, self.weight)


def test_a_weight_with_other_values_is_named_at_its_op() -> None:
    model, reference = make_pair(3)
    with torch.no_grad():
        model.blocks[1].qkv.weight[0, 0] += 1.0
    x = torch.randn(2, 3, 16)
    why = peer_diff.first_difference(reference, lambda: reference(x), lambda: model(x))
    assert why.startswith("op ") and "(linear): a weight holds other values than the resident's when the op reads " \
                                     "it (argument 1: a cast or a copy still in flight)" in why


def test_a_cast_weight_is_named_as_a_cast() -> None:
    reference = Scaled()
    peer = copy.deepcopy(reference).double()
    x = torch.randn(2, 8)
    why = peer_diff.first_difference(reference, lambda: reference(x), lambda: peer(x.double()))
    assert why == "op 0 (linear): argument 0 is torch.float64 (2, 8), resident's torch.float32 (2, 8) (a cast)"


def test_an_untraced_op_that_differs_shows_as_a_differing_input() -> None:
    reference = Scaled()
    peer = copy.deepcopy(reference)
    peer.scale = 1.5
    x = torch.randn(2, 8)
    why = peer_diff.first_difference(reference, lambda: reference(x), lambda: peer(x))
    assert why == ("op 1 (linear): an input already differs while every traced op before matched (an untraced op in "
                   "between, elementwise or a cast, computed differently)")


def test_identical_arguments_with_another_output_is_another_kernel() -> None:
    weight = torch.randn(4, 4)
    op = peer_diff.Op("linear", [torch.ones(2, 4), weight], torch.zeros(2, 4), [False, True])
    why = peer_diff._compare(3, op, "linear", [torch.ones(2, 4), weight.clone()], torch.ones(2, 4))
    assert why is not None and why.startswith("op 3 (linear): identical inputs and weights, different output: "
                                              "another kernel ran")


def test_another_code_path_and_a_shorter_run_are_named() -> None:
    op = peer_diff.Op("linear", [torch.ones(2)], torch.ones(2), [False])
    assert peer_diff._compare(0, op, "scaled_dot_product_attention", [torch.ones(2)], torch.ones(2)) == (
        "op 0 (scaled_dot_product_attention): resident runs linear there; the peer takes another code path")
    reference = Scaled()
    x = torch.randn(2, 8)
    assert peer_diff.first_difference(reference, lambda: reference(x), lambda: F.linear(x, reference.weight)) == (
        "the peer runs fewer traced ops (1 of 2)")


def test_alignment_is_the_largest_power_of_two_up_to_256() -> None:
    buffer = torch.empty(1024, dtype=torch.uint8)
    base = peer_diff.alignment(buffer)
    assert base >= 64  # torch's host allocations are at least 64-byte aligned
    assert peer_diff.alignment(buffer[32:]) == 32 and peer_diff.alignment(buffer[1:]) == 1


def test_changed_numerics_switches_are_named_and_put_back() -> None:
    before = peer_diff.numerics_settings()
    try:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = \
            not before["matmul.allow_bf16_reduced_precision_reduction"]
        changed = peer_diff.settings_changed(before, peer_diff.numerics_settings())
        assert changed == (f"matmul.allow_bf16_reduced_precision_reduction "
                           f"{before['matmul.allow_bf16_reduced_precision_reduction']} -> "
                           f"{not before['matmul.allow_bf16_reduced_precision_reduction']}")
    finally:
        peer_diff.restore_settings(before)
    assert peer_diff.numerics_settings() == before
    assert peer_diff.settings_changed(before, peer_diff.numerics_settings()) is None


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_restoring_keeps_the_float32_precision_and_tf32_together(precision: str) -> None:
    before = peer_diff.numerics_settings()
    try:
        torch.set_float32_matmul_precision(precision)
        wanted = peer_diff.numerics_settings()
        torch.set_float32_matmul_precision("medium")
        peer_diff.restore_settings(wanted)
        assert peer_diff.numerics_settings() == wanted
    finally:
        peer_diff.restore_settings(before)
