"""Thin command-line entry points (``python -m torchtitan.tools.<name>``): ``sweep`` and ``compare_runs`` over the
study package (``torchtitan.study``), ``pretokenize`` over the tokens loader, ``gpu_check`` over
``torchtitan.gpu_check``."""
