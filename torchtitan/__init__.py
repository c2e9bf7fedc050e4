"""Llama 3 pre-training with memory-lean optimizers (Adam-mini first).

The package, by what each part serves:

- ``config``: the job's configuration (one table a module), parsed defaults -> TOML -> command line, torchtitan's
  2024 keys, and ``preflight`` (the job checked before any worker starts).
- ``models``: Llama 3 and the roles its weights declare.
- ``distributed``: process groups, the collectives the loop needs, the CUDA allocator's settings, process trees;
  ``parallelisms``: the device mesh, the tensor-parallel plan, activation checkpointing, compile, FSDP2/HSDP.
- ``optim``: the optimizers, their settings and their state.
- ``datasets``: tokenizers and data loaders (text and pre-tokenized).
- ``training``: one training step and what guards it (loss, lr schedule, divergence guard, validation, preemption,
  garbage collection).
- ``telemetry``: what a run reports (metrics, optimizer health, step timing, profiling).
- ``checkpoint``: DCP checkpoints, Hugging Face weights in and out.
- ``estimation``: per-rank memory for a job on fake tensors.
- ``study``: optimizer studies (plans, schedulers, statistics, the report); ``gpu_check``: every check that needs a
  GPU; ``tools``: thin command-line entry points.
- Leaves: ``errors`` (the user's one-line errors and exit codes), ``files`` (files written whole), ``logging``.

A module of a former layout (``torchtitan.config_manager``, ``torchtitan.optim.partition``, ...) fails to import with
one line naming its new home (``torchtitan.moved``). Imports nothing heavy.
"""

from torchtitan.moved import install_finder, lazy_names

__getattr__ = lazy_names(__name__, {})
install_finder()
