"""A differential stateful fuzz of both backends against the resident model.

A seeded random driver interleaves what users do to an offloaded model (enable with random layouts,
forwards in every grad mode, faults and Ctrl-C inside a block, ``mutate_params_scope`` edits that nest or
raise, loads strict and partial, ``state_dict()``, ``requires_grad_``, ``stats()``, re-plans from a fixed
cost table, disable and enable again) on a model and on a resident twin given the same edits. After
each step the offloaded model's outputs and state dict equal the twin's bit for bit; after disable
every parameter holds its exact value, and the engine is idle between steps. At the end the model, dropped
while offloaded or after a disable, is freed with its last reference (the cycle collector switched off).

The models vary: 1 to 6 blocks of mixed kinds (a Linear with a buffer that counts calls, a weight tied
inside the block, a block with no parameters, LayerNorm-heavy blocks that leave a view of a weight for the
model to read after they ran, a bf16 weight big enough for the codec), weights tied across two blocks (refused unless both stay resident), parameters outside the block
list, and often a second list that runs after the first; a quarter of them run their blocks in a shuffled
order (the run-order watch then rewires the prefetches in the first forward), and half of them run each block
under activation checkpointing in grad mode (non-reentrant or reentrant: backward runs the blocks again, last
first). Enable picks the lists (FastVideo's first one,
``"all"``, the second alone, or both in another order than they run) and, now and then, ``compress``
(True or "auto"; the python backend refuses True). ``FASTOFFLOAD_FUZZ_SEEDS``
(a count) and ``FASTOFFLOAD_FUZZ_STEPS`` run it longer than CI does (the defaults take ~10-20 s on one core);
``FASTOFFLOAD_FUZZ_FIRST_SEED`` starts the seeds past the ones an earlier run covered.
"""
from __future__ import annotations

import contextlib
import gc
import os
import random
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import fastoffload_ext as fo
from fastoffload_ext.errors import OffloadConfigError
from fastoffload_ext.planning import BlockCosts, module_packed_bytes

from ._models import offload_hook

D = 8
CODED_WIDTH = 320  # a (D, 320) bf16 weight is 5 KiB, over the codec's 4 KiB minimum
WIDE_WIDTH = 4096  # 64 KiB: big beside the pinned pool's per-region slack (the checkpoint fuzz's disk tier)
BACKENDS = ["ext", "python"]
SEEDS = int(os.environ.get("FASTOFFLOAD_FUZZ_SEEDS", "48"))
STEPS = int(os.environ.get("FASTOFFLOAD_FUZZ_STEPS", "50"))
FIRST_SEED = int(os.environ.get("FASTOFFLOAD_FUZZ_FIRST_SEED", "0"))


class Fault(RuntimeError):
    pass


class Interrupt(KeyboardInterrupt):
    pass


