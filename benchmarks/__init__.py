"""Benchmark suite for fastoffload_ext: ``python -m benchmarks --help``.

Sections (one module each): bandwidth, forward, startup, overhead, lazy. Every figure is compared with
something measured in the same run (the floor, the resident model, the pure-Python backend), because
the absolute numbers move with the host CPU and the PCIe link; the ratios are what docs/DESIGN.md ("Workloads and targets") targets.
"""
