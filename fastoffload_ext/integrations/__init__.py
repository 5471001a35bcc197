"""Integrations with the frameworks that run the offloaded models: one module per framework.

Nothing here imports a framework at package import time: each integration imports its framework when
it is used, so ``import fastoffload_ext`` stays light and works where none is installed.

- :mod:`fastoffload_ext.integrations.fastvideo`: ``install()`` makes an installed FastVideo use this
  engine wherever it enables layerwise offload; ``uninstall()`` puts FastVideo's own back.
- :mod:`fastoffload_ext.integrations.diffusers`: offload the transformer of a diffusers pipeline, with
  the pipeline's device moves defined on it, and the text encoder and VAE loaded lazily.
- :mod:`fastoffload_ext.integrations.peft`: LoRA merges on an offloaded model run on its blocks' real
  weights, one block at a time (enable installs it; it imports nothing from peft itself).
"""
from __future__ import annotations
