"""[checkpoint]: saves, resumes, weights in and out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchtitan.config.options import opt


@dataclass
class Checkpoint:
    enable_checkpoint: bool = opt(False, "save and resume checkpoints")
    folder: Optional[str] = opt(
        None,
        "checkpoint folder, relative to job.dump_folder unless absolute; unset: checkpoint/<optimizer state>, the "
        "optimizer's name plus each option that shapes its state and is not at its default (e.g. "
        "checkpoint/AdamMini-state_dtype=bfloat16), so runs whose optimizer states differ never share checkpoints",
    )
    interval_type: str = opt(
        "steps",
        "unit of checkpoint.interval: steps, or seconds of wall time since the last save (rank 0's clock decides "
        "for all ranks)",
        choices=("steps", "seconds"),
    )
    interval: int = opt(
        500, "save every N steps, or N seconds with interval_type = seconds (and at the last step)", gt=0
    )
    keep_latest_k: int = opt(0, "keep only the newest k checkpoints; 0 keeps all", ge=0)
    async_mode: str = opt(
        "disabled",
        "disabled, async (full checkpoints are written by a background thread) or async_with_pinned_mem (async, "
        "staging into pinned CPU buffers kept from one save to the next: faster copies from the GPU); the weights "
        "export is always written at once",
        choices=("disabled", "async", "async_with_pinned_mem"),
    )
    load_step: int = opt(-1, "resume from this step; -1 resumes from the latest complete checkpoint", ge=-1)
    export_dtype: str = opt(
        "float32",
        "dtype of the final weights-only export (needs model_weights_only or last_save_in_hf)",
        choices=("float32", "bfloat16", "float16"),
    )
    model_weights_only: bool = opt(False, "at the end, export model weights only (in export_dtype)")
    initial_load_path: Optional[str] = opt(
        None,
        "when checkpoint.folder holds no checkpoint yet, start from this one (a step-N folder, or a folder of "
        "them: the latest), e.g. another optimizer's run",
    )
    initial_load_model_only: bool = opt(
        True, "from initial_load_path load the model weights only: optimizer, lr schedule, data and step start fresh"
    )
    initial_load_in_hf: bool = opt(
        False,
        "initial_load_path is a Hugging Face Llama folder (config.json + model.safetensors or a sharded index): "
        "start from its weights",
    )
    last_save_in_hf: bool = opt(
        False,
        "after the last step, write the weights as a Hugging Face Llama folder (step-N-hf: config.json + "
        "safetensors in export_dtype) that transformers loads",
    )
    create_seed_checkpoint: bool = opt(
        False,
        "write the initial state as step-0 in checkpoint.folder and stop without training (needs enable_checkpoint "
        "and an empty folder); a later run resumes from it on any number of ranks",
    )
