"""Every check that needs a GPU (``scripts/gpu_check.sh``, ``python -m torchtitan.tools.gpu_check``): ``context``
(what a step is given, the packages present, commands within a budget), ``measure`` (a model trained a few steps
beside its estimate), ``steps`` (the steps and the plan of groups) and ``runner`` (each step in a process of its
own, the report)."""
