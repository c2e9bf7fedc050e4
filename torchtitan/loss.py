"""The training loss, shared by the training step and validation so that both follow one dtype policy."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``(batch, seq, vocab)`` logits against ``(batch, seq)`` labels."""
    # At least float32 for the softmax; float64 runs stay float64 so that parity checks can be exact.
    logits = logits.flatten(0, 1)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels.flatten())
