"""A differential stateful fuzz of LoRA adapters on an offloaded diffusers transformer against its resident twin.

A tiny ``WanTransformer3DModel`` (2-5 blocks, float32 or bfloat16) is offloaded with random settings, and a
seeded driver runs the same operation on it and on a resident twin: diffusers' adapter methods
(``add_adapter``, ``load_lora_adapter``, ``set_adapters``, ``disable_lora``/``enable_lora``, ``fuse_lora``
with a scale and a subset of the adapters, ``unfuse_lora``, ``delete_adapters``, ``unload_lora``), peft's
own ``merge()``/``unmerge()`` on one layer, edits inside ``mutate_params_scope``, partial
``load_state_dict`` calls, ``requires_grad_`` on the adapters, disables and re-enables (``is_replace``
included), and forwards under ``inference_mode``, ``no_grad`` and grad mode (the input's gradient
compared; an adapter that trains inside an offloaded block is refused, as documented), some of them raising
inside a block.

An operation either runs on both and leaves them equal, or the offloaded model refuses it with
:class:`OffloadStateError` and nothing changes (the twin is put back from a copy taken before it).
After every operation the outputs, the state dict, the peft adapter state dict and every layer's merged
adapters equal the twin's bit for bit. At the end the model is disabled (every parameter the twin's) or
dropped while offloaded, and freed with its last reference.

``FASTOFFLOAD_FUZZ_SEEDS``, ``FASTOFFLOAD_FUZZ_STEPS`` and ``FASTOFFLOAD_FUZZ_FIRST_SEED`` run it longer, as
for ``test_fuzz_backends.py``.
"""
from __future__ import annotations

import copy
import gc
import os
import random
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("peft", reason="peft is not installed (scripts/setup_env.sh installs it)")
pytest.importorskip("diffusers", reason="diffusers is not installed (scripts/setup_env.sh installs it)")

from peft import LoraConfig  # noqa: E402
from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

import fastoffload_ext as fo  # noqa: E402
from fastoffload_ext.errors import OffloadConfigError, OffloadStateError  # noqa: E402
from tests._models import offload_hook  # noqa: E402
from tests._pipelines import wan  # noqa: E402

SEEDS = int(os.environ.get("FASTOFFLOAD_FUZZ_SEEDS", "12"))
STEPS = int(os.environ.get("FASTOFFLOAD_FUZZ_STEPS", "30"))
FIRST_SEED = int(os.environ.get("FASTOFFLOAD_FUZZ_FIRST_SEED", "0"))

# Linear layers an adapter may wrap: inside every block, and proj_out outside the block list.
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2", "proj_out"]
GRAD_REFUSAL = "requires grad, and grad mode is on"


def _transformer(layers: int, dtype: torch.dtype, seed: int) -> nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**{**wan.TINY.transformer, "num_layers": layers}).to(dtype)
    return model.eval().requires_grad_(False)


