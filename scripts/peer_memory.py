"""How much device memory FastVideo's layerwise offload holds when the host runs ahead, and what that buys it.

FastVideo allocates each prefetched block's tensors from torch's caching allocator (``record_stream`` keeps them
until the compute stream is done with them), so it is not held to two blocks: in a loop that reads nothing back,
the host issues the next blocks' copies as fast as it dispatches, and the device holds as many blocks as the host
is ahead. ext copies into k+1 static slots whatever the host does. This times FastVideo's offload and the
resident model on one of the benchmark's real architectures in two loops, in interleaved rounds:

- readback: each forward followed by ``output.cpu()`` (the host meets the device at every step);
- steady: forwards back to back, one wait at the end (a denoising loop).

and reads the device's peak allocation above what was allocated before each loop, for the resident model
(activations only) and for FastVideo (activations and the blocks it holds), then each one's steady reserve
(``benchmarks.utils.steady_reserve``): what torch's allocator reserved over a steady loop above an emptied cache,
which counts the blocks freed on the host while the device still used them.

    python scripts/peer_memory.py [--model flux] [--tokens 1024,9216] [--rounds 3] [--steps 4]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import models, peers  # noqa: E402
from benchmarks.utils import GB, steady_reserve, time_back_to_back  # noqa: E402


def _loop(forward: Callable[[], Any], steps: int, readback: bool,
          outputs: list[torch.Tensor]) -> tuple[float, float]:
    """(median ms a step, peak bytes allocated above the start) of ``steps`` forwards; their outputs go to
    ``outputs``."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if readback:
        times = []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            outputs.append(forward().cpu())
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        times = time_back_to_back(lambda: outputs.append(forward()), steps)
    torch.cuda.synchronize()
    return float(statistics.median(times)), float(torch.cuda.max_memory_allocated() - base)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="flux", choices=sorted(models.MODELS))
    parser.add_argument("--tokens", default="1024,9216", help="comma-separated token counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("peer_memory: needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    spec = models.MODELS[args.model]
    master = models.build_master(spec, types.SimpleNamespace(cuda=True, device=device, quick=True))
    lists = models.block_list_names(master, spec.block_lists)
    offloaded = copy.deepcopy(master)
    peers.fastvideo(offloaded, device, lists)
    first = getattr(master, lists[0])
    block_bytes = sum(p.numel() * p.element_size() for p in first[0].parameters())
    print(f"{spec.name}: FastVideo offloads {lists[0]} ({len(first)} blocks of {block_bytes / GB:.3f} GB)")
    for tokens in (int(t) for t in args.tokens.split(",")):
        inputs = spec.inputs(spec.config, tokens, device)

        def run(model: torch.nn.Module) -> Callable[[], torch.Tensor]:
            def forward() -> torch.Tensor:
                with torch.inference_mode():
                    return model(**inputs, return_dict=False)[0]
            return forward

        forwards = {"resident": run(master), "fastvideo": run(offloaded)}
        reference = forwards["resident"]().cpu()
        assert torch.equal(reference, forwards["fastvideo"]().cpu()), "not bit-equal"
        outputs: dict[tuple[str, str], list[torch.Tensor]] = {}
        got: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for index in range(args.rounds):
            order = [(name, loop) for name in forwards for loop in ("readback", "steady")]
            for name, loop in order[index % len(order):] + order[:index % len(order)]:
                kept = outputs.setdefault((name, loop), [])
                got.setdefault((name, loop), []).append(_loop(forwards[name], args.steps, loop == "readback", kept))
        for loop in ("readback", "steady"):
            resident, fastvideo = got[("resident", loop)], got[("fastvideo", loop)]
            ratio = statistics.median(f[0] / r[0] for f, r in zip(fastvideo, resident))
            extra = max(f[1] for f in fastvideo) - max(r[1] for r in resident)
            print(f"  {tokens} tokens, {loop:8s}: resident {statistics.median(r[0] for r in resident):7.1f} ms, "
                  f"fastvideo {statistics.median(f[0] for f in fastvideo):7.1f} ms = {ratio:.3f}x resident; "
                  f"peak above the loop's start: resident {max(r[1] for r in resident) / GB:.2f} GB, fastvideo "
                  f"{max(f[1] for f in fastvideo) / GB:.2f} GB (= resident + {extra / block_bytes:.1f} blocks); "
                  f"every fastvideo output bit-equal: "
                  f"{all(torch.equal(reference, out.cpu()) for out in outputs[('fastvideo', loop)])}")
        reserves = {name: steady_reserve(forward, args.steps) for name, forward in forwards.items()}
        extra = reserves["fastvideo"] - reserves["resident"]
        print(f"  {tokens} tokens, steady reserve over {args.steps} forwards above an emptied cache: resident "
              f"{reserves['resident'] / GB:.2f} GB, fastvideo {reserves['fastvideo'] / GB:.2f} GB "
              f"(= resident + {extra / block_bytes:.1f} blocks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