class FuzzBlock(nn.Module):
    """One block of the kind ``kind``; ``fault`` (a plain attribute, set on both twins) makes its forward raise."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fault: type[BaseException] | None = None
        self.counting = True
        self.register_buffer("shift", torch.randn(D))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        if kind == "linear":
            self.lin = nn.Linear(D, D)
            self.norm = nn.LayerNorm(D)
        elif kind == "tied":  # one weight under two names inside the block
            self.a = nn.Linear(D, D)
            self.b = nn.Linear(D, D, bias=False)
            self.b.weight = self.a.weight
        elif kind == "odd":  # a scalar, a transposed weight, an empty weight and mixed dtypes in one block
            self.scalar = nn.Parameter(torch.randn(()))
            self.wt = nn.Parameter(torch.randn(D, D).t())
            self.none = nn.Parameter(torch.randn(0, D))
            self.f16 = nn.Parameter(torch.randn(D).to(torch.float16))
            self.f64 = nn.Parameter(torch.randn(D).to(torch.float64))
        elif kind == "norms":
            self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(4))
            self.gate = nn.Parameter(torch.randn(D))
        elif kind in ("coded", "wide"):  # bf16 and over the codec's minimum size: compress=True/"auto" code it
            width = CODED_WIDTH if kind == "coded" else WIDE_WIDTH
            self.w = nn.Parameter(torch.randn(D, width).to(torch.bfloat16))
        # "empty": no parameter at all, only buffers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fault is not None:
            raise self.fault("injected fault")
        if self.counting:
            with torch.no_grad():
                self.calls.add_(1)
        x = x + self.shift
        if self.kind == "linear":
            x = x + self.lin(self.norm(x))
        elif self.kind == "tied":
            x = F.gelu(self.a(x)) + self.b(x) * 0.5
        elif self.kind == "odd":
            x = (x @ self.wt) * self.scalar + self.f16.float() + self.f64.float() + self.none.sum()
        elif self.kind == "norms":
            for norm in self.norms:
                x = norm(x) * self.gate
            self.kept = self.gate[: D // 2]  # a view of a weight that the model reads after the block ran
        elif self.kind in ("coded", "wide"):
            x = x + (x @ self.w.float()).unflatten(-1, (self.w.shape[1] // D, D)).sum(-2) * 0.01
        else:
            x = x * 0.5
        return x


class FuzzModel(nn.Module):
    """``blocks`` (FastVideo's rule finds it), then ``tail``, a second list that runs after it (Flux's
    single-stream blocks; often empty), which ``block_lists`` puts in the ring. ``run_order`` (indices into
    ``chain``) makes the forward run the blocks in another order, as Lumina2 and Latte do."""

    def __init__(self, kinds: list[str], tie: tuple[int, int] | None, tail: list[str],
                 run_order: list[int] | None = None, checkpointed: str | None = None) -> None:
        super().__init__()
        self.checkpointed = checkpointed  # None, "non-reentrant" or "reentrant": each block checkpointed in grad mode
        self.proj_in = nn.Linear(D, D)
        self.blocks = nn.ModuleList(FuzzBlock(kind) for kind in kinds)
        self.tail = nn.ModuleList(FuzzBlock(kind) for kind in tail)
        self.scale = nn.Parameter(torch.randn(D))
        self.run_order = run_order
        if tie is not None:  # a Linear weight tied across two blocks
            i, j = tie
            self.blocks[j].lin.weight = self.blocks[i].lin.weight

    @property
    def chain(self) -> list[FuzzBlock]:
        """Every block of both lists, in list order."""
        return [*self.blocks, *self.tail]

    def prefix(self, index: int) -> str:
        """The state-dict prefix of ``chain[index]``."""
        return f"blocks.{index}." if index < len(self.blocks) else f"tail.{index - len(self.blocks)}."

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        chain = self.chain
        for block in chain:  # what a direct block call or a backward pass left there is not this forward's
            block.__dict__.pop("kept", None)
        for index in self.run_order if self.run_order is not None else range(len(chain)):
            if self.checkpointed is not None and torch.is_grad_enabled():
                x = checkpoint(chain[index], x, use_reentrant=self.checkpointed == "reentrant")
            else:
                x = chain[index](x)
        for block in chain:  # views of weights kept past their blocks' release, read now
            kept = block.__dict__.pop("kept", None)
            if kept is not None:
                x = x + kept.sum() * 0.01
        return x * self.scale


KINDS = ["linear", "linear", "tied", "norms", "empty", "odd", "coded"]


def _kinds(rng: random.Random) -> tuple[list[str], tuple[int, int] | None, list[str]]:
    n = rng.randint(1, 6)
    kinds = [rng.choice(KINDS) for _ in range(n)]
    linears = [i for i, k in enumerate(kinds) if k == "linear"]
    tie = tuple(rng.sample(linears, 2)) if len(linears) >= 2 and rng.random() < 0.25 else None
    tail = [rng.choice(KINDS) for _ in range(rng.choice([0, 0, 1, 2, 3]))]
    return kinds, tie, tail  # type: ignore[return-value]


def run_order(rng: random.Random, n: int) -> list[int] | None:
    """Often None (list order); else the blocks shuffled, so the run-order watch rewires the prefetches."""
    if n < 3 or rng.random() < 0.75:
        return None
    order = list(range(n))
    rng.shuffle(order)
    return order


def _pair(rng: random.Random) -> tuple[FuzzModel, FuzzModel]:
    kinds, tie, tail = _kinds(rng)
    seed = rng.randrange(1 << 30)
    order = run_order(rng, len(kinds) + len(tail))
    # From its own generator: the driver's draws, and so what the earlier seeds ran, stay as they were.
    checkpointed = random.Random(seed).choice([None, None, "non-reentrant", "reentrant"])
    torch.manual_seed(seed)
    model = FuzzModel(kinds, tie, tail, order, checkpointed)
    torch.manual_seed(seed)
    twin = FuzzModel(kinds, tie, tail, order, checkpointed)
    return model, twin


@contextlib.contextmanager
def uncounted_step(model: FuzzModel, x: torch.Tensor) -> Iterator[Callable[[], None]]:
    """A no-grad forward of ``model`` on ``x`` to calibrate with, the blocks' call counters off meanwhile (a
    calibration runs it as often as it needs, the twin not at all)."""
    def step() -> None:
        with torch.no_grad():
            model(x)

    for block in model.chain:
        block.counting = False
    try:
        yield step
    finally:
        for block in model.chain:
            block.counting = True


class Driver:
    """One model, its resident twin, and the operations on both."""

    def __init__(self, backend: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.backend = backend
        self.model, self.twin = _pair(self.rng)
        self.model.requires_grad_(False)
        self.twin.requires_grad_(False)
        self.gen = torch.Generator().manual_seed(seed)
        self.log: list[str] = [f"kinds={[b.kind for b in self.model.blocks]}, tail={[b.kind for b in self.model.tail]}, "
                               f"run order={self.model.run_order}"]
        # Packed bytes of each block of the chain as built (a re-plan's cost table; a budget's scale).
        self.block_bytes = [module_packed_bytes(b) for b in self.model.chain]

    # ---- helpers ------------------------------------------------------------------------------

    @property
    def group(self) -> fo.LayerwiseOffloadGroup | None:
        return fo.get_offload_group(self.model)

    def offloaded(self) -> list[int]:
        group = self.group
        if group is None:
            return []
        hooked = {id(s.module_ref) for s in group.states}
        return [i for i, b in enumerate(self.model.chain) if id(b) in hooked]

    def x(self) -> torch.Tensor:
        return torch.randn(2, 3, D, generator=self.gen)

    def check_idle(self) -> None:
        group = self.group
        if group is None:
            return
        for i in self.offloaded():
            if offload_hook(self.model.chain[i]).state_dict_hooks._loading:
                continue  # a load raised inside it: real until its next load, scope or re-plan finishes it
            for name, p in self.model.chain[i].named_parameters():
                assert p.numel() == 0, f"blocks.{i}.{name} holds {tuple(p.shape)} between steps"
        if group.engine is not None:
            slots = [group.engine.slot_state(s) for s in range(group.engine.num_slots)]
            assert "in_use" not in slots, slots
            materialized = [i for i, state in zip(group.offloaded_indices, group.states)
                            if group.engine.is_materialized(state.handle)]
            assert all(offload_hook(group.blocks[i]).state_dict_hooks._loading for i in materialized), materialized

    def check_state_dict(self) -> None:
        got, want = self.model.state_dict(), self.twin.state_dict()
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
            assert torch.equal(got[key], want[key]), key

    def check_params(self) -> None:
        got = dict(self.model.named_parameters(remove_duplicate=False))
        want = dict(self.twin.named_parameters(remove_duplicate=False))
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].shape == want[key].shape and got[key].dtype == want[key].dtype, f"{key}: {got[key]!r}"
            assert torch.equal(got[key], want[key]), key
            assert got[key].requires_grad == want[key].requires_grad, key

    def both(self, fn: Any) -> None:
        fn(self.model)
        fn(self.twin)

    # ---- operations ---------------------------------------------------------------------------

    def op_enable(self) -> None:
        rng = self.rng
        kwargs: dict[str, Any] = dict(device="cpu", backend=self.backend, cyclic=rng.random() < 0.7)
        lists = rng.choices([None, "all", ["tail", "blocks"], ["tail"]], [0.7, 0.15, 0.07, 0.08])[0]
        if lists is not None:
            kwargs["block_lists"] = lists  # ["tail", "blocks"]: a ring in another order than the blocks run
        n = len(self.model.blocks) if lists is None else \
            len(self.model.tail) + (0 if lists == ["tail"] else len(self.model.blocks))
        if rng.random() < 0.25:
            kwargs["compress"] = rng.choice([True, "auto"])  # the python backend refuses True
        choice = rng.random()
        if choice < 0.3:
            kwargs["resident_blocks"] = rng.randint(0, n)
        elif choice < 0.5:
            kwargs["resident_blocks"] = sorted(rng.sample(range(n), rng.randint(0, n)))
        if rng.random() < 0.7:
            kwargs["prefetch_depth"] = rng.randint(0, n + 1)
        if rng.random() < 0.35:
            kwargs["device_budget"] = int(max(self.block_bytes) * rng.uniform(1.5, n + 2))
            if rng.random() < 0.5:
                kwargs.pop("resident_blocks", None)
        replace = self.group is not None
        self.log.append(f"enable({kwargs}, is_replace={replace})")
        before = self.model.state_dict()
        try:
            fo.enable_layerwise_offload(self.model, replace, **kwargs)
        except (OffloadConfigError, ValueError) as error:
            self.log.append(f"  refused: {str(error)[:100]}")
            if self.group is None:
                after = self.model.state_dict()
                assert all(torch.equal(before[k], after[k]) for k in before)
            return

    def op_forward(self) -> None:
        mode = self.rng.choice(["no_grad", "inference_mode", "grad"])
        fault_at = None
        fault: type[BaseException] | None = None
        roll = self.rng.random()
        if roll < 0.2 and len(self.model.chain):
            fault_at = self.rng.randrange(len(self.model.chain))
            fault = self.rng.choice([Fault, Interrupt])
        x = self.x()
        grad_input = mode == "grad" and self.rng.random() < 0.5
        self.log.append(f"forward({mode}, fault={fault and fault.__name__}@{fault_at}, grad_input={grad_input})")
        # Predict the engine's refusal: a grad-recording forward through an offloaded block whose
        # parameters require grad. The twin raises at that block too (before its forward body).
        # Both in the order the forward runs the blocks (the model's run_order, else list order).
        ran = self.model.run_order if self.model.run_order is not None else list(range(len(self.model.chain)))
        refused_at = None
        if mode == "grad":
            offloaded = set(self.offloaded())
            for i in ran:
                if i in offloaded and any(p.requires_grad for p in self.model.chain[i].parameters()):
                    refused_at = i
                    break
        # A reentrant checkpoint runs the forward without grad: the refusal can come only in backward, which runs the
        # block again with grad (and only where the output requires grad), while the twin trains on.
        backward_refusal = refused_at is not None and self.model.checkpointed == "reentrant"
        if backward_refusal:
            refused_at = None
        stop = min([i for i in (fault_at, refused_at) if i is not None], key=ran.index, default=None)
        refused = stop is not None and stop == refused_at
        if stop is not None:
            self.twin.chain[stop].fault = Fault if refused else fault
        if fault_at is not None:
            self.model.chain[fault_at].fault = fault
        try:
            out = self._run(self.model, x, mode, grad_input)
            err = None
        except BaseException as e:  # noqa: BLE001 (Ctrl-C is one of the faults)
            out, err = None, e
        finally:
            if fault_at is not None:
                self.model.chain[fault_at].fault = None
        try:
            want = self._run(self.twin, x, mode, grad_input)
            want_err = None
        except BaseException as e:  # noqa: BLE001
            want, want_err = None, e
        finally:
            if stop is not None:
                self.twin.chain[stop].fault = None
        if want_err is None and backward_refusal and err is not None:
            assert isinstance(err, RuntimeError) and "requires grad, and grad mode is on" in str(err), repr(err)
            with torch.no_grad():  # the twin's backward ran every block again, the refused one stopped midway
                for block, twin_block in zip(self.model.chain, self.twin.chain):
                    twin_block.calls.copy_(block.calls)
        elif want_err is None:
            assert err is None, f"offloaded forward raised {err!r}; resident ran"
            assert torch.equal(out[0], want[0])
            if grad_input:
                assert torch.equal(out[1], want[1])
            for (name, p), q in zip(self.model.named_parameters(), self.twin.parameters()):
                if q.grad is not None or p.grad is not None:
                    assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad), name
        elif refused:
            assert isinstance(err, RuntimeError) and "requires grad, and grad mode is on" in str(err), repr(err)
        else:
            assert type(err) is type(want_err), (err, want_err)
        self.both(lambda m: m.zero_grad(set_to_none=True))
        err = want_err = None  # their tracebacks hold this frame: kept here, a cycle would keep the model alive

    @staticmethod
    def _run(model: nn.Module, x: torch.Tensor, mode: str, grad_input: bool) -> tuple[torch.Tensor, Any]:
        if mode == "no_grad":
            with torch.no_grad():
                return model(x), None
        if mode == "inference_mode":
            with torch.inference_mode():
                return model(x).clone(), None
        x = x.clone().requires_grad_(grad_input)
        out = model(x)
        if out.requires_grad:
            out.sum().backward()
        return out.detach(), x.grad

    def op_mutate(self) -> None:
        offloaded = self.offloaded()
        n = len(self.model.chain)
        index = self.rng.randrange(n)
        params = [name for name, _ in self.twin.chain[index].named_parameters()]
        if not params:
            self.log.append(f"mutate(block {index}): no parameters")
            return
        name = self.rng.choice(params)
        factor = self.rng.choice([2.0, -0.5, 0.25])
        nested = self.rng.random() < 0.3
        raising = self.rng.choice([None, None, Fault, Interrupt])
        self.log.append(f"mutate(block {index} {'offloaded' if index in offloaded else 'resident'}, {name} *= {factor},"
                        f" nested={nested}, raising={raising and raising.__name__})")

        def edit(model: nn.Module) -> None:
            with torch.no_grad():
                model.chain[index].get_parameter(name).mul_(factor)

        edit(self.twin)
        if index not in offloaded:
            edit(self.model)
            return
        hook = offload_hook(self.model.chain[index])
        try:
            with hook.mutate_params_scope():
                if nested:
                    with hook.mutate_params_scope():
                        edit(self.model)
                else:
                    edit(self.model)
                if raising is not None:
                    raise raising("conversion failed")
        except (Fault, Interrupt):
            pass

    def op_edit_outside(self) -> None:
        """An in-place edit of a parameter outside the blocks (the caller's own), or of a resident block's."""
        names = [n for n, _ in self.twin.named_parameters() if not n.startswith(("blocks.", "tail."))]
        resident = set(range(len(self.model.chain))) - set(self.offloaded())
        names += [n for i in sorted(resident) for n, _ in self.twin.named_parameters()
                  if n.startswith(self.twin.prefix(i))]
        name = self.rng.choice(names)
        self.log.append(f"edit({name} += 1)")

        def edit(model: nn.Module) -> None:
            with torch.no_grad():
                model.get_parameter(name).add_(1)

        self.both(edit)

    def op_load(self) -> None:
        keys = list(self.twin.state_dict().keys())
        partial = self.rng.random() < 0.5
        chosen = [k for k in keys if self.rng.random() < 0.5] if partial else keys
        strict = self.rng.random() < 0.5
        extra = self.rng.random() < 0.2
        source = {k: torch.randn(v.shape, generator=self.gen).to(v.dtype) if v.is_floating_point() else v.clone()
                  for k, v in self.twin.state_dict().items() if k in chosen}
        if extra:
            source["blocks.0.unexpected"] = torch.zeros(1)
        self.log.append(f"load(strict={strict}, {len(source)}/{len(keys)} keys, extra={extra})")
        results = []
        for model in (self.model, self.twin):
            try:
                r = model.load_state_dict(dict(source), strict=strict)
                results.append(("ok", sorted(r.missing_keys), sorted(r.unexpected_keys)))
            except RuntimeError as error:
                results.append(("raised", str(error).split("\n")[0]))
        assert results[0] == results[1], results

    def op_load_interrupted(self) -> None:
        """A load that raises part-way, inside block k (its offload pre-hook has run), on both twins."""
        index = self.rng.randrange(len(self.model.chain))
        fault = self.rng.choice([Fault, Interrupt])
        source = {k: torch.randn(v.shape, generator=self.gen).to(v.dtype) if v.is_floating_point() else v.clone()
                  for k, v in self.twin.state_dict().items()}
        self.log.append(f"load_interrupted(block {index}, {fault.__name__})")

        def interrupt(*args: Any) -> None:
            raise fault("interrupted while loading")

        for model in (self.model, self.twin):
            handle = model.chain[index].register_load_state_dict_pre_hook(interrupt)
            with pytest.raises(fault):
                model.load_state_dict(dict(source))
            handle.remove()

    def op_block_load(self) -> None:
        index = self.rng.randrange(len(self.model.chain))
        source = {k: torch.randn(v.shape, generator=self.gen).to(v.dtype) if v.is_floating_point() else v.clone()
                  for k, v in self.twin.chain[index].state_dict().items()}
        self.log.append(f"blocks[{index}].load_state_dict({len(source)} keys)")
        for model in (self.model, self.twin):
            model.chain[index].load_state_dict(dict(source))

    def op_requires_grad(self) -> None:
        target = self.rng.choice(["model", "outside", "block"])
        flag = self.rng.random() < 0.5
        index = self.rng.randrange(len(self.model.chain))
        self.log.append(f"requires_grad_({target}, {flag}, block={index})")

        def apply(model: nn.Module) -> None:
            if target == "model":
                model.requires_grad_(flag)
            elif target == "outside":
                model.proj_in.requires_grad_(flag)
                model.scale.requires_grad_(flag)
            else:
                model.chain[index].requires_grad_(flag)

        self.both(apply)

    def op_stats(self) -> None:
        group = self.group
        self.log.append("stats()")
        if group is None:
            return
        stats = group.stats()
        offloaded = self.offloaded()
        assert stats["offloaded_blocks"] == len(group.states)
        assert stats["resident"] == list(group.resident)
        assert sorted(set(range(len(group.blocks))) - set(group.resident)) == sorted(group.offloaded_indices)
        want = sum(p.numel() * p.element_size() for i in offloaded for p in self.twin.chain[i].parameters())
        assert stats["weight_bytes"] == want, (stats["weight_bytes"], want)

    def op_replan(self) -> None:
        group = self.group
        if group is None or group.plan is None:
            self.log.append("replan: no plan")
            return
        chain = [id(block) for block in self.model.chain]
        sizes = [self.block_bytes[chain.index(id(block))] for block in group.blocks]  # the ring's blocks, its order
        compute = [self.rng.choice([0.01, 0.1, 1.0, 3.0]) for _ in sizes]
        costs = BlockCosts(compute, sizes, self.rng.choice([1e-3, 1e-2, 1.0]))
        self.log.append(f"replan({compute})")
        try:
            group.replan(costs)
        except OffloadConfigError as error:
            self.log.append(f"  refused: {str(error)[:100]}")
        assert fo.get_offload_group(self.model) is not None

    def op_scope_work(self) -> None:
        """A forward, a load or a rebinding inside one offloaded block's mutate_params_scope."""
        offloaded = self.offloaded()
        if not offloaded:
            return
        index = self.rng.choice(offloaded)
        what = self.rng.choice(["forward", "load", "rebind", "new_param"])
        self.log.append(f"scope(block {index}: {what})")
        hook = offload_hook(self.model.chain[index])
        x = self.x()
        params = [name for name, _ in self.twin.chain[index].named_parameters()]
        with hook.mutate_params_scope():
            if what == "forward":
                with torch.no_grad():
                    assert torch.equal(self.model(x), self.twin(x))
            elif what == "load":
                source = {k: torch.randn(v.shape, generator=self.gen).to(v.dtype) if v.is_floating_point()
                          else v.clone() for k, v in self.twin.state_dict().items()}
                for model in (self.model, self.twin):
                    model.load_state_dict(dict(source))
            elif params:
                name = self.rng.choice(params)
                want = self.twin.chain[index].get_parameter(name)
                new = torch.randn(want.shape, generator=self.gen).to(want.dtype)
                for model in (self.model, self.twin):
                    owner, _, leaf = name.rpartition(".")
                    module = model.chain[index].get_submodule(owner)
                    param = module.get_parameter(leaf)
                    if what == "rebind":
                        param.data = new.clone()
                    else:
                        setattr(module, leaf, nn.Parameter(new.clone(), requires_grad=param.requires_grad))

    def op_block_calls(self) -> None:
        """Blocks called one by one, out of order, skipped and repeated (a sampler that reuses blocks)."""
        n = len(self.model.chain)
        order = [self.rng.randrange(n) for _ in range(self.rng.randint(1, 2 * n))]
        mode = self.rng.choice(["no_grad", "inference_mode"])
        self.log.append(f"block_calls({order}, {mode})")
        x = self.x()
        with getattr(torch, mode)():
            got, want = x, x
            for i in order:
                got, want = self.model.chain[i](got), self.twin.chain[i](want)
                assert torch.equal(got, want), i

    def op_state_dicts(self) -> None:
        """state_dict with keep_vars, and a block's own state_dict."""
        index = self.rng.randrange(len(self.model.chain))
        self.log.append(f"state_dicts(block {index})")
        got, want = self.model.state_dict(keep_vars=True), self.twin.state_dict(keep_vars=True)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        got, want = self.model.chain[index].state_dict(), self.twin.chain[index].state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    def op_calibrate(self) -> None:
        group = self.group
        if group is None:
            return
        self.log.append("calibrate()")
        with uncounted_step(self.model, self.x()) as step:
            try:
                group.calibrate(step, repeats=1)
            except OffloadConfigError as error:
                # A block that a scope grew (new parameters) can leave no layout within the budget: the re-plan
                # refuses with the numbers and changes nothing.
                assert "is too small for" in str(error), error
                assert self.group is group
                self.log.append("  refused: " + str(error)[:100])

    def op_disable(self) -> None:
        if self.group is None:
            return
        self.log.append("disable(cpu)")
        fo.disable_layerwise_offload(self.model, device="cpu")
        assert self.group is None
        self.check_params()

    OPS = [("op_enable", 3), ("op_forward", 6), ("op_mutate", 3), ("op_edit_outside", 1), ("op_load", 2),
           ("op_block_load", 1), ("op_requires_grad", 2), ("op_stats", 1), ("op_replan", 2), ("op_disable", 2),
           ("op_scope_work", 2), ("op_calibrate", 1), ("op_block_calls", 2), ("op_state_dicts", 1),
           ("op_load_interrupted", 1)]

    # Operations a caller may run inside a grad mode of its own: what they rebuild must be ordinary tensors still.
    MODED_OPS = ("op_mutate", "op_load", "op_block_load", "op_disable", "op_enable", "op_load_interrupted")

    def step(self) -> None:
        names, weights = zip(*self.OPS)
        op = self.rng.choices(names, weights)[0]
        if self.group is None and self.rng.random() < 0.5:
            op = "op_enable"  # most steps run on an offloaded model
        mode = self.rng.choice(["plain", "plain", "no_grad", "inference_mode"]) if op in self.MODED_OPS else "plain"
        if mode != "plain":
            self.log.append(f"under {mode}:")
        with getattr(torch, mode)() if mode != "plain" else contextlib.nullcontext():
            getattr(self, op)()
        inference = [name for name, p in self.model.named_parameters() if p.is_inference()]
        assert inference == [name for name, p in self.twin.named_parameters() if p.is_inference()], inference
        self.check_idle()
        self.check_state_dict()

    def lifetime_refs(self) -> list[weakref.ref]:
        """Weak references to the model and to what its offload holds (group, states, engine)."""
        group = self.group
        refs = [weakref.ref(self.model)]
        if group is not None:
            refs += [weakref.ref(group)] + [weakref.ref(state) for state in group.states]
            refs += [weakref.ref(group.engine)] if group.engine is not None else []
        return refs

    def run(self, steps: int) -> None:
        try:
            self.op_enable()
            for _ in range(steps):
                self.step()
            # Whatever the history, the model then goes with its last reference, offloaded or not (no cycle
            # for the collector to find): dropped while offloaded, or after a disable.
            gc.collect()
            gc.disable()
            refs = self.lifetime_refs()
            if self.group is not None and self.rng.random() < 0.5:
                # A forward first: a forward that a Ctrl-C ended is known to be over only at the next one, and
                # its record holds the model until then (ModelForwards).
                self.log.append("drop while offloaded")
                with torch.no_grad():
                    x = self.x()
                    assert torch.equal(self.model(x), self.twin(x))
            else:
                if self.group is not None:
                    self.op_disable()
                self.check_params()
                with torch.no_grad():
                    x = self.x()
                    assert torch.equal(self.model(x), self.twin(x))
            del self.model
            assert [ref() is None for ref in refs] == [True] * len(refs)
        except BaseException:
            print("\n".join(self.log))
            raise
        finally:
            gc.enable()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + SEEDS))
def test_fuzz_against_the_resident_model(backend: str, seed: int) -> None:
    Driver(backend, seed).run(STEPS)
