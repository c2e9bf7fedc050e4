"""Check a job before any worker starts: ``python -m torchtitan.config.preflight --nproc N [train.py options]``.

``run_llama_train.sh`` runs this first, so that a mistake in the config shows as one line instead of one traceback
per worker from the launcher. ``train.py`` runs the same checks at start; its first rank leaves out the layout check
(seconds) when the launcher says it checked this very job (:data:`CHECKED_VARIABLE`).
"""

from __future__ import annotations

import hashlib
import os
import sys

from torchtitan.config.job_config import JobConfig
from torchtitan.errors import UserError, exit_code


def model_args_for(job_config: JobConfig, vocab_size: int):
    """The flavor's ModelArgs with the tokenizer's vocabulary and the job's sequence length."""
    import dataclasses

    from torchtitan.models.llama import llama3_configs

    flavor = job_config.model.flavor
    if flavor not in llama3_configs:
        raise UserError(f"model.flavor '{flavor}' is unknown; choose one of {', '.join(llama3_configs)}")
    args = dataclasses.replace(
        llama3_configs[flavor],
        vocab_size=vocab_size,
        max_seq_len=job_config.training.seq_len,
        norm_type=job_config.model.norm_type,
        **_model_overrides(job_config, llama3_configs[flavor]),
    )
    try:
        args.check()
    except ValueError as e:
        raise UserError(f"model.flavor '{flavor}': {e}") from None
    return args


# [model] options that replace the flavor's value when set.
_MODEL_OVERRIDES = (
    "rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_seq_len",
    "enable_weight_tying",
)
_LLAMA3_SCALING_OPTIONS = _MODEL_OVERRIDES[1:5]


def _model_overrides(job_config: JobConfig, flavor_args) -> dict:
    """The [model] options set in the job; a llama3-scaling factor without llama3 scaling is refused."""
    m = job_config.model
    overrides = {key: getattr(m, key) for key in _MODEL_OVERRIDES if getattr(m, key) not in (None, "flavor")}
    scaling = overrides.get("rope_scaling", flavor_args.rope_scaling)
    if scaling != "llama3":
        for key in _LLAMA3_SCALING_OPTIONS:
            if key in overrides:
                raise UserError(
                    f"model.{key} applies to llama3 RoPE scaling, which flavor '{m.flavor}' with model.rope_scaling "
                    f"{scaling!r} does not use; set --model.rope_scaling llama3 or remove model.{key}"
                )
    return overrides


def preflight(job_config: JobConfig, world_size: int, check_layout: bool = True):
    """Raise UserError for anything that would fail after the workers start.

    ``check_layout`` False leaves out what the layout rules out for the optimizer (a build on fake tensors, seconds):
    train.py's ranks but the first. Returns (parallel dims, model args, tokenizer) for the trainer to go on with.
    """
    # Imported here so that `--help` and config errors answer without importing torch.
    from torchtitan.datasets import build_tokenizer, check_hub_reachable, resolve_dataset
    from torchtitan.optim.settings import optimizer_settings
    from torchtitan.parallelisms import ParallelDims, validate_model_for_parallelism

    t = job_config.training
    parallel_dims = ParallelDims.from_job_config(job_config, world_size)
    # The optimizer's name and options (one that does not apply is an error), before any model is built.
    optimizer_settings(job_config)
    resolve_dataset(t.dataset, t.dataset_path)
    if job_config.validation.enable:
        from torchtitan.training.validate import check_validation

        check_validation(job_config)
    tokenizer = build_tokenizer(job_config.model.tokenizer_path, job_config.model.tokenizer_type)
    if t.dataset == "tokens":
        from torchtitan.datasets.tokens import check_tokenizer, read_manifest

        check_tokenizer(
            read_manifest(t.dataset_path), t.dataset_path, job_config.model.tokenizer_path, tokenizer.fingerprint
        )
    model_args = model_args_for(job_config, tokenizer.n_words)
    validate_model_for_parallelism(model_args, parallel_dims)
    if check_layout:
        # Before the workers start, or before train.py's first rank joins its process group.
        from torchtitan.estimation.layout_check import check_optimizer_layout

        check_optimizer_layout(job_config, parallel_dims, model_args)
    if job_config.checkpoint.initial_load_in_hf:
        from torchtitan.checkpoint.hf import check_hf_config

        check_hf_config(job_config.checkpoint.initial_load_path, model_args)
    # Last: the one check that may wait on the network.
    check_hub_reachable(t.dataset, t.dataset_path)
    v = job_config.validation
    if v.enable and v.dataset is not None:
        check_hub_reachable(v.dataset, v.dataset_path, "validation")
    return parallel_dims, model_args, tokenizer


# Set by run_llama_train.sh once this module passed a job: the digest of (world size, train.py's arguments).
CHECKED_VARIABLE = "TORCHTITAN_PREFLIGHT_CHECKED"


def job_digest(world_size: int, train_argv: list[str]) -> str:
    """SHA-256 of the world size and train.py's arguments, each ended by a NUL byte: the launcher's
    ``printf '%s\\0' N ARGS... | sha256sum``, so that a launcher's check stands for exactly this job."""
    data = b"".join(os.fsencode(a) + b"\0" for a in [str(world_size), *train_argv])
    return hashlib.sha256(data).hexdigest()


def checked_by_launcher(world_size: int, train_argv: list[str], environ=os.environ) -> bool:
    """Whether the launcher ran this module's checks, the layout check included, on this job at this world size."""
    return environ.get(CHECKED_VARIABLE) == job_digest(world_size, train_argv)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--nproc" or not argv[1].isdigit() or int(argv[1]) < 1:
        print("usage: python -m torchtitan.config.preflight --nproc N [train.py options]", file=sys.stderr)
        return 2
    return exit_code(lambda: preflight(JobConfig.parse_args(argv[2:]), int(argv[1])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
