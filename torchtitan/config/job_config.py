"""``JobConfig``: one field per TOML table (``torchtitan.config.tables``), and the checks that span several tables.

Per-option ranges are declared beside each option and checked while parsing (``torchtitan.config.parsing``); the
``[optimizer]`` options are checked by ``torchtitan.optim.settings``, as the optimizer builder and ``AdamMini`` check
them. Mistakes raise :class:`torchtitan.errors.UserError` with one line naming the key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from torchtitan.config.parsing import parse
from torchtitan.config.tables.checkpoint import Checkpoint
from torchtitan.config.tables.job import Job
from torchtitan.config.tables.memory_estimation import MemoryEstimation
from torchtitan.config.tables.metrics import WANDB_INSTALL, Metrics, Profiling
from torchtitan.config.tables.model import Model
from torchtitan.config.tables.optimizer import Optimizer
from torchtitan.config.tables.training import ActivationCheckpoint, Comm, Float8, Loss, Training
from torchtitan.config.tables.validation import Validation
from torchtitan.errors import UserError
from torchtitan.models.norm_types import RMSNORM_TYPES

# Each run's resolved config, written beside its metrics (train.py) and read back by ``--job.config_file``.
JOB_CONFIG_RECORD = "job_config.toml"


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    training: Training = field(default_factory=Training)
    loss: Loss = field(default_factory=Loss)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    profiling: Profiling = field(default_factory=Profiling)
    float8: Float8 = field(default_factory=Float8)
    comm: Comm = field(default_factory=Comm)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)

    @classmethod
    def parse_args(cls, argv: Optional[list[str]] = None, *, prog: str = "train.py") -> "JobConfig":
        """Defaults, then ``--job.config_file`` (if given), then the other command-line overrides."""
        config = parse(cls, list(sys.argv[1:] if argv is None else argv), prog)
        config.validate()
        return config

    def validate(self) -> None:
        """Checks that span several keys; per-key ranges are checked from the field metadata."""
        from torchtitan.optim.settings import check_values
        from torchtitan.training.lr_scheduling import check_schedule, schedule_options  # torch-free, like this module

        check_values(self)
        t = self.training
        check_schedule(**schedule_options(t))
        if t.data_parallel_shard_degree == 0:
            raise UserError("training.data_parallel_shard_degree must be -1 (fill) or a positive integer")
        if t.dataset_path is not None and not os.path.exists(t.dataset_path):
            raise UserError(f"training.dataset_path '{t.dataset_path}' does not exist; point it at a file or folder")
        self._validate_validation()
        self._refuse_options_that_do_nothing()
        self._validate_loss()
        self._validate_metrics()
        initial = self.checkpoint.initial_load_path
        if initial is not None and not os.path.isdir(initial):
            raise UserError(
                f"checkpoint.initial_load_path '{initial}' is not a folder; point it at a checkpoint's step-N folder"
            )
        self._validate_checkpoint_additions()
        ac = self.activation_checkpoint
        if ac.mode == "selective" and ac.selective_ac_option != "op":
            if not ac.selective_ac_option.isdigit() or int(ac.selective_ac_option) < 1:
                raise UserError(
                    "activation_checkpoint.selective_ac_option must be 'op' or a positive integer k (every k-th layer)"
                )

    def _refuse_options_that_do_nothing(self) -> None:
        """An option set where it cannot act would make a run look other than it is: refuse it."""
        c, defaults = self.checkpoint, Checkpoint()  # [optimizer]'s own: torchtitan.optim.settings.check_values
        if c.export_dtype != defaults.export_dtype and not (c.model_weights_only or c.last_save_in_hf):
            raise UserError(
                "checkpoint.export_dtype sets the dtype of the weights exports, which are off; add "
                "--checkpoint.model_weights_only or --checkpoint.last_save_in_hf, or remove checkpoint.export_dtype"
            )
        if c.initial_load_model_only != defaults.initial_load_model_only and c.initial_load_path is None:
            raise UserError(
                "checkpoint.initial_load_model_only applies to checkpoint.initial_load_path, which is unset; set "
                "the path or remove the option"
            )
        t = self.training
        if t.data_seed != Training().data_seed and t.dataset != "tokens":
            raise UserError(
                f"training.data_seed orders pre-tokenized data, but training.dataset is '{t.dataset}' (read in its "
                "files' order); remove it, or pretokenize the data and use training.dataset 'tokens'"
            )
        if t.allow_data_change and not c.enable_checkpoint:
            raise UserError(
                "training.allow_data_change applies to resuming a checkpoint, which is off; add "
                "--checkpoint.enable_checkpoint or remove training.allow_data_change"
            )
        if c.async_mode != defaults.async_mode and not c.enable_checkpoint:
            raise UserError(
                f"checkpoint.async_mode {c.async_mode} applies to full checkpoints, which are off (the weights export "
                "is always written at once); add --checkpoint.enable_checkpoint or remove checkpoint.async_mode"
            )

    def _validate_checkpoint_additions(self) -> None:
        """Hugging Face import/export, time-based intervals and seed checkpoints."""
        c, norm = self.checkpoint, self.model.norm_type
        hf_keys = [
            key
            for key, on in (("initial_load_in_hf", c.initial_load_in_hf), ("last_save_in_hf", c.last_save_in_hf))
            if on
        ]
        if hf_keys and norm not in RMSNORM_TYPES:
            raise UserError(
                f"checkpoint.{hf_keys[0]} needs an RMSNorm model (Hugging Face Llama has no {norm}); set "
                "model.norm_type = 'rmsnorm'"
            )
        if c.initial_load_in_hf:
            if c.initial_load_path is None:
                raise UserError(
                    "checkpoint.initial_load_in_hf needs checkpoint.initial_load_path: a Hugging Face folder"
                )
            if not c.initial_load_model_only:
                raise UserError(
                    "checkpoint.initial_load_in_hf loads model weights only; remove checkpoint.initial_load_model_only "
                    "= false"
                )
            if not os.path.isfile(os.path.join(c.initial_load_path, "config.json")):
                raise UserError(
                    f"checkpoint.initial_load_path '{c.initial_load_path}' has no config.json; point it at a Hugging "
                    "Face Llama folder"
                )
        if c.create_seed_checkpoint and not c.enable_checkpoint:
            raise UserError(
                "checkpoint.create_seed_checkpoint writes step-0 into checkpoint.folder; set enable_checkpoint"
            )
        if c.interval_type == "seconds" and not c.enable_checkpoint:
            raise UserError("checkpoint.interval_type = 'seconds' times checkpoint saves; set enable_checkpoint")
        t = self.training
        if t.data_parallel_type == "ddp" and t.data_parallel_replicate_degree > 1:
            raise UserError(
                "training.data_parallel_type = 'ddp' replicates over all data-parallel ranks; remove "
                "training.data_parallel_replicate_degree (or use fsdp with it for HSDP)"
            )

    def _validate_validation(self) -> None:
        t, v = self.training, self.validation
        if v.held_out_every == 1:
            raise UserError("validation.held_out_every 1 would hold out every document; use 0 (none) or 2 or more")
        if v.dataset_path is not None and not os.path.exists(v.dataset_path):
            raise UserError(f"validation.dataset_path '{v.dataset_path}' does not exist; point it at a file or folder")
        if not v.enable:
            return
        defaults = Validation()
        reads_tokens = (v.dataset or t.dataset) == "tokens"
        if reads_tokens and v.steps != defaults.steps:
            raise UserError(
                f"validation.steps counts batches of text data, but validation reads tokens data, scored by "
                f"validation.windows ({v.windows}: the same windows at any layout); remove validation.steps or set "
                "validation.windows"
            )
        if not reads_tokens and v.first_window:
            raise UserError(
                "validation.first_window numbers windows of tokens data, but validation reads "
                f"{v.dataset or t.dataset} data, scored by validation.steps; remove validation.first_window"
            )
        if not reads_tokens and v.windows != defaults.windows:
            raise UserError(
                f"validation.windows counts windows of tokens data, but validation reads {v.dataset or t.dataset} "
                "data, scored by validation.steps; remove validation.windows or set validation.steps"
            )
        if v.seq_len is not None and v.seq_len > t.seq_len:
            raise UserError(f"validation.seq_len {v.seq_len} exceeds training.seq_len {t.seq_len}; lower it")
        if v.seq_len is not None and v.seq_len % t.tensor_parallel_degree:
            raise UserError(
                f"training.tensor_parallel_degree {t.tensor_parallel_degree} does not divide validation.seq_len "
                f"{v.seq_len}; pick a length it divides"
            )

    def _validate_metrics(self) -> None:
        m, defaults = self.metrics, Metrics()
        wandb_keys = ("wandb_project", "wandb_entity", "wandb_run_name", "wandb_group")
        changed = [key for key in wandb_keys if getattr(m, key) != getattr(defaults, key)]
        if not m.enable_wandb and changed:
            raise UserError(f"metrics.{changed[0]} is set but metrics.enable_wandb is off; set enable_wandb or drop it")
        health_keys = ("health_max_layers", "health_snapshot_gib", "loss_spike_factor", "loss_spike_window")
        changed = [key for key in health_keys if getattr(m, key) != getattr(defaults, key)]
        if m.health_freq == 0 and changed:
            raise UserError(
                f"metrics.{changed[0]} applies to optimizer health, which metrics.health_freq 0 turns off; set a "
                "health_freq or remove it"
            )
        if m.enable_wandb and importlib.util.find_spec("wandb") is None:
            raise UserError(f"metrics.enable_wandb needs the wandb package: {WANDB_INSTALL}")

    def _validate_loss(self) -> None:
        t, v = self.training, self.validation
        micro_batches = {"training": t.batch_size * t.seq_len}
        if v.enable:
            micro_batches["validation"] = (v.batch_size or t.batch_size) * (v.seq_len or t.seq_len)
        for what, tokens in micro_batches.items():
            if self.loss.num_chunks > tokens:
                raise UserError(
                    f"loss.num_chunks {self.loss.num_chunks} exceeds the {tokens} tokens of a {what} micro-batch "
                    "(batch_size x seq_len); lower it"
                )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self, header: str = "") -> str:
        """The whole resolved config as a TOML file that ``--job.config_file`` reads back to the same config: every
        key, unset ones (None, the default of every optional key) left out; ``header`` goes first as comments."""
        import tomli_w

        tables = {
            section: {key: value for key, value in values.items() if value is not None}
            for section, values in self.to_dict().items()
        }
        comments = "".join(f"# {line}\n" for line in header.splitlines())
        return comments + tomli_w.dumps(tables)
