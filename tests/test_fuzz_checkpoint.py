"""A differential stateful fuzz of offload built from a checkpoint (``weights=``) against the resident model.

The resident twin is built with seeded weights and written to a safetensors file; the offloaded model is
built on the meta device and enabled with ``weights=`` (often with its second list in the ring too,
``block_lists="all"``, and now and then running its blocks in a shuffled order, which the disk tier's read-ahead
then follows) under a random ``host_budget`` (the blocks beyond
it stay on disk, read every step through a staging ring of random size), random prefetch depth, wrap-around,
read mode and ``compress`` (a compressed disk tier reads a spill file). A seeded driver then interleaves
forwards in every grad mode with faults and Ctrl-C inside a block, blocks called out of order, edits inside
``mutate_params_scope`` and partial ``load_state_dict`` calls (each either applies, as on the twin, or
refuses and changes nothing: a disk-tier block has no host copy to rebuild), ``state_dict()`` and
``stats()``. After each step the outputs and the state dict equal the twin's bit for bit and the engine is
idle. At the end the model is disabled to the host (every parameter the twin's) or dropped while offloaded,
and then freed with its last reference, its spill file removed.

``FASTOFFLOAD_FUZZ_SEEDS``, ``FASTOFFLOAD_FUZZ_STEPS`` and ``FASTOFFLOAD_FUZZ_FIRST_SEED`` run it longer, as
for ``test_fuzz_backends.py``.
"""
from __future__ import annotations

import contextlib
import gc
import os
import random
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import fastoffload_ext as fo
from fastoffload_ext.errors import OffloadConfigError, OffloadStateError
from fastoffload_ext.planning import module_packed_bytes
from fastoffload_ext.planning.tiers import STAGING_SLACK, region_bytes
from fastoffload_ext.storage import DiskOptions

from ._models import offload_hook
from .test_fuzz_backends import D, Fault, FuzzModel, Interrupt, run_order, uncounted_step

SEEDS = int(os.environ.get("FASTOFFLOAD_FUZZ_SEEDS", "16"))
STEPS = int(os.environ.get("FASTOFFLOAD_FUZZ_STEPS", "40"))
FIRST_SEED = int(os.environ.get("FASTOFFLOAD_FUZZ_FIRST_SEED", "0"))

# Kinds a checkpoint can hold as they are: no tied tensors (safetensors refuses them) and no transposed
# weight (weights= refuses a layout other than the checkpoint's row-major one, with its reason). "wide"
# blocks are big beside the staging ring's per-buffer slack, so that a budget can leave some on disk.
KINDS = ["linear", "coded", "wide", "wide", "wide", "norms", "empty"]
REFUSED = (OffloadConfigError, OffloadStateError, RuntimeError)


def _error_text(error: BaseException) -> str:
    return str(error).split("\n")[0][:120]


