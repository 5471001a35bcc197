"""The offload engine: the hook surface, the per-block states of both backends, the layerwise API,
host-copy sharing between the ranks of one host, and CUDA-graph capture of an offloaded forward.

docs/DESIGN.md ("Architecture") says which of these drives the compiled core and how.
"""
