"""Estimate each rank's memory for a training job and several optimizers, on a CPU, without allocating it.

    python estimation.py --job.config_file train_configs/llama3_8b.toml \
        [--memory_estimation.world_size 8] [--memory_estimation.optimizers AdamW,AdamMini,AdamW4bit] \
        [--memory_estimation.device cuda|cpu] [--memory_estimation.json estimate.json | -] [--section.key value ...]

Takes the same config file and overrides as ``train.py`` (plus the ``[memory_estimation]`` section). The job's
model is built and parallelized by the trainer's own code on a fake process group of ``world_size`` ranks, with
fake tensors, and one training step (``torchtitan.training.step.train_step``, the step ``train.py`` runs) is tracked for
each optimizer.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    from torchtitan.errors import exit_code

    return exit_code(lambda: estimate(argv))


def estimate(argv: Optional[list[str]]) -> None:
    from torchtitan.config.job_config import JobConfig

    job_config = JobConfig.parse_args(argv, prog="estimation.py")
    # The simulated step's gradient clipping on a 2-D mesh advises on its collectives; no use to a reader here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    # Imported after the config is read, so that --help and config mistakes answer at once.
    from torchtitan.estimation import estimate_memory, format_table, to_json

    result = estimate_memory(job_config)
    destination = job_config.memory_estimation.json
    if destination == "-":
        print(json.dumps(to_json(result), indent=2))
        return
    print(format_table(result))
    if destination:
        with open(destination, "w") as f:
            json.dump(to_json(result), f, indent=2)
            f.write("\n")
        print(f"wrote {destination}")


if __name__ == "__main__":
    sys.exit(main())
