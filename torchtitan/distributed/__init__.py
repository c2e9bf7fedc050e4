"""Distributed plumbing beside ``torchtitan.parallelisms`` (which lays the model out over the mesh).

- ``utils``: devices and process groups, determinism, a local tensor and its placement, gradient clipping, a
  gradient brought to its parameter's layout.
- ``collectives``: the scalar reductions the loop needs, each on a tensor its group's backend can take.
- ``cuda_allocator``: the CUDA caching allocator's settings, applied before torch is imported (imports nothing).
- ``process_tree``: a process and every process it started, ended together.
"""
