"""Copy interference: how much slower a *resident* model runs while host-to-device copies stream on another stream.

No offload is involved. The model (one of the benchmark's real architectures, random bf16 weights, all on the GPU)
runs its forward alone (A) and with enough block-sized pinned copies queued on a side stream to cover the whole
forward (B), in interleaved rounds (the order flips every round). The ratio B / A is the share of an offloaded
step that no offloader can remove: every layerwise offloader copies while the model computes. Device time comes
from CUDA events around the forward, host time from the clock around the same calls.

    python scripts/copy_interference.py [--model wan-1.3b] [--tokens 1560,6240] [--rounds 16]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import models  # noqa: E402  (the repository's benchmark package, by path)

BLOCK_BYTES = 86 * 2**20  # one Wan-1.3B block in bf16


def _forward(model: torch.nn.Module, inputs: dict, copies: int, side: torch.cuda.Stream, src: torch.Tensor,
             dst: list[torch.Tensor]) -> tuple[float, float]:
    """(device ms, host ms) of one forward, with ``copies`` block-sized copies queued on ``side`` first."""
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for i in range(copies):
            dst[i % len(dst)].copy_(src, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began = time.perf_counter()
    start.record()
    with torch.no_grad():
        model(**inputs, return_dict=False)
    end.record()
    host_ms = (time.perf_counter() - began) * 1e3
    end.synchronize()
    device_ms = start.elapsed_time(end)
    torch.cuda.synchronize()  # the copies left over finish outside the timed window
    return device_ms, host_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="wan-1.3b", choices=sorted(models.MODELS))
    parser.add_argument("--tokens", default="1560,6240", help="comma-separated token counts")
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("copy_interference: needs a CUDA GPU (it times a resident model against itself while copies stream)")
        return 2
    device = torch.device("cuda")
    spec = models.MODELS[args.model]
    model = models.build_master(spec, types.SimpleNamespace(cuda=True, device=device, quick=True))
    src = torch.empty(BLOCK_BYTES, dtype=torch.uint8).pin_memory()
    dst = [torch.empty(BLOCK_BYTES, dtype=torch.uint8, device=device) for _ in range(2)]
    side = torch.cuda.Stream()
    for tokens in (int(t) for t in args.tokens.split(",")):
        inputs = spec.inputs(spec.config, tokens, device)
        for _ in range(3):
            _forward(model, inputs, 0, side, src, dst)
        alone_ms = _forward(model, inputs, 0, side, src, dst)[0]
        copies = int(alone_ms * 1e-3 * 60e9 / BLOCK_BYTES) + 8  # more than the forward lasts at the PCIe peak
        alone, streaming, ratios = [], [], []
        for r in range(args.rounds):
            got = {}
            for n in ((0, copies) if r % 2 == 0 else (copies, 0)):
                got[n] = _forward(model, inputs, n, side, src, dst)
            alone.append(got[0])
            streaming.append(got[copies])
            ratios.append(got[copies][0] / got[0][0])
        deciles = statistics.quantiles(ratios, n=10)
        print(f"{args.model} {tokens} tokens, resident: alone {statistics.median(a[0] for a in alone):.2f} ms "
              f"(host {statistics.median(a[1] for a in alone):.2f} ms); with {copies} x {BLOCK_BYTES >> 20} MiB H2D "
              f"copies streaming {statistics.median(b[0] for b in streaming):.2f} ms "
              f"(host {statistics.median(b[1] for b in streaming):.2f} ms); ratio {statistics.median(ratios):.3f} "
              f"[p10 {deciles[0]:.3f}, p90 {deciles[-1]:.3f}], {args.rounds} interleaved rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
