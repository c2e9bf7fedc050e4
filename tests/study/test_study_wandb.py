"""A study's runs in Weights & Biases: each named after its run, grouped by the study."""

from __future__ import annotations

from tests.helpers import DEBUG_CONFIG
from torchtitan.config.job_config import JobConfig
from torchtitan.study.plan import RunSpec, run_command, wandb_group


def test_a_study_with_wandb_names_each_run_and_groups_them_by_the_study(tmp_path):
    dump = tmp_path / "adam-mini-vs-adamw"
    assert wandb_group(dump, DEBUG_CONFIG, []) is None  # W&B off: nothing to name
    group = wandb_group(dump, DEBUG_CONFIG, ["--metrics.enable_wandb", "true"])
    assert group == "adam-mini-vs-adamw"
    spec = RunSpec("AdamW", 1e-3, 4)
    command = run_command(spec, dump / "runs" / spec.name, ["--metrics.enable_wandb", "true"], ["launch"], False, group)
    config = JobConfig.parse_args(["--job.config_file", DEBUG_CONFIG, *command[1:]])
    assert config.metrics.wandb_run_name == spec.name and config.metrics.wandb_group == group
    assert "--metrics.wandb_group" not in run_command(spec, dump, [], ["launch"])
