"""Soak: two offloaded models alternate on one device for many steps, next to unrelated work on a third thread.

Every ``--check-every`` steps both outputs are compared bit for bit with a resident reference, and pinned
bytes, host bytes, GPU allocated bytes and host RSS are sampled; at the end offload is disabled and every
parameter must equal its value from before enable. Exit code 0 only when all of that held.

    python scripts/soak.py [--steps 1000] [--check-every 100] [--device cuda|cpu] [--out DIR] [--backend ext|python]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

import torch

# Run as a script, this file's folder is on sys.path, not the repository root: the toy model lives in
# benchmarks/workloads.py, shared with the tests and the benchmarks.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fastoffload_ext  # noqa: E402
from benchmarks.utils import rss_bytes  # noqa: E402
from benchmarks.workloads import BlockStack  # noqa: E402

MIB = 1 << 20
MEMORY_KEYS = ("pinned_bytes", "host_reserved_bytes", "gpu_allocated_bytes", "rss_bytes")


@dataclass
class Spec:
    name: str
    d: int
    n_blocks: int
    dtype: torch.dtype
    prefetch_depth: int
    tokens: int


SPECS = {  # per device type: two models that differ in width, depth, dtype and prefetch depth
    "cuda": [Spec("A", 256, 7, torch.bfloat16, 1, 512), Spec("B", 192, 5, torch.float16, 2, 384)],
    "cpu": [Spec("A", 64, 7, torch.bfloat16, 1, 16), Spec("B", 48, 5, torch.float32, 2, 24)],
}


@dataclass
class Offloaded:
    spec: Spec
    model: BlockStack
    reference: BlockStack
    original: dict[str, torch.Tensor]  # CPU copies of the parameters, taken before enable


def build(spec: Spec, device: torch.device, backend: str, seed: int) -> Offloaded:
    torch.manual_seed(seed)
    # Transformer-shaped: an input projection, the block list (offloaded), an output projection.
    model = BlockStack(spec.d, spec.n_blocks, n_norms=2, projections=True).to(spec.dtype)
    original = {name: param.detach().clone() for name, param in model.named_parameters()}
    reference = copy.deepcopy(model).to(device)
    model.proj_in.to(device)  # modules outside the block list are the caller's to place
    model.proj_out.to(device)
    fastoffload_ext.enable_layerwise_offload(model, device=device, backend=backend, prefetch_depth=spec.prefetch_depth)
    return Offloaded(spec, model, reference, original)


class BackgroundWork:
    """Matmuls on their own thread (and CUDA stream) until the ``with`` block ends, however it ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.iterations = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-background", daemon=True)

    def _run(self) -> None:
        try:
            size = 1024 if self.device.type == "cuda" else 96
            stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            on_stream = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            with on_stream, torch.inference_mode():
                a, b, out = (torch.randn(size, size, device=self.device) for _ in range(3))
                while not self._stop.is_set():
                    torch.mm(a, b, out=out)  # into a fixed buffer: no allocation to blur the memory samples
                    self.iterations += 1
                if stream is not None:
                    stream.synchronize()
        except BaseException as error:  # reported by the main thread
            self.error = error

    def __enter__(self) -> BackgroundWork:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()


def sample(step: int, equal: dict[str, bool], runs: list[Offloaded], device: torch.device, start: float) -> dict:
    stats = [fastoffload_ext.get_offload_group(run.model).stats() for run in runs]
    return {"step": step, "bit_equal": equal,
            "pinned_bytes": sum(s["pinned_bytes"] for s in stats),
            "host_reserved_bytes": sum(s["host_reserved_bytes"] for s in stats),
            "gpu_allocated_bytes": torch.cuda.memory_allocated(device) if device.type == "cuda" else 0,
            "rss_bytes": rss_bytes(), "seconds": round(time.perf_counter() - start, 3)}


def params_restored(run: Offloaded) -> tuple[bool, int]:
    """Whether every parameter equals its value from before enable, and the bytes compared."""
    params = {name: param.detach().cpu() for name, param in run.model.named_parameters()}
    if params.keys() != run.original.keys():
        return False, 0
    equal = all(p.dtype == run.original[n].dtype and torch.equal(p, run.original[n]) for n, p in params.items())
    return equal, sum(p.numel() * p.element_size() for p in params.values())


