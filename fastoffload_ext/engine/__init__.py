"""The offload engine: the hook surface, the per-block states of both backends, the layerwise API,
host-copy sharing between the ranks of one host, CUDA-graph capture of an offloaded forward, and
the forward that replays those graphs behind ``model(...)``.

docs/DESIGN.md ("Architecture") says which of these drives the compiled core and how.
"""
