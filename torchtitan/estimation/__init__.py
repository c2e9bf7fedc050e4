"""Per-rank memory of a training job for several optimizers, simulated on a CPU without allocating it.

``estimation.py`` at the repository root is the command line; :func:`estimate_memory` does the work and
:mod:`torchtitan.estimation.report` formats it.
"""

from torchtitan.estimation.report import format_table, to_json
from torchtitan.estimation.simulate import Estimate, OptimizerEstimate, estimate_memory
from torchtitan.estimation.tracker import LiveMemoryTracker

__all__ = ["Estimate", "LiveMemoryTracker", "OptimizerEstimate", "estimate_memory", "format_table", "to_json"]
