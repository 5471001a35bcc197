#!/usr/bin/env bash
# Idempotent set-up used by `make test` and `make bench`: installs what is missing, builds the
# extension in place when its sources changed. Uses the torch that is already installed (the GPU
# machines have no network); installs one only where none is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}

have() { "$PY" -c "import $1" >/dev/null 2>&1; }
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! have torch; then
  echo "setup: installing $TORCH_SPEC" >&2
  pip_install "$TORCH_SPEC"
fi
missing=()
# module:package pairs. The first five are pyproject.toml's "test" extra (tests import the benchmarks' toy
# model, hence psutil and tabulate); safetensors is what weights= reads checkpoints with (and the tests write
# them with); `make bench` adds the rest of the "bench" extra through EXTRA_MODULES.
for pair in pytest:pytest hypothesis:hypothesis psutil:psutil tabulate:tabulate safetensors:safetensors \
    ninja:ninja setuptools:setuptools wheel:wheel ${EXTRA_MODULES:-}; do
  have "${pair%%:*}" || missing+=("${pair##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  pip_install "${missing[@]}" || echo "setup: could not install ${missing[*]} (offline?); continuing" >&2
fi

# The integration tests run against the real frameworks. FastVideo pins another torch and a long runtime
# list, so it goes in without dependencies, plus only the modules its hooks and loaders import; torchvision
# must match the installed torch (0.N+15 for torch 2.N) or pip would replace torch. Offline machines install
# from .whl/ (scripts/offline_wheels.sh fills it) when it is there. FASTOFFLOAD_SKIP_INTEGRATIONS=1 skips all of it.
if [ "${FASTOFFLOAD_SKIP_INTEGRATIONS:-0}" != 1 ]; then
  # An offline machine has the wheels in .whl/; asking the index there would only time out.
  wheels=(); [ -d .whl ] && wheels=(--no-index --find-links .whl)
  if ! have diffusers || ! have transformers || ! have accelerate; then
    pip_install "${wheels[@]}" diffusers transformers accelerate sentencepiece \
      || echo "setup: could not install diffusers/transformers (offline?); their tests skip" >&2
  fi
  # LoRA adapters on an offloaded model (fastoffload_ext.integrations.peft) are tested against peft itself.
  if ! have peft; then
    pip_install "${wheels[@]}" peft || echo "setup: could not install peft (offline?); the LoRA tests skip" >&2
  fi
  # Installed or not, by its files: importing it needs the modules below, which may be what is missing.
  if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('fastvideo') is None)" 2>/dev/null; then
    tv_minor=$(( $("$PY" -c "import torch; print(torch.__version__.split('.')[1])") + 15 ))
    pip_install "${wheels[@]}" --no-deps fastvideo==0.2.1 "torchvision==0.${tv_minor}.*" \
      || echo "setup: could not install fastvideo (offline?); its tests skip" >&2
  fi
  # Checked one by one and whether or not fastvideo was already there: a machine that has fastvideo but
  # lacks one of these skips every FastVideo test (fastvideo.utils imports remote_pdb, its T5 configs ftfy,
  # and ftfy needs wcwidth, which pip finds in .whl/ as well).
  fv_missing=()
  for pair in imageio:imageio einops:einops remote_pdb:remote_pdb wcwidth:wcwidth ftfy:ftfy; do
    have "${pair%%:*}" || fv_missing+=("${pair##*:}")
  done
  if [ ${#fv_missing[@]} -gt 0 ]; then
    echo "setup: installing FastVideo's runtime modules ${fv_missing[*]}" >&2
    # One at a time: offline, a module absent from .whl/ must not stop the others.
    for package in "${fv_missing[@]}"; do
      pip_install "${wheels[@]}" "$package" \
        || echo "setup: could not install $package (offline and not in .whl/?); FastVideo tests skip" >&2
    done
  fi
  have fastvideo.hooks.layerwise_offload \
    || echo "setup: fastvideo.hooks.layerwise_offload does not import; FastVideo tests skip" >&2
fi

# Rebuild only when the sources or the torch changed: a stamp of both sits next to the package.
stamp=$(cat setup.py csrc/* | sha1sum | cut -d' ' -f1)-$("$PY" -c "import torch; print(torch.__version__)")
if [ "$(cat fastoffload_ext/_build_stamp 2>/dev/null)" != "$stamp" ] || ! "$PY" -c "import fastoffload_ext._C" >/dev/null 2>&1; then
  echo "setup: building fastoffload_ext (FASTOFFLOAD_CUDA=${FASTOFFLOAD_CUDA:-auto}, MAX_JOBS=${MAX_JOBS:-$(nproc)})" >&2
  start=$(date +%s)
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install --disable-pip-version-check --no-build-isolation --no-deps -q -e . \
    > build.log 2>&1 || { tail -40 build.log >&2; echo "setup: build failed, full log in build.log" >&2; exit 1; }
  echo "$stamp" > fastoffload_ext/_build_stamp
  echo "setup: built in $(( $(date +%s) - start )) s" >&2
fi
