"""The ranks benchmark section's concurrent H2D figure (the section itself runs under torchrun in the suite)."""
from __future__ import annotations

import torch


def test_the_ranks_line_up_after_their_buffers_exist_so_that_their_copies_overlap(monkeypatch) -> None:
    import benchmarks.bandwidth as bandwidth
    import benchmarks.ranks as ranks

    events: list[str] = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        events.append("allocate")
        return real_empty(*args, **kwargs)

    def copies(dst, src, *, warmup, iters):
        events.append("copy")
        return 1000.0  # ms for the GiB, a stand-in

    monkeypatch.setattr(ranks.torch, "empty", empty)
    monkeypatch.setattr(bandwidth, "measure_copy_ms", copies)
    figure = ranks._h2d_gbps(torch.device("cpu"), lambda: events.append("barrier"))
    assert events == ["allocate", "allocate", "barrier", "copy"]
    assert figure == ranks.GiB / 1e9
