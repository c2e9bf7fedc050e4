"""Parallel degrees → device mesh, and the Llama 3 parallelization plan (TP, activation checkpointing, compile,
float8, FSDP2/HSDP). See ``parallel_dims`` and ``parallelize_llama`` for the single-process convention
(``build_mesh`` returns None and only activation checkpointing, float8 and compile apply)."""

from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.parallelize_llama import (
    loss_parallel_context,
    mixed_precision_mode,
    parallelize_llama,
    validate_model_for_parallelism,
)

__all__ = [
    "ParallelDims",
    "loss_parallel_context",
    "mixed_precision_mode",
    "parallelize_llama",
    "validate_model_for_parallelism",
]
