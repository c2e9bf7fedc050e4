"""validation.first_window: tokens data scores the windows from an offset (a study's confirmation runs score
windows its selection runs did not), checked before any worker starts."""

from __future__ import annotations

import numpy as np
import pytest

from tests.data.test_validation import SEQ_LEN, TOKENIZER, random_tokens_folder, tokens_validation_job
from torchtitan.config.job_config import JobConfig
from torchtitan.datasets import build_tokenizer
from torchtitan.datasets.tokens import TokenArray, read_manifest
from torchtitan.errors import UserError
from torchtitan.training.validate import check_validation, load_validation_batches


def test_the_windows_from_first_window_are_scored_and_too_few_are_refused(tmp_path):
    # 40 training windows, every 4th held out: 10 validation windows; 7 from window 3 are windows 3 to 9.
    tokenizer = build_tokenizer(str(TOKENIZER))
    folder = random_tokens_folder(tmp_path / "tokens", tokenizer, 40)
    stored = np.empty(40 * (SEQ_LEN + 1), dtype=np.int64)
    TokenArray(folder, read_manifest(folder)).read(0, len(stored), stored)
    held_out = [stored[w * (SEQ_LEN + 1) : w * (SEQ_LEN + 1) + SEQ_LEN].tolist() for w in range(0, 40, 4)]
    job = tokens_validation_job(folder, 4, "--validation.first_window", "3")
    check_validation(job)
    rows = [row.tolist() for inputs, _ in load_validation_batches(job, tokenizer, 0, 1) for row in inputs]
    assert rows == held_out[3:10]
    too_far = tokens_validation_job(folder, 4, "--validation.first_window", "4")
    with pytest.raises(UserError, match="holds 10 validation windows .* fewer than validation.first_window 4 \\+ "):
        check_validation(too_far)


def test_first_window_on_text_data_is_refused():
    with pytest.raises(UserError, match="validation.first_window numbers windows of tokens data, but validation reads"):
        JobConfig.parse_args(["--validation.enable", "--validation.first_window", "8"])
