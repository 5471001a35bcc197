"""Property-based equivalence: random module trees offloaded by both backends, bit for bit.

Hypothesis draws a model (tests/_trees.py: 1-7 blocks, each a random nesting of Linear / LayerNorm /
channels_last Conv2d / bags of fp32, bf16, fp16, fp8 and int8 parameters, transposed, zero-size and
scalar ones, int8 and bool buffers) and the offload settings (prefetch depth 0-3, resident blocks
0..L, cyclic on/off, 1-4 steps). For both backends, on the CPU (the real C++ engine with the host as its
device for "ext") and, with the ``cuda`` marker, on the GPU against the resident model on that GPU:

- every step's output equals the resident model's with ``torch.equal`` (the output folds an exact
  checksum of every parameter and buffer, so no byte can be wrong unnoticed);
- between steps every offloaded parameter is a placeholder and no engine slot is in use;
- after ``disable_layerwise_offload`` every parameter and buffer equals its original bitwise, with
  the same dtype, shape and strides, no hook is left, and the engine's pool holds no bytes.

Tied parameters across blocks must be refused with "is the same tensor as" whenever one side would be
offloaded, leaving the model untouched; tied within one block, or between resident blocks, they work.

Runs are reproducible (``derandomize=True``, no example database). How many examples ran, and how many
parameter bytes were compared, is written to ``fastoffload_property_counts.json`` in the temp directory
and checked by the last test of this file.
"""
from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastoffload_ext as fo

from ._trees import TreeModel, TreeSpec, features, has_hooks, inputs, mismatches, snapshot, snapshot_bytes, trees

BACKENDS = ("ext", "python")
EQUIVALENCE_EXAMPLES = 300
CUDA_EQUIVALENCE_EXAMPLES = 100
TIE_EXAMPLES = 60
COUNTS_FILE = Path(tempfile.gettempdir()) / "fastoffload_property_counts.json"

PROPERTY_SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Filled by the properties below, checked by test_every_property_ran_all_its_examples.
COUNTS: dict[str, int] = {}


def _count(key: str, amount: int = 1) -> None:
    COUNTS[key] = COUNTS.get(key, 0) + amount
    COUNTS_FILE.write_text(json.dumps(COUNTS, indent=2, sort_keys=True))