class CheckpointDriver:
    def __init__(self, seed: int, folder: Path) -> None:
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.kinds = [self.rng.choice(KINDS) for _ in range(self.rng.randint(3, 10))]
        self.tail = [self.rng.choice(KINDS) for _ in range(self.rng.choice([0, 1, 2]))]
        order = run_order(self.rng, len(self.kinds) + len(self.tail))  # the disk tier reads ahead in it
        torch.manual_seed(self.rng.randrange(1 << 30))
        self.twin = FuzzModel(self.kinds, None, self.tail, order).requires_grad_(False)
        self.path = folder / "model.safetensors"
        save_file({k: v.contiguous() for k, v in self.twin.state_dict().items()}, str(self.path))
        with torch.device("meta"):
            self.model = FuzzModel(self.kinds, None, self.tail, order).requires_grad_(False)
        self.sizes = [module_packed_bytes(block) for block in self.twin.chain]  # both lists, in the order they run
        self.log: list[str] = [f"kinds={self.kinds}, tail={self.tail}, run order={order}, block bytes={self.sizes}"]
        self.spill: str | None = None

    @property
    def group(self) -> fo.LayerwiseOffloadGroup | None:
        return fo.get_offload_group(self.model)

    def x(self) -> torch.Tensor:
        return torch.randn(2, 3, D, generator=self.gen)

    # ---- checks -------------------------------------------------------------------------------

    def check(self) -> None:
        group = self.group
        if group is not None:
            for state in group.states:
                block = state.module_ref
                if offload_hook(block).state_dict_hooks._loading:
                    continue
                assert all(p.numel() == 0 for p in block.parameters()), "a block holds its weights between steps"
            if group.engine is not None:
                slots = [group.engine.slot_state(s) for s in range(group.engine.num_slots)]
                assert "in_use" not in slots, slots
        got, want = self.model.state_dict(), self.twin.state_dict()
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key

    # ---- operations ---------------------------------------------------------------------------

    def enable(self) -> bool:
        rng = self.rng
        # Often the tail list too (block_lists="all"): its blocks are packed from the file and tiered with the rest.
        all_lists = bool(self.tail) and rng.random() < 0.5
        ring = self.sizes if all_lists else self.sizes[:len(self.kinds)]
        largest = max(ring)
        staging = rng.choice([1, 1, 2, 3])
        budget: Any = rng.choice([None, "budget", "budget", "budget"])
        if budget == "budget":  # the staging ring, and room for none, some or all of the blocks beside it
            regions = sum(region_bytes(size) for size in ring)
            share = rng.choice([0.0, 0.3, 0.6, 1.1]) * rng.random()
            budget = staging * (largest + STAGING_SLACK) + int(share * regions)
        kwargs: dict[str, Any] = dict(device="cpu", weights=str(self.path), host_budget=budget,
                                      cyclic=rng.random() < 0.7, prefetch_depth=rng.randint(1, 3),
                                      disk_options=DiskOptions(staging_buffers=staging,
                                                               read_mode=rng.choice(["auto", "buffered"]),
                                                               read_threads=rng.randint(1, 3),
                                                               chunk_bytes=rng.choice([4096, 8 << 20])))
        if all_lists:
            kwargs["block_lists"] = "all"
        if rng.random() < 0.3:
            kwargs["resident_blocks"] = rng.randint(0, len(ring))
        elif rng.random() < 0.3:  # the planner picks what stays on the device; with a disk tier it counts the reads
            kwargs["device_budget"] = int(largest * rng.uniform(1.5, len(ring) + 2))
        if rng.random() < 0.4:
            kwargs["compress"] = rng.choice([True, "auto"])
        self.log.append(f"enable({ {k: v for k, v in kwargs.items() if k != 'weights'} })")
        try:
            group = fo.enable_layerwise_offload(self.model, **kwargs)
        except OffloadConfigError as error:
            self.log.append(f"  refused: {_error_text(error)}")
            assert self.group is None
            assert all(p.device.type == "meta" for p in self.model.parameters()), "a refused enable changed the model"
            return False
        assert group is not None
        # Every block resident (an int covering them all): read onto the device at enable, no engine.
        self.spill = (group.engine.spill_path or None) if group.engine is not None else None
        disk = [i for i, state in enumerate(group.states) if state.on_disk]
        self.log.append(f"  disk tier: {disk}, spill={bool(self.spill)}")
        return True

    def op_forward(self) -> None:
        mode = self.rng.choice(["no_grad", "inference_mode", "grad"])
        chain = len(self.model.chain)
        fault_at = self.rng.randrange(chain) if self.rng.random() < 0.2 else None
        fault = self.rng.choice([Fault, Interrupt])
        x = self.x()
        self.log.append(f"forward({mode}, fault={fault.__name__ if fault_at is not None else None}@{fault_at})")
        results = []
        for model in (self.model, self.twin):
            if fault_at is not None:
                model.chain[fault_at].fault = fault
            try:
                results.append(("ok", self._run(model, x, mode)))
            except (Fault, Interrupt) as error:
                results.append(("raised", type(error)))
            finally:
                if fault_at is not None:
                    model.chain[fault_at].fault = None
        (got_kind, got), (want_kind, want) = results
        assert got_kind == want_kind, results
        if got_kind == "ok":
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        else:
            assert got is want

    @staticmethod
    def _run(model: nn.Module, x: torch.Tensor, mode: str) -> tuple[torch.Tensor, ...]:
        if mode == "no_grad":
            with torch.no_grad():
                return (model(x),)
        if mode == "inference_mode":
            with torch.inference_mode():
                return (model(x).clone(),)
        x = x.clone().requires_grad_(True)  # gradients to the input through frozen offloaded blocks
        out = model(x)
        out.sum().backward()
        return out.detach(), x.grad

    def op_block_calls(self) -> None:
        n = len(self.model.chain)
        order = [self.rng.randrange(n) for _ in range(self.rng.randint(1, 2 * n))]
        self.log.append(f"block_calls({order})")
        x = self.x()
        with torch.no_grad():
            got, want = x, x
            for i in order:
                got, want = self.model.chain[i](got), self.twin.chain[i](want)
                assert torch.equal(got, want), i

    def op_mutate(self) -> None:
        index = self.rng.randrange(len(self.model.chain))
        names = [name for name, _ in self.twin.chain[index].named_parameters()]
        if not names:
            return
        name, factor = self.rng.choice(names), self.rng.choice([2.0, -0.5])
        raising = self.rng.choice([None, None, Fault])
        self.log.append(f"mutate(block {index}, {name} *= {factor}, raising={raising and raising.__name__})")
        applied = False
        if all(state.module_ref is not self.model.chain[index] for state in self.group.states):
            for model in (self.model, self.twin):  # a resident block: the caller edits it as any module
                with torch.no_grad():
                    model.chain[index].get_parameter(name).mul_(factor)
            return
        hook = offload_hook(self.model.chain[index])
        try:
            with hook.mutate_params_scope():
                with torch.no_grad():
                    self.model.chain[index].get_parameter(name).mul_(factor)
                applied = True
                if raising is not None:
                    raise raising("conversion failed")
        except Fault:
            pass
        except REFUSED as error:
            assert not applied, error
            assert "disk tier" in str(error), error
            self.log.append(f"  refused: {_error_text(error)}")
        if applied:
            with torch.no_grad():
                self.twin.chain[index].get_parameter(name).mul_(factor)

    def op_load(self) -> None:
        keys = [k for k in self.twin.state_dict() if self.rng.random() < 0.4]
        source = {k: torch.randn(v.shape, generator=self.gen).to(v.dtype) if v.is_floating_point() else v.clone()
                  for k, v in self.twin.state_dict().items() if k in keys}
        self.log.append(f"load({len(source)} keys)")
        try:
            self.model.load_state_dict(dict(source), strict=False)
        except REFUSED as error:
            self.log.append(f"  refused: {_error_text(error)}")
            return  # check() then finds that nothing changed
        self.twin.load_state_dict(dict(source), strict=False)

    def op_stats(self) -> None:
        group = self.group
        stats = group.stats()
        self.log.append("stats()")
        assert stats["offloaded_blocks"] == len(group.states)
        disk = [s for s in group.states if getattr(s, "on_disk", False)]  # a re-plan applies it from host memory
        if disk:
            assert group.engine.disk_stats()["staging_count"] >= 1
            assert stats["disk_blocks"] == len(disk)

    def op_calibrate(self) -> None:
        """A calibration step, and the re-plan it makes for a planned group: refused where the new layout
        would need a block from disk in host memory, and then nothing changes."""
        group = self.group
        self.log.append("calibrate()")
        with uncounted_step(self.model, self.x()) as step:
            try:
                group.calibrate(step, repeats=1)
            except (OffloadConfigError, OffloadStateError) as error:
                self.log.append(f"  refused: {_error_text(error)}")
                assert self.group is group

    OPS = [("op_forward", 6), ("op_block_calls", 2), ("op_mutate", 2), ("op_load", 2), ("op_stats", 1),
           ("op_calibrate", 1)]
    # Operations a caller may run inside a grad mode of its own: they must still leave ordinary tensors behind.
    MODED_OPS = ("enable", "op_mutate", "op_load", "disable")

    def moded(self, op: str) -> contextlib.AbstractContextManager[Any]:
        mode = self.rng.choice(["plain", "plain", "no_grad", "inference_mode"]) if op in self.MODED_OPS else "plain"
        if mode == "plain":
            return contextlib.nullcontext()
        self.log.append(f"under {mode}:")
        return getattr(torch, mode)()

    def check_ordinary(self) -> None:
        inference = [name for name, p in self.model.named_parameters() if p.is_inference()]
        assert not inference, f"inference tensors bound to {inference}"

    def run(self, steps: int) -> None:
        try:
            for _ in range(4):  # each refusal is checked; a seed rarely has four
                with self.moded("enable"):
                    enabled = self.enable()
                if enabled:
                    break
            else:
                return
            self.check_ordinary()
            names, weights = zip(*self.OPS)
            for _ in range(steps):
                op = self.rng.choices(names, weights)[0]
                with self.moded(op):
                    getattr(self, op)()
                self.check_ordinary()
                self.check()
            gc.collect()
            gc.disable()
            group = self.group
            refs = [weakref.ref(self.model), weakref.ref(group)]
            refs += [weakref.ref(group.engine)] if group.engine is not None else []
            group = None
            if self.rng.random() < 0.5:
                self.log.append("disable(cpu)")
                with self.moded("disable"):
                    fo.disable_layerwise_offload(self.model, device="cpu")
                self.check_ordinary()
                for (name, p), q in zip(self.model.named_parameters(), self.twin.parameters()):
                    assert p.device.type == "cpu" and torch.equal(p, q), name
            else:
                self.log.append("drop while offloaded")
            with torch.no_grad():
                x = self.x()
                assert torch.equal(self.model(x), self.twin(x))
            del self.model
            assert [ref() is None for ref in refs] == [True] * len(refs)
            assert self.spill is None or not Path(self.spill).exists(), f"spill file {self.spill} left behind"
        except BaseException:
            print("\n".join(self.log))
            raise
        finally:
            gc.enable()


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + SEEDS))
def test_fuzz_checkpoint_offload_against_the_resident_model(seed: int, tmp_path: Path) -> None:
    CheckpointDriver(seed, tmp_path).run(STEPS)