def soak(steps: int, check_every: int, device: torch.device, backend: str) -> dict:
    runs = [build(spec, device, backend, seed) for seed, spec in enumerate(SPECS[device.type])]
    generator = torch.Generator(device).manual_seed(1234)
    samples: list[dict] = []
    bytes_compared = 0
    start = time.perf_counter()
    with BackgroundWork(device) as background, torch.inference_mode():
        for step in range(steps):
            check = step % check_every == 0 or step == steps - 1
            equal: dict[str, bool] = {}
            for run in runs:
                x = torch.randn(2, run.spec.tokens, run.spec.d, device=device, dtype=run.spec.dtype, generator=generator)
                out = run.model(x)
                if check:
                    equal[run.spec.name] = torch.equal(out, run.reference(x))
                    bytes_compared += out.numel() * out.element_size()
            if check:
                samples.append(sample(step, equal, runs, device, start))
            if background.error is not None:
                break
    if background.error is not None:
        raise RuntimeError("the background work failed") from background.error
    restored = True
    for run in runs:
        fastoffload_ext.disable_layerwise_offload(run.model)
        equal_params, compared = params_restored(run)
        restored &= equal_params
        bytes_compared += compared
    settled = samples[1:] or samples  # step 0 includes allocator warm-up: the baseline is step check_every
    return {"steps": steps, "check_every": check_every, "device": str(device), "backend": backend,
            "models": [{**asdict(run.spec), "dtype": str(run.spec.dtype)} for run in runs],
            "checks": len(samples), "all_bit_equal": all(all(s["bit_equal"].values()) for s in samples),
            "params_restored": restored, "bytes_compared": bytes_compared,
            "background_iterations": background.iterations,
            "drift": {key: settled[-1][key] - settled[0][key] for key in MEMORY_KEYS},
            "span": {key: max(s[key] for s in settled) - min(s[key] for s in settled) for key in MEMORY_KEYS},
            "samples": samples}


def report(result: dict) -> str:
    names = list(result["samples"][0]["bit_equal"])
    lines = [f"{'step':>6} " + " ".join(f"{name + ' eq':>5}" for name in names)
             + f" {'pinned MiB':>10} {'host MiB':>9} {'gpu MiB':>8} {'rss MiB':>8} {'s':>7}"]
    for s in result["samples"]:
        lines.append(f"{s['step']:>6} " + " ".join(f"{'yes' if s['bit_equal'][n] else 'NO':>5}" for n in names)
                     + f" {s['pinned_bytes'] / MIB:>10.2f} {s['host_reserved_bytes'] / MIB:>9.2f}"
                     f" {s['gpu_allocated_bytes'] / MIB:>8.2f} {s['rss_bytes'] / MIB:>8.1f} {s['seconds']:>7.2f}")
    drift = result["drift"]
    lines.append(f"soak: {result['steps']} steps, {result['checks']} checks, all bit-equal: "
                 f"{'yes' if result['all_bit_equal'] else 'no'}, params restored: "
                 f"{'yes' if result['params_restored'] else 'no'}, bytes compared: {result['bytes_compared']}, "
                 f"drift pinned {drift['pinned_bytes']:+d} B, gpu allocated {drift['gpu_allocated_bytes']:+d} B, "
                 f"rss {drift['rss_bytes']:+d} B ({drift['rss_bytes'] / MIB:+.2f} MiB)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--check-every", type=int, default=100)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="folder for soak.json")
    parser.add_argument("--backend", choices=("ext", "python"), default="ext")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.check_every < 1:
        parser.error("--steps and --check-every must be at least 1")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    result = soak(args.steps, args.check_every, device, args.backend)
    print(report(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "soak.json").write_text(json.dumps(result, indent=2))
    return 0 if result["all_bit_equal"] and result["params_restored"] else 1


if __name__ == "__main__":
    sys.exit(main())