def _run_steps(model: torch.nn.Module, xs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with torch.no_grad():
        return [model(x) for x in xs]


def _assert_between_steps(model: TreeModel, group: fo.LayerwiseOffloadGroup, resident: int,
                          original: dict) -> None:
    for i, block in enumerate(model.blocks):
        if i < resident:
            assert not has_hooks(block), f"resident block {i} got a hook"
            assert not mismatches(block, {k.split(".", 2)[2]: v for k, v in original.items()
                                          if k.startswith(f"blocks.{i}.")})
        else:
            # Placeholders: empty, same rank and dtype.
            for name, p in block.named_parameters():
                want_dtype, want_shape = original[f"blocks.{i}.{name}"][:2]
                assert p.numel() == 0 and p.dtype == want_dtype and p.dim() == max(len(want_shape), 1), name
    if group.engine is not None:
        engine = group.engine
        states = [engine.slot_state(s) for s in range(engine.num_slots)]
        assert "in_use" not in states, states


@settings(max_examples=EQUIVALENCE_EXAMPLES, **PROPERTY_SETTINGS)
@given(spec=trees(), depth=st.sampled_from(range(4)), cyclic=st.booleans(), steps=st.sampled_from(range(1, 5)),
       data=st.data())
def test_random_trees_are_bit_exact_and_restored(spec: TreeSpec, depth: int, cyclic: bool, steps: int,
                                                 data: st.DataObject) -> None:
    resident = data.draw(st.sampled_from(range(len(spec.blocks) + 1)), label="resident_blocks")
    _check_equivalence(spec, depth, cyclic, steps, resident, "cpu", "equivalence")


@pytest.mark.cuda
@settings(max_examples=CUDA_EQUIVALENCE_EXAMPLES, **PROPERTY_SETTINGS)
@given(spec=trees(), depth=st.sampled_from(range(4)), cyclic=st.booleans(), steps=st.sampled_from(range(1, 5)),
       data=st.data())
def test_random_trees_are_bit_exact_and_restored_on_cuda(spec: TreeSpec, depth: int, cyclic: bool, steps: int,
                                                         data: st.DataObject) -> None:
    """The same property with the GPU as the device: copies, events and slots for real; the reference is
    the resident model on the same GPU."""
    resident = data.draw(st.sampled_from(range(len(spec.blocks) + 1)), label="resident_blocks")
    _check_equivalence(spec, depth, cyclic, steps, resident, "cuda", "equivalence_cuda")


def _check_equivalence(spec: TreeSpec, depth: int, cyclic: bool, steps: int, resident: int, device: str,
                       key: str) -> None:
    pristine = TreeModel(spec)
    original = snapshot(pristine)
    xs = [x.to(device) for x in inputs(spec.seed, steps)]
    want = _run_steps(copy.deepcopy(pristine).to(device), xs)
    for backend in BACKENDS:
        model = copy.deepcopy(pristine)
        group = fo.enable_layerwise_offload(model, device=device, backend=backend, prefetch_depth=depth,
                                            resident_blocks=resident, cyclic=cyclic)
        assert group is not None and group.backend == backend
        assert len(group.states) == len(spec.blocks) - resident
        _assert_between_steps(model, group, resident, original)
        with torch.no_grad():
            for step, (x, (want_x, want_acc)) in enumerate(zip(xs, want)):
                got_x, got_acc = model(x)
                assert torch.equal(got_acc, want_acc), (backend, step, "checksums")
                assert torch.equal(got_x, want_x), (backend, step, "activation")
                _assert_between_steps(model, group, resident, original)
        pool = group.engine.pool if group.engine is not None else None
        fo.disable_layerwise_offload(model, device=device)
        assert fo.get_offload_group(model) is None
        assert not any(has_hooks(block) for block in model.blocks)
        assert mismatches(model, original) == [], backend
        assert all(p.device.type == device for p in model.parameters())
        if pool is not None:
            stats = pool.stats()
            assert (stats["in_use_bytes"], stats["allocation_count"], stats["reserved_bytes"]) == (0, 0, 0), stats
            assert group.engine.stats()["slot_bytes"] == 0
        else:
            assert all(not s.cpu_named_parameters and not s.gpu_named_parameters for s in group.states)
        # The restored model is an ordinary model again.
        got_x, got_acc = _run_steps(model, xs[:1])[0]
        assert torch.equal(got_x, want[0][0]) and torch.equal(got_acc, want[0][1])
        _count(f"{key}.{backend}.cases")
        _count(f"{key}.{backend}.steps", steps)
        _count(f"{key}.{backend}.param_bytes_compared", snapshot_bytes(original, model))
        _count(f"{key}.{backend}.offloaded_blocks", len(group.states))
    _count(f"{key}.examples")
    if device == "cpu":
        for feature in features(pristine, spec, depth=depth, resident=resident, cyclic=cyclic, steps=steps):
            _count(f"{key}.feature.{feature}")


@settings(max_examples=TIE_EXAMPLES, **PROPERTY_SETTINGS)
@given(spec=trees(min_blocks=2, max_blocks=5), data=st.data())
def test_tied_parameters_across_blocks_are_refused(spec: TreeSpec, data: st.DataObject) -> None:
    n = len(spec.blocks)
    source = data.draw(st.sampled_from(range(n)), label="source block")
    target = data.draw(st.sampled_from(range(n)), label="target block")  # == source: tied within one block
    resident = data.draw(st.sampled_from(range(n + 1)), label="resident_blocks")
    backend = data.draw(st.sampled_from(BACKENDS), label="backend")
    model = TreeModel(spec)
    shared = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(spec.seed)))
    model.blocks[source].register_parameter("shared", shared)
    model.blocks[target].register_parameter("shared_again", shared)
    reference = copy.deepcopy(model)
    original = snapshot(model)
    (x,) = inputs(spec.seed, 1)
    (want,) = _run_steps(reference, [x])

    refused = source != target and max(source, target) >= resident
    if refused:
        with pytest.raises(ValueError, match="is the same tensor as") as raised:
            fo.enable_layerwise_offload(model, device="cpu", backend=backend, resident_blocks=resident)
        # Both places are named, so the user can find the tie.
        message = str(raised.value)
        assert f"blocks.{source}.shared" in message and f"blocks.{target}.shared_again" in message, message
        assert fo.get_offload_group(model) is None
        assert not any(has_hooks(block) for block in model.blocks)
        assert mismatches(model, original) == []
        assert model.blocks[target].shared_again is model.blocks[source].shared  # still tied
        _count("ties.refused")
        _count("ties.param_bytes_compared", snapshot_bytes(original, model))
    else:
        group = fo.enable_layerwise_offload(model, device="cpu", backend=backend, resident_blocks=resident)
        assert group is not None
        with torch.no_grad():
            for _ in range(2):
                got = model(x)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        fo.disable_layerwise_offload(model)
        assert mismatches(model, original) == []
        assert model.blocks[target].shared_again is model.blocks[source].shared
        _count("ties.accepted")
        _count("ties.param_bytes_compared", snapshot_bytes(original, model))
    _count("ties.examples")


# What the equivalence property must have drawn at least once (tests/_trees.py: features).
REQUIRED_FEATURES = ("blocks=1", "blocks=7", "depth=0", "depth=3", "resident=0", "resident=all", "resident=some",
                     "cyclic=off", "steps=4", "linear.transposed", "conv.channels_last", "param.fp8",
                     "param.int8", "param.bf16", "param.fp16", "param.transposed", "param.channels_last",
                     "param.zero_size", "param.scalar", "buffer.bool", "buffer.int8", "block.no_params",
                     "nesting=3")


def test_every_property_ran_all_its_examples() -> None:
    """Hypothesis ran every example it was asked for (derandomized: the same ones on every run)."""
    if "equivalence.examples" not in COUNTS and "ties.examples" not in COUNTS:
        pytest.skip("the properties of this file did not run in this session")
    if "equivalence.examples" in COUNTS:
        assert COUNTS["equivalence.examples"] == EQUIVALENCE_EXAMPLES
        for backend in BACKENDS:
            assert COUNTS[f"equivalence.{backend}.cases"] == EQUIVALENCE_EXAMPLES
            assert COUNTS[f"equivalence.{backend}.param_bytes_compared"] > 0
        missing = [f for f in REQUIRED_FEATURES if f"equivalence.feature.{f}" not in COUNTS]
        assert missing == [], f"the strategy never drew {missing}"
    if "equivalence_cuda.examples" in COUNTS:
        assert COUNTS["equivalence_cuda.examples"] == CUDA_EQUIVALENCE_EXAMPLES
        assert all(COUNTS[f"equivalence_cuda.{backend}.param_bytes_compared"] > 0 for backend in BACKENDS)
    if "ties.examples" in COUNTS:
        assert COUNTS["ties.examples"] == TIE_EXAMPLES
        # The draw covers both outcomes.
        assert COUNTS.get("ties.refused", 0) > 0 and COUNTS.get("ties.accepted", 0) > 0
