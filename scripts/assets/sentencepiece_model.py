"""The sentencepiece tokenizer's training."""

from __future__ import annotations

import io
from typing import Sequence

# ----------------------------------------------------------------------------------------------------------------
# sentencepiece


def train_sentencepiece(documents: Sequence[str], vocab_size: int) -> bytes:
    """A byte-fallback BPE that round-trips any text: identity normalization, whitespace kept as written."""
    import sentencepiece as spm

    lines = [line for doc in documents for line in doc.split("\n") if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        shuffle_input_sentence=False,
        input_sentence_size=0,
        minloglevel=2,
    )
    return model.getvalue()
