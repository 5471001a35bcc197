#!/usr/bin/env bash
# Fills .whl/ with what an offline GPU machine needs beyond its image: scripts/setup_env.sh installs the
# integration tests' packages from there, and the models section imports its peers from there
# (benchmarks/peers.py). Run it where an index is reachable, then carry .whl/ to the GPU machine.
# Usage: bash scripts/offline_wheels.sh [--python 3.12]   (the GPU image's Python, by default 3.12)
# Everything is downloaded without dependencies: the image already holds torch, transformers, accelerate,
# peft, numpy, safetensors, huggingface_hub and the rest; each line below is something it lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=3.12
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PYVER=$2; shift ;;
    *) echo "offline_wheels: unknown option $1 (use --python X.Y)" >&2; exit 2 ;;
  esac
  shift
done
specs=(
  diffusers                 # the models section, the pipeline example and their tests
  "importlib_metadata<8.8"  # diffusers' one dependency the image lacks (8.8 and later need lazy-importer too)
  fastvideo==0.2.1          # FastVideo's own hooks and loaders (setup_env.sh installs it without dependencies)
  remote_pdb wcwidth ftfy   # what those modules import beyond the image
  sglang mmgp==3.8.2        # peers, imported from their wheels
  dill optimum-quanto       # the peers' real dependencies (peers.PEER_DEPENDENCIES)
)
mkdir -p .whl
python3 -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: --dest .whl \
  --python-version "$PYVER" --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  "${specs[@]}"
ls .whl
