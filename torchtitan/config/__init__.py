"""The job's configuration.

- ``job_config``: ``JobConfig``, one field per TOML table, and the checks that span several tables.
- ``tables/``: the tables, one module per group of the TOML file, each option with its default, help and range.
- ``parsing``: defaults, then the TOML file, then ``--section.key value``; ``--help``.
- ``legacy``: torchtitan's 2024 keys, translated or refused.
- ``preflight``: ``python -m torchtitan.config.preflight --nproc N [options]``, the job checked before any worker
  starts.

Torch-free: the launcher checks a job before torch is imported.
"""
