"""[validation]: the held-out loss, how often and on what."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchtitan.config.options import opt


@dataclass
class Validation:
    enable: bool = opt(False, "evaluate the loss on held-out data every validation.freq steps and at the last step")
    freq: int = opt(100, "evaluate every N optimizer steps (and at the last step)", gt=0)
    steps: int = opt(
        10,
        "text data: batches per data-parallel rank per evaluation (fewer if the validation data runs out first); "
        "tokens data scores validation.windows instead",
        gt=0,
    )
    windows: int = opt(
        64,
        "tokens data: validation windows (validation.seq_len + 1 tokens each) per evaluation, the first N by index, "
        "divided between the data-parallel ranks: the same windows at any layout, local batch or resume",
        gt=0,
    )
    first_window: int = opt(
        0,
        "tokens data: the first validation window scored (windows first_window .. first_window + windows - 1); a "
        "study's confirmation runs score windows its selection runs did not",
        ge=0,
    )
    dataset: Optional[str] = opt(
        None, "validation data: sample, c4, text or tokens; unset (or the training data): its held-out split"
    )
    dataset_path: Optional[str] = opt(None, "local file or folder of validation data (like training.dataset_path)")
    batch_size: Optional[int] = opt(
        None, "sequences per data-parallel rank per batch; unset: training.batch_size", gt=0
    )
    seq_len: Optional[int] = opt(None, "tokens per sequence, at most training.seq_len; unset: training.seq_len", gt=0)
    held_out_every: int = opt(
        20,
        "about 1 in N documents of the training data (by a hash of the text; for tokens data every N-th window) "
        "is held out: never trained on, even with validation off; 0 trains on every document",
        ge=0,
    )
