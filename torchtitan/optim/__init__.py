"""Optimizers: Adam-mini and (added by the optimizer builder) the container the trainer uses."""

from torchtitan.optim.adam_mini import AdamMini
from torchtitan.optim.builder import OptimizersContainer, build_optimizers

__all__ = ["AdamMini", "OptimizersContainer", "build_optimizers"]