def _layers(model: nn.Module) -> dict[str, BaseTunerLayer]:
    return {name: m for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


class AdapterDriver:
    """An offloaded tiny Wan transformer, its resident twin, and the operations on both."""

    def __init__(self, seed: int, device: str = "cpu") -> None:
        self.device = device
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.layers = self.rng.randint(2, 5)
        self.dtype = self.rng.choice([torch.float32, torch.bfloat16])
        weights_seed = self.rng.randrange(1 << 30)
        self.model = _transformer(self.layers, self.dtype, weights_seed).to(device)
        self.twin = _transformer(self.layers, self.dtype, weights_seed).to(device)
        self.adapters: list[str] = []
        self.made = 0
        self.log: list[str] = [f"layers={self.layers}, dtype={self.dtype}"]

    @property
    def group(self) -> fo.LayerwiseOffloadGroup | None:
        return fo.get_offload_group(self.model)

    def offloaded(self) -> list[int]:
        group = self.group
        if group is None:
            return []
        hooked = {id(s.module_ref) for s in group.states}
        return [i for i, block in enumerate(self.model.blocks) if id(block) in hooked]

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(1, 16, 3, 8, 8, generator=self.gen).to(self.device, self.dtype)
        text = torch.randn(1, 16, 32, generator=self.gen).to(self.device, self.dtype)
        return x, torch.tensor([self.rng.randint(1, 999)], device=self.device), text

    # ---- checks -------------------------------------------------------------------------------

    def check(self) -> None:
        self.check_idle()
        got, want = self.model.state_dict(), self.twin.state_dict()
        assert list(got) == list(want)
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key].cpu(), want[key].cpu()), key
        assert list(getattr(self.model, "peft_config", {})) == list(getattr(self.twin, "peft_config", {}))
        layers, twin_layers = _layers(self.model), _layers(self.twin)
        assert list(layers) == list(twin_layers)
        for name, layer in layers.items():
            twin = twin_layers[name]
            assert layer.merged_adapters == twin.merged_adapters, name
            assert layer.active_adapters == twin.active_adapters, name
            assert layer.disable_adapters == twin.disable_adapters, name
            assert layer.scaling == twin.scaling, name
        for name in self.adapters:
            saved = get_peft_model_state_dict(self.model, adapter_name=name)
            expected = get_peft_model_state_dict(self.twin, adapter_name=name)
            assert saved.keys() == expected.keys(), name
            assert all(torch.equal(saved[k].cpu(), expected[k].cpu()) for k in saved), name
        self.compare_forwards("inference_mode")

    def check_idle(self) -> None:
        group = self.group
        if group is None:
            return
        for state in group.states:  # an adapter added since the enable is the block's own until a rebuild
            held = {id(p) for p in state.module_ref.parameters()}
            for name, p in state.offloaded_parameters().items():
                assert p.numel() == 0, f"{name} holds {tuple(p.shape)} between steps"
                assert id(p) in held, f"the host copy still holds {name}, which its block no longer has"
        if group.engine is not None:
            slots = [group.engine.slot_state(s) for s in range(group.engine.num_slots)]
            assert "in_use" not in slots, slots

    def compare_forwards(self, mode: str) -> None:
        args = self.inputs()
        group = self.group  # an adapter added since the enable is the block's own tensor, and may train
        refused = mode == "grad" and group is not None and any(
            p.requires_grad for state in group.states for p in state.offloaded_parameters().values())
        want = self._run(self.twin, args, mode)
        if refused:
            with pytest.raises(RuntimeError, match=GRAD_REFUSAL):
                self._run(self.model, args, mode)
            self.log.append(f"  forward({mode}) refused: an adapter trains inside an offloaded block")
            return
        got = self._run(self.model, args, mode)
        assert torch.equal(got[0], want[0]), mode
        assert got[1].keys() == want[1].keys() and all(torch.equal(got[1][k], want[1][k]) for k in got[1]), mode

    @staticmethod
    def _run(model: nn.Module, args: tuple[torch.Tensor, ...],
             mode: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The output, and in grad mode the gradients of the input and of every parameter that trains (adapters
        added since the enable are the blocks' own tensors, and train)."""
        x, timestep, text = args
        if mode == "inference_mode":
            with torch.inference_mode():
                return model(x, timestep, text, return_dict=False)[0].clone(), {}
        if mode == "no_grad":
            with torch.no_grad():
                return model(x, timestep, text, return_dict=False)[0], {}
        x = x.clone().requires_grad_(True)
        out = model(x, timestep, text, return_dict=False)[0]
        out.float().square().sum().backward()
        grads = {"input": x.grad}
        for name, p in model.named_parameters():
            if p.grad is not None:
                grads[name] = p.grad
            p.grad = None
        return out.detach(), grads

    def both(self, what: str, apply: Callable[[nn.Module], Any]) -> None:
        """``apply`` on the twin, then on the model: both run, both raise, or the model refuses and nothing
        changes (the twin is put back)."""
        self.log.append(what)
        saved = copy.deepcopy(self.twin)
        twin_error = model_error = None
        try:
            apply(self.twin)
        except Exception as error:  # noqa: BLE001 (diffusers and peft raise ValueError, KeyError, ...)
            twin_error = error
        try:
            apply(self.model)
        except Exception as error:  # noqa: BLE001
            model_error = error
        if twin_error is not None:
            assert model_error is not None, f"{what}: the resident twin raised {twin_error!r}, the offloaded model ran"
            assert type(model_error) is type(twin_error), (model_error, twin_error)
            self.log.append(f"  both raised {type(twin_error).__name__}")
        elif model_error is not None:
            assert isinstance(model_error, OffloadStateError), f"{what}: {model_error!r}"
            assert "othing" in str(model_error), model_error  # "Nothing was merged", "nothing was cast", ...
            self.twin = saved
            self.log.append(f"  refused: {str(model_error)[:100]}")
        twin_error = model_error = None  # their tracebacks hold this frame

    # ---- operations ---------------------------------------------------------------------------

    def op_enable(self) -> None:
        rng = self.rng
        kwargs: dict[str, Any] = dict(device=self.device, backend=rng.choice(["ext", "python"]),
                                      cyclic=rng.random() < 0.7)
        if rng.random() < 0.3:
            some = sorted(rng.sample(range(self.layers), rng.randint(0, self.layers)))
            kwargs["resident_blocks"] = rng.choice([rng.randint(0, self.layers), some])
        if rng.random() < 0.6:
            kwargs["prefetch_depth"] = rng.randint(0, self.layers)
        if kwargs["backend"] == "ext" and self.dtype == torch.bfloat16 and rng.random() < 0.4:
            kwargs["compress"] = rng.choice([True, "auto"])
        replace = self.group is not None
        self.log.append(f"enable({kwargs}, is_replace={replace})")
        try:
            fo.enable_layerwise_offload(self.model, replace, **kwargs)
        except (OffloadConfigError, OffloadStateError) as error:
            self.log.append(f"  refused: {str(error)[:100]}")

    def op_disable(self) -> None:
        if self.group is None:
            return
        self.log.append("disable()")
        fo.disable_layerwise_offload(self.model)
        params, twin = dict(self.model.named_parameters()), dict(self.twin.named_parameters())
        assert params.keys() == twin.keys()
        assert all(params[k].device == twin[k].device and torch.equal(params[k], twin[k]) and
                   params[k].requires_grad == twin[k].requires_grad for k in twin)

    def op_add(self) -> None:
        name = f"a{self.made}"
        self.made += 1
        targets = self.rng.sample(TARGETS, self.rng.randint(1, len(TARGETS)))
        rank = self.rng.choice([2, 4])
        alpha = self.rng.choice([rank, 2 * rank])
        seed = self.rng.randrange(1 << 30)

        def add(model: nn.Module) -> None:
            torch.manual_seed(seed)  # init_lora_weights=False: B is random too, so the adapter changes the output
            config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
            model.add_adapter(config, adapter_name=name)
            if self.dtype != torch.float32:
                for layer in _layers(model).values():
                    for part in (layer.lora_A, layer.lora_B):
                        if name in part:
                            part[name].to(self.dtype)

        self.both(f"add_adapter({name}, r={rank}, alpha={alpha}, {targets})", add)
        if name in getattr(self.twin, "peft_config", {}):
            self.adapters.append(name)

    def op_load(self) -> None:
        """``load_lora_adapter`` of an adapter made on a donor copy of the base weights."""
        name = f"a{self.made}"
        self.made += 1
        targets = self.rng.sample(TARGETS, self.rng.randint(1, len(TARGETS)))
        donor = _transformer(self.layers, self.dtype, 0).to(self.device)
        torch.manual_seed(self.rng.randrange(1 << 30))
        donor.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights=False),
                          adapter_name="donor")
        saved = get_peft_model_state_dict(donor, adapter_name="donor")
        lora = {f"transformer.{k}": v.to(self.dtype) for k, v in saved.items()}
        low_memory = self.rng.random() < 0.5  # what diffusers' pipelines ask for by default
        self.both(f"load_lora_adapter({name}, {targets}, low_cpu_mem_usage={low_memory})",
                  lambda m: m.load_lora_adapter(dict(lora), adapter_name=name, prefix="transformer",
                                                low_cpu_mem_usage=low_memory))
        if name in getattr(self.twin, "peft_config", {}):
            self.adapters.append(name)

    def _some_adapters(self) -> list[str]:
        return self.rng.sample(self.adapters, self.rng.randint(1, len(self.adapters)))

    def op_set_adapters(self) -> None:
        if not self.adapters:
            return
        names = self._some_adapters()
        weights = [self.rng.choice([0.25, 0.5, 1.0, 1.5]) for _ in names]
        self.both(f"set_adapters({names}, {weights})", lambda m: m.set_adapters(names, weights=weights))

    def op_toggle(self) -> None:
        method = self.rng.choice(["disable_lora", "enable_lora"])
        if self.adapters:
            self.both(f"{method}()", lambda m: getattr(m, method)())

    def op_fuse(self) -> None:
        if not self.adapters:
            return
        kwargs: dict[str, Any] = dict(lora_scale=self.rng.choice([1.0, 0.5, 0.7]))
        if self.rng.random() < 0.5:
            kwargs["adapter_names"] = self._some_adapters()
        if self.rng.random() < 0.3:
            kwargs["safe_fusing"] = True
        self.both(f"fuse_lora({kwargs})", lambda m: m.fuse_lora(**kwargs))

    def op_unfuse(self) -> None:
        if self.adapters:
            self.both("unfuse_lora()", lambda m: m.unfuse_lora())

    def op_layer_merge(self) -> None:
        names = list(_layers(self.twin))
        if not names:
            return
        name = self.rng.choice(names)
        merge = self.rng.random() < 0.6

        def apply(model: nn.Module) -> None:
            layer = model.get_submodule(name)
            layer.merge() if merge else layer.unmerge()

        self.both(f"{name}.{'merge' if merge else 'unmerge'}()", apply)

    def op_delete(self) -> None:
        if not self.adapters:
            return
        name = self.rng.choice(self.adapters)
        self.both(f"delete_adapters({name})", lambda m: m.delete_adapters(name))
        if name not in getattr(self.twin, "peft_config", {}):
            self.adapters.remove(name)

    def op_unload(self) -> None:
        if self.adapters and self.rng.random() < 0.3:
            self.both("unload_lora()", lambda m: m.unload_lora())
            self.adapters = [n for n in self.adapters if n in getattr(self.twin, "peft_config", {})]

    def op_requires_grad(self) -> None:
        flag = self.rng.random() < 0.4

        def apply(model: nn.Module) -> None:
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.requires_grad_(flag)

        self.both(f"adapters.requires_grad_({flag})", apply)

    def op_scope_edit(self) -> None:
        index = self.rng.randrange(self.layers)
        names = [n for n, _ in self.twin.blocks[index].named_parameters()]
        name = self.rng.choice(names)
        factor = self.rng.choice([2.0, -0.5, 0.25])
        where = "offloaded" if index in self.offloaded() else "resident"
        self.log.append(f"blocks.{index}.{name} *= {factor} ({where})")

        def edit(model: nn.Module) -> None:
            with torch.no_grad():
                model.blocks[index].get_parameter(name).mul_(factor)

        edit(self.twin)
        if index in self.offloaded():
            with offload_hook(self.model.blocks[index]).mutate_params_scope():
                edit(self.model)
        else:
            edit(self.model)

    def op_load_state_dict(self) -> None:
        state = self.twin.state_dict()
        chosen = [k for k in state if self.rng.random() < 0.3]
        source = {k: torch.randn(state[k].shape, generator=self.gen).to(state[k].device, state[k].dtype) for k in chosen
                  if state[k].is_floating_point()}
        self.log.append(f"load_state_dict({len(source)}/{len(state)} keys, strict=False)")
        for model in (self.twin, self.model):
            result = model.load_state_dict(dict(source), strict=False)
            assert not result.unexpected_keys

    def op_forward(self) -> None:
        mode = self.rng.choice(["inference_mode", "no_grad", "grad"])
        self.log.append(f"forward({mode})")
        self.compare_forwards(mode)

    def op_forward_fault(self) -> None:
        """A forward that raises inside a block, after its attention layers ran (peft may have unmerged them)."""
        index = self.rng.randrange(self.layers)
        fault = self.rng.choice([RuntimeError, KeyboardInterrupt])
        mode = self.rng.choice(["inference_mode", "no_grad"])
        self.log.append(f"forward({mode}) raising {fault.__name__} in blocks.{index}.ffn")
        args = self.inputs()

        def raising(*_: Any) -> None:
            raise fault("injected")

        for model in (self.twin, self.model):
            handle = model.blocks[index].ffn.register_forward_hook(raising)
            try:
                with pytest.raises(fault):
                    self._run(model, args, mode)
            finally:
                handle.remove()

    OPS = [("op_enable", 2), ("op_disable", 1), ("op_add", 3), ("op_load", 1), ("op_set_adapters", 2),
           ("op_toggle", 1), ("op_fuse", 3), ("op_unfuse", 2), ("op_layer_merge", 2), ("op_delete", 1),
           ("op_unload", 1), ("op_requires_grad", 1), ("op_scope_edit", 2), ("op_load_state_dict", 1),
           ("op_forward", 3), ("op_forward_fault", 1)]

    def step(self) -> None:
        names, weights = zip(*self.OPS)
        op = self.rng.choices(names, weights)[0]
        if self.group is None and self.rng.random() < 0.6:
            op = "op_enable"  # most steps run on an offloaded model
        getattr(self, op)()
        self.check()

    def run(self, steps: int) -> None:
        try:
            self.op_enable()
            for _ in range(steps):
                self.step()
            gc.collect()
            gc.disable()
            refs = [weakref.ref(self.model)]
            if self.group is not None:
                refs += [weakref.ref(self.group)] + [weakref.ref(s) for s in self.group.states]
            if self.group is not None and self.rng.random() < 0.5:
                self.log.append("drop while offloaded")
            else:
                self.op_disable()
            del self.model
            assert [ref() is None for ref in refs] == [True] * len(refs)
        except BaseException:
            print("\n".join(self.log))
            raise
        finally:
            gc.enable()


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + SEEDS))
def test_fuzz_adapters_against_the_resident_model(seed: int) -> None:
    AdapterDriver(seed).run(STEPS)


@pytest.mark.cuda
@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + max(SEEDS // 2, 1)))
def test_fuzz_adapters_against_the_resident_model_on_cuda(seed: int) -> None:
    AdapterDriver(seed, "cuda").run(STEPS)
