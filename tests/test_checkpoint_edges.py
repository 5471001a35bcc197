"""Edge cases of start-up from a checkpoint and of the disk tier: exact values or a clear refusal."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from fastoffload_ext import disable_layerwise_offload, enable_layerwise_offload
from fastoffload_ext.storage.checkpoint import open_checkpoint
from tests._checkpoints import inputs, meta_stack, reference_stack, write_single
from tests._models import params_equal

REPO = Path(__file__).resolve().parents[1]


def _overwrite_outside_blocks(path: Path) -> None:
    """Writes zeros over the bytes of every tensor outside the block list, in place (same size)."""
    checkpoint = open_checkpoint(path)
    with open(path, "r+b") as file:
        for name, entry in checkpoint.entries.items():
            if not name.startswith("blocks."):
                file.seek(entry.offset)
                file.write(b"\0" * entry.nbytes)


def test_resident_tensors_on_the_host_do_not_follow_a_checkpoint_rewritten_in_place(tmp_path: Path) -> None:
    reference = reference_stack(4)
    path = write_single(reference, tmp_path / "model.safetensors")
    model = meta_stack(4)
    enable_layerwise_offload(model, device="cpu", weights=path)
    x = inputs()
    with torch.no_grad():
        expected = reference(x)
        assert torch.equal(model(x), expected)
        _overwrite_outside_blocks(path)
        assert torch.equal(model(x), expected)
    disable_layerwise_offload(model, device="cpu")
    assert params_equal(model, reference)


def test_resident_tensors_on_the_host_survive_a_truncated_checkpoint(tmp_path: Path) -> None:
    # Run in a child: a tensor still mapped from the file would kill the process (SIGBUS) when read.
    script = textwrap.dedent(f"""
        import os, torch
        from fastoffload_ext import enable_layerwise_offload
        from tests._checkpoints import inputs, meta_stack, reference_stack, write_single
        reference = reference_stack(4)
        path = write_single(reference, {str(tmp_path / "model.safetensors")!r})
        model = meta_stack(4)
        enable_layerwise_offload(model, device="cpu", weights=path, resident_blocks=4)
        os.truncate(path, 100)
        with torch.no_grad():
            assert torch.equal(model(inputs()), reference(inputs()))
        print("exact")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and "exact" in done.stdout, (done.returncode, done.stderr[-2000:])

