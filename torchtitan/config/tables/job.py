"""[job]: where a run writes and what it is called."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchtitan.config.options import opt


@dataclass
class Job:
    config_file: Optional[str] = opt(None, "TOML job config to load before command-line overrides")
    dump_folder: str = opt("./outputs", "folder for TensorBoard logs, checkpoints and traces")
    description: str = opt("default job", "free-text description of the job, logged at start")
    print_args: bool = opt(False, "log the full resolved config at start")
    use_for_integration_test: bool = opt(
        False, "a train_configs/ file the test suite checks through JobConfig and preflight"
    )
