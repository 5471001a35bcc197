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
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import models
from benchmarks.copy_load import CHUNK_BYTES, CopyLoad


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
    load = CopyLoad(device)
    for tokens in (int(t) for t in args.tokens.split(",")):
        inputs = spec.inputs(spec.config, tokens, device)

        def forward(inputs: dict = inputs) -> None:
            with torch.inference_mode():
                model(**inputs, return_dict=False)
        for _ in range(3):
            load.time(forward, 0)
        copies = load.copies_for(load.time(forward, 0)[0])
        alone, streaming, ratios = [], [], []
        for r in range(args.rounds):
            got = {n: load.time(forward, n) for n in ((0, copies) if r % 2 == 0 else (copies, 0))}
            alone.append(got[0])
            streaming.append(got[copies])
            ratios.append(got[copies][0] / got[0][0])
        deciles = statistics.quantiles(ratios, n=10)
        print(f"{args.model} {tokens} tokens, resident: alone {statistics.median(a[0] for a in alone):.2f} ms "
              f"(host {statistics.median(a[1] for a in alone):.2f} ms); with {copies} x {CHUNK_BYTES >> 20} MiB H2D "
              f"copies streaming {statistics.median(b[0] for b in streaming):.2f} ms "
              f"(host {statistics.median(b[1] for b in streaming):.2f} ms); ratio {statistics.median(ratios):.3f} "
              f"[p10 {deciles[0]:.3f}, p90 {deciles[-1]:.3f}], {args.rounds} interleaved rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
